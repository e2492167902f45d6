"""The search phase of a teleport: the group element to move by (Zhao 2026, Algorithm 1, lines 3-4).

From a :class:`~teleopt.teleport.phases.Planned` teleport: group coordinates from the
:class:`~teleopt.teleport.search.SearchStrategy` (starting at the identity), bounded for round-off in the training
precision, scaled towards the identity until the caps hold (:class:`~teleopt.teleport.safety.Caps`: trust region,
gain, predicted decrease, stability), made exact in the parameters' dtype and identical on every rank; a
:class:`~teleopt.teleport.phases.Found` with the elements, or a :class:`~teleopt.teleport.phases.Declined` (a
non-finite gradient, non-finite coordinates, no move left).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from teleopt.sharding import square_sum
from teleopt.teleport.ascent import shrink_to_feasible
from teleopt.teleport.coordinates import exact_in_dtype, max_abs, zero_coordinates
from teleopt.teleport.distributed import broadcast_, check_identical, rank_mean
from teleopt.teleport.fast_path import FastEvaluator, member_tensors
from teleopt.teleport.general_path import double_backward_hint
from teleopt.teleport.phases import Declined, Found, PhaseEngine, Planned
from teleopt.teleport.safety import Caps, StabilityCap, stability_cap
from teleopt.teleport.search import SearchProblem, SearchResult
from teleopt.teleport.verdict import non_finite_gradient

__all__ = ["search"]


@dataclass(frozen=True)
class _Start:
    """The search's starting point: the problem, ||grad L(w)||^2 and the identity's coordinates."""

    problem: SearchProblem
    n0: float
    identity: list[Tensor]


def search(engine: PhaseEngine, planned: Planned) -> Found | Declined:
    """The elements to apply to ``planned``'s sites, or why there are none."""
    start = _start(engine, planned)
    measured: dict[str, Any] = {"grad_norm_before": math.sqrt(start.n0)}
    if not math.isfinite(start.n0):  # the same on every rank (a global norm); the name is this rank's
        reason = f"declined: non-finite gradient ({non_finite_gradient(planned.ctx) or 'its norm is not finite'})"
        return Declined(reason, planned.loss, planned, measured)
    with double_backward_hint():
        result = engine.config.search.strategy_for(engine.config.objective, start.problem).search(start.problem)
    measured["objective_before"] = _objective_before(start, result)
    caps, measured["sharpness_before"] = _caps(engine, planned, start)
    coords, shrink = shrink_to_feasible(start.problem.within_roundoff(result.coords, planned.request.precision), caps.feasible)
    coords = exact_in_dtype(planned.sites, start.problem.groups, coords, planned.ctx.tensors)
    broadcast_(coords)
    norms = max_abs(coords)  # NaN or inf where a coordinate is
    measured.update(shrink=shrink, coordinate_norms={s.name: v for s, v in zip(planned.sites, norms)})
    if not all(math.isfinite(v) for v in norms):
        return Declined("declined: the search returned non-finite coordinates", planned.loss, planned, measured)
    if all(v == 0.0 for v in norms):
        why = "the caps allow no move" if shrink == 0.0 else "no improvement found" + start.problem.limits()
        return Declined("declined: " + why, planned.loss, planned, measured)
    return _chosen(engine, planned, start, coords, measured)


def _start(engine: PhaseEngine, planned: Planned) -> _Start:
    evaluator, sites, ctx, objective = planned.need_evaluator(), planned.sites, planned.ctx, engine.config.objective
    like = evaluator.like  # the whole site members (gathered on every rank when sharded)
    device = (
        getattr(evaluator, "search_device", None) or next(like[n] for n in sites[0].tensor_names).device
    )  # the host for GL sites on a GPU
    groups = [s.action.group(member_tensors(s, like)) for s in sites]
    coords0 = [zero_coordinates(s, g, device) for s, g in zip(sites, groups)]
    prepared = objective.prepare(evaluator, engine.config.generator)
    identity = coords0  # read only: every strategy copies its start (a coordinate set can be large)
    with torch.enable_grad():  # off .grad where the objective reads none: the gradient norm's model is never made
        off = _norms_off_grads(engine, planned) and [p.grad for p in ctx.trainable.values() if p.grad is not None]
        n0 = square_sum(off) if off else float(evaluator.grad_norm_sq(evaluator.elements(identity)).detach())
    trust = [engine._trust_region(s, ctx) for s in sites]
    problem = SearchProblem(sites, groups, evaluator, objective, prepared, coords0, trust)
    return _Start(problem, n0, identity)


