"""Matrix groups GL_n and O(n), optionally block-diagonal (Zhao 2026, Ex. 1.2.2, 1.2.6, 1.2.12)."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from teleopt.groups.base import BALANCE_RCOND, Group, GroupKind, _check_finite, _check_size, apply_on_axis
from teleopt.groups.cache import active_cache, active_placements, remembering_placements
from teleopt.groups.expm import expm_pair, expm_pair_horner
from teleopt.sharding import from_local_like, full, is_sharded, replicate_like, sharded_dims

__all__ = ["GeneralLinear", "Orthogonal", "remembering_placements"]


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

    @property
    def block_size(self) -> int:  # type: ignore[override]
        return self.n

    def _config(self) -> tuple:
        return (self.n,) if self.blocks is None else (self.n, self.blocks)

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.n, self.n) if self.blocks is None else (self.blocks, self.n, self.n)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        eye = torch.eye(self.n, dtype=dtype, device=device)
        return eye if self.blocks is None else eye.expand(self.blocks, self.n, self.n).clone()

    def shared_identity(self, dtype=torch.float64, device=None) -> Tensor:
        eye = torch.eye(self.n, dtype=dtype, device=device)
        return eye if self.blocks is None else eye.expand(self.blocks, self.n, self.n)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a @ b

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        coords = torch.randn(self.element_shape, generator=generator, dtype=torch.float64) * (scale / math.sqrt(self.n))
        return self.exp(coords.to(dtype=dtype, device=device))

    def _blocked(self, g: Tensor) -> Tensor:
        return g.unsqueeze(0) if self.blocks is None else g

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        if power not in (1, -1):
            raise ValueError(f"{type(self).__name__} representations have power +1 or -1, got {power}")
        if is_sharded(x):
            return self._act_on_shards(g, x, axis, power)
        if not (torch.is_grad_enabled() and g.requires_grad):
            # outside autograd (the apply phase moves parameters, gradients and moments by one element):
            # g^-T once per element in its own precision, then a product per tensor instead of a solve
            return self._multiply(self._placed(g, power, x.device, x.dtype), x, axis)
        gb = self._blocked(g).to(device=x.device, dtype=x.dtype)
        if power == 1:
            return self._multiply(gb, x, axis)
        nb = gb.shape[0]
        return apply_on_axis(x, axis, lambda flat: self._contragredient(gb, flat.reshape(nb, self.n, -1)).reshape(flat.shape))

    def _multiply(self, matrices: Tensor, x: Tensor, axis: int) -> Tensor:
        """Each block's matrix times its rows of ``x`` along ``axis``."""
        nb = matrices.shape[0]
        return apply_on_axis(x, axis, lambda flat: (matrices @ flat.reshape(nb, self.n, -1)).reshape(flat.shape))

    def _contragredient_of(self, g: Tensor) -> Tensor:
        """:meth:`block_matrices` of ``g`` for power -1, remembered while ``g`` lives unchanged.

        Actions build a group per call, so the memo is kept by element, in the active
        :class:`~teleopt.groups.cache.GroupCache` (table ``"contragredient"``): one teleport moves a site's parameters, gradients and moments, and evaluates the search, with the
        same few elements.
        """
        matrices = self._remembered_contragredient(g)
        if matrices is None:
            matrices = self._solved(self._blocked(g))
            self._remember_contragredient(g, matrices)
        return matrices

    def _placed(self, g: Tensor, power: float, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The block matrices of ``g`` (power 1) or its contragredient (power -1) on ``device`` in ``dtype``.

        Inside :func:`~teleopt.groups.cache.remembering_placements` a copy to another device is remembered
        while ``g`` lives unchanged: a GL site searched on the host moves a GPU model's parameters,
        gradients and moments with one copy of its element, instead of one synchronising host-to-device
        copy per tensor."""
        matrices = self._contragredient_of(g) if power == -1 else self._blocked(g)
        placements = active_placements()
        if matrices.device == device or placements is None:
            return matrices.to(device=device, dtype=dtype)
        key = (id(g), type(self), self.n, power, device, dtype)
        hit = placements.get("placed", g, key)
        if hit is not None:
            return hit
        placed = matrices.to(device=device, dtype=dtype)
        placements.put("placed", g, key, placed)
        return placed

    def _remembered_contragredient(self, g: Tensor) -> Tensor | None:
        cache = active_cache()
        return None if cache is None else cache.get("contragredient", g, (id(g), type(self), self.n))

    def _remember_contragredient(self, g: Tensor, matrices: Tensor) -> None:
        cache = active_cache()
        if cache is not None:
            cache.put("contragredient", g, (id(g), type(self), self.n), matrices)

    def _act_on_shards(self, g: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        """:meth:`act_on_axis` of a ``DTensor`` (FSDP2).  On an axis that no mesh dimension shards, each rank
        moves its own shard, with no communication (``DTensor``'s own ``solve`` would gather ``x``).  A
        sharded axis (a bias of a row-sharded layer, O(units)) is gathered and moved whole, and returned
        replicated on ``x``'s mesh (differentiable in ``g``; writing it into ``x`` keeps each rank's shard)."""
        assert is_sharded(x), "act_on_axis calls this for DTensors only"
        if is_sharded(g):  # an element replicated on the mesh is whole on every rank (to_local: differentiable)
            g = g.to_local()
        if axis % x.ndim in sharded_dims(x):
            return replicate_like(self.act_on_axis(g, full(x), axis, power), x)
        # each rank's shard holds the whole acted axis: move it locally (to_local/from_local: differentiable)
        return from_local_like(self.act_on_axis(g, x.to_local(), axis, power).contiguous(), x, contiguous=True)

    def block_matrices(self, g: Tensor, power: float) -> Tensor:
        """rho(g) per block for ``power`` +1 (g itself), the contragredient for -1 (g^{-T} for GL, g for O(n))."""
        if power not in (1, -1):
            raise ValueError(f"{type(self).__name__} representations have power +1 or -1, got {power}")
        gb = self._blocked(g)
        if power == 1:
            return gb
        if not (torch.is_grad_enabled() and g.requires_grad):
            return self._contragredient_of(g)
        remembered = self._remembered_contragredient(g)  # exp(-xi)^T from GeneralLinear.exp under autograd
        return remembered if remembered is not None else self._solved(gb)

    def block_matrices_many(self, elements: Sequence[Tensor], power: float) -> Tensor | None:
        """:meth:`block_matrices` of several elements stacked (k, blocks, n, n) outside autograd: one stack
        (contragredients as remembered, or solved, per element)."""
        if power not in (1, -1) or not elements or any(g.requires_grad and torch.is_grad_enabled() for g in elements):
            return super().block_matrices_many(elements, power)
        blocks = elements if power == 1 else [self._contragredient_of(g) for g in elements]
        return torch.stack(list(blocks)).reshape(len(elements), self.blocks or 1, self.n, self.n)

    def _solved(self, gb: Tensor) -> Tensor:
        eye = torch.eye(self.n, dtype=gb.dtype, device=gb.device).expand(gb.shape)
        return self._contragredient(gb, eye)

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
        Mb = M.to(device=x.device, dtype=x.dtype).reshape(k, self.blocks or 1, self.n, self.n)
        A = self._algebra_matrix(Mb, power)
        moved = x.movedim(axis, 1)
        cols = moved.reshape(k, self.blocks or 1, self.n, -1)
        return (A @ cols).reshape(moved.shape).movedim(1, axis)

    @abstractmethod
    def _algebra_matrix(self, M: Tensor, power: float) -> Tensor:
        """The matrix d rho(M) applies to the axis' columns (batched)."""


#: the largest block size whose near-balance step takes :func:`~teleopt.groups.expm.expm_pair_horner` (fewer
#: calls, more products: cheaper for small blocks); larger blocks take :func:`~teleopt.groups.expm.expm_pair`
HORNER_MAX_N = 16
#: singular values of a boundary step's direction below this fraction of the largest count as zero
BOUNDARY_RTOL = 1e-6
#: Relative asymmetry below which a boundary direction is taken as symmetric (round-off of 2 (B - A)).
SYMMETRIC_RTOL = 1e-12


class GeneralLinear(_MatrixGroup):
    """GL_n(R) (or ``blocks`` independent copies): Zhao 2026, Ex. 1.2.2, 1.2.11-1.2.13.

    Lie algebra coordinates are arbitrary n x n matrices; ``exp`` is
    ``torch.linalg.matrix_exp`` (from the eigendecomposition for a symmetric
    boundary point), so every element is invertible (det = e^trace > 0).
    """

    kind: GroupKind = "general"
    continuous = True
    # the gradient norm of a GL site is convex in g^T g: its maximum over the trust region is on the
    # boundary, where one BoundaryStep lands at a fraction of the cost of 100 steps through matrix_exp
    boundary_search: ClassVar[bool] = True
    plain_exp: ClassVar[bool] = True
    full_matrix_algebra: ClassVar[bool] = True

    def exp_stack_key(self) -> Hashable | None:
        """GL groups of one block size stack their exps (:meth:`exp_stacked`), unless a subclass has its own exp."""
        return ("general", self.n) if type(self).exp is GeneralLinear.exp else None

    def exp(self, coords: Tensor) -> Tensor:
        """``matrix_exp``; for a symmetric boundary point U diag(lambda) U^T (:meth:`boundary_point`, unchanged,
        outside autograd) U diag(e^lambda) U^T from its eigendecomposition instead, with the contragredient
        U diag(e^-lambda) U^T remembered for the apply (no ``matrix_exp`` and no LU solve).

        Under autograd (a projected ascent's steps) exp(xi) and exp(-xi) by matrix products
        (:func:`~teleopt.groups.expm.expm_pair`), exp(-xi)^T remembered as the contragredient: no backward
        through ``matrix_exp`` and no solve."""
        self._check_coords(coords)
        if coords.requires_grad and torch.is_grad_enabled():
            g, inverse = expm_pair(coords)
            self._remember_contragredient(g, self._blocked(inverse.mT))
            return g
        cache = active_cache()
        pair = None if cache is None or coords.requires_grad else cache.get("exp", coords, id(coords))
        if pair is not None:  # computed by balance_near_many, its contragredient remembered there
            return pair[0]
        hit = None if cache is None or coords.requires_grad else cache.get("eigen", coords, id(coords))
        if hit is None:
            return torch.linalg.matrix_exp(coords)
        U, lam = hit
        g = (U * torch.exp(lam).unsqueeze(-2)) @ U.mT
        inverse = (U * torch.exp(-lam).unsqueeze(-2)) @ U.mT  # g^-1 = g^-T: g is symmetric
        self._remember_contragredient(g, self._blocked(inverse))
        return g

    @staticmethod
    def exp_stacked(groups: Sequence[Group], coords: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`exp` under autograd of several groups' coordinates of one block size, by one :func:`expm_pair`
        of all their blocks stacked (one call for all sites instead of one per site, whose fixed costs
        dominate for small blocks); each contragredient remembered as :meth:`exp`
        does.  The degree and scaling are chosen for the largest block, so values agree with :meth:`exp` to
        rounding, not bit for bit."""
        if not all(isinstance(grp, GeneralLinear) for grp in groups):
            raise TypeError(f"GeneralLinear.exp_stacked takes GeneralLinear groups, got {sorted({type(grp).__name__ for grp in groups})}")
        gl = [grp for grp in groups if isinstance(grp, GeneralLinear)]
        n, kinds = {grp.n for grp in gl}, {(xi.dtype, xi.device) for xi in coords}
        if len(groups) != len(coords) or len(n) != 1 or len(kinds) != 1:
            raise ValueError(
                f"exp_stacked takes one coordinate tensor per group, all of one block size, dtype and device; got {len(groups)} "
                f"groups of sizes {sorted(n)} and {len(coords)} tensors of {sorted(str(k) for k in kinds)}"
            )
        for grp, xi in zip(gl, coords):
            grp._check_coords(xi)
        g, inverse = expm_pair(torch.cat([grp._blocked(xi) for grp, xi in zip(gl, coords)]))
        out, start = [], 0
        for grp, xi in zip(gl, coords):
            count = grp.blocks or 1
            gi = g[start : start + count].reshape(xi.shape)
            grp._remember_contragredient(gi, inverse[start : start + count].mT)
            out.append(gi)
            start += count
        return out

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

    def boundary_point(self, direction: Tensor, radius: float) -> Tensor | None:
        """r U V^T per block, from the SVD U S V^T of d: the point of the spectral ball ||xi||_2 <= r that
        maximises <d, xi> = tr(d^T xi) (the dual norm of the spectral norm is the nuclear norm, attained
        at the polar factor).  When the objective depends on g only through g^T g, as the gradient norm
        of a GL site does (tr(A (g^T g)^-1) + tr(B g^T g)), d = 2 (B - A) is symmetric and the point is
        r U sign(Lambda) U^T: every eigen-direction of B - A stretched or shrunk by e^r."""
        if not bool((direction != 0).any()):
            return None
        sym = (direction + direction.mT) / 2
        if bool((direction - sym).abs().amax() <= SYMMETRIC_RTOL * direction.abs().amax()):
            # symmetric up to round-off (the gradient norm's 2 (B - A)): an eigendecomposition U Lambda U^T is the
            # SVD with V = U sign(Lambda), at a fraction of its cost
            lam, U = torch.linalg.eigh(sym)
            kept = (lam.abs() > BOUNDARY_RTOL * lam.abs().amax(dim=-1, keepdim=True)).to(U.dtype)
            point = radius * ((U * (torch.sign(lam) * kept).unsqueeze(-2)) @ U.mT)
            cache = active_cache()
            if cache is not None and not point.requires_grad:  # exp(point) then needs no matrix_exp (see exp)
                cache.put("eigen", point, id(point), (U, radius * torch.sign(lam) * kept))
            return point
        U, S, Vh = torch.linalg.svd(direction, full_matrices=False)
        # singular values at round-off level relative to the block's largest leave <d, xi> unchanged whatever
        # xi does there, and their singular vectors are round-off: those directions stay at 0 (the smallest
        # maximiser), so the point does not depend on the order of the reductions (sharded or not)
        kept = (S > BOUNDARY_RTOL * S.amax(dim=-1, keepdim=True)).to(U.dtype)
        return radius * ((U * kept.unsqueeze(-2)) @ Vh)

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
        # the geometric mean is congruence-invariant: with A = L L^T, P = L^-T (L^T B L)^1/2 L^-1 (P A P = B), so
        # a Cholesky factor and one eigendecomposition give P, where A^1/2 took a second one
        L = torch.linalg.cholesky(A)
        m, V = torch.linalg.eigh(_sym(L.mT @ B @ L))
        inv = torch.linalg.solve_triangular(L, eye, upper=False)
        del A, B, L  # each (sites, blocks, n, n) matrix freed once read: the solve's peak memory
        P = _sym(inv.mT @ ((V * m.clamp_min(0).sqrt().unsqueeze(-2)) @ V.mT) @ inv)
        del inv, V
        lam, W = torch.linalg.eigh(P)
        del P
        xi = 0.5 * torch.log(lam.clamp_min(torch.finfo(torch.float64).tiny))
        if radius is not None:
            xi = xi.clamp(-radius, radius)
        coords = torch.where(mask, (W * xi.unsqueeze(-2)) @ W.mT, 0.0)
        cache = active_cache()
        if cache is not None:  # exp(coords) then needs no matrix_exp (see exp); blocks left alone stay exactly I
            cache.put("eigen", coords, id(coords), (torch.where(mask, W, eye), torch.where(ok[..., None], xi, 0.0)))
        return coords

    def balance_many(
        self, stats: Sequence[Mapping[float, Tensor]], radius: float | None, rcond: float = BALANCE_RCOND
    ) -> list[Tensor | None]:
        """:meth:`balance` of several sites at once: their Gram matrices stacked on a leading axis, one batched
        eigendecomposition per step for all (each block is solved on its own, as one call each would)."""
        both = all(set(s) == {1.0, -1.0} for s in stats)
        if len(stats) < 2 or not both or len({(s[1.0].shape, s[-1.0].shape, s[1.0].dtype) for s in stats}) != 1:
            return super().balance_many(stats, radius, rcond)
        coords = self.balance({p: torch.stack([s[p] for s in stats]) for p in (1.0, -1.0)}, radius, rcond)
        sites = coords.unbind(0)
        cache = active_cache()
        eigen = None if cache is None else cache.get("eigen", coords, id(coords))
        if cache is not None and eigen is not None:  # each site's coordinates keep their eigendecomposition (see exp)
            for xi, U, lam in zip(sites, eigen[0].unbind(0), eigen[1].unbind(0)):
                cache.put("eigen", xi, id(xi), (U, lam))
        return list(sites)

    def balance_near_many(self, stats: Sequence[Mapping[float, Tensor]], limit: float) -> list[Tensor] | None:
        """One Newton step of the balance equation from the identity, for points near balance (every-step balance).

        With g = exp(S), S symmetric, g A g = g^-1 B g^-1 (:meth:`balance`'s P A P = B, P = g^2) is to first
        order A - B + S C + C S = 0 with C = A + B: a Lyapunov equation, solved in the eigenbasis of C
        (C = U diag(c) U^T: S = U [(U^T (B - A) U)_ij / (c_i + c_j)] U^T).  One ``eigh`` of C for all blocks of
        all sites, where :meth:`balance` takes a Cholesky factor, two ``eigvalsh`` and two ``eigh``; the
        imbalance A - B left is quadratic in the one before (Newton's method).  exp(S) and exp(-S) come from
        matrix products (:func:`~teleopt.groups.expm.expm_pair_horner` for blocks up to ``HORNER_MAX_N``, else
        :func:`~teleopt.groups.expm.expm_pair`) and are remembered for :meth:`exp` and the contragredient.  ``None`` (the closed form decides) where a site lacks a side, a block of C is
        singular to ``BALANCE_RCOND``, or some ||S||_F exceeds ``limit`` or is not finite (the point is not near
        balance); the three are read from the host at once."""
        if not stats or any(set(s) != {1.0, -1.0} for s in stats):
            return None
        A, B = (torch.stack([s[p] for s in stats]).reshape(-1, self.n, self.n) for p in (1.0, -1.0))
        c, U = torch.linalg.eigh(A + B)  # reads one triangle: C need not be symmetric to the last bit
        X = (U.mT @ (B - A) @ U).div_(c.unsqueeze(-1) + c.unsqueeze(-2))
        del A, B  # freed once read: the step's peak memory
        S = _sym(U @ X @ U.mT)
        del X, U
        # one read of the host: C singular to BALANCE_RCOND (smallest <= rcond * largest, also where the largest
        # <= 0), the longest step (||S||_F^2) and ||S||_1 for the exponential's degree
        checks = torch.stack(
            [(c[:, 0] <= BALANCE_RCOND * c[:, -1]).any().to(S.dtype), S.square().sum((-2, -1)).amax(), S.abs().sum(-2).amax()]
        )
        singular, longest, norm_1 = checks.tolist()
        if singular or not longest <= limit**2:
            return None
        g, inverse = (expm_pair_horner if self.n <= HORNER_MAX_N else expm_pair)(S, norm_1)
        shape = (len(stats), *(self.coord_shape or ()))
        coords = S.reshape(shape).unbind(0)
        cache = active_cache()
        if cache is not None:  # exp(xi) for exp, its contragredient exp(-xi)^T for the moves (blocked)
            contragredients = inverse.mT.reshape(len(stats), self.blocks or 1, self.n, self.n).unbind(0)
            for xi, gi, ci in zip(coords, g.reshape(shape).unbind(0), contragredients):
                cache.put("exp", xi, id(xi), (gi, ci))
                self._remember_contragredient(gi, ci)
        return list(coords)

    roundoff_growth: ClassVar[bool] = True

    def roundoff_amplification(self, stats: Mapping[float, Tensor], coords: Tensor) -> Callable[[Tensor], Tensor] | None:
        """iota(s) = ||g X||_F ||g^-T Y||_F / ||Y^T X||_* per block at g = exp(s xi), with X X^T = A and Y Y^T = B
        the Gram matrices of the writers (power +1) and readers (power -1) in ``stats``.

        A product Y^T X computed from rounded factors errs by about u ||g X|| ||g^-T Y|| (u the unit round-off),
        so iota is the factor by which the site's members amplify round-off relative to the product they compute.
        Its denominator is the same on the whole orbit, and iota >= 1 with equality at the balanced point
        (:meth:`balance`: min_g ||g X|| ||g^-T Y|| = tr (A^1/2 B A^1/2)^1/2 = ||Y^T X||_*), so a bound on iota
        bounds the round-off however many teleports came before.  For a symmetric xi = U diag(lambda) U^T (the
        boundary step's) ||g X||^2 = sum_i e^(2 s lambda_i) (U^T A U)_ii, no matrix exponential.  ``None``
        without both sides; blocks whose product is 0 (relative to ``BALANCE_RCOND``) get 1."""
        A, B = stats.get(1.0), stats.get(-1.0)
        if A is None or B is None:
            return None
        A, B = _sym(A).reshape(-1, self.n, self.n), _sym(B).reshape(-1, self.n, self.n)
        xi = coords.detach().to(device=A.device, dtype=torch.float64).reshape(A.shape)
        # ||Y^T X||_*^2 sums the eigenvalues' roots of A B, similar to L^T B L (A = L L^T) or A^1/2 B A^1/2
        L, info = torch.linalg.cholesky_ex(A)
        if bool((info != 0).any()):  # A only semi-definite
            a, U = torch.linalg.eigh(A)
            L = (U * a.clamp_min(0).sqrt().unsqueeze(-2)) @ U.mT
        nuclear = torch.linalg.eigvalsh(_sym(L.mT @ B @ L)).clamp_min(0).sqrt().sum(-1)
        scale = (A.diagonal(dim1=-2, dim2=-1).sum(-1) * B.diagonal(dim1=-2, dim2=-1).sum(-1)).sqrt()
        zero = ~(nuclear > BALANCE_RCOND * scale)
        nuclear = nuclear.clamp_min(torch.finfo(torch.float64).tiny)
        cache = active_cache()
        eigen = None if cache is None or coords.requires_grad else cache.get("eigen", coords, id(coords))
        if eigen is not None or bool(((xi - xi.mT).abs() <= SYMMETRIC_RTOL * xi.abs().amax().clamp_min(1e-300)).all()):
            if eigen is not None:  # a boundary point's own eigendecomposition (boundary_point): no second one
                V, lam = eigen[0].to(xi).reshape(A.shape), eigen[1].to(xi).reshape(A.shape[:-1])
            else:
                lam, V = torch.linalg.eigh(_sym(xi))
            a_diag, b_diag = ((V.mT @ A) * V.mT).sum(-1), ((V.mT @ B) * V.mT).sum(-1)

            def sizes(s: Tensor) -> tuple[Tensor, Tensor]:
                e = torch.exp(2 * s.to(lam).unsqueeze(-1) * lam)
                return (e * a_diag).sum(-1), (b_diag / e).sum(-1)
        else:

            def sizes(s: Tensor) -> tuple[Tensor, Tensor]:
                step = s.to(xi).reshape(-1, 1, 1) * xi
                g, g_inv = torch.linalg.matrix_exp(step), torch.linalg.matrix_exp(-step)
                return ((g @ A) * g).sum((-2, -1)), ((B @ g_inv) * g_inv).sum((-2, -1))  # tr(g A g^T), tr(g^-T B g^-1)

        def iota(s: Tensor) -> Tensor:
            writers, readers = sizes(s)
            return torch.where(zero, torch.ones_like(nuclear), (writers * readers).sqrt() / nuclear)

        return iota

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
    """O(n) (or ``blocks`` copies): Zhao 2026, Ex. 1.2.6 and eq. 4.33; SO(2) for Prop. 4.4.1.

    Coordinates are n x n matrices whose skew-symmetric part generates the element:
    ``exp(A) = matrix_exp((A - A^T) / 2)`` (so ``exp`` reaches SO(n)).  The
    contragredient representation equals the standard one and inverses are
    transposes.
    """

    kind: GroupKind = "orthogonal"
    self_dual: ClassVar[bool] = True
    continuous = True

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        q = torch.linalg.matrix_exp((coords - coords.mT) / 2)
        # matrix_exp's truncated Taylor series leaves q orthogonal only to about 3e-12 for some float64
        # inputs (Orthogonal(3) at seed 8108872 in tests/test_groups.py: 1.3e-12), and the contragredient
        # below is the transpose; one Newton-Schulz step of the polar decomposition, q (3I - q^T q) / 2,
        # brings it to round-off (worst 6.7e-16 over 2,000 random elements) and stays differentiable
        eye = torch.eye(self.n, dtype=q.dtype, device=q.device)
        return q @ (1.5 * eye - 0.5 * q.mT @ q)

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

    def boundary_point(self, direction: Tensor, radius: float) -> Tensor | None:
        """None: O(n) has no trust region, so no boundary to step to (search it by ascent)."""
        return None

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


def _sym(m: Tensor) -> Tensor:
    return (m + m.mT).mul_(0.5)  # one new block matrix (the product by 0.5 in place)


def _well_conditioned(eigenvalues: Tensor, rcond: float) -> Tensor:
    """Per block (the last axis holds a block's ascending eigenvalues): smallest > ``rcond`` * largest > 0."""
    top = eigenvalues[..., -1]
    return (top > 0) & (eigenvalues[..., 0] > rcond * top)
