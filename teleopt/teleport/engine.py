"""One teleport in four phases: plan, search, apply, verify (Zhao 2026, Algorithm 1, lines 2-6).

:class:`~teleopt.teleport.Teleport` is the optimizer users hold; it hands every teleport to a :class:`TeleportEngine`:

* **plan**: the path (``"fast"``, closed-form gradient transport, or ``"general"``, through the model on a
  batch), the sites, the loss at w and the :class:`~teleopt.teleport.evaluator.Evaluator`;
* **search**: group coordinates from the :class:`~teleopt.teleport.search.SearchStrategy`, scaled towards
  the identity until the caps hold (:class:`~teleopt.teleport.safety.Caps`), identical on every rank;
* **apply**: parameters, ``.grad`` and optimizer state moved to g . w, after a snapshot of what a rollback restores;
* **verify**: finite tensors, unchanged model outputs on the teleport batch, the closure's forwards or probe
  inputs (:mod:`~teleopt.teleport.check`; with none of them the plan phase declines), and an unchanged loss
  (and held-out loss), or a rollback; an accepted teleport is then watched (:class:`~teleopt.teleport.watch.Watch`).

All four run inside a :class:`~teleopt.teleport.transaction.Transaction` (an exception anywhere leaves
everything as it was). The papers' first-order teleport is another engine (``PaperCompatEngine``).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.detection.certify import output_leaves
from teleopt.functional import Batch, FunctionalModel, LossFn
from teleopt.numerics import all_finite_sums, default_rtol
from teleopt.sharding import local, reshard, square_sum
from teleopt.site import Site
from teleopt.teleport.ascent import shrink_to_feasible
from teleopt.teleport.check import OutputCapture, OutputCheck, buffers_restored, float64_rerun, forward, seeded
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import exact_in_dtype, max_abs, zero_coordinates
from teleopt.teleport.distributed import any_rank, broadcast_, broadcast_batch, check_identical, rank_mean
from teleopt.teleport.evaluator import Evaluator
from teleopt.teleport.fast_path import FastEvaluator, fast_path_eligible, member_tensors
from teleopt.teleport.general_path import GeneralEvaluator, double_backward_hint
from teleopt.teleport.objectives import Objective
from teleopt.teleport.precision import Precision
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import Caps, InverseSnapshot, SafetyConfig, Snapshot, StabilityCap, stability_cap
from teleopt.teleport.search import SearchConfig, SearchProblem, SearchResult
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transaction import Transaction
from teleopt.teleport.verdict import Failure, loss_failures, non_finite_gradient, output_failures, restore_difference
from teleopt.teleport.watch import InverseMove, TeleportRecord, keeps_snapshot, watch_elements
from teleopt.wrapper import OptimizerWrapper

__all__ = ["EngineConfig", "TeleportRequest", "Plan", "TeleportEngine"]


@dataclass
class EngineConfig:
    """What every teleport of one ``Teleport`` shares: the model, the base optimizer and the settings.

    ``trust_key`` is the param-group key of the trust-region radius; ``generator`` draws the objectives' random
    directions, ``seed`` seeds the stability cap's. ``sharded``: the module's parameters are FSDP2 ``DTensor``s (fast
    path only; see :mod:`~teleopt.teleport.distributed`)."""

    module: nn.Module
    optimizer: Optimizer
    objective: Objective
    search: SearchConfig
    safety: SafetyConfig
    policy: StatePolicy
    loss_fn: LossFn | None
    generator: torch.Generator
    seed: int
    trust_key: str
    sharded: bool = False
    hook_target: nn.Module | None = None


@dataclass
class TeleportRequest:
    """One call for a teleport: the loss at w (from the closure, if any), the closure to re-run after it, the teleport
    batch and the held-out batch; for the check (:mod:`~teleopt.teleport.check`) the probe inputs and where they came
    from, the RNG seed of its forwards and the closure's output leaves at w; the sites left out and why; the precision
    the model trains in."""

    loss: Any
    closure: Callable[[], Any] | None
    batch: Batch | None
    heldout: Batch | None
    probe: Batch | None = None
    probe_source: str = ""
    seed: int = 0
    closure_outputs: list[Tensor] | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    precision: Precision = field(default_factory=Precision)


@dataclass
class Plan:
    """The plan phase's result: everything search, apply and verify read."""

    sites: list[Site]
    path: str
    request: TeleportRequest
    report: TeleportReport
    ctx: TeleportContext
    fmodel: FunctionalModel | None
    evaluator: Evaluator | None = None
    check: OutputCheck | None = None
    after: list[Tensor] | None = None
    grads_finite: bool = False  # the moved gradients are proven finite (FastEvaluator.gradients_finite_after)
    transaction: Transaction | None = None  # what any exception rolls back to (Teleport opens it before the plan)

    def need_evaluator(self) -> Evaluator:
        """The evaluator (planned by every engine that searches)."""
        if self.evaluator is None:
            raise RuntimeError("this teleport was planned without an evaluator")
        return self.evaluator


