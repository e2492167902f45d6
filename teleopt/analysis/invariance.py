"""Learned invariance and equivariance of linear models under data symmetries (papers/004).

A finite group ``G`` of invertible ``d x d`` matrices acts on a model's inputs as
``x -> g x`` (samples are rows, as in ``nn.Linear``: a batch ``X`` (N, d) becomes
``X g^T``).  papers/004 shows that a linear model ``x -> W x`` trained by gradient flow
on data that contains whole orbits (Assumption 1) splits into a part that respects
the symmetry and one that does not, that the two never interact, and that the
asymmetric part decays exponentially (Theorem 3.3; Theorem 4.2 for equivariance).
This module gives the pieces needed to check that on a real run:

* :class:`FiniteLinearGroup`: the group as a validated set of matrices (identity,
  closure, invertibility, a size cap), built from its elements or from generators;
* :meth:`FiniteLinearGroup.reynolds_operator`: the Reynolds operator
  ``P = (1/|G|) sum_g g`` (a projector onto the fixed vectors) or the paper's
  unnormalised ``R = sum_g g`` (Theorem 3.3);
* :func:`split_weights`: ``W = W_sym + W_asym`` with ``x -> W_sym x`` invariant
  (Theorem 3.3.2) or, given an output representation, equivariant (Theorem 4.2.2);
* :func:`asymmetry`: the asymmetry loss ``E_x |f(x) - E_g f(g x)|`` of papers/004
  Sec. 5 for any callable or ``nn.Module``;
* :func:`orbit_closure`: a dataset completed to whole orbits (Assumptions 1 and 4);
* :func:`linear_regression_flow`: the closed-form gradient flow of eqs. (3) and (5)
  with the decay rates of the asymmetric part, to compare a run with the theorem.

Conventions versus the paper.  papers/004 writes samples as row vectors acting on
weights from the left (``f_w(x) = x w``) and group elements acting from the right
(``x g``), so its ``g`` is our ``g^T``.  In our convention the invariant weights are
the fixed vectors of ``g^T`` and the symmetric part of ``W`` is ``W P`` (rows
projected by ``P^T``), which gives an exactly invariant predictor for every finite
group.  For orthogonal groups ``P = P^T`` is the orthogonal projector, ``R = R^T``,
and the split is the paper's ``ker(R)^perp (+) ker(R)``.  Theorem 3.3 needs
Assumption 3 (``g^T`` in ``G``), which for a finite group is the same as
orthogonality: ``g^T g`` is then a symmetric positive-definite element of finite
order, so it is ``I``.  For a non-orthogonal group the symmetric part is still
well defined and the trained predictor still becomes invariant, but the two parts
of gradient flow do interact, so :func:`linear_regression_flow` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "FiniteLinearGroup",
    "WeightSplit",
    "split_weights",
    "asymmetry",
    "orbit_closure",
    "LinearRegressionFlow",
    "linear_regression_flow",
]

DEFAULT_MAX_ORDER = 1024
"""Largest group :class:`FiniteLinearGroup` accepts unless told otherwise."""


def _default_tol(dtype: torch.dtype) -> float:
    # sqrt(machine epsilon): 1.5e-8 in float64, 3.5e-4 in float32.  Exact group
    # elements (0, +-1, cos/sin of 2 pi k / n) and their products are correct to a
    # few ulps, while two distinct elements differ by O(1), so this separates
    # "equal up to round-off" from "different" with many orders of margin both ways.
    return math.sqrt(torch.finfo(dtype).eps)


def _check_float_tensor(value: object, what: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def _check_square_stack(matrices: Tensor, what: str) -> None:
    if matrices.ndim != 3:
        raise ValueError(f"{what} must have shape (n, d, d), got {tuple(matrices.shape)}")
    if matrices.shape[1] != matrices.shape[2]:
        raise ValueError(f"{what} must be square matrices, got shape {tuple(matrices.shape)} (non-square)")
    if matrices.shape[0] == 0 or matrices.shape[1] == 0:
        raise ValueError(f"{what} is empty (shape {tuple(matrices.shape)})")
    if not bool(torch.isfinite(matrices).all()):
        raise ValueError(f"{what} has non-finite entries")


def _check_invertible(matrices: Tensor, tol: float, what: str) -> None:
    singular = torch.linalg.svdvals(matrices)
    bad = singular[:, -1] <= tol * singular[:, 0]
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{what}[{i}] is not invertible (smallest/largest singular value {float(singular[i, -1] / singular[i, 0]):.2e})")


def _relative_distance(a: Tensor, b: Tensor) -> Tensor:
    """||a - b||_F / ||a||_F over the last two axes."""
    return torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(a)


def _nearest(elements: Tensor, queries: Tensor, tol: float) -> tuple[Tensor, Tensor]:
    """Index of the element nearest to each query and its relative Frobenius distance.

    Candidates come from a sorted random 1-D projection (the two neighbours of each
    query), checked in the full norm; queries whose candidates are not within
    ``tol`` fall back to a brute-force search, so the answer is the true nearest
    element whenever one is within ``tol``.
    """
    n = elements.shape[0]
    flat_e, flat_q = elements.flatten(1), queries.flatten(1)
    z = torch.randn(flat_e.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    z = z.to(dtype=elements.dtype, device=elements.device)
    keys, order = torch.sort(flat_e @ z)
    pos = torch.searchsorted(keys, (flat_q @ z).contiguous())
    cand = torch.stack([order[(pos - 1).clamp(0, n - 1)], order[pos.clamp(0, n - 1)]])
    dist = _relative_distance(queries.unsqueeze(0), elements[cand])
    best = dist.argmin(0)
    index = cand.gather(0, best[None])[0]
    error = dist.gather(0, best[None])[0]
    unsure = (error > tol).nonzero().flatten()
    if len(unsure):
        chunk = max(1, 2**22 // max(1, n * flat_e.shape[1]))
        for start in range(0, len(unsure), chunk):
            rows = unsure[start : start + chunk]
            full = torch.cdist(flat_q[rows], flat_e) / flat_q[rows].norm(dim=1, keepdim=True)
            error[rows], index[rows] = full.min(1)
    return index, error


class FiniteLinearGroup:
    """A finite group of invertible ``d x d`` matrices acting on inputs as ``x -> g x`` (papers/004 Sec. 2).

    ``elements`` (|G|, d, d) must contain the identity, be closed under matrix
    multiplication and contain no element twice, all up to the relative Frobenius
    tolerance ``tol`` (default ``sqrt(eps)`` of the dtype: 1.5e-8 in float64, 3.5e-4
    in float32).  A finite set of invertible matrices closed under multiplication
    is a group, so inverses need no separate check.  Groups larger than
    ``max_order`` are refused (a generator of infinite order, such as a rotation by
    an irrational angle, would otherwise never close).

    Example 3.1 of papers/004 (features ``(1, x)``, reflection ``x -> -x``)::

        group = FiniteLinearGroup.reflection(2, [1])

    Raises ``TypeError`` for a non-tensor or non-floating dtype and ``ValueError``
    naming the problem for a wrong shape, an empty or non-square stack, a singular
    element, a missing identity, a duplicate, or a set that is not closed.
    """

    def __init__(self, elements: Tensor, *, tol: float | None = None, max_order: int = DEFAULT_MAX_ORDER) -> None:
        elements = _check_float_tensor(elements, "elements")
        _check_square_stack(elements, "elements")
        tol = _default_tol(elements.dtype) if tol is None else float(tol)
        if not tol > 0:
            raise ValueError(f"tol must be positive, got {tol}")
        if not (isinstance(max_order, int) and max_order >= 1):
            raise ValueError(f"max_order must be a positive int, got {max_order!r}")
        n, d = elements.shape[0], elements.shape[1]
        if n > max_order:
            raise ValueError(f"{n} elements exceed max_order={max_order}; raise max_order if the group is really that large")
        elements = elements.detach().clone()
        _check_invertible(elements, tol, "elements")

        eye = torch.eye(d, dtype=elements.dtype, device=elements.device)
        to_identity = _relative_distance(eye.expand_as(elements), elements)
        identity = int(to_identity.argmin())
        if float(to_identity[identity]) > tol:
            raise ValueError(f"elements do not contain the identity (nearest element at relative distance {float(to_identity[identity]):.2e})")

        if n > 1:
            self_excluded, nearest_other = _nearest_other(elements)
            if float(self_excluded.min()) <= tol:
                i = int(self_excluded.argmin())
                raise ValueError(f"elements[{i}] and elements[{int(nearest_other[i])}] are the same matrix (duplicate, relative distance {float(self_excluded[i]):.2e})")

        table = torch.empty(n, n, dtype=torch.long, device=elements.device)
        block = max(1, 2**20 // max(1, n * d * d))
        for start in range(0, n, block):
            left = elements[start : start + block]
            products = (left[:, None] @ elements[None]).flatten(0, 1)
            index, error = _nearest(elements, products, tol)
            if float(error.max()) > tol:
                k = int(error.argmax())
                i, j = start + k // n, k % n
                raise ValueError(
                    f"elements are not closed under multiplication: elements[{i}] @ elements[{j}] is not in the set "
                    f"(nearest element at relative distance {float(error[k]):.2e} > tol {tol:.1e})"
                )
            table[start : start + block] = index.view(-1, n)
        # Each row of a group's Cayley table is a permutation (cancellation law).
        if not bool((table.sort(1).values == torch.arange(n, device=table.device)).all()):
            raise ValueError("elements are not a group within tol: two products coincide (ill-conditioned elements or tol too loose)")

        self._elements = elements
        self._tol = tol
        self._table = table
        self._identity = identity
        self._inverse = (table == identity).int().argmax(1)

    @classmethod
    def from_generators(
        cls, generators: Tensor | Sequence[Tensor], *, tol: float | None = None, max_order: int = DEFAULT_MAX_ORDER
    ) -> FiniteLinearGroup:
        """The group generated by ``generators`` ((k, d, d), one (d, d) matrix, or a sequence of them).

        Closes the set under multiplication breadth first (products of known
        elements with the generators, identified up to ``tol``) and raises
        ``ValueError`` once more than ``max_order`` elements appear.
        """
        if isinstance(generators, Tensor):
            gens = generators
        elif isinstance(generators, Sequence) and len(generators) > 0 and all(isinstance(g, Tensor) for g in generators):
            gens = torch.stack(list(generators))
        else:
            raise TypeError("generators must be a tensor (k, d, d) or (d, d), or a non-empty sequence of (d, d) tensors")
        gens = _check_float_tensor(gens, "generators")
        if gens.ndim == 2:
            gens = gens[None]
        _check_square_stack(gens, "generators")
        tol = _default_tol(gens.dtype) if tol is None else float(tol)
        _check_invertible(gens, tol, "generators")
        gens = gens.detach()
        known = torch.eye(gens.shape[1], dtype=gens.dtype, device=gens.device)[None]
        frontier = known
        while len(frontier):
            candidates = (frontier[:, None] @ gens[None]).flatten(0, 1)
            _, error = _nearest(known, candidates, tol)
            candidates = candidates[error > tol]
            fresh: list[Tensor] = []
            for c in candidates:  # deduplicate the new products among themselves
                if not fresh or float(_relative_distance(c.expand(len(fresh), -1, -1), torch.stack(fresh)).min()) > tol:
                    fresh.append(c)
                    if len(known) + len(fresh) > max_order:
                        raise ValueError(
                            f"the generators produce more than max_order={max_order} elements: the group may be infinite "
                            "(e.g. a rotation by an irrational angle) or tol too tight"
                        )
            frontier = torch.stack(fresh) if fresh else known[:0]
            known = torch.cat([known, frontier])
        return cls(known, tol=tol, max_order=max_order)

    @classmethod
    def reflection(cls, dim: int, coordinates: Sequence[int], *, dtype: torch.dtype = torch.float64) -> FiniteLinearGroup:
        """``{I, F}`` with ``F`` flipping the sign of ``coordinates`` (papers/004 Example 3.1: ``reflection(2, [1])``)."""
        _check_dim(dim)
        coords = list(coordinates)
        if not coords or any(not isinstance(c, int) or not 0 <= c < dim for c in coords) or len(set(coords)) != len(coords):
            raise ValueError(f"coordinates must be distinct ints in [0, {dim}), got {coordinates!r}")
        flip = torch.ones(dim, dtype=dtype)
        flip[coords] = -1
        return cls(torch.stack([torch.eye(dim, dtype=dtype), torch.diag(flip)]))

    @classmethod
    def permutations(
        cls, generators: Sequence[Sequence[int]], *, dtype: torch.dtype = torch.float64, max_order: int = DEFAULT_MAX_ORDER
    ) -> FiniteLinearGroup:
        """Coordinate permutations generated by ``generators``; ``p`` acts as ``(g x)_i = x_{p[i]}``.

        E.g. ``permutations([[1, 0]])`` is the ``x <-> y`` swap of papers/004 App. D-E.
        """
        perms = [list(p) for p in generators]
        if not perms:
            raise ValueError("permutations need at least one generator")
        dim = len(perms[0])
        for p in perms:
            if len(p) != dim or sorted(p) != list(range(dim)):
                raise ValueError(f"{p!r} is not a permutation of range({dim})")
        eye = torch.eye(dim, dtype=dtype)
        return cls.from_generators(torch.stack([eye[p] for p in perms]), max_order=max_order)

    @classmethod
    def symmetric(cls, dim: int, *, dtype: torch.dtype = torch.float64, max_order: int = DEFAULT_MAX_ORDER) -> FiniteLinearGroup:
        """All ``dim!`` coordinate permutations (generated by a transposition and a cycle)."""
        _check_dim(dim)
        if dim == 1:
            return cls(torch.eye(1, dtype=dtype)[None])
        swap = [1, 0, *range(2, dim)]
        cycle = [*range(1, dim), 0]
        return cls.permutations([swap, cycle], dtype=dtype, max_order=max_order)

    @classmethod
    def rotations(cls, order: int, *, dtype: torch.dtype = torch.float64) -> FiniteLinearGroup:
        """The cyclic group of plane rotations by multiples of ``2 pi / order`` (2 x 2 matrices)."""
        if not (isinstance(order, int) and order >= 1):
            raise ValueError(f"order must be a positive int, got {order!r}")
        angles = torch.arange(order, dtype=torch.float64) * (2 * math.pi / order)
        c, s = torch.cos(angles), torch.sin(angles)
        return cls(torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2).to(dtype))

    @property
    def elements(self) -> Tensor:
        """The matrices (|G|, d, d) (a copy: the group is immutable)."""
        return self._elements.clone()

    @property
    def order(self) -> int:
        """|G|."""
        return self._elements.shape[0]

    def __len__(self) -> int:
        return self.order

    @property
    def dim(self) -> int:
        """d: the dimension of the inputs the group acts on."""
        return self._elements.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self._elements.dtype

    @property
    def device(self) -> torch.device:
        return self._elements.device

    @property
    def tol(self) -> float:
        """Relative Frobenius tolerance used to identify matrices."""
        return self._tol

    @property
    def cayley_table(self) -> Tensor:
        """(|G|, |G|) long: ``elements[table[i, j]] = elements[i] @ elements[j]``."""
        return self._table.clone()

    @property
    def identity_index(self) -> int:
        """Index of the identity in :attr:`elements`."""
        return self._identity

    @property
    def inverse_indices(self) -> Tensor:
        """(|G|,) long: ``elements[inverse_indices[i]]`` is the inverse of ``elements[i]``."""
        return self._inverse.clone()

    def __repr__(self) -> str:
        return f"FiniteLinearGroup(order={self.order}, dim={self.dim}, dtype={self.dtype})"

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> FiniteLinearGroup:
        """The same group with its matrices cast (table, identity and inverses carried over)."""
        elements = self._elements.to(dtype=dtype or self.dtype, device=device or self.device)
        if elements.dtype == self.dtype and elements.device == self.device:
            return self
        if not elements.is_floating_point():
            raise TypeError(f"a group's matrices need a floating-point dtype, got {elements.dtype}")
        new = object.__new__(FiniteLinearGroup)
        new._elements = elements
        new._tol = max(self._tol, _default_tol(elements.dtype))
        new._table = self._table.to(elements.device)
        new._identity = self._identity
        new._inverse = self._inverse.to(elements.device)
        return new

    def is_orthogonal(self, tol: float | None = None) -> bool:
        """Whether every ``g^T g = I`` (papers/004 Assumption 5; for finite groups the same as Assumption 3)."""
        tol = self._tol if tol is None else tol
        gram = self._elements.mT @ self._elements
        eye = torch.eye(self.dim, dtype=self.dtype, device=self.device)
        return float(torch.linalg.matrix_norm(gram - eye).max()) <= tol * math.sqrt(self.dim)

    def reynolds_operator(self, normalized: bool = True) -> Tensor:
        """``P = (1/|G|) sum_g g`` (normalized) or the paper's unnormalised ``R = sum_g g`` (papers/004 Theorem 3.3).

        ``P`` is idempotent with image the vectors fixed by every ``g`` (``g P = P``);
        ``P^T`` projects weights onto those with ``x -> w . x`` invariant.
        """
        total = self._elements.sum(0)
        return total / self.order if normalized else total

    def act(self, inputs: Tensor) -> Tensor:
        """Every group element applied to a batch: (N, d) -> (|G|, N, d), row ``[i, n] = elements[i] @ inputs[n]``."""
        x = _check_inputs(inputs, self.dim, "inputs")
        return x @ self._like(x).mT

    def check_representation(self, matrices: Tensor, what: str = "representation") -> Tensor:
        """Validate ``matrices`` (|G|, m, m) as a representation aligned with :attr:`elements` and return it.

        ``matrices[i]`` is the image of ``elements[i]``; it must be invertible and
        satisfy ``rho(g_i) rho(g_j) = rho(g_i g_j)`` up to :attr:`tol` (a
        homomorphism, papers/004 Sec. 2).  It need not be faithful: the trivial
        representation (all identities) is allowed.
        """
        rho = _check_float_tensor(matrices, what)
        _check_square_stack(rho, what)
        if rho.shape[0] != self.order:
            raise ValueError(f"{what} has {rho.shape[0]} matrices, the group has {self.order} elements")
        _check_invertible(rho, self._tol, what)
        products = rho[:, None] @ rho[None]
        error = _relative_distance(products, rho[self._table.to(rho.device)])
        if float(error.max()) > max(self._tol, _default_tol(rho.dtype)):
            i, j = divmod(int(error.argmax()), self.order)
            raise ValueError(f"{what} is not a homomorphism: rho({i}) rho({j}) != rho({i}*{j}) (relative error {float(error.max()):.2e})")
        return rho

    def _like(self, tensor: Tensor) -> Tensor:
        return self._elements.to(dtype=tensor.dtype, device=tensor.device)


def _check_dim(dim: object) -> None:
    if not (isinstance(dim, int) and dim >= 1):
        raise ValueError(f"dim must be a positive int, got {dim!r}")


def _nearest_other(elements: Tensor) -> tuple[Tensor, Tensor]:
    flat = elements.flatten(1)
    dist = torch.cdist(flat, flat) / flat.norm(dim=1, keepdim=True)
    dist.fill_diagonal_(math.inf)
    return dist.min(1)


def _check_inputs(inputs: object, dim: int, what: str) -> Tensor:
    x = _check_float_tensor(inputs, what)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what} must have shape (N, {dim}), got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{what} is empty")
    return x


def _check_group(group: object) -> FiniteLinearGroup:
    if not isinstance(group, FiniteLinearGroup):
        raise TypeError(f"group must be a FiniteLinearGroup, got {type(group).__name__}")
    return group


def _output_representation(group: FiniteLinearGroup, rho: Tensor | None, like: Tensor) -> Tensor | None:
    if rho is None:
        return None
    return group.check_representation(rho, "output_representation").to(dtype=like.dtype, device=like.device)


class WeightSplit(NamedTuple):
    """``weight = symmetric + asymmetric`` (papers/004 Theorem 3.3.2 / 4.2.2)."""

    symmetric: Tensor
    asymmetric: Tensor


def _project(weight: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> Tensor:
    """The Reynolds projection of weights (out, in) or (in,): onto invariant or equivariant maps."""
    g = group._like(weight)
    if rho is None:
        return weight @ g.mean(0)
    rho_inverse = rho[group._inverse.to(rho.device)]
    return torch.einsum("gab,bc,gcd->ad", rho_inverse, weight, g) / group.order


def _check_weight(w: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> Tensor:
    if w.ndim not in (1, 2) or w.shape[-1] != group.dim:
        raise ValueError(f"weight must have shape (out, {group.dim}) or ({group.dim},) in nn.Linear convention, got {tuple(w.shape)}")
    if rho is not None and (w.ndim != 2 or w.shape[0] != rho.shape[1]):
        raise ValueError(f"with an output representation of size {rho.shape[1]}, weight must have shape ({rho.shape[1]}, {group.dim}), got {tuple(w.shape)}")
    return w


def split_weights(weight: Tensor, group: FiniteLinearGroup, *, output_representation: Tensor | None = None) -> WeightSplit:
    """Split a linear model's weights into symmetric and asymmetric parts (papers/004 Theorems 3.3.2, 4.2.2).

    ``weight`` is in ``nn.Linear`` convention: (out, in) or a vector (in,), acting as
    ``x -> W x``, with ``in = group.dim``.

    * Invariance (no ``output_representation``): ``symmetric = W P`` with the
      Reynolds operator ``P = (1/|G|) sum_g g``, so ``x -> symmetric @ x`` is
      exactly G-invariant (``P g = P``).  For orthogonal groups this is the
      orthogonal projection onto ``ker(R)^perp`` of Theorem 3.3.
    * Equivariance: given ``rho`` (|G|, out, out) aligned with ``group.elements``
      (see :meth:`FiniteLinearGroup.check_representation`),
      ``symmetric = (1/|G|) sum_g rho(g)^-1 W g``, which satisfies
      ``symmetric g = rho(g) symmetric`` (the commutant ``V_G`` of Theorem 4.2 when
      ``rho`` is the input representation itself).

    In both cases the projection is idempotent and ``asymmetric = W - symmetric``;
    the result is differentiable in ``weight``.
    """
    group = _check_group(group)
    w = _check_float_tensor(weight, "weight")
    rho = _output_representation(group, output_representation, w)
    symmetric = _project(_check_weight(w, group, rho), group, rho)
    return WeightSplit(symmetric, w - symmetric)


def asymmetry(
    f: Callable[[Tensor], Tensor],
    inputs: Tensor,
    group: FiniteLinearGroup,
    *,
    output_representation: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """The asymmetry loss ``E_x |f(x) - E_g f(g x)|`` of papers/004 Sec. 5.

    ``f`` is any callable mapping a batch (M, d) to outputs (M,) or (M, ...) (an
    ``nn.Module`` included); it is called once, on all ``|G| * N`` transformed
    inputs stacked group-major, so put modules whose forward mixes samples (train
    mode BatchNorm) in eval mode first.  The expectation over ``g`` is the uniform
    (Haar) average over the finite group.  For vector outputs ``|.|`` is the
    Euclidean norm over the output entries.  With ``output_representation`` rho
    (|G|, m, m) it measures equivariance instead: ``E_x |f(x) - E_g rho(g)^-1 f(g x)|``.

    ``reduction``: ``"mean"`` (a scalar) or ``"none"`` (one value per input).  The
    result keeps the autograd graph of ``f``.  For a linear model ``f(x) = W x``
    the per-input value is ``|W_asym x|`` with ``W_asym`` from :func:`split_weights`.
    """
    group = _check_group(group)
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    x = _check_inputs(inputs, group.dim, "inputs")
    n = x.shape[0]
    outputs = f(group.act(x).flatten(0, 1))
    if not isinstance(outputs, Tensor) or outputs.ndim == 0 or outputs.shape[0] != group.order * n:
        shape = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
        raise ValueError(f"f must map a batch of {group.order * n} inputs to a tensor with {group.order * n} rows, got {shape}")
    outputs = outputs.reshape(group.order, n, -1)
    rho = _output_representation(group, output_representation, outputs)
    if rho is not None:
        if outputs.shape[-1] != rho.shape[1]:
            raise ValueError(f"f's outputs have {outputs.shape[-1]} entries, output_representation acts on {rho.shape[1]}")
        outputs = torch.einsum("gab,gnb->gna", rho[group._inverse.to(rho.device)], outputs)
    deviation = outputs[group.identity_index] - outputs.mean(0)
    per_input = torch.linalg.vector_norm(deviation, dim=-1)
    return per_input.mean() if reduction == "mean" else per_input


def orbit_closure(
    inputs: Tensor, group: FiniteLinearGroup, targets: Tensor | None = None, *, output_representation: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Complete a dataset to whole orbits (papers/004 Assumption 1, or Assumption 4 with ``output_representation``).

    Returns ``(X, Y)`` with ``|G| * N`` rows, group-major (the block ``i`` is
    ``elements[i]`` applied to every input): ``X`` rows ``g x``, ``Y`` rows ``y``
    (invariant labels) or ``rho(g) y`` (equivariant labels).  Training on it is
    Corollary 3.2 / 4.1: its Gram matrix ``X^T X`` is the paper's ``K_G`` of the
    representatives.  ``targets`` (N,) or (N, m); ``None`` returns ``(X, None)``.
    """
    group = _check_group(group)
    x = _check_inputs(inputs, group.dim, "inputs")
    full_x = group.act(x).flatten(0, 1)
    if targets is None:
        if output_representation is not None:
            raise ValueError("output_representation needs targets to act on")
        return full_x, None
    y = _check_float_tensor(targets, "targets")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},) or ({x.shape[0]}, m), got {tuple(y.shape)}")
    rho = _output_representation(group, output_representation, y)
    if rho is None:
        return full_x, y.repeat(group.order, *([1] * (y.ndim - 1)))
    if y.ndim != 2 or y.shape[1] != rho.shape[1]:
        raise ValueError(f"equivariant targets must have shape ({x.shape[0]}, {rho.shape[1]}), got {tuple(y.shape)}")
    return full_x, (y @ rho.mT).flatten(0, 1)


