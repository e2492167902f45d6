"""The verify phase of a teleport: accept it, or roll it back (the post-conditions of "Every teleport is verified").

After the apply phase moved everything to g . w: the moved tensors must be finite, the loss (and held-out loss)
unchanged within ``SafetyConfig.loss_tol`` and the model's outputs unchanged on what the plan phase recorded them
on (:mod:`~teleopt.teleport.check`, judged by :mod:`~teleopt.teleport.verdict`; an inconclusive result below
float64 is re-run on a float64 copy, :func:`settle_inconclusive`).  All ranks decide together.  A
:class:`~teleopt.teleport.phases.Verified` teleport carries what the watch keeps to undo it; a failed one is
restored from the apply phase's snapshot and ends as a :class:`~teleopt.teleport.phases.Declined` (``"rolled
back: ..."``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from teleopt.detection.certify import output_leaves
from teleopt.numerics import all_finite_sums, default_rtol
from teleopt.sharding import local, square_sum
from teleopt.site import Site
from teleopt.teleport.apply_phase import watch_undo
from teleopt.teleport.check import OutputCheck, float64_rerun
from teleopt.teleport.distributed import any_rank
from teleopt.teleport.phases import Applied, Checked, Declined, Found, PhaseEngine, Planned, TeleportRequest, Verified
from teleopt.teleport.report import relative_drift
from teleopt.teleport.safety import InverseSnapshot
from teleopt.teleport.verdict import Failure, loss_failures, output_verdict, restore_difference

__all__ = ["verify", "Originals", "Rerun", "settle_inconclusive"]


def verify(engine: PhaseEngine, applied: Applied) -> Verified | Declined:
    """Accept ``applied`` (with what the watch keeps, when ``SafetyConfig.watch_steps`` is on) or restore the
    snapshot and decline it, saying which post-conditions failed."""
    found = applied.found
    planned = found.planned
    ctx, names = planned.ctx, planned.names()
    moved = [ctx.tensors[n] for n in names]
    if not found.grads_finite:  # else proven finite by the search
        moved += [g for g in (ctx.trainable[n].grad for n in names if n in ctx.trainable) if g is not None]
    reasons = [] if all_finite_sums(local(t) for t in moved) else ["non-finite parameters or gradients"]
    checked = _check(engine, applied, not reasons)
    reasons += checked.reasons
    device = local(moved[0]).device
    if not any_rank(bool(reasons), device=device if device.type != "cpu" else None):  # every rank rolls back, or none
        undo = watch_undo(engine, applied) if engine.config.safety.watch_steps > 0 else None
        return Verified(applied, checked, undo)
    applied.snapshot.restore()
    reason = "rolled back: " + ("; ".join(reasons) if reasons else "another rank's post-condition failed")
    if isinstance(applied.snapshot, InverseSnapshot) and not applied.snapshot.copies:
        if suffix := _recheck(engine, planned):
            reason += suffix
            warnings.warn(f"Teleport: {reason}", stacklevel=2)
    return Declined(reason, checked.loss, applied, checked.measured)


@dataclass(frozen=True)
class _Losses:
    loss_before: float | None
    loss_after: float | None
    heldout_before: float | None
    heldout_after: float | None


def _check(engine: PhaseEngine, applied: Applied, settle: bool) -> Checked:
    """The loss, held-out loss and outputs at g . w against those at w; ``settle``: re-run inconclusive
    failures in float64."""
    found = applied.found
    planned, safety = found.planned, engine.config.safety
    loss, after, loss_after = _after(engine, planned)
    heldout = planned.request.heldout
    heldout_after = None if heldout is None else engine._heldout_loss(heldout, planned.request.seed)
    losses = _Losses(planned.loss_before, loss_after, planned.heldout_before, heldout_after)
    dtype = planned.ctx.tensors[next(iter(planned.names()))].dtype
    failures = loss_failures(losses, safety, planned.sites, dtype)
    drift = relative_drift(planned.loss_before, loss_after)
    more, measured = output_verdict(planned.check, after or [], drift, planned.sites, safety.loss_tol, planned.check.describe())
    failures += more
    if failures and settle:
        elements = [e.to(torch.float64) for e in found.elements]
        rerun = Rerun(planned.sites, planned.check, planned.request, applied.snapshot, elements)
        failures, settled = settle_inconclusive(engine, rerun, failures, measured["check_detail"])
        measured.update(settled)
    measured.update(loss_after=loss_after, heldout_after=heldout_after, grad_norm_after=_grad_norm_after(found))
    return Checked(loss, measured, [f.reason for f in failures])


def _after(engine: PhaseEngine, planned: Planned) -> tuple[Any, list[Tensor] | None, float | None]:
    """The loss to hand back, the check's outputs and the loss at g . w; re-runs the closure or recomputes
    ``.grad`` where the apply phase did not move it."""
    request, fmodel, check = planned.request, planned.fmodel, planned.check
    loss, loss_after, after = request.loss, None, None
    if check.kind == "batch" and request.batch is not None:
        out = engine.check_forward(check)
        after = output_leaves(out)
        if fmodel is not None:
            loss_after = engine._loss_value(fmodel, out, request.batch)
    elif check.kind == "probe":
        after = output_leaves(engine.check_forward(check))
    moves = planned.need_evaluator().moves_gradients
    if not moves and request.closure is not None:
        loss, _ = engine.rerun_closure(request.closure, precision=request.precision)
        if fmodel is None and loss is not None:
            loss_after = float(loss)
    elif not moves and fmodel is not None and request.batch is not None:
        planned.ctx.fresh_gradients(fmodel, request.batch)
    elif request.closure is not None and fmodel is None:
        loss, leaves = engine.rerun_closure(request.closure, check if check.kind == "closure" else None, request.precision)
        after = after if leaves is None else leaves
        loss_after = None if loss is None else float(loss)
    return loss, after, loss_after


def _grad_norm_after(found: Found) -> float | None:
    """||grad L(g . w)||: the search's, else read off ``.grad``."""
    after = found.measured.get("grad_norm_after")
    if after is None and (grads := [p.grad for p in found.planned.ctx.trainable.values() if p.grad is not None]):
        after = math.sqrt(square_sum(grads))
    return after


