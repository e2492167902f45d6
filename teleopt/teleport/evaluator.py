"""The contract objectives, caps and search strategies evaluate teleported points through.

An evaluator answers questions about g . w for a list of sites, as functions of
the group elements (differentiable in them): the gradient norm, the base
optimizer's predicted decrease, the site members at g . w.  Two implement it:
:class:`~teleopt.teleport.fast_path.FastEvaluator` (closed-form transport of
``.grad``, no model pass; ``moves_gradients``) and
:class:`~teleopt.teleport.general_path.GeneralEvaluator` (through the model on a
batch), which also implements :class:`BatchEvaluator` for objectives that need
the loss itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from torch import Tensor

from teleopt.site import Site
from teleopt.teleport.context import TeleportContext

__all__ = ["Evaluator", "BatchEvaluator", "require_batch"]


@runtime_checkable
class Evaluator(Protocol):
    """Teleport quantities at g . w for ``sites`` (see module docs).

    ``moves_gradients`` is true when applying a teleport also moves ``.grad`` to
    g . w exactly (closed-form transport); otherwise the gradient there must be
    recomputed on a batch or by the closure.
    """

    sites: list[Site]
    ctx: TeleportContext
    like: dict[str, Tensor]
    moves_gradients: bool

    def elements(self, coords: Sequence[Tensor]) -> list[Tensor]:
        """exp of each site's Lie algebra coordinates."""
        ...

    def grad_norm_sq(self, elements: Sequence[Tensor]) -> Tensor:
        """||grad L(g . w)||^2 over all trainable parameters (float64)."""
        ...

    def first_order_decrease(self, elements: Sequence[Tensor]) -> Tensor:
        """<grad, u> of the base optimizer's next step from g . w."""
        ...

    def site_params(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Site members at g . w."""
        ...

    def next_step_point(self, elements: Sequence[Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Every trainable parameter at g . w and the base optimizer's diagonal preconditioner there."""
        ...

    def site_gains(self, elements: Sequence[Tensor], n0: float) -> dict[str, float | None]:
        """Per site: the ||grad L||^2 ratio when only that site moves (empty when not known in closed form)."""
        ...

    def apply(self, elements: Sequence[Tensor]) -> Counter[str]:
        """Move the live site members, what ``moves_gradients`` promises and the optimizer state to
        g . w in place; returns the count of each state-policy decision."""
        ...

    def can_undo(self) -> bool:
        """Whether :meth:`undo` will move ``.grad`` and the optimizer state back after :meth:`apply`
        (decided before it: where not, the rollback snapshot must hold copies of them)."""
        ...

    def exactly_invertible(self, elements: Sequence[Tensor]) -> bool:
        """Whether :meth:`undo` with ``params`` restores the parameters bit for bit after :meth:`apply`
        (decided before it: where not, the rollback snapshot holds copies of the site members)."""
        ...

    def end_search(self) -> None:
        """Free what only the search reads (the gradient norm's reduced terms and memos) before the apply
        phase allocates; the search's quantities are not asked for again."""
        ...

    def undo(self, elements: Sequence[Tensor], params: bool = False) -> None:
        """Move ``.grad`` and the optimizer state of the site members back from g . w to w by the
        inverse elements (only when :meth:`can_undo`), and the parameters with ``params`` (only when
        :meth:`exactly_invertible`; else they are restored from copies)."""
        ...

    def originals(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """The site members at w computed from g . w after :meth:`apply` (where :meth:`exactly_invertible`)."""
        ...


@runtime_checkable
class BatchEvaluator(Evaluator, Protocol):
    """An evaluator with a teleport batch: the loss itself at and around g . w."""

    def lookahead_loss(self, elements: Sequence[Tensor]) -> Tensor:
        """L(g . w - u): the batch loss after the base optimizer's next step from g . w."""
        ...

    def perturbed_loss(self, elements: Sequence[Tensor], direction: Mapping[str, Tensor], t: float) -> Tensor:
        """L(g . w + t d) on the batch."""
        ...


def require_batch(evaluator: Evaluator, what: str) -> BatchEvaluator:
    """``evaluator`` as a :class:`BatchEvaluator`, or ``TypeError`` naming ``what`` needs one."""
    if not isinstance(evaluator, BatchEvaluator):
        raise TypeError(f"{what} needs a teleport batch (the general path); got a {type(evaluator).__name__}")
    return evaluator
