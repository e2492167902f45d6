"""The watch's rollback of a ``Teleport``: when to undo the watched teleports, and undoing them as one transaction.

When a gradient or the loss blows up inside a watch window (:func:`watch_fires`, :mod:`teleopt.teleport.watch`),
``Teleport.step`` calls :func:`rollback_watch` instead of the base's update.  The undo (inverse elements, Zhao 2026,
Prop. 4.5.1, or the snapshot) runs all or nothing, as a teleport does (:mod:`teleopt.teleport.transaction`):
parameters, optimizer state and Lookahead's slow weights move back, the gradients are dropped, the record
counts the rollback and scales the caps by ``SafetyConfig.backoff``; the hooks get a report with
``path="watch"``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import default_loss_tol
from teleopt.teleport.watch import batch_loss

__all__ = ["rollback_watch", "watch_fires"]


def watch_fires(owner: Any, loss: Any) -> bool:
    """Whether ``owner``'s (a ``Teleport``) watch in progress sets off a rollback at this step: the gradient norm or
    ``loss`` (else a ``batch_fn`` batch's loss, where the watch needs one) beyond ``SafetyConfig.watch_factor`` of
    its reference for ``watch_patience`` steps (:meth:`~teleopt.teleport.watch.TeleportRecord.watch_fired`)."""
    safety, batch_fn = owner._safety, owner._batch_fn
    fresh = None if batch_fn is None else partial(batch_loss, owner._module, owner._loss_fn, batch_fn, owner._check_seed())
    return owner._record.watch_fired(owner._grads(), loss, safety.watch_factor, safety.watch_patience, fresh)


def rollback_watch(owner: Any, step: int) -> None:
    """Undo ``owner``'s (a ``Teleport``) watched teleports at ``step`` and report it to its hooks."""
    record, safety = owner._record, owner._safety
    watch = record.watch
    if watch is None:
        raise ValueError("rollback_watch: owner has no watch in progress")
    tol = safety.loss_tol if safety.loss_tol is not None else default_loss_tol(next(iter(owner._param_list())).dtype)
    with owner._atomic() as transaction:  # all or nothing, as a teleport (teleopt.teleport.transaction)
        transaction.protect(*watch.writes())
        how = watch.undo(owner._probe_inputs()[0], owner._check_seed(), tol)
        owner._lookahead.undo(owner._module)
        for p in owner._param_list():
            p.grad = None
        record.rolled_back(safety.backoff)
    report = TeleportReport(step=step, path="watch", objective=owner._objective.name, sites=list(owner._sites or []))
    report.reason = (
        f"rolled back after {step - watch.teleport_step} step(s): {watch.why}; parameters and optimizer state "
        f"{how}, caps scaled by {record.backoff:g}"
    )
    owner._call_hooks(report)
