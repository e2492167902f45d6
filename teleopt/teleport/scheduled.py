"""A scheduled teleport: the lean balance path first, then the engine on ``batch_fn``'s batch.

``Teleport.step`` hands every due teleport here.  A teleport the companion
(:mod:`~teleopt.teleport.companion`) can take needs no batch: the closed-form balance reads only the weights
(ENorm, Stock et al. 2019; BaLoRA, Castin et al. 2026), so ``batch_fn`` is not called for it, except for the
first teleport of each balance plan, whose output check (:mod:`~teleopt.teleport.lean_check`) runs on the
whole batch, as the engine's.  Every other teleport takes ``batch_fn``'s batch as before (one call per teleport: the
engine reuses the batch a check drew).  A closure passed to ``step`` (a loss) never comes here
without a batch: it always goes through the engine with its check.  The first lean teleport of a step
takes ||grad||^2 before its move from the step's watch (``TeleportRecord.read``); a later one (``batches`` > 1)
reads the moved gradients again.
"""

from __future__ import annotations

from typing import Any

from teleopt.functional import Batch
from teleopt.teleport.companion import BalanceCompanion
from teleopt.teleport.config import checked_batch
from teleopt.teleport.engine import TeleportRequest

__all__ = ["scheduled_teleports"]


class _Draw:
    """``batch_fn()`` at most once per teleport, when its check or the engine asks for the batch."""

    def __init__(self, owner: Any) -> None:
        self.owner, self.drawn = owner, False
        self.batch: Batch | None = None

    def __call__(self) -> Batch | None:
        fn = self.owner._batch_fn
        if not self.drawn:
            self.batch, self.drawn = None if fn is None else checked_batch(fn(), "the batch of batch_fn()"), True
        return self.batch


def scheduled_teleports(owner: Any, loss: Any) -> None:
    """Run ``owner``'s (a ``Teleport``) due teleport(s): ``schedule.batches`` of them, each lean where it can be."""
    for _ in range(owner._schedule.batches):
        draw, tried = _Draw(owner), False
        if owner._batch_fn is not None and loss is None:
            request = TeleportRequest(None, None, None, owner._heldout, seed=owner._check_seed())
            companion = BalanceCompanion.of(owner)
            lean = companion.teleport(owner, request, draw)
            tried = companion.tried  # no plan (new storage: planned again): the engine's turn may take it lean
            owner._record.read = None  # this step's ||grad||^2, read by the watch, is the first teleport's only
            if lean is not None:
                continue
        # the closure already ran once (torch's contract: at most once per step)
        # the lean path, tried above, is not tried again on the engine's request
        owner._teleport_now(TeleportRequest(loss, None, draw(), owner._heldout, seed=owner._check_seed(), lean=not tried))
