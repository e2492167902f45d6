"""Finite groups of invertible matrices, validated (Gideoni 2023, Sec. 2, Assumptions 1-4).

:class:`FiniteLinearGroup` is the group ``G`` of :mod:`teleopt.analysis.invariance`:
a validated set of ``d x d`` matrices (identity, closure, invertibility, a size cap),
built from its elements or from generators, with its Reynolds operator
``P = (1/|G|) sum_g g`` (Theorem 3.3's ``R = sum_g g`` unnormalised).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["FiniteLinearGroup", "DEFAULT_MAX_ORDER", "check_float_tensor", "check_inputs"]

DEFAULT_MAX_ORDER = 1024
"""Largest group :class:`FiniteLinearGroup` accepts unless told otherwise."""


def _default_tol(dtype: torch.dtype) -> float:
    # sqrt(machine epsilon): 1.5e-8 in float64, 3.5e-4 in float32.  Exact group
    # elements (0, +-1, cos/sin of 2 pi k / n) and their products are correct to a
    # few ulps, while two distinct elements differ by O(1), so this separates
    # "equal up to round-off" from "different" with many orders of margin both ways.
    return math.sqrt(torch.finfo(dtype).eps)


def check_float_tensor(value: object, what: str) -> Tensor:
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
    """A finite group of invertible ``d x d`` matrices acting on inputs as ``x -> g x`` (Gideoni 2023, Sec. 2).

    ``elements`` (|G|, d, d) must contain the identity, be closed under matrix
    multiplication and contain no element twice, all up to the relative Frobenius
    tolerance ``tol`` (default ``sqrt(eps)`` of the dtype: 1.5e-8 in float64, 3.5e-4
    in float32).  A finite set of invertible matrices closed under multiplication
    is a group, so inverses need no separate check.  Groups larger than
    ``max_order`` are refused (a generator of infinite order, such as a rotation by
    an irrational angle, would otherwise never close).

    Example 3.1 of Gideoni 2023 (features ``(1, x)``, reflection ``x -> -x``)::

        group = FiniteLinearGroup.reflection(2, [1])

    Raises ``TypeError`` for a non-tensor or non-floating dtype and ``ValueError``
    naming the problem for a wrong shape, an empty or non-square stack, a singular
    element, a missing identity, a duplicate, or a set that is not closed.
    """

    def __init__(self, elements: Tensor, *, tol: float | None = None, max_order: int = DEFAULT_MAX_ORDER) -> None:
        elements = check_float_tensor(elements, "elements")
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
            raise ValueError(
                f"elements do not contain the identity (nearest element at relative distance {float(to_identity[identity]):.2e})"
            )

        if n > 1:
            self_excluded, nearest_other = _nearest_other(elements)
            if float(self_excluded.min()) <= tol:
                i = int(self_excluded.argmin())
                raise ValueError(
                    f"elements[{i}] and elements[{int(nearest_other[i])}] are the same matrix (duplicate, relative distance {float(self_excluded[i]):.2e})"
                )

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
        gens = check_float_tensor(gens, "generators")
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
        """``{I, F}`` with ``F`` flipping the sign of ``coordinates`` (Gideoni 2023, Example 3.1: ``reflection(2, [1])``)."""
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

        E.g. ``permutations([[1, 0]])`` is the ``x <-> y`` swap of Gideoni 2023, App. D-E.
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
        """Whether every ``g^T g = I`` (Gideoni 2023, Assumption 5; for finite groups the same as Assumption 3)."""
        tol = self._tol if tol is None else tol
        gram = self._elements.mT @ self._elements
        eye = torch.eye(self.dim, dtype=self.dtype, device=self.device)
        return float(torch.linalg.matrix_norm(gram - eye).max()) <= tol * math.sqrt(self.dim)

    def reynolds_operator(self, normalized: bool = True) -> Tensor:
        """``P = (1/|G|) sum_g g`` (normalized) or the paper's unnormalised ``R = sum_g g`` (Gideoni 2023, Theorem 3.3).

        ``P`` is idempotent with image the vectors fixed by every ``g`` (``g P = P``);
        ``P^T`` projects weights onto those with ``x -> w . x`` invariant.
        """
        total = self._elements.sum(0)
        return total / self.order if normalized else total

    def act(self, inputs: Tensor) -> Tensor:
        """Every group element applied to a batch: (N, d) -> (|G|, N, d), row ``[i, n] = elements[i] @ inputs[n]``."""
        x = check_inputs(inputs, self.dim, "inputs")
        return x @ self._like(x).mT

    def check_representation(self, matrices: Tensor, what: str = "representation") -> Tensor:
        """Validate ``matrices`` (|G|, m, m) as a representation aligned with :attr:`elements` and return it.

        ``matrices[i]`` is the image of ``elements[i]``; it must be invertible and
        satisfy ``rho(g_i) rho(g_j) = rho(g_i g_j)`` up to :attr:`tol` (a
        homomorphism, Gideoni 2023, Sec. 2).  It need not be faithful: the trivial
        representation (all identities) is allowed.
        """
        rho = check_float_tensor(matrices, what)
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


def check_inputs(inputs: object, dim: int, what: str) -> Tensor:
    x = check_float_tensor(inputs, what)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what} must have shape (N, {dim}), got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{what} is empty")
    return x