@dataclass(frozen=True)
class LinearRegressionFlow:
    """Gradient flow of linear least squares on symmetric data, in closed form (papers/004 Theorems 3.3, 4.2).

    For ``L = (loss_scale / 2) sum_n |y_n - W x_n|^2`` gradient flow is
    ``dW/dt = loss_scale (C - W K)`` with ``K = X^T X`` (``kernel``; on orbit-closed
    data this is the paper's ``K_G = sum_g g^T X^T X g`` over representatives) and
    ``C = Y^T X`` (``moment``; the paper's ``R^T X^T y`` resp. ``C_G``).  On data that
    satisfies Assumption 1 (resp. 4) for an orthogonal group, ``K`` commutes with
    every ``g`` and ``C`` is symmetric, so the symmetric and asymmetric parts of
    :func:`split_weights` evolve independently (Theorem 3.3.2) and
    ``W_asym(t) = W_asym(0) exp(-loss_scale K t)`` (Theorem 3.3.3): each asymmetric
    mode decays at one of ``asymmetric_rates`` (the eigenvalues of
    ``loss_scale * K`` on the asymmetric subspace), the slowest at ``decay_rate``.

    Weights are vectors (in,) when the targets were (N,), else (out, in).  With no
    output representation every output row has the same rates, listed once.
    ``data_asymmetry`` is the relative distance of the data from Assumption 1/4
    (``max_g |g K g^T - K| / |K|`` and ``|C - C_sym| / (|X| |Y|)``, the larger).
    """

    group: FiniteLinearGroup
    output_representation: Tensor | None
    kernel: Tensor
    moment: Tensor
    loss_scale: float
    asymmetric_rates: Tensor
    symmetric_rates: Tensor
    data_asymmetry: float

    @property
    def decay_rate(self) -> float:
        """Slowest asymmetric rate (``inf`` when the asymmetric subspace is empty; ``0`` means no decay: ``K`` singular there)."""
        return float(self.asymmetric_rates[0]) if len(self.asymmetric_rates) else math.inf

    def _times(self, times: Tensor | float | Sequence[float]) -> Tensor:
        t = torch.as_tensor(times, dtype=self.kernel.dtype, device=self.kernel.device).reshape(-1)
        if not bool((t >= 0).all()):
            raise ValueError("times must be non-negative")
        return t

    def _initial(self, initial: Tensor) -> Tensor:
        w = _check_float_tensor(initial, "initial")
        if w.shape != self.moment.shape:
            raise ValueError(f"initial weights must have shape {tuple(self.moment.shape)}, got {tuple(w.shape)}")
        return w.to(self.kernel.dtype)

    def weights(self, initial: Tensor, times: Tensor | float | Sequence[float]) -> Tensor:
        """``W(t)`` for each time (eq. (3), or eq. (5) for equivariance): (T, *initial.shape).

        ``W(t) = W0 exp(-sKt) + C K^+ (I - exp(-sKt))``, with ``K^+ (I - exp(-sKt))``
        read as ``s t`` on the null space of ``K`` (``s = loss_scale``).
        """
        w0, t = self._initial(initial), self._times(times)
        lam, vec = torch.linalg.eigh(self.kernel)
        st = self.loss_scale * t[:, None]
        decay = torch.exp(-st * lam)
        growth = torch.where(lam == 0, st, -torch.expm1(-st * lam) / torch.where(lam == 0, 1, lam))
        w0v, cv = w0 @ vec, self.moment @ vec
        return (w0v.unsqueeze(0) * _broadcast(decay, w0) + cv.unsqueeze(0) * _broadcast(growth, w0)) @ vec.T

    def asymmetric_part(self, initial: Tensor, times: Tensor | float | Sequence[float]) -> Tensor:
        """``W_asym(t) = W_asym(0) exp(-sKt)`` (Theorem 3.3.3 / 4.2.3): (T, *initial.shape), independent of the labels."""
        w0, t = self._initial(initial), self._times(times)
        asym = split_weights(w0, self.group, output_representation=self.output_representation).asymmetric
        lam, vec = torch.linalg.eigh(self.kernel)
        decay = torch.exp(-self.loss_scale * t[:, None] * lam)
        return ((asym @ vec).unsqueeze(0) * _broadcast(decay, w0)) @ vec.T

    def limit(self, initial: Tensor) -> Tensor:
        """``W(t -> inf)``: the least-squares solution plus ``W0``'s component in ``ker K`` (Corollary 3.4 / 4.3)."""
        w0 = self._initial(initial)
        lam, vec = torch.linalg.eigh(self.kernel)
        null = lam <= lam.abs().max() * self.kernel.shape[0] * torch.finfo(lam.dtype).eps
        inv = torch.where(null, 0, 1 / torch.where(null, 1, lam))
        return ((w0 @ vec) * null + (self.moment @ vec) * inv) @ vec.T