def _recheck(engine: PhaseEngine, planned: Planned) -> str:
    """After a rollback by the inverse elements (no copies) the check's outputs must equal those before the
    teleport bit for bit; a difference (a parameter at the edge of its dtype's range) is added to the reason."""
    check = planned.check
    if check.kind != "closure" and check.before:
        diff = restore_difference(output_leaves(engine.check_forward(check)), check.before)
        if diff is not None:
            return f"; after the rollback the outputs differ from before by {diff:.2e} (inverse elements, no copies)"
    return ""


class Originals(Protocol):
    """The site members at w (a snapshot's ``saved``)."""

    @property
    def saved(self) -> Mapping[str, Tensor]: ...


@dataclass(frozen=True)
class Rerun:
    """What the float64 re-run of a check needs: the sites, the check and its request, the members at w and the
    elements (float64)."""

    sites: list[Site]
    check: OutputCheck
    request: TeleportRequest
    originals: Originals
    elements: list[Tensor]


def settle_inconclusive(engine: PhaseEngine, rerun: Rerun, failures: list[Failure], detail: str) -> tuple[list[Failure], dict[str, Any]]:
    """Re-run inconclusive ``failures`` (:mod:`~teleopt.teleport.check`) in float64: the failures that stand and
    the report fields measured (``check_error_float64``, ``check_tol_float64``, ``check_detail`` after ``detail``)."""
    check, sites = rerun.check, rerun.sites
    if any(s.action.needs_data for s in sites) or not all(f.inconclusive() for f in failures):
        return failures, {}
    if engine.config.sharded:  # a float64 copy of an FSDP2 model would run collectives on one rank's whim
        return failures + [Failure("(inconclusive below float64; no float64 re-run of a sharded model)", math.inf, 0.0, torch.float64)], {}
    again = check if check.kind != "closure" else engine.plan_check(sites, replace(rerun.request, batch=None, closure=None))
    if again is None or again.batch is None:
        why = "(inconclusive below float64; no inputs to re-run the check in float64)"
        return failures + [Failure(why, math.inf, 0.0, torch.float64)], {}
    try:
        err64 = float64_rerun(engine.config.module, rerun.originals.saved, sites, rerun.elements, again)
    except Exception as e:  # noqa: BLE001 - a model that cannot be copied to float64: the failure stands
        return failures + [Failure(f"(inconclusive; the float64 re-run failed: {type(e).__name__})", math.inf, 0.0, torch.float64)], {}
    tol64 = default_rtol(torch.float64)
    measured: dict[str, Any] = {"check_error_float64": err64, "check_tol_float64": tol64}
    if err64 <= tol64:
        measured["check_detail"] = (
            f"{detail}; {failures[0].reason} in {failures[0].dtype}: inconclusive, re-run on a float64 copy "
            f"({again.describe()}): {err64:.1e} <= {tol64:.0e}"
        )
        return [], measured
    return failures + [Failure(f"float64 re-run: outputs changed by {err64:.2e} > {tol64:.0e}", err64, tol64, torch.float64)], measured
