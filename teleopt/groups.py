"""Groups that act on parameter tensors, with exact elements.

Every symmetry in papers/001 Table 1.1 is a group acting on one axis of a set of
parameter tensors: the general linear group GL_n (Ex. 1.2.2, 1.2.11-1.2.13), the
orthogonal group O(n) (Ex. 1.2.6, eq. 4.33), the positive scaling group R_{>0}^n
(Ex. 1.2.4, 1.2.7), the sign-flip group Z_2^n (Ex. 1.2.5), the symmetric group S_n
(Ex. 1.2.9, 1.2.10, 1.2.12) and the additive group R^n (Ex. 1.2.8).  A block group
is ``blocks`` independent copies acting on consecutive chunks of the axis, as the
per-head groups (GL_{d_k})^h of multi-head attention (Ex. 1.2.12).

Elements are built exactly: ``exp`` uses ``torch.linalg.matrix_exp`` or the scalar
exponential, inverses use ``torch.linalg.solve``/``inv`` or transposition, never a
first-order expansion such as I - T for (I + T)^-1 (the shortcut papers/001 Sec.
4.6.1 uses, which changes the loss it claims to preserve).

The *representation* used on a tensor axis is selected by ``power``:

* matrix groups: ``power=+1`` maps a vector x on the axis to g x, ``power=-1`` to
  g^{-T} x (the contragredient representation: input columns of the next layer);
* positive scaling: x -> c**power * x (``power=-alpha`` for homogeneous activations
  of degree alpha, ``power=2`` for BatchNorm running variances);
* signs: x -> s**power * x;  permutations: x -> P x whatever the power.

The contragredient of ``power`` is ``-power``; it is how gradients (covectors)
transform (papers/001 Prop. 4.5.1, eq. 4.19).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import ClassVar, Literal

import torch
from torch import Tensor

GroupKind = Literal["general", "orthogonal", "diagonal", "sign", "permutation", "translation"]

#: :meth:`Group.balance`: a unit or block whose side is singular to this, relative to the largest, stays.
BALANCE_RCOND = 1e-10

__all__ = ["Group", "GeneralLinear", "Orthogonal", "PositiveScaling", "SignFlip", "Permutation", "Translation", "apply_on_axis"]


def _check_tensor(g: object, what: str) -> Tensor:
    if not isinstance(g, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(g).__name__}")
    return g


def _check_finite(g: Tensor, what: str) -> None:
    if g.is_floating_point() and not bool(torch.isfinite(g).all()):
        bad = (~torch.isfinite(g)).nonzero()[0].tolist()
        raise ValueError(f"{what} has non-finite entries (first at index {bad})")


def _check_size(v: object, what: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{what} must be a positive int, got {v!r}")


def apply_on_axis(x: Tensor, axis: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply ``fn`` to ``x`` viewed as (axis_size, rest) and return the same layout.

    ``fn`` receives a 2-D tensor whose rows are indexed by the chosen axis.
    """
    moved = x.movedim(axis, 0)
    flat = moved.reshape(moved.shape[0], -1)
    out = fn(flat)
    return out.reshape(moved.shape).movedim(0, axis)