def _broadcast(per_mode: Tensor, like: Tensor) -> Tensor:
    """(T, in) factors -> broadcastable against (T, *like.shape)."""
    return per_mode if like.ndim == 1 else per_mode[:, None, :]


def _subspace_rates(operator: Tensor, projector: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues of a symmetric ``operator`` restricted to ``im(projector)`` and to its orthogonal complement."""
    occupancy, basis = torch.linalg.eigh((projector + projector.mT) / 2)
    inside = occupancy > 0.5
    rates = []
    for keep in (inside, ~inside):
        q = basis[:, keep]
        rates.append(torch.linalg.eigvalsh(q.mT @ operator @ q) if q.shape[1] else operator.new_zeros(0))
    return rates[0], rates[1]


def linear_regression_flow(
    inputs: Tensor,
    targets: Tensor,
    group: FiniteLinearGroup,
    *,
    output_representation: Tensor | None = None,
    loss_scale: float = 1.0,
    strict: bool = True,
) -> LinearRegressionFlow:
    """Theorem 3.3 (invariance) or 4.2 (with ``output_representation``) for a linear model on this training set.

    ``inputs`` (N, d) and ``targets`` (N,) or (N, out) are the data the model is
    trained on, already orbit-closed (see :func:`orbit_closure`); the model is
    ``x -> W x`` without bias (append a constant feature, fixed by the group, as in
    Example 3.1).  ``loss_scale`` s sets the loss ``(s/2) sum |y - W x|^2``: 1 is the
    paper's total squared error, ``2`` is ``MSELoss(reduction="sum")``,
    ``2 / (N * out)`` is ``MSELoss()``.  Gradient descent with step ``eta`` follows
    the flow at time ``t = k * eta`` with per-step factors ``1 - eta * rate``, i.e. a
    relative rate error of about ``eta * rate / 2``.

    Raises ``ValueError`` if the group (or the output representation) is not
    orthogonal (Assumption 3 / 5: without it the two parts interact), and, when
    ``strict``, if the data is further than the group's ``tol`` from Assumption 1
    / 4.  With ``strict=False`` the result is computed anyway and
    ``data_asymmetry`` says how far off it is: the closed form :meth:`weights` is
    still exact gradient flow, but the parts then interact, so
    ``asymmetric_part`` and the rates (``K`` compressed to the asymmetric subspace)
    are approximations (papers/004 App. D observes the decay on data that is
    symmetric only on average).
    """
    group = _check_group(group)
    x = _check_inputs(inputs, group.dim, "inputs")
    y = _check_float_tensor(targets, "targets")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},) or ({x.shape[0]}, out), got {tuple(y.shape)}")
    if not (isinstance(loss_scale, (int, float)) and loss_scale > 0 and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    dtype = torch.promote_types(x.dtype, y.dtype)
    x, y = x.to(dtype), y.to(dtype)
    rho = _output_representation(group, output_representation, y)
    if not group.is_orthogonal():
        raise ValueError(
            "the group is not orthogonal: papers/004 Assumption 3 (g^T in G; for a finite group the same as g^T g = I) "
            "fails, and gradient flow then mixes the symmetric and asymmetric parts"
        )
    if rho is not None:
        if y.ndim != 2 or y.shape[1] != rho.shape[1]:
            raise ValueError(f"equivariant targets must have shape ({x.shape[0]}, {rho.shape[1]}), got {tuple(y.shape)}")
        eye = torch.eye(rho.shape[1], dtype=dtype, device=rho.device)
        if float(torch.linalg.matrix_norm(rho.mT @ rho - eye).max()) > group.tol * math.sqrt(rho.shape[1]):
            raise ValueError("output_representation is not orthogonal (papers/004 Assumption 5)")

    kernel = x.T @ x
    moment = y.T @ x if y.ndim == 2 else y @ x
    g = group._like(kernel)
    kernel_residual = float(torch.linalg.matrix_norm(g @ kernel @ g.mT - kernel).max() / torch.linalg.matrix_norm(kernel).clamp_min(1e-300))
    moment_sym = _project(moment, group, rho)
    # relative to |X| |Y| >= |C|: C itself may be 0 (no invariant weights), then only round-off remains
    moment_residual = float((moment - moment_sym).norm() / (x.norm() * y.norm()).clamp_min(1e-300))
    data_asymmetry = max(kernel_residual, moment_residual)
    if strict and data_asymmetry > group.tol:
        raise ValueError(
            f"the data is not symmetric (papers/004 Assumption {1 if rho is None else 4}): relative residual "
            f"{data_asymmetry:.2e} > tol {group.tol:.1e}; complete it with orbit_closure or pass strict=False"
        )

    operator = loss_scale * kernel
    if rho is None:
        asym_rates, sym_rates = _subspace_rates(operator, torch.eye(group.dim, dtype=dtype, device=kernel.device) - g.mean(0).T)
    else:
        out = rho.shape[1]
        # Row-major vec: Pi(W)[a, d] = mean_g sum_bc rho(g)^-1[a, b] W[b, c] g[c, d], i.e. vec(A W B) = (A kron B^T) vec(W).
        rho_inverse = rho[group._inverse.to(rho.device)]
        projector = torch.einsum("gab,gcd->adbc", rho_inverse, g).reshape(out * group.dim, out * group.dim) / group.order
        big = torch.kron(torch.eye(out, dtype=dtype, device=kernel.device), operator)
        asym_rates, sym_rates = _subspace_rates(big, torch.eye(out * group.dim, dtype=dtype, device=kernel.device) - projector)
    return LinearRegressionFlow(
        group=group,
        output_representation=rho,
        kernel=kernel,
        moment=moment,
        loss_scale=float(loss_scale),
        asymmetric_rates=asym_rates,
        symmetric_rates=sym_rates,
        data_asymmetry=data_asymmetry,
    )
