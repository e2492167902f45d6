"""The abstract :class:`Group` acting on one axis of parameter tensors, and its checks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import ClassVar, Literal

import torch
from torch import Tensor

GroupKind = Literal["general", "orthogonal", "diagonal", "sign", "permutation", "translation"]

#: :meth:`Group.balance`: a unit or block whose side is singular to this, relative to the largest, stays.
BALANCE_RCOND = 1e-10

__all__ = ["BALANCE_RCOND", "Group", "GroupKind", "apply_on_axis", "validated", "is_validated"]

#: (storage address, shape, dtype) of the elements validated by the enclosing :func:`validated` blocks of this
#: context (an immutable set; each block sets its own and restores the one before)
_VALIDATED: ContextVar[frozenset[tuple[int, tuple[int, ...], torch.dtype]]] = ContextVar("teleopt_validated", default=frozenset())


def _key(g: Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return (g.data_ptr(), tuple(g.shape), g.dtype)


@contextmanager
def validated(elements: Sequence[Tensor]) -> Iterator[None]:
    """Within the block, :func:`is_validated` holds for ``elements`` (and views of their data): the caller
    validated them (:meth:`Group.validate`) and keeps them alive and unchanged, so actions applying them
    again skip the check (a GL element's is an SVD)."""
    token = _VALIDATED.set(_VALIDATED.get() | {_key(g) for g in elements})
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def is_validated(g: Tensor) -> bool:
    """Whether ``g`` is an element of an enclosing :func:`validated` block."""
    keys = _VALIDATED.get()
    return bool(keys) and _key(g) in keys


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


def box_boundary_point(direction: Tensor, radius: float) -> Tensor:
    """r sign(d): the corner of the box |xi_i| <= r that maximises <d, xi> (the zero coordinates for d = 0,
    as sign(0) = 0: no device read to decide it)."""
    return radius * torch.sign(direction)


class Group(ABC):
    """A group acting linearly on an axis of length ``dim``.

    Subclasses give identity, composition, inverse, the exponential map from Lie
    algebra coordinates (continuous groups), random elements from a
    ``torch.Generator`` and the representation on a tensor axis.
    """

    kind: GroupKind
    continuous: bool

    #: whether the representation on an axis is diagonal: each entry multiplied by its own factor, a power of
    #: the element's entry (positive scalings, signs), so an in-place product moves a tensor
    diagonal: ClassVar[bool] = False
    #: whether the contragredient representation equals the representation, rho(g)^-T = rho(g) (orthogonal
    #: matrices, signs, permutations): a covector then moves like a vector on the same axis
    self_dual: ClassVar[bool] = False
    #: whether the Lie algebra is every n x n matrix (gl(n)), so I + T is a first-order element for any T
    #: (Zhao 2026, Sec. 4.6.1's approximation)
    full_matrix_algebra: ClassVar[bool] = False

    def exp_stack_key(self) -> Hashable | None:
        """Groups whose :meth:`exp` under autograd :meth:`exp_stacked` evaluates in one call share this key
        (``None``: the group's own :meth:`exp`, one call per group)."""
        return None

    @staticmethod
    def exp_stacked(groups: Sequence[Group], coords: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`exp` of each group's coordinates (groups sharing an :meth:`exp_stack_key` may batch it)."""
        return [grp.exp(xi) for grp, xi in zip(groups, coords)]

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
    def element_shape(self) -> tuple[int, ...]:
        """Shape of a group element tensor: a vector over the axis unless the group says otherwise."""
        return (self.dim,)

    @property
    def coord_shape(self) -> tuple[int, ...] | None:
        """Shape of Lie algebra coordinates: ``element_shape`` for continuous groups, ``None`` for discrete ones."""
        return self.element_shape if self.continuous else None

    @abstractmethod
    def identity(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
        """The identity element."""

    def shared_identity(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> Tensor:
        """The identity element for reading only: equal to :meth:`identity`, but a block-diagonal matrix group's
        blocks share one n x n identity (a broadcast view, not a copy per block); writing into it is an error."""
        return self.identity(dtype, device)

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

    def act_on_axis_(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> bool:
        """:meth:`act_on_axis` in place, when the representation is elementwise (diagonal groups); returns
        whether it did (``False``: ``x`` untouched, use :meth:`act_on_axis`).  Bitwise the out-of-place result."""
        return False

    #: the size n of the blocks (blocks, n, n) that :meth:`block_matrices` returns, ``None`` for groups
    #: whose representations are not block matrices (diagonal and discrete groups)
    block_size: int | None = None

    def block_matrices(self, g: Tensor, power: float) -> Tensor | None:
        """The matrices (blocks, n, n) that :meth:`act_on_axis` with ``power`` multiplies each block of an
        axis by (block b of rows of the axis -> M_b @ rows), or ``None`` for representations that are not
        block matrices (the default: diagonal and discrete groups act elementwise or by indexing)."""
        return None

    def block_matrices_many(self, elements: Sequence[Tensor], power: float) -> Tensor | None:
        """:meth:`block_matrices` of several elements of groups equal to this one, stacked (k, blocks, n, n)."""
        blocks = [self.block_matrices(g, power) for g in elements]
        if not blocks or any(m is None for m in blocks):
            return None
        return torch.stack([m.reshape(-1, *m.shape[-2:]) for m in blocks if m is not None])

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

    #: whether the default search of a fast-path teleport steps straight to the trust region's boundary
    #: (:class:`~teleopt.teleport.search.BoundaryStep`) instead of ascending: for groups whose ascent is
    #: costly and whose gradient-norm maximum lies on the boundary (GL)
    boundary_search: ClassVar[bool] = False

    #: whether the default search of a fast-path teleport steps to the boundary for this group when the
    #: objective's maximum lies there (:attr:`Objective.maximum_on_boundary
    #: <teleopt.teleport.objectives.Objective.maximum_on_boundary>`) and no ascent was configured
    #: (positive scalings: the gradient norm is convex in the log-scales)
    boundary_search_when_convex: ClassVar[bool] = False

    #: whether :meth:`exp` is the exponential of the coordinates themselves (elementwise for scalings,
    #: ``matrix_exp`` for GL_n): its differential at 0 is then the identity map, so at the identity the
    #: gradient of a function of the element is its gradient in the coordinates (no backward through exp)
    plain_exp: ClassVar[bool] = False

    def boundary_point(self, direction: Tensor, radius: float) -> Tensor | None:
        """The coordinates in the trust region of ``radius`` that maximise <direction, xi> (the linear
        maximisation oracle of the Frank-Wolfe method over :meth:`project_coordinates`' region): by
        default r d / ||d|| on the Euclidean ball; ``None`` for a zero direction (or the zero coordinates, where
        they come without a read from the device: the box groups' r sign(d))."""
        norm = direction.norm()
        if not float(norm) > 0:
            return None
        return direction * (radius / norm)

    def ascent_step_size(self, lr: float) -> float:
        """Per-coordinate step of a normalised (Adam-like) ascent moving the element by about ``lr``."""
        return lr

    def exact_coordinates(self, xi: Tensor, dtype: torch.dtype) -> Tensor:
        """Coordinates near ``xi``, no farther from the identity, whose element acts on tensors of ``dtype``
        without round-off; ``xi`` itself when the group has no such elements (round-off then stays)."""
        return xi

    def algebra_action(self, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        """d/dt act_on_axis(exp(t M), x, axis, power) at t = 0, for ``x`` (k, ...) and k Lie algebra
        elements ``M`` (k, *coord_shape) batched on a leading axis."""
        raise TypeError(f"{type(self).__name__} has no closed-form Lie-algebra action on an axis")

    def square_factor(self, g: Tensor, power: float) -> Tensor | None:
        """Entrywise factor of x**2 under ``act_on_axis(g, x, axis, power)`` if the representation is diagonal."""
        return None

    #: whether :meth:`roundoff_amplification` can be other than ``None`` (its statistics are then worth computing)
    roundoff_growth: ClassVar[bool] = False

    def roundoff_amplification(self, stats: Mapping[float, Tensor], coords: Tensor) -> Callable[[Tensor], Tensor] | None:
        """How much the members' round-off grows at exp(s coords), per block, as a function of the per-block
        scales s (a float64 tensor of one value per block, giving one value per block): ``None`` where the
        group's elements add none (scalings by any factor keep each product's relative rounding error;
        orthogonal maps keep every norm).  See :meth:`GeneralLinear.roundoff_amplification
        <teleopt.groups.GeneralLinear.roundoff_amplification>`; ``stats`` are the members'
        :meth:`norm_statistic` summed per power."""
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

    def balance_many(
        self, stats: Sequence[Mapping[float, Tensor]], radius: float | None, rcond: float = BALANCE_RCOND
    ) -> list[Tensor | None]:
        """:meth:`balance` of several independent sites whose groups equal this one (same kind and
        coordinate shape), all with ``radius``: one call each here; groups whose closed form batches
        solve them in one."""
        return [self.balance(s, radius, rcond) for s in stats]

    def balance_near_many(self, stats: Sequence[Mapping[float, Tensor]], limit: float) -> list[Tensor] | None:
        """Coordinates of one cheap step towards the balanced point of each site (as :meth:`balance_many`), for
        points already near it; ``None`` where this group has no such step or a step is longer than ``limit``
        (then :meth:`balance_many` decides).  Any coordinates give an exact teleport; the step only has to
        decrease the imbalance, and its repetition to approach the balanced set."""
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