class Group(ABC):
    """A group acting linearly on an axis of length ``dim``.

    Subclasses give identity, composition, inverse, the exponential map from Lie
    algebra coordinates (continuous groups), random elements from a
    ``torch.Generator`` and the representation on a tensor axis.
    """

    kind: GroupKind
    continuous: bool

    def __init__(self, n: int) -> None:
        _check_size(n, "group size n")
        self.n = n

    @property
    def dim(self) -> int:
        """Length of the tensor axis the group acts on."""
        return self.n

    def _config(self) -> tuple:
        return (self.n,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self._config()}".replace(",)", ")")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Group) and type(self) is type(other) and self._config() == other._config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._config()))

    # -- elements ---------------------------------------------------------
    @property
    @abstractmethod
    def element_shape(self) -> tuple[int, ...]:
        """Shape of a group element tensor."""

    @property
    def coord_shape(self) -> tuple[int, ...] | None:
        """Shape of Lie algebra coordinates (``None`` for discrete groups)."""
        return None

    @abstractmethod
    def identity(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
        """The identity element."""

    @staticmethod
    @abstractmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        """The product a b: acting with it equals acting with b, then with a."""

    @staticmethod
    @abstractmethod
    def inverse(g: Tensor) -> Tensor:
        """The inverse element, computed exactly (solve/transposition, never I - T)."""

    def exp(self, coords: Tensor) -> Tensor:
        """Exponential map from Lie algebra coordinates to the group (differentiable)."""
        raise TypeError(f"{type(self).__name__} is discrete: it has no Lie algebra coordinates")

    @abstractmethod
    def random(
        self,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """A random element; for continuous groups exp of coordinates of size ``scale``."""

    @abstractmethod
    def validate(self, g: Tensor) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``g`` is a valid element."""

    # -- representation ---------------------------------------------------
    @abstractmethod
    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        """Transform ``x`` along ``axis`` (length ``dim``) by the representation ``power``."""

    def second_moment_power(self, power: float) -> float | None:
        """How elementwise second moments (Adam's exp_avg_sq) transform, if exactly.

        Returns the power of the representation that maps the squared covector
        (``None`` when no exact elementwise rule exists: GL and O(n)).
        """
        return None

    # -- geometry of the coordinates (teleportation searches here) ----------
    has_algebra_action: ClassVar[bool] = False  #: whether :meth:`algebra_action` has a closed form

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Project coordinates ``xi`` (outside autograd) in place onto the trust region of ``radius``;
        by default the Euclidean ball (groups override it with the bound their conditioning needs)."""
        norm = xi.norm()
        if float(norm) > radius:
            xi.mul_(radius / norm)

    def ascent_step_size(self, lr: float) -> float:
        """Per-coordinate step of a normalised (Adam-like) ascent moving the element by about ``lr``."""
        return lr

    def algebra_action(self, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        """d/dt act_on_axis(exp(t M), x, axis, power) at t = 0, for ``x`` (k, ...) and k Lie algebra
        elements ``M`` (k, *coord_shape) batched on a leading axis."""
        raise TypeError(f"{type(self).__name__} has no closed-form Lie-algebra action on an axis")

    def square_factor(self, g: Tensor, power: float) -> Tensor | None:
        """Entrywise factor of x**2 under ``act_on_axis(g, x, axis, power)`` if the representation is diagonal."""
        return None

    # -- weight norms on the orbit (the ``balance`` teleport objective) -------
    has_balance: ClassVar[bool] = False  #: whether :meth:`norm_statistic` and :meth:`balance` have closed forms

    def norm_statistic(self, x: Tensor, axis: int) -> Tensor | None:
        """What ||act_on_axis(g, x, axis, power)||^2 depends on, as a float64 tensor that adds over tensors
        (``None``: no closed form).  Scalings: the sum of squares of each unit's slice; matrix groups: the
        Gram matrix of the axis per block."""
        return None

    def balance(self, stats: Mapping[float, Tensor], radius: float | None, rcond: float = BALANCE_RCOND) -> Tensor | None:
        """Coordinates of the element minimising sum_p ||rho(g)^p X_p||^2, the squared norm of the tensors
        whose :meth:`norm_statistic` summed to ``stats[p]``, with the coordinates in the trust region of
        ``radius`` (``None``: unbounded).  Units or blocks without a balanced point, where one side's
        statistic is missing or singular to ``rcond`` relative to its largest (LoRA's B = 0 at
        initialisation, a rank-deficient Gram matrix, a dead unit), keep zero coordinates: the norm has
        no minimum there, only an infimum at infinity.  ``None`` when the group has no closed form."""
        return None

    def _check_axis(self, x: Tensor, axis: int) -> None:
        if x.shape[axis] != self.dim:
            raise ValueError(
                f"{self!r} acts on an axis of length {self.dim}, but axis {axis} of a tensor "
                f"with shape {tuple(x.shape)} has length {x.shape[axis]}"
            )

    def _check_coords(self, coords: Tensor) -> None:
        _check_tensor(coords, "Lie algebra coordinates")
        if tuple(coords.shape) != self.coord_shape:
            raise ValueError(f"{self!r} expects coordinates of shape {self.coord_shape}, got {tuple(coords.shape)}")

    def _check_shape(self, g: Tensor) -> None:
        _check_tensor(g, "group element")
        if tuple(g.shape) != self.element_shape:
            raise ValueError(f"{self!r} expects elements of shape {self.element_shape}, got {tuple(g.shape)}")


class _MatrixGroup(Group):
    """Shared code of GL_n and O(n): elements are (blocks, n, n) or (n, n) matrices."""

    def __init__(self, n: int, blocks: int | None = None) -> None:
        super().__init__(n)
        if blocks is not None:
            _check_size(blocks, "blocks")
        self.blocks = blocks

    @property
    def dim(self) -> int:
        return self.n * (self.blocks or 1)

    def _config(self) -> tuple:
        return (self.n,) if self.blocks is None else (self.n, self.blocks)

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.n, self.n) if self.blocks is None else (self.blocks, self.n, self.n)

    @property
    def coord_shape(self) -> tuple[int, ...]:
        return self.element_shape

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        eye = torch.eye(self.n, dtype=dtype, device=device)
        return eye if self.blocks is None else eye.expand(self.blocks, self.n, self.n).clone()

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a @ b

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        coords = torch.randn(self.coord_shape, generator=generator, dtype=torch.float64) * (scale / math.sqrt(self.n))
        return self.exp(coords.to(dtype=dtype, device=device))

    def _blocked(self, g: Tensor) -> Tensor:
        return g.unsqueeze(0) if self.blocks is None else g

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        if power not in (1, -1):
            raise ValueError(f"{type(self).__name__} representations have power +1 or -1, got {power}")
        gb = self._blocked(g).to(x.dtype)
        nb = gb.shape[0]

        def fn(flat: Tensor) -> Tensor:
            cols = flat.reshape(nb, self.n, -1)
            if power == 1:
                out = gb @ cols
            else:
                out = self._contragredient(gb, cols)
            return out.reshape(flat.shape)

        return apply_on_axis(x, axis, fn)

    has_balance: ClassVar[bool] = True

    def norm_statistic(self, x: Tensor, axis: int) -> Tensor:
        """Gram matrix X X^T of the axis per block (shape ``coord_shape``): ||g X||^2 = tr(g^T g X X^T)."""
        self._check_axis(x, axis)
        cols = x.detach().to(torch.float64).movedim(axis, 0).reshape(self.blocks or 1, self.n, -1)
        gram = cols @ cols.mT
        return gram if self.blocks is not None else gram[0]

    @abstractmethod
    def _contragredient(self, g: Tensor, cols: Tensor) -> Tensor:
        """g^{-T} applied to the columns of ``cols`` (batched over blocks)."""

    has_algebra_action: ClassVar[bool] = True

    def ascent_step_size(self, lr: float) -> float:
        return lr / self.n  # Adam moves every entry by about lr: a spectral norm up to n lr

    def algebra_action(self, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        k = x.shape[0]
        Mb = M.to(x.dtype).reshape(k, self.blocks or 1, self.n, self.n)
        A = self._algebra_matrix(Mb, power)
        moved = x.movedim(axis, 1)
        cols = moved.reshape(k, self.blocks or 1, self.n, -1)
        return (A @ cols).reshape(moved.shape).movedim(1, axis)

    @abstractmethod
    def _algebra_matrix(self, M: Tensor, power: float) -> Tensor:
        """The matrix d rho(M) applies to the axis' columns (batched)."""


class GeneralLinear(_MatrixGroup):
    """GL_n(R) (or ``blocks`` independent copies): papers/001 Ex. 1.2.2, 1.2.11-1.2.13.

    Lie algebra coordinates are arbitrary n x n matrices; ``exp`` is
    ``torch.linalg.matrix_exp``, so every element is exactly invertible.
    """

    kind: GroupKind = "general"
    continuous = True

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return torch.linalg.matrix_exp(coords)

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return torch.linalg.inv(g)

    def _contragredient(self, g: Tensor, cols: Tensor) -> Tensor:
        return torch.linalg.solve(g.mT, cols)

    def _algebra_matrix(self, M: Tensor, power: float) -> Tensor:
        return M if power == 1 else -M.mT

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Spectral norm ||xi||_2 <= radius per block (condition number of exp(xi) <= e^{2 radius})."""
        if float(torch.linalg.matrix_norm(xi).max()) <= radius:  # spectral <= Frobenius: nothing to clip
            return
        U, S, Vh = torch.linalg.svd(xi, full_matrices=False)
        if bool((S > radius).any()):
            xi.copy_(U @ torch.diag_embed(S.clamp(max=radius)) @ Vh)

    def balance(self, stats: Mapping[float, Tensor], radius: float | None, rcond: float = BALANCE_RCOND) -> Tensor:
        """The element equalising the two sides' Gram matrices, g A g^T = g^-T B g^-1.

        With P = g^T g, sum ||g X_+||^2 + ||g^-T X_-||^2 = tr(P A) + tr(P^-1 B), A and B the summed
        Gram matrices of the writers (power +1) and readers (power -1).  It is convex in P with
        stationarity P A P = B, so P is the geometric mean A^-1 # B = A^-1/2 (A^1/2 B A^1/2)^1/2 A^-1/2,
        and g = P^1/2 (any g with g^T g = P: the rest is an orthogonal factor that changes no norm).
        The coordinates are the symmetric log(P) / 2, with eigenvalues clipped to [-radius, radius]
        (the trust region: each eigenvalue's 1-D problem is convex, so clipping keeps the decrease).
        When A = A A^T and B = B^T B of a LoRA pair B A, this is the balanced pair A A^T = B^T B, and
        g = (B^T B)^1/4 when A has orthonormal rows.

        A block whose A or B has an eigenvalue at most ``rcond`` times its largest (LoRA's B = 0 at
        initialisation; fewer columns than n), or a site with one side only, has no minimiser (the norm
        decreases without bound towards a singular g) and keeps zero coordinates.
        """
        A, B = stats.get(1.0), stats.get(-1.0)
        ref = A if A is not None else B
        if ref is None:
            raise ValueError("balance needs the statistics of power +1 or -1 members")
        if A is None or B is None:
            return torch.zeros_like(ref)  # one side only: no minimiser
        A, B = _sym(A), _sym(B)
        eye = torch.eye(self.n, dtype=A.dtype, device=A.device).expand(A.shape)
        ok = _well_conditioned(torch.linalg.eigvalsh(A), rcond) & _well_conditioned(torch.linalg.eigvalsh(B), rcond)
        if not bool(ok.any()):
            return torch.zeros_like(A)
        mask = ok[..., None, None]
        A, B = torch.where(mask, A, eye), torch.where(mask, B, eye)  # the blocks left alone solve to the identity
        a, U = torch.linalg.eigh(A)
        root = (U * a.sqrt().unsqueeze(-2)) @ U.mT
        inv_root = (U * a.rsqrt().unsqueeze(-2)) @ U.mT
        m, V = torch.linalg.eigh(_sym(root @ B @ root))
        P = _sym(inv_root @ ((V * m.clamp_min(0).sqrt().unsqueeze(-2)) @ V.mT) @ inv_root)
        lam, W = torch.linalg.eigh(P)
        xi = 0.5 * torch.log(lam.clamp_min(torch.finfo(torch.float64).tiny))
        if radius is not None:
            xi = xi.clamp(-radius, radius)
        return torch.where(mask, (W * xi.unsqueeze(-2)) @ W.mT, torch.zeros_like(A))

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"GL elements must be floating point, got {g.dtype}")
        _check_finite(g, "GL element")
        sv = torch.linalg.svdvals(g.detach().to(torch.float64))
        ratio = sv[..., -1] / sv[..., 0].clamp_min(torch.finfo(torch.float64).tiny)
        limit = self.n * torch.finfo(g.dtype).eps
        if bool((ratio <= limit).any()):
            raise ValueError(f"GL element is not invertible: smallest/largest singular value {float(ratio.min()):.3e} <= {limit:.1e}")


class Orthogonal(_MatrixGroup):
    """O(n) (or ``blocks`` copies): papers/001 Ex. 1.2.6 and eq. 4.33; SO(2) for Prop. 4.4.1.

    Coordinates are n x n matrices whose skew-symmetric part generates the element:
    ``exp(A) = matrix_exp((A - A^T) / 2)`` (so ``exp`` reaches SO(n)).  The
    contragredient representation equals the standard one and inverses are
    transposes.
    """

    kind: GroupKind = "orthogonal"
    continuous = True

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return torch.linalg.matrix_exp((coords - coords.mT) / 2)

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return g.mT.clone()

    def _contragredient(self, g: Tensor, cols: Tensor) -> Tensor:
        return g @ cols

    def _algebra_matrix(self, M: Tensor, power: float) -> Tensor:
        return (M - M.mT) / 2  # exp uses the skew part, the same for either power

    def balance(self, stats: Mapping[float, Tensor], radius: float | None, rcond: float = BALANCE_RCOND) -> Tensor:
        """The identity: orthogonal maps change no norm, every element is a minimiser."""
        ref = next(iter(stats.values()))
        return torch.zeros_like(ref)

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """O(n) is compact: no bound needed."""

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"O(n) elements must be floating point, got {g.dtype}")
        _check_finite(g, "O(n) element")
        err = float((g.mT @ g - torch.eye(self.n, dtype=g.dtype, device=g.device)).abs().max())
        # a check against user error, not round-off: matrix_exp of a skew matrix is orthogonal to ~1e-13
        limit = self.n * torch.finfo(g.dtype).eps ** 0.5
        if err > limit:
            raise ValueError(f"element is not orthogonal: max |g^T g - I| = {err:.3e} > {limit:.1e}")


class PositiveScaling(Group):
    """The positive scaling group R_{>0}^n: papers/001 Ex. 1.2.4 (homogeneous activations), 1.2.7.

    Elements are vectors c of positive scales; coordinates are log-scales and
    ``exp`` is the elementwise exponential.
    """

    kind: GroupKind = "diagonal"
    continuous = True

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    @property
    def coord_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.ones(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a * b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return 1.0 / g

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return torch.exp(coords)

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        coords = torch.randn(self.coord_shape, generator=generator, dtype=torch.float64) * scale
        return self.exp(coords).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"scaling elements must be floating point, got {g.dtype}")
        _check_finite(g, "scaling element")
        if bool((g <= 0).any()):
            raise ValueError(f"scaling element must be positive, smallest entry is {float(g.min()):.3e}")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        factor = g.to(x.dtype) if power == 1 else g.to(x.dtype) ** power
        shape = [1] * x.ndim
        shape[axis] = self.dim
        return x * factor.reshape(shape)

    def second_moment_power(self, power: float) -> float | None:
        return 2 * power

    has_algebra_action: ClassVar[bool] = True

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Every log-scale |xi_i| <= radius: each scale lies in [e^-radius, e^radius]."""
        xi.clamp_(-radius, radius)

    def algebra_action(self, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        shape = [x.shape[0]] + [1] * (x.ndim - 1)
        shape[axis] = -1
        return x * (power * M.to(x.dtype)).reshape(shape)

    def square_factor(self, g: Tensor, power: float) -> Tensor | None:
        return g ** (2.0 * power)

    has_balance: ClassVar[bool] = True

    def norm_statistic(self, x: Tensor, axis: int) -> Tensor:
        """Sum of squares of each unit's slice: ||c^p x||^2 = sum_i c_i^(2p) s_i."""
        self._check_axis(x, axis)
        return x.detach().to(torch.float64).movedim(axis, 0).reshape(self.dim, -1).square().sum(1)

    def balance(self, stats: Mapping[float, Tensor], radius: float | None, rcond: float = BALANCE_RCOND) -> Tensor:
        """Log-scales x minimising sum_p sum_i stats[p]_i e^(2 p x_i), unit by unit (each a convex 1-D problem).

        With one writer power p > 0 (mass a) and one reader power -q < 0 (mass b), the closed form
        x = log(q b / (p a)) / (2 (p + q)); for p = q = 1 the scale c = e^x = (b / a)^(1/4) of ENorm
        (Stock et al. 2019), |w_in,i| = |w_out,i| afterwards.  Other mixtures of powers take safeguarded
        Newton steps.  Units whose writer or reader mass is at most ``rcond`` times the largest over the
        units (one side empty, a dead unit) have no minimiser and stay at 0.
        """
        terms = {p: m for p, m in stats.items() if p != 0}
        if not terms:
            return torch.zeros(self.dim, dtype=torch.float64, device=next(iter(stats.values())).device)
        pos = [p for p in terms if p > 0]
        neg = [p for p in terms if p < 0]
        ref = next(iter(terms.values()))
        a = sum((terms[p] for p in pos), torch.zeros_like(ref))
        b = sum((terms[p] for p in neg), torch.zeros_like(ref))
        ok = (a > rcond * a.max()) & (b > rcond * b.max())
        if not bool(ok.any()):
            return torch.zeros_like(ref)
        if len(pos) == 1 and len(neg) == 1:
            p, q = pos[0], -neg[0]
            one = torch.ones_like(ref)
            x = (torch.log(q * torch.where(ok, b, one)) - torch.log(p * torch.where(ok, a, one))) / (2 * (p + q))
        else:
            x = _newton_balance(terms, radius)
        x = torch.where(ok, x, torch.zeros_like(x))
        return x if radius is None else x.clamp(-radius, radius)


class SignFlip(Group):
    """The sign-flip group Z_2^n for odd activations (papers/001 Ex. 1.2.5).

    Elements are vectors of +-1 in the working dtype.
    """

    kind: GroupKind = "sign"
    continuous = False

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.ones(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a * b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return g.clone()

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        bits = torch.randint(0, 2, (self.dim,), generator=generator)
        return (1 - 2 * bits).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not bool(((g == 1) | (g == -1)).all()):
            raise ValueError("sign-flip element must have entries +1 or -1 only")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        if float(power) != int(power):
            raise ValueError(f"sign flips need an integer power, got {power}")
        if int(power) % 2 == 0:
            return x
        shape = [1] * x.ndim
        shape[axis] = self.dim
        return x * g.to(x.dtype).reshape(shape)

    def second_moment_power(self, power: float) -> float | None:
        return 2 * power


class Permutation(Group):
    """The symmetric group S_n acting on n blocks of an axis (papers/001 Ex. 1.2.9, 1.2.10, 1.2.12).

    An element is an index tensor ``p`` (a permutation of ``range(n)``) acting by
    ``x -> x[p]`` along the axis, i.e. (p . x)_i = x_{p_i}; in the papers'
    notation p = pi^{-1}.  With ``unit_size=d`` each of the n units is a chunk of d
    consecutive entries (attention heads): the axis has length n * d.
    """

    kind: GroupKind = "permutation"
    continuous = False

    def __init__(self, n: int, unit_size: int = 1) -> None:
        super().__init__(n)
        _check_size(unit_size, "unit_size")
        self.unit_size = unit_size

    @property
    def dim(self) -> int:
        return self.n * self.unit_size

    def _config(self) -> tuple:
        return (self.n,) if self.unit_size == 1 else (self.n, self.unit_size)

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.n,)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.arange(self.n, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return b[a]

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return torch.argsort(g)

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        return torch.randperm(self.n, generator=generator).to(device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if g.dtype != torch.long:
            raise TypeError(f"permutation elements must be torch.long index tensors, got {g.dtype}")
        if not torch.equal(torch.sort(g.cpu()).values, torch.arange(self.n)):
            raise ValueError(f"element is not a permutation of range({self.n}): {g.tolist()}")

    def _expanded(self, g: Tensor) -> Tensor:
        d = self.unit_size
        if d == 1:
            return g
        return (g[:, None] * d + torch.arange(d, device=g.device)).reshape(-1)

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        return x.index_select(axis, self._expanded(g).to(x.device))

    def second_moment_power(self, power: float) -> float | None:
        return 1


class Translation(Group):
    """The additive group (R^n, +) of softmax translations (papers/001 Ex. 1.2.8).

    Elements are vectors; composition is addition and ``exp`` is the identity map.
    It acts affinely, so it has no linear representation on an axis: actions that
    use it (see ``teleopt.actions.softmax``) add the element themselves.
    """

    kind: GroupKind = "translation"
    continuous = True

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    @property
    def coord_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.zeros(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a + b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return -g

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return coords

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        return (torch.randn(self.coord_shape, generator=generator, dtype=torch.float64) * scale).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"translation elements must be floating point, got {g.dtype}")
        _check_finite(g, "translation element")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        raise TypeError("the translation group acts affinely; it has no linear representation on an axis")

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Every |xi_i| <= radius."""
        xi.clamp_(-radius, radius)


def _sym(m: Tensor) -> Tensor:
    return 0.5 * (m + m.mT)


def _well_conditioned(eigenvalues: Tensor, rcond: float) -> Tensor:
    """Per block (the last axis holds a block's ascending eigenvalues): smallest > ``rcond`` * largest > 0."""
    top = eigenvalues[..., -1]
    return (top > 0) & (eigenvalues[..., 0] > rcond * top)


def _newton_balance(terms: Mapping[float, Tensor], radius: float | None, iterations: int = 50) -> Tensor:
    """argmin_x sum_p m_p e^(2 p x) per unit by Newton steps of at most 1 in x, kept inside the trust region
    (or |x| <= 40 when unbounded; the minimiser of a one-signed sum is at that edge)."""
    bound = 40.0 if radius is None else radius
    ref = next(iter(terms.values()))
    x = torch.zeros_like(ref)
    for _ in range(iterations):
        g = torch.zeros_like(x)
        h = torch.zeros_like(x)
        for p, m in terms.items():
            e = m * torch.exp(2 * p * x)
            g = g + 2 * p * e
            h = h + 4 * p * p * e
        step = torch.where(h > 0, -g / h.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(x)).clamp(-1.0, 1.0)
        x = (x + step).clamp(-bound, bound)
        if float(step.abs().max()) < 1e-12:
            break
    if radius is None:  # a minimiser at the artificial edge is at infinity: leave that unit alone
        x = torch.where(x.abs() >= bound, torch.zeros_like(x), x)
    return x