@dataclass
class _Start:
    """The search phase's starting point: the problem, ||grad L(w)||^2 and the identity's coordinates."""

    problem: SearchProblem
    n0: float
    identity: list[Tensor]


class TeleportEngine:
    """Runs teleports for a ``Teleport`` (see module docs); ``record`` is the wrapper's counters."""

    def __init__(self, config: EngineConfig, record: TeleportRecord) -> None:
        self.config, self.record = config, record

    def run(self, sites: list[Site], request: TeleportRequest, transaction: Transaction | None = None) -> tuple[TeleportReport, Any]:
        """Plan, then search, apply and verify inside ``transaction``; returns the report and the loss to hand back."""
        start = time.perf_counter()
        plan = self.plan(sites, request)
        if isinstance(plan, TeleportReport):  # declined while planning
            return plan, request.loss
        plan.transaction = transaction
        loss = self.execute(plan)
        plan.report.time_s = time.perf_counter() - start
        return plan.report, loss

    def execute(self, plan: Plan) -> Any:
        """Search, apply and verify a planned teleport."""
        elements = self.search(plan)
        if elements is None:
            return plan.request.loss
        plan.need_evaluator().end_search()
        snapshot = self.apply(plan, elements)
        return self.verify(plan, snapshot)

    # ------------------------------------------------------------------ plan
    def fast_ok(self, sites: Sequence[Site]) -> bool:
        """Whether the fast path can take these sites and the objective."""
        return bool(sites) and all(fast_path_eligible(s) for s in sites) and not self.config.objective.needs_batch

    def choose_path(self, sites: Sequence[Site]) -> str:
        """``"fast"`` or ``"general"`` (the configured one, or the fast one when possible)."""
        path = self.config.search.path
        if path != "auto":
            return path
        return "fast" if self.fast_ok(sites) else "general"

    def batch_need(self, sites: Sequence[Site]) -> str:
        """What needs a teleport batch when the general path has none (for the error message)."""
        objective = self.config.objective
        if objective.needs_batch:
            return f"objective {objective.name!r}"
        return f"sites {[s.name for s in sites if not fast_path_eligible(s)]}"

    def _check_path(self, sites: Sequence[Site], path: str, batch: Batch | None) -> None:
        if self.config.sharded and path != "fast":
            raise ValueError(
                f"Teleport on an FSDP2 (fully_shard) model takes the fast path only (exact linear sites, objectives "
                f"without a batch); this teleport needs the general path ({self.batch_need(sites)})"
            )
        if path == "fast" and not self.fast_ok(sites):
            bad = [s.name for s in sites if not fast_path_eligible(s)]
            why = f"sites {bad} are not exact linear sites" if bad else f"objective {self.config.objective.name!r} needs a batch"
            raise ValueError(f"path='fast' is not possible: {why}; use path='general' with a batch")
        if path != "fast" and batch is None:
            raise ValueError(
                f"{self.batch_need(sites)} need(s) a teleport batch (the general path evaluates the model on it): pass "
                "teleport(batch=(inputs, target)) or Teleport(..., batch_fn=...)"
            )

    def plan(self, sites: list[Site], request: TeleportRequest) -> Plan | TeleportReport:
        """The plan phase; a report (with the reason) when the teleport is declined already."""
        cfg = self.config
        path = self.choose_path(sites)
        report = TeleportReport(step=self.record.step, path=path, objective=cfg.objective.name, sites=sites, skipped=dict(request.skipped))
        if not sites:
            report.reason = "declined: no active continuous sites"
            return report
        self._check_path(sites, path, request.batch)
        batch = request.batch
        if batch is not None and path != "fast":
            batch = broadcast_batch(batch)
        request = replace(request, batch=batch)
        ctx = TeleportContext.build(cfg.module, cfg.optimizer, cfg.policy)
        check = self.plan_check(sites, request)
        reason = self._declined(ctx, check, path)
        out: Any = None
        if reason is None and check is not None:
            report.check, report.check_detail = check.kind, check.describe()
            out = self._reference(check, request)
            if isinstance(out, str):
                reason = out
        device = ctx.tensors[sites[0].tensor_names[0]].device
        # declined on every rank or on none (the search and the apply communicate)
        if any_rank(reason is not None, device=device if device.type != "cpu" else None):
            report.reason = reason or "declined: another rank declined"
            report.check, report.check_detail = "none", ""
            return report
        assert check is not None  # else a reason
        # the loss the post-condition compares: on the teleport batch when there is one, else the closure's
        fmodel = None if batch is None else FunctionalModel(cfg.module, cfg.loss_fn)
        if fmodel is not None and batch is not None:
            report.loss_before = self._loss_value(fmodel, out, batch)
        elif request.loss is not None:
            report.loss_before = float(request.loss)
        if request.heldout is not None:
            report.heldout_before = self._heldout_loss(request.heldout, request.seed)
        plan = Plan(sites, path, request, report, ctx, fmodel, check=check)
        return self.plan_evaluator(plan)

    def _declined(self, ctx: TeleportContext, check: OutputCheck | None, path: str) -> str | None:
        """Why the teleport cannot go ahead: a non-finite gradient (the fast path's search declines on a non-finite
        gradient norm instead, a pass over the gradients fewer), or nothing to check it on."""
        bad = None if path == "fast" else non_finite_gradient(ctx)
        if bad is not None:
            return f"declined: non-finite gradient ({bad})"
        if check is None:
            return (
                "declined: nothing to check the teleport on (no teleport batch, closure, example_inputs or earlier forward of the "
                "model): pass teleport(batch=...) or a closure, Teleport(..., batch_fn=... or example_inputs=...), or run the model once"
            )
        return None

    def plan_check(self, sites: Sequence[Site], request: TeleportRequest) -> OutputCheck | None:
        """What the outputs are compared on: the batch, the closure's forwards or probe inputs (in that order)."""
        if request.batch is not None:
            check = OutputCheck.of_sites("batch", request.batch, None, request.seed, sites, "teleport batch")
        elif request.closure is not None:
            return OutputCheck.of_sites("closure", None, None, request.seed, sites, "closure")
        elif request.probe is not None:
            check = OutputCheck.of_sites("probe", request.probe, False, request.seed, sites, request.probe_source)
        else:
            return None
        check.precision = request.precision  # compared in the training precision too
        return check

    def _reference(self, check: OutputCheck, request: TeleportRequest) -> Any:
        """The check's outputs before the teleport (the model output; a reason string to decline with)."""
        if check.kind == "closure":
            check.before = list(request.closure_outputs or [])
            return None
        if check.kind != "probe":
            return self.check_forward(check, reference=True)
        try:
            out = self.check_forward(check, reference=True)
        except Exception as e:  # noqa: BLE001 - probe inputs the model does not take: decline, say why
            first = str(e).splitlines()[0] if str(e) else ""
            return f"declined: the probe inputs ({check.source}) do not run through the model ({type(e).__name__}: {first})"
        if not check.before:
            return f"declined: the model's output on the probe inputs ({check.source}) has no tensor to compare"
        return out

    def _loss_value(self, fmodel: FunctionalModel, out: Any, batch: Batch) -> float | None:
        """The batch loss of the output ``out`` (``None`` when there is no ``loss_fn`` and the output is neither a scalar nor carries one as ``.loss``)."""
        if self.config.loss_fn is None:
            loss = out if isinstance(out, Tensor) else getattr(out, "loss", None)
            if not (isinstance(loss, Tensor) and loss.numel() == 1):
                return None
        return float(fmodel.loss_of(out, batch.target))

    def _heldout_loss(self, heldout: Batch, seed: int) -> float:
        module = self.config.module
        try:
            out = forward(module, heldout, None, seed)
        finally:
            self._reshard()
        return float(FunctionalModel(module, self.config.loss_fn).loss_of(out, heldout.target))

    def plan_evaluator(self, plan: Plan) -> Plan | TeleportReport:
        """Give ``plan`` its evaluator (computing ``.grad`` from the batch if the fast path has none)."""
        cfg, ctx, batch = self.config, plan.ctx, plan.request.batch
        if plan.path != "fast":
            plan.evaluator = GeneralEvaluator(plan.sites, ctx, batch, cfg.loss_fn)
            return plan
        if not ctx.grads({n for s in plan.sites for n in s.tensor_names}):
            if cfg.sharded:  # gradients from a batch would need the functional (unsharded) model
                plan.report.reason = "declined: no gradients (call backward first: FSDP2 models teleport from .grad)"
                return plan.report
            if plan.fmodel is None or batch is None:
                plan.report.reason = "declined: no gradients (call backward first, or pass a closure or batch)"
                return plan.report
            ctx.gradients_from_batch(plan.fmodel, batch)
        needs_decrease = cfg.objective.needs_optimizer_model or (
            cfg.safety.max_predicted_decrease is not None and plan.report.loss_before is not None and ctx.model.supported
        )
        plan.evaluator = FastEvaluator(plan.sites, ctx, with_decrease=needs_decrease)
        return plan

    # ------------------------------------------------------------------ search
    def search(self, plan: Plan) -> list[Tensor] | None:
        """The search phase: the elements to apply, or ``None`` when the teleport is declined."""
        report = plan.report
        start = self._start(plan)
        if not math.isfinite(start.n0):  # the same on every rank (a global norm); the name is this rank's
            report.reason = f"declined: non-finite gradient ({non_finite_gradient(plan.ctx) or 'its norm is not finite'})"
            return None
        with double_backward_hint():
            result = self.config.search.strategy_for(self.config.objective, start.problem).search(start.problem)
        report.objective_before = self._objective_before(start, result)
        caps = self._caps(plan, start)
        coords, shrink = shrink_to_feasible(start.problem.within_roundoff(result.coords, plan.request.precision), caps.feasible)
        coords = exact_in_dtype(plan.sites, start.problem.groups, coords, plan.ctx.tensors)
        broadcast_(coords)
        report.shrink = shrink
        norms = max_abs(coords)  # NaN or inf where a coordinate is
        report.coordinate_norms = {s.name: v for s, v in zip(plan.sites, norms)}
        if not all(math.isfinite(v) for v in norms):
            report.reason = "declined: the search returned non-finite coordinates"
            return None
        if all(v == 0.0 for v in norms):
            report.reason = "declined: " + ("the caps allow no move" if shrink == 0.0 else "no improvement found" + start.problem.limits())
            return None
        return self._chosen(plan, start, coords)

    def _trust_region(self, site: Site, ctx: TeleportContext) -> float | None:
        radii = [ctx.groups[n][self.config.trust_key] for n in site.tensor_names if n in ctx.groups]
        radii = [r for r in radii if r is not None]
        if not radii:
            return None
        return float(min(radii)) * self.record.backoff * float(site.info.get("trust_fraction", 1.0))  # teleopt.detection.overlap

    def _start(self, plan: Plan) -> _Start:
        evaluator, sites, ctx = plan.need_evaluator(), plan.sites, plan.ctx
        like = evaluator.like  # the whole site members (gathered on every rank when sharded)
        device = (
            getattr(evaluator, "search_device", None) or next(like[n] for n in sites[0].tensor_names).device
        )  # the host for GL sites on a GPU
        groups = [s.action.group(member_tensors(s, like)) for s in sites]
        coords0 = [zero_coordinates(s, g, device) for s, g in zip(sites, groups)]
        prepared = self.config.objective.prepare(evaluator, self.config.generator)
        identity = coords0  # read only: every strategy copies its start (a coordinate set can be large)
        with torch.enable_grad():  # off .grad where the objective reads none: the gradient norm's model is never made
            off = self._norms_off_grads(plan) and [p.grad for p in ctx.trainable.values() if p.grad is not None]
            n0 = square_sum(off) if off else float(evaluator.grad_norm_sq(evaluator.elements(identity)).detach())
        plan.report.grad_norm_before = math.sqrt(n0)
        trust = [self._trust_region(s, ctx) for s in sites]
        problem = SearchProblem(sites, groups, evaluator, self.config.objective, prepared, coords0, trust)
        return _Start(problem, n0, identity)

    def _norms_off_grads(self, plan: Plan) -> bool:  # ||grad|| read off .grad before and after (reads_gradients)
        cfg = self.config
        return plan.path == "fast" and not cfg.sharded and not cfg.objective.reads_gradients and cfg.safety.max_gain is None

    def _objective_before(self, start: _Start, result: SearchResult) -> float:
        problem = start.problem
        if result.score_start is None:  # a strategy that never evaluated the identity
            with torch.enable_grad():
                elements = problem.evaluator.elements(start.identity)
                return float(problem.objective.value(problem.evaluator, elements, problem.prepared).detach())
        return result.score_start if problem.objective.direction == "increase" else -result.score_start

    def _caps(self, plan: Plan, start: _Start) -> Caps:
        safety, evaluator, loss0 = self.config.safety, start.problem.evaluator, plan.report.loss_before
        if self.config.sharded and loss0 is not None:  # the global loss: the caps' bisection communicates
            device = next(iter(plan.ctx.tensors.values())).device
            loss0 = rank_mean(loss0, device if device.type != "cpu" else None)
        decrease = (
            safety.max_predicted_decrease is not None and loss0 is not None and plan.ctx.model.supported and loss0 > safety.loss_floor
        )
        stability = self._stability(plan, start.identity)
        return Caps(safety, evaluator, self.record.backoff, start.n0, None, loss0, stability, decrease, start.identity)

    def _stability(self, plan: Plan, identity: list[Tensor]) -> StabilityCap | None:
        """(sharpness of a candidate, cap) for ``SafetyConfig.stability_margin``, or None when off or impossible."""
        safety, ctx, fmodel, batch = self.config.safety, plan.ctx, plan.fmodel, plan.request.batch
        if safety.stability_margin is None or fmodel is None or batch is None or not ctx.model.supported:
            return None
        threshold = min(ctx.model.stability_threshold(ctx.groups[n]) for n in ctx.trainable)
        generator = torch.Generator().manual_seed(self.config.seed + 7919 * (self.record.accepted + 1))
        cap = stability_cap(plan.need_evaluator(), lambda tensors: fmodel.loss(tensors, batch), identity, safety, generator)
        plan.report.sharpness_before = cap[1]
        return cap[0], max(safety.stability_margin * self.record.backoff * threshold, cap[1])

    def _chosen(self, plan: Plan, start: _Start, coords: list[Tensor]) -> list[Tensor]:
        problem, report = start.problem, plan.report
        evaluator = problem.evaluator
        with torch.enable_grad():
            # the memo's tensors themselves where they carry no graph: actions remember per element (GL contragredients)
            elements = [e.detach() if e.requires_grad else e for e in evaluator.elements(coords)]
            report.objective_after = float(problem.objective.value(evaluator, elements, problem.prepared).detach())
            if evaluator.moves_gradients and not self._norms_off_grads(plan):
                report.grad_norm_after = math.sqrt(float(evaluator.grad_norm_sq(elements).detach()))
                report.site_gains = evaluator.site_gains(elements, start.n0)
                plan.grads_finite = isinstance(evaluator, FastEvaluator) and evaluator.gradients_finite_after(report.grad_norm_after)
        report.elements = {s.name: e.to(torch.float64) for s, e in zip(plan.sites, elements)}
        if self.config.sharded:
            # every rank moves the whole site members and keeps its shard: they must apply the same elements
            check_identical(elements, "teleport elements")
        return elements

    # ------------------------------------------------------------------ apply
    def snapshot(self, plan: Plan, elements: list[Tensor]) -> Snapshot | InverseSnapshot:
        """Everything a rollback restores: all tensors and state with the watch on, else the site members
        (their gradients and state by the inverse elements where the evaluator can undo, no closure reruns)."""
        ctx, evaluator = plan.ctx, plan.need_evaluator()
        params = [p for g in self.config.optimizer.param_groups for p in g["params"]]
        names = {n for s in plan.sites for n in s.tensor_names}
        undo = plan.request.closure is None and evaluator.can_undo()
        if self.watch_keeps_snapshot(plan):
            return Snapshot(dict(ctx.tensors), self.config.optimizer, params, grads=True)
        if undo:
            members = {n: ctx.tensors[n] for n in names}
            if evaluator.exactly_invertible(elements):  # no copies: the inverse elements restore bit for bit
                return InverseSnapshot(members, lambda params: evaluator.undo(elements, params), lambda: evaluator.originals(elements))
            return InverseSnapshot(members, lambda params: evaluator.undo(elements, params))
        member_ids = {id(ctx.tensors[n]) for n in names}
        return Snapshot(
            {n: ctx.tensors[n] for n in names},
            self.config.optimizer,
            [p for p in params if id(p) in member_ids],
            grads=True,
        )

    def _undo(self, plan: Plan, snapshot: Snapshot | InverseSnapshot) -> Snapshot | InverseMove:  # what the watch keeps
        if not self.watch_keeps_snapshot(plan):
            elements, cfg = watch_elements(plan.sites, plan.report.elements, plan.ctx.tensors), self.config
            return InverseMove(plan.sites, elements, cfg.module, cfg.optimizer, cfg.policy)
        assert isinstance(snapshot, Snapshot)
        snapshot.grads.clear()  # the rollback clears .grad and skips that update
        return snapshot

    def watch_keeps_snapshot(self, plan: Plan) -> bool:  # watch_restore="snapshot", or a site with no inverse move
        return keeps_snapshot(self.config.safety, plan.sites)

    def apply(self, plan: Plan, elements: list[Tensor]) -> Snapshot | InverseSnapshot:
        """The apply phase: snapshot, then move parameters, gradients and optimizer state to g . w."""
        snapshot = self.snapshot(plan, elements)
        if plan.transaction is not None:  # before anything is written in place
            plan.transaction.protect_sites(plan.sites, plan.ctx, plan.request.closure is not None, snapshot)
        plan.report.state_decisions = dict(plan.need_evaluator().apply(elements))
        return snapshot

    # ------------------------------------------------------------------ verify
    def verify(self, plan: Plan, snapshot: Snapshot | InverseSnapshot) -> Any:
        """The verify phase: accept the teleport (and watch it) or roll it back; returns the loss."""
        names = {n for s in plan.sites for n in s.tensor_names}
        ctx = plan.ctx
        moved = [ctx.tensors[n] for n in names]
        moved += [] if plan.grads_finite else [g for g in (ctx.trainable[n].grad for n in names if n in ctx.trainable) if g is not None]
        reasons = []
        if not all_finite_sums(local(t) for t in moved):
            reasons.append("non-finite parameters or gradients")
        loss = self._loss_after(plan)
        failures = self._drift(plan, ctx.tensors[next(iter(names))].dtype)
        failures += self._outputs(plan)
        if failures and not reasons:
            failures = self._settle_inconclusive(plan, snapshot, failures)
        reasons += [f.reason for f in failures]
        self._grad_norm_after(plan)
        device = local(next(iter(moved))).device
        if any_rank(bool(reasons), device=device if device.type != "cpu" else None):
            snapshot.restore()
            plan.report.accepted = False
            plan.report.reason = "rolled back: " + ("; ".join(reasons) if reasons else "another rank's post-condition failed")
            if isinstance(snapshot, InverseSnapshot) and not snapshot.copies:
                self._recheck(plan)
            return loss
        self.accept(plan, snapshot)
        return loss

    def _loss_after(self, plan: Plan) -> Any:
        """Set ``report.loss_after`` and the check's outputs after the teleport; re-run the closure or
        recompute ``.grad`` where the apply phase did not move it; returns the loss to hand back."""
        request, fmodel, report, check = plan.request, plan.fmodel, plan.report, plan.check
        assert check is not None, "every teleport is planned with a check"
        loss, loss_after = request.loss, None
        if check.kind == "batch" and request.batch is not None:
            out = self.check_forward(check)
            plan.after = output_leaves(out)
            if fmodel is not None:
                loss_after = self._loss_value(fmodel, out, request.batch)
        elif check.kind == "probe":
            plan.after = output_leaves(self.check_forward(check))
        moves = plan.need_evaluator().moves_gradients
        if not moves and request.closure is not None:
            loss = self.rerun_closure(request.closure, precision=request.precision)
            if fmodel is None and loss is not None:
                loss_after = float(loss)
        elif not moves and fmodel is not None and request.batch is not None:
            plan.ctx.fresh_gradients(fmodel, request.batch)
        elif request.closure is not None and fmodel is None:
            loss = self.rerun_closure(request.closure, plan if check.kind == "closure" else None, request.precision)
            loss_after = None if loss is None else float(loss)
        report.loss_after = loss_after
        return loss

    def rerun_closure(self, closure: Callable[[], Any], plan: Plan | None = None, precision: Precision | None = None) -> Any:
        """Run the closure again at g . w with the module's buffers restored afterwards, in ``precision`` (the
        training precision it ran in before); with the ``plan`` of a closure check, under its RNG seed,
        recording the model's outputs as ``plan.after``."""
        module = self.config.module
        with buffers_restored(module), (precision or Precision()).forward():
            if plan is None or plan.check is None:
                loss = OptimizerWrapper._run_closure(closure)
            else:
                capture = OutputCapture()
                with capture.on(self.config.hook_target or module), seeded(module, plan.check.seed):
                    loss = OptimizerWrapper._run_closure(closure)
                plan.after = capture.leaves
        self._reshard()
        return loss

    def _reshard(self) -> None:
        """Reshard an FSDP2 model after a forward pass of its own (FSDP2 leaves the root unsharded
        after a pass without backward, and in-place changes of the shards would not reach it)."""
        if self.config.sharded:
            reshard(self.config.module)

    def check_forward(self, check: OutputCheck, reference: bool = False) -> Any:
        """The model output on the check's inputs (recorded as the outputs before with ``reference``); a sharded
        (FSDP2) model runs the pass collectively on every rank and is resharded afterwards."""
        try:
            return check.reference(self.config.module) if reference else check.run(self.config.module)
        finally:
            self._reshard()

    def _drift(self, plan: Plan, dtype: torch.dtype) -> list[Failure]:
        """Why the loss or held-out loss changed too much (empty: invariance held)."""
        report, heldout = plan.report, plan.request.heldout
        if heldout is not None:
            report.heldout_after = self._heldout_loss(heldout, plan.request.seed)
        return loss_failures(report, self.config.safety, plan.sites, dtype)

    def _outputs(self, plan: Plan) -> list[Failure]:
        """Compare the outputs after with those before (:func:`~teleopt.teleport.verdict.output_failures`)."""
        assert plan.check is not None, "every teleport is planned with a check"
        return output_failures(plan.check, plan.after or [], plan.report, plan.sites, self.config.safety.loss_tol)

    def _recheck(self, plan: Plan) -> None:
        """After a rollback by the inverse elements (no copies) the check's outputs must equal those before the
        teleport bit for bit; a difference (a parameter at the edge of its dtype's range) is reported and warned."""
        check = plan.check
        if check is not None and check.kind != "closure" and check.before:
            diff = restore_difference(output_leaves(self.check_forward(check)), check.before)
            if diff is not None:
                plan.report.reason += f"; after the rollback the outputs differ from before by {diff:.2e} (inverse elements, no copies)"
                warnings.warn(f"Teleport: {plan.report.reason}", stacklevel=2)

    def _settle_inconclusive(self, plan: Plan, snapshot: Snapshot | InverseSnapshot, failures: list[Failure]) -> list[Failure]:
        """Re-run inconclusive failures (:mod:`~teleopt.teleport.check`) in float64; the failures that stand."""
        check, report, request = plan.check, plan.report, plan.request
        assert check is not None
        if any(s.action.needs_data for s in plan.sites) or not all(f.inconclusive() for f in failures):
            return failures
        if self.config.sharded:  # a float64 copy of an FSDP2 model would run collectives on one rank's whim
            return failures + [Failure("(inconclusive below float64; no float64 re-run of a sharded model)", math.inf, 0.0, torch.float64)]
        rerun = check if check.kind != "closure" else self.plan_check(plan.sites, replace(request, batch=None, closure=None))
        if rerun is None or rerun.batch is None:
            return failures + [
                Failure("(inconclusive below float64; no inputs to re-run the check in float64)", math.inf, 0.0, torch.float64)
            ]
        elements = [report.elements[s.name] for s in plan.sites]
        try:
            err64 = float64_rerun(self.config.module, snapshot.saved, plan.sites, elements, rerun)
        except Exception as e:  # noqa: BLE001 - a model that cannot be copied to float64: the failure stands
            return failures + [Failure(f"(inconclusive; the float64 re-run failed: {type(e).__name__})", math.inf, 0.0, torch.float64)]
        tol64 = default_rtol(torch.float64)
        report.check_error_float64, report.check_tol_float64 = err64, tol64
        if err64 <= tol64:
            report.check_detail += (
                f"; {failures[0].reason} in {failures[0].dtype}: inconclusive, re-run on a float64 copy "
                f"({rerun.describe()}): {err64:.1e} <= {tol64:.0e}"
            )
            return []
        return failures + [Failure(f"float64 re-run: outputs changed by {err64:.2e} > {tol64:.0e}", err64, tol64, torch.float64)]

    def _grad_norm_after(self, plan: Plan) -> None:
        if plan.report.grad_norm_after is None and (grads := [p.grad for p in plan.ctx.trainable.values() if p.grad is not None]):
            plan.report.grad_norm_after = math.sqrt(square_sum(grads))

    def accept(self, plan: Plan, snapshot: Snapshot | InverseSnapshot) -> None:
        """Count the teleport as accepted and put it under watch (``SafetyConfig.watch_steps``)."""
        report, record, safety = plan.report, self.record, self.config.safety
        report.accepted = True
        report.reason = "accepted"
        record.accepted += 1
        if safety.watch_steps > 0:  # the teleport's elements (inverse move) or a full snapshot without gradients
            record.open_watch(self._undo(plan, snapshot), safety.watch_steps, report)
