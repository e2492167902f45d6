"""The watch's rollback of a ``Teleport``: undo the watched teleports as one transaction, then report.

When a gradient or the loss blows up inside a watch window (:mod:`teleopt.teleport.watch`), ``Teleport.step``
calls :func:`rollback_watch` instead of the base's update.  The undo (inverse elements, Zhao 2026,
Prop. 4.5.1, or the snapshot) runs all or nothing, as a teleport does (:mod:`teleopt.teleport.transaction`):
parameters, optimizer state and Lookahead's slow weights move back, the gradients are dropped, the record
counts the rollback and scales the caps by ``SafetyConfig.backoff``; the hooks get a report with
``path="watch"``.
"""

from __future__ import annotations

from typing import Any

from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import default_loss_tol

__all__ = ["rollback_watch"]


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
