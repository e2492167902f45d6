"""A scheduled teleport: the lean balance path first, then the engine on ``batch_fn``'s batch.

``Teleport.step`` hands every due teleport here.  A teleport the companion
(:mod:`~teleopt.teleport.companion`) can take needs no batch: the closed-form balance reads only the weights
(ENorm, Stock et al. 2019; BaLoRA, Castin et al. 2026), so ``batch_fn`` is not called for it.  Every other
teleport, the first of each balance plan included (the engine checks it on the batch), takes ``batch_fn``'s
batch as before.  A closure passed to ``step`` (a loss) or an explicit ``teleport(batch=...)`` never comes here
without a batch: those always go through the engine with their check.  The first lean teleport of a step
takes ||grad||^2 before its move from the step's watch (``TeleportRecord.read``); a later one (``batches`` > 1)
reads the moved gradients again.
"""

from __future__ import annotations

from typing import Any

from teleopt.teleport.companion import BalanceCompanion
from teleopt.teleport.config import checked_batch
from teleopt.teleport.engine import TeleportRequest

__all__ = ["scheduled_teleports"]


def scheduled_teleports(owner: Any, loss: Any) -> None:
    """Run ``owner``'s (a ``Teleport``) due teleport(s): ``schedule.batches`` of them, each lean where it can be."""
    for _ in range(owner._schedule.batches):
        if owner._batch_fn is not None and loss is None:
            lean = BalanceCompanion.of(owner).teleport(owner, TeleportRequest(None, None, None, owner._heldout, seed=owner._check_seed()))
            owner._record.read = None  # this step's ||grad||^2, read by the watch, is the first teleport's only
            if lean is not None:
                continue
        batch = None if owner._batch_fn is None else checked_batch(owner._batch_fn(), "the batch of batch_fn()")
        # the closure already ran once (torch's contract: at most once per step)
        owner._teleport_now(TeleportRequest(loss, None, batch, owner._heldout, seed=owner._check_seed()))
