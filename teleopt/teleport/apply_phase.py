"""The apply phase of a teleport: move parameters, ``.grad`` and optimizer state to g . w (Zhao 2026, Algorithm 1,
line 5; the state as :class:`~teleopt.teleport.state_policy.StatePolicy` says).

Before anything is written, what a rollback restores is taken (:func:`snapshot`) and handed to the transaction;
after an accepted teleport, :func:`watch_undo` is what the watch keeps to undo it later.
"""

from __future__ import annotations

from torch import Tensor

from teleopt.teleport.phases import Applied, Found, PhaseEngine
from teleopt.teleport.safety import InverseSnapshot, Snapshot
from teleopt.teleport.watch import InverseMove, keeps_snapshot, watch_elements

__all__ = ["apply", "snapshot", "watch_undo"]


def apply(engine: PhaseEngine, found: Found) -> Applied:
    """Snapshot, then move parameters, gradients and optimizer state by ``found``'s elements."""
    planned = found.planned
    saved = snapshot(engine, found)
    if planned.transaction is not None:  # before anything is written in place
        planned.transaction.protect_sites(planned.sites, planned.ctx, planned.request.closure is not None, saved)
    return Applied(found, saved, dict(planned.need_evaluator().apply(found.elements)))


def snapshot(engine: PhaseEngine, found: Found) -> Snapshot | InverseSnapshot:
    """Everything a rollback restores: all tensors and state with the watch on, else the site members
    (their gradients and state by the inverse elements where the evaluator can undo, no closure reruns)."""
    planned, optimizer, elements = found.planned, engine.config.optimizer, found.elements
    ctx, evaluator, names = planned.ctx, planned.need_evaluator(), planned.names()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if keeps_snapshot(engine.config.safety, planned.sites):  # watch_restore="snapshot", or a site with no inverse move
        return Snapshot(dict(ctx.tensors), optimizer, params, grads=True)
    if planned.request.closure is None and evaluator.can_undo():
        members = {n: ctx.tensors[n] for n in names}
        if evaluator.exactly_invertible(elements):  # no copies: the inverse elements restore bit for bit
            return InverseSnapshot(members, lambda params: evaluator.undo(elements, params), lambda: evaluator.originals(elements))
        return InverseSnapshot(members, lambda params: evaluator.undo(elements, params))
    member_ids = {id(ctx.tensors[n]) for n in names}
    members_only: dict[str, Tensor] = {n: ctx.tensors[n] for n in names}
    return Snapshot(members_only, optimizer, [p for p in params if id(p) in member_ids], grads=True)


def watch_undo(engine: PhaseEngine, applied: Applied) -> Snapshot | InverseMove:
    """What the watch keeps to undo the accepted teleport: its inverse move, else the full snapshot without
    gradients (the watch's rollback clears ``.grad`` and skips that update)."""
    found, cfg = applied.found, engine.config
    planned = found.planned
    if not keeps_snapshot(cfg.safety, planned.sites):
        elements = watch_elements(planned.sites, found.by_name(), planned.ctx.tensors)
        return InverseMove(planned.sites, elements, cfg.module, cfg.optimizer, cfg.policy)
    assert isinstance(applied.snapshot, Snapshot)
    applied.snapshot.grads.clear()
    return applied.snapshot
