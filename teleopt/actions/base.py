"""The group-action interface every symmetry in teleopt implements.

A group action (Zhao 2026, Sec. 1.1) is a map G x Param -> Param with
identity . w = w and g1 . (g2 . w) = (g1 g2) . w.  A *parameter space symmetry*
additionally leaves the loss invariant, L(g . w) = L(w).  teleopt distinguishes:

* ``exact``: invariance for every input (functional symmetries, Table 1.1);
* ``data-dependent``: invariance on a given batch only (Zhao 2026, Prop. 4.4.2,
  Zhao et al. 2023, Theorem 2.4.1); ``act`` then needs the batch;
* ``approximate``: invariance up to a stated error (e.g. BatchNorm with eps > 0).

Parameters are a tuple of tensors in the order of ``member_names`` (optional
members may be ``None``).  For exact actions that are linear (or affine with a
constant Jacobian) in the parameters, ``transport_gradient`` maps the gradient at
w to the gradient at g . w without any forward or backward pass:
grad L(g . w) = (J^{-1})^T grad L(w) with J = d(g . w)/dw (Zhao 2026, Prop. 4.5.1,
eq. 4.19).  ``transport_second_moment`` gives the exact rule for elementwise
second moments when one exists (diagonal and permutation groups only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from teleopt.groups import Group

Exactness = Literal["exact", "data-dependent", "approximate"]
Params = tuple[Tensor | None, ...]
_EXACTNESS: tuple[Exactness, ...] = ("exact", "data-dependent", "approximate")

__all__ = ["GroupAction", "ExampleProblem", "Exactness", "Params", "required"]


def required(member: Tensor | None, name: str = "member") -> Tensor:
    """An entry of :data:`Params` narrowed to a tensor.

    ``Params`` allows ``None`` for optional members; :meth:`GroupAction.check_params`
    rejects ``None`` for required ones, and this states it (to readers and the type
    checker) where a required member is read, raising if the check was skipped.
    """
    if member is None:
        raise ValueError(f"required {name} is None")
    return member


@dataclass(frozen=True)
class ExampleProblem:
    """A small problem an action is a symmetry of, used by ``teleopt.testing``.

    ``fn(params, data)`` returns the quantity the action leaves invariant: the
    model output for functional symmetries (``functional=True``) or a scalar loss
    otherwise.  ``data`` is whatever ``fn`` and ``act`` take (``None`` if unused).
    """

    params: Params
    data: Any
    fn: Callable[[Params, Any], Tensor]
    functional: bool = True

    def loss(self, params: Params, data: Any = None) -> Tensor:
        """A scalar loss built from ``fn`` (a fixed random quadratic of the output)."""
        out = self.fn(params, self.data if data is None else data)
        if out.ndim == 0:
            return out
        target = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
        return 0.5 * ((out - target) ** 2).sum()


class GroupAction(ABC):
    """A group acting on a tuple of parameter tensors (Zhao 2026, Def. 1.1.1 and Table 1.1).

    Class attributes describe the action; subclasses implement :meth:`group`,
    :meth:`act` and :meth:`example`.  Elements are tensors (matrices for GL/O,
    vectors for scalings, signs and translations, index tensors for permutations)
    and are built exactly: ``exp`` of Lie algebra coordinates through
    ``torch.linalg.matrix_exp``, inverses by ``solve``/transposition.
    """

    name: str = ""
    group_name: str = ""
    reference: str = ""
    exactness: Exactness = "exact"
    linear: bool = True
    group_type: type[Group]
    member_names: tuple[str, ...] = ()
    optional_members: frozenset[str] = frozenset()

    # -- description ----------------------------------------------------------
    @property
    def continuous(self) -> bool:
        """True for Lie groups (teleportation by ascent on coordinates), False for finite groups."""
        return bool(self.group_type.continuous)

    @property
    def needs_data(self) -> bool:
        """Whether ``act`` needs the batch the symmetry holds on."""
        return self.exactness == "data-dependent"

    @property
    def has_gradient_transport(self) -> bool:
        """Whether ``transport_gradient`` is available (constant Jacobian: linear or translation)."""
        return self.linear

    @property
    def isometric(self) -> bool:
        """Whether every element moves each member by an isometry of the Frobenius norm (an orthogonal or
        permutation matrix on one axis): the norms of the parameters and of the transported gradients are
        the same all along an orbit (Zhao 2026, Prop. 4.5.1 with J orthogonal)."""
        return False

    def acted_axes(self) -> tuple[int | None, ...]:
        """Per member, the axis of its tensor the group acts on (``None``: not a single axis, or unknown)."""
        return (None,) * len(self.member_names)

    def describe(self) -> dict[str, Any]:
        """One row of the registry table."""
        return {
            "name": self.name,
            "group": self.group_name,
            "continuous": self.continuous,
            "exactness": self.exactness,
            "linear": self.linear,
            "members": ", ".join(self.member_names),
            "reference": self.reference,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {self.group_name}, {self.exactness}>"

    # -- parameters -----------------------------------------------------------
    def check_params(self, params: Sequence[Tensor | None]) -> Params:
        """Validate the parameter tuple and return it as a tuple."""
        if isinstance(params, Tensor) or not isinstance(params, Sequence):
            raise TypeError(f"{self.name}: params must be a tuple of tensors ({', '.join(self.member_names)}), got {type(params).__name__}")
        params = tuple(params)
        if len(params) != len(self.member_names):
            raise ValueError(
                f"{self.name}: expected {len(self.member_names)} parameter tensors ({', '.join(self.member_names)}), got {len(params)}"
            )
        for name, p in zip(self.member_names, params):
            if p is None:
                if name not in self.optional_members:
                    raise ValueError(f"{self.name}: member {name!r} is required but is None")
            elif not isinstance(p, Tensor):
                raise TypeError(f"{self.name}: member {name!r} must be a torch.Tensor, got {type(p).__name__}")
            elif not p.is_floating_point():
                raise TypeError(f"{self.name}: member {name!r} must be floating point, got {p.dtype}")
        return params

    def _reference_tensor(self, params: Params) -> Tensor:
        for p in params:
            if p is not None:
                return p
        raise ValueError(f"{self.name}: all members are None")

    def _check_data(self, data: Any) -> None:
        if self.needs_data and data is None:
            raise ValueError(
                f"{self.name} is a data-dependent action: it is a symmetry only on a given batch, so act() needs data=<the batch>"
            )

    # -- the group --------------------------------------------------------------
    @abstractmethod
    def group(self, params: Params) -> Group:
        """The group instance acting on these parameters (its size follows their shapes)."""

    def coord_shape(self, params: Params) -> tuple[int, ...] | None:
        """Shape of Lie algebra coordinates for these parameters (``None`` if discrete)."""
        return self.group(self.check_params(params)).coord_shape

    def identity(self, params: Params) -> Tensor:
        """The identity element for these parameters."""
        ref = self._reference_tensor(self.check_params(params))
        return self.group(params).identity(dtype=ref.dtype, device=ref.device)

    def exp(self, coords: Tensor, params: Params) -> Tensor:
        """The element exp(coords) of the group acting on ``params`` (differentiable)."""
        return self.group(self.check_params(params)).exp(coords)

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        """The product a b (acting with it equals acting with b, then with a)."""
        return self.group_type.compose(a, b)

    def inverse(self, g: Tensor) -> Tensor:
        """The inverse element, computed exactly."""
        return self.group_type.inverse(g)

    def random_element(self, params: Params, generator: torch.Generator | None = None, scale: float = 1.0) -> Tensor:
        """A random element drawn from ``generator`` (exp of coordinates of size ``scale``)."""
        ref = self._reference_tensor(self.check_params(params))
        return self.group(params).random(generator=generator, scale=scale, dtype=ref.dtype, device=ref.device)

    def validate_element(self, g: Tensor, params: Params) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``g`` is a valid element for ``params``."""
        self.group(self.check_params(params)).validate(g)

    # -- the action ---------------------------------------------------------------
    @abstractmethod
    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        """Return g . params (differentiable in ``g`` and ``params``; inputs are not modified)."""

    def transport_gradient(self, g: Tensor, grads: Params) -> Params:
        """Gradient at g . w from the gradient at w: (J^{-1})^T grad (Zhao 2026, eq. 4.19).

        First moments (SGD momentum, Adam's exp_avg) are covectors and move the same way.
        """
        raise TypeError(
            f"{self.name} has no closed-form gradient transport ({self.exactness}, "
            f"{'linear' if self.linear else 'non-linear'}): evaluate gradients at the new point instead"
        )

    #: whether the covector rule depends on where the gradient is (the Jacobian of a non-linear action at w):
    #: callers then use :meth:`transport_gradient_at` with the parameters' values
    transport_reads_params: bool = False

    def transport_gradient_at(self, g: Tensor, grads: Params, params: Params) -> Params:
        """:meth:`transport_gradient` of gradients taken at ``params``: (J(w)^{-1})^T grad with J(w) the Jacobian
        of w -> g . w there (Zhao 2026, eq. 4.19); the same for actions with a constant Jacobian."""
        return self.transport_gradient(g, grads)

    def transport_second_moment(self, g: Tensor, moments: Params) -> Params | None:
        """Exact transport of elementwise second moments, or ``None`` when there is none."""
        return None

    # -- the infinitesimal action ----------------------------------------------------
    @property
    def has_infinitesimal_action(self) -> bool:
        """Whether :meth:`infinitesimal_action` has a closed form (Zhao 2026, Sec. 5.2.2)."""
        return False

    def infinitesimal_action(self, group: Group, M: Tensor, tensors: Params) -> Params:
        """d rho(M) applied to each member, batched over k Lie algebra elements.

        ``tensors`` holds the members batched as (k, *shape) and ``M`` the k
        elements (k, *coord_shape) of ``group``'s algebra; the result is each
        member's image d/dt (exp(t M) . w) at t = 0 (zero where the member is not
        acted on; ``None`` for absent members).
        """
        raise TypeError(f"site action {self.name}: no closed-form infinitesimal action")

    @abstractmethod
    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        """A small random problem this action is a symmetry of (for property tests)."""


def check_exactness(value: str) -> Exactness:
    """Validate an exactness label."""
    for label in _EXACTNESS:
        if value == label:
            return label
    raise ValueError(f"exactness must be one of {_EXACTNESS}, got {value!r}")