def _norms_off_grads(engine: PhaseEngine, planned: Planned) -> bool:  # ||grad|| read off .grad before and after
    cfg = engine.config
    return planned.path == "fast" and not cfg.sharded and not cfg.objective.reads_gradients and cfg.safety.max_gain is None


def _objective_before(start: _Start, result: SearchResult) -> float:
    problem = start.problem
    if result.score_start is None:  # a strategy that never evaluated the identity
        with torch.enable_grad():
            elements = problem.evaluator.elements(start.identity)
            return float(problem.objective.value(problem.evaluator, elements, problem.prepared).detach())
    return result.score_start if problem.objective.direction == "increase" else -result.score_start


def _caps(engine: PhaseEngine, planned: Planned, start: _Start) -> tuple[Caps, float | None]:
    """The caps the coordinates are scaled under, and the sharpness at w where the stability cap measured it."""
    safety, evaluator, loss0 = engine.config.safety, start.problem.evaluator, planned.loss_before
    if engine.config.sharded and loss0 is not None:  # the global loss: the caps' bisection communicates
        device = next(iter(planned.ctx.tensors.values())).device
        loss0 = rank_mean(loss0, device if device.type != "cpu" else None)
    model = planned.ctx.model
    decrease = safety.max_predicted_decrease is not None and loss0 is not None and model.supported and loss0 > safety.loss_floor
    stability, sharpness = _stability(engine, planned, start.identity)
    return Caps(safety, evaluator, engine.record.backoff, start.n0, None, loss0, stability, decrease, start.identity), sharpness


def _stability(engine: PhaseEngine, planned: Planned, identity: list[Tensor]) -> tuple[StabilityCap | None, float | None]:
    """(sharpness of a candidate, cap) for ``SafetyConfig.stability_margin`` and the sharpness at w; ``None``s when
    off or impossible."""
    safety, ctx, fmodel, batch, record = engine.config.safety, planned.ctx, planned.fmodel, planned.request.batch, engine.record
    if safety.stability_margin is None or fmodel is None or batch is None or not ctx.model.supported:
        return None, None
    threshold = min(ctx.model.stability_threshold(ctx.groups[n]) for n in ctx.trainable)
    generator = torch.Generator().manual_seed(engine.config.seed + 7919 * (record.accepted + 1))
    cap = stability_cap(planned.need_evaluator(), lambda tensors: fmodel.loss(tensors, batch), identity, safety, generator)
    return (cap[0], max(safety.stability_margin * record.backoff * threshold, cap[1])), cap[1]


def _chosen(engine: PhaseEngine, planned: Planned, start: _Start, coords: list[Tensor], measured: dict[str, Any]) -> Found:
    """The elements at ``coords`` and the objective (and gradient norm) there."""
    problem = start.problem
    evaluator, finite = problem.evaluator, False
    with torch.enable_grad():
        # the memo's tensors themselves where they carry no graph: actions remember per element (GL contragredients)
        elements = [e.detach() if e.requires_grad else e for e in evaluator.elements(coords)]
        measured["objective_after"] = float(problem.objective.value(evaluator, elements, problem.prepared).detach())
        if evaluator.moves_gradients and not _norms_off_grads(engine, planned):
            after = math.sqrt(float(evaluator.grad_norm_sq(elements).detach()))
            measured.update(grad_norm_after=after, site_gains=evaluator.site_gains(elements, start.n0))
            finite = isinstance(evaluator, FastEvaluator) and evaluator.gradients_finite_after(after)
    if engine.config.sharded:
        # every rank moves the whole site members and keeps its shard: they must apply the same elements
        check_identical(elements, "teleport elements")
    return Found(planned, elements, measured, finite)
