"""One teleport in four phases: plan, search, apply, verify (papers/001 Algorithm 1, lines 2-6).

:class:`~teleopt.teleport.Teleport` is the optimizer users hold; it hands every
teleport to a :class:`TeleportEngine`:

* **plan**: the path (``"fast"``, closed-form gradient transport, or
  ``"general"``, through the model on a batch), the sites, the loss at w and the
  :class:`~teleopt.teleport.evaluator.Evaluator`;
* **search**: group coordinates from the :class:`~teleopt.teleport.search.SearchStrategy`
  (projected ascent by default), scaled towards the identity until the caps hold
  (:class:`~teleopt.teleport.safety.Caps`) and made identical on every rank;
* **apply**: parameters, ``.grad`` and optimizer state moved to g . w, after a
  snapshot of what a rollback restores;
* **verify**: finite tensors and an unchanged loss (and held-out loss), or a
  rollback; an accepted teleport is then watched (:class:`~teleopt.teleport.watch.Watch`).

The papers' first-order teleport is another engine
(:class:`~teleopt.teleport.paper_compat.PaperCompatEngine`), not a branch here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.functional import Batch, FunctionalModel, LossFn
from teleopt.site import Site
from teleopt.teleport.ascent import shrink_to_feasible
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import zero_coordinates
from teleopt.teleport.distributed import any_rank, broadcast_, broadcast_batch
from teleopt.teleport.evaluator import Evaluator
from teleopt.teleport.fast_path import FastEvaluator, fast_path_eligible, member_tensors
from teleopt.teleport.general_path import GeneralEvaluator
from teleopt.teleport.objectives import Objective
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import (
    Caps,
    SafetyConfig,
    Snapshot,
    StabilityCap,
    default_loss_tol,
    preconditioned_sharpness,
)
from teleopt.teleport.search import SearchConfig, SearchProblem, SearchResult
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.watch import TeleportRecord, Watch
from teleopt.wrapper import OptimizerWrapper

__all__ = ["EngineConfig", "TeleportRequest", "Plan", "TeleportEngine"]


@dataclass
class EngineConfig:
    """What every teleport of one ``Teleport`` shares: the model, the base optimizer and the settings.

    ``trust_key`` is the param-group key of the trust-region radius; ``generator``
    draws the objectives' random directions, ``seed`` seeds the stability cap's.
    """

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


@dataclass
class TeleportRequest:
    """One call for a teleport: the loss at w (from the closure, if any), the closure to re-run
    after it, the teleport batch and the held-out batch."""

    loss: Any
    closure: Callable[[], Any] | None
    batch: Batch | None
    heldout: Batch | None


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
        self.config = config
        self.record = record

    def run(self, sites: list[Site], request: TeleportRequest) -> tuple[TeleportReport, Any]:
        """Plan, then search, apply and verify; returns the report and the loss to hand back."""
        start = time.perf_counter()
        plan = self.plan(sites, request)
        if isinstance(plan, TeleportReport):  # declined while planning
            return plan, request.loss
        loss = self.execute(plan)
        plan.report.time_s = time.perf_counter() - start
        return plan.report, loss

    def execute(self, plan: Plan) -> Any:
        """Search, apply and verify a planned teleport."""
        elements = self.search(plan)
        if elements is None:
            return plan.request.loss
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
        report = TeleportReport(step=self.record.step, path=path, objective=cfg.objective.name, sites=sites)
        if not sites:
            report.reason = "declined: no active continuous sites"
            return report
        self._check_path(sites, path, request.batch)
        batch = request.batch
        if batch is not None and path != "fast":
            batch = broadcast_batch(batch)
        ctx = TeleportContext.build(cfg.module, cfg.optimizer, cfg.policy)
        # the loss the post-condition compares: on the teleport batch when there is one, else the closure's
        fmodel = None if batch is None else FunctionalModel(cfg.module, cfg.loss_fn)
        if fmodel is not None and batch is not None:
            report.loss_before = float(fmodel.loss({}, batch))
        elif request.loss is not None:
            report.loss_before = float(request.loss)
        if request.heldout is not None:
            report.heldout_before = float(FunctionalModel(cfg.module, cfg.loss_fn).loss({}, request.heldout))
        plan = Plan(sites, path, replace(request, batch=batch), report, ctx, fmodel)
        return self.plan_evaluator(plan)

    def plan_evaluator(self, plan: Plan) -> Plan | TeleportReport:
        """Give ``plan`` its evaluator (computing ``.grad`` from the batch if the fast path has none)."""
        cfg, ctx, batch = self.config, plan.ctx, plan.request.batch
        if plan.path != "fast":
            plan.evaluator = GeneralEvaluator(plan.sites, ctx, batch, cfg.loss_fn)
            return plan
        if not ctx.grads({n for s in plan.sites for n in s.tensor_names}):
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
        result = self.config.search.strategy_for(self.config.objective).search(start.problem)
        report.objective_before = self._objective_before(start, result)
        caps = self._caps(plan, start)
        coords, shrink = shrink_to_feasible(result.coords, caps.feasible)
        broadcast_(coords)
        report.shrink = shrink
        report.coordinate_norms = {s.name: float(c.abs().max()) if c.numel() else 0.0 for s, c in zip(plan.sites, coords)}
        if all(float(c.abs().max()) == 0.0 for c in coords if c.numel()):
            report.reason = "declined: the caps allow no move" if shrink == 0.0 else "declined: no improvement found"
            return None
        return self._chosen(plan, start, coords)

    def _trust_region(self, site: Site, ctx: TeleportContext) -> float | None:
        radii = [ctx.groups[n][self.config.trust_key] for n in site.tensor_names if n in ctx.groups]
        radii = [r for r in radii if r is not None]
        if not radii:
            return None
        return float(min(radii)) * self.record.backoff

    def _start(self, plan: Plan) -> _Start:
        evaluator, sites, ctx = plan.need_evaluator(), plan.sites, plan.ctx
        device = next(ctx.tensors[n] for n in sites[0].tensor_names).device
        like = {n: ctx.tensors[n] for s in sites for n in s.tensor_names}
        groups = [s.action.group(member_tensors(s, like)) for s in sites]
        coords0 = [zero_coordinates(s, g, device) for s, g in zip(sites, groups)]
        prepared = self.config.objective.prepare(evaluator, self.config.generator)
        identity = [c.clone() for c in coords0]
        with torch.enable_grad():
            n0 = float(evaluator.grad_norm_sq(evaluator.elements(identity)).detach())
        plan.report.grad_norm_before = math.sqrt(n0)
        trust = [self._trust_region(s, ctx) for s in sites]
        problem = SearchProblem(sites, groups, evaluator, self.config.objective, prepared, coords0, trust)
        return _Start(problem, n0, identity)

    def _objective_before(self, start: _Start, result: SearchResult) -> float:
        problem = start.problem
        if result.score_start is None:  # a strategy that never evaluated the identity
            with torch.enable_grad():
                elements = problem.evaluator.elements(start.identity)
                return float(problem.objective.value(problem.evaluator, elements, problem.prepared).detach())
        return result.score_start if problem.objective.direction == "increase" else -result.score_start

    def _caps(self, plan: Plan, start: _Start) -> Caps:
        safety, evaluator, loss0 = (
            self.config.safety,
            start.problem.evaluator,
            plan.report.loss_before,
        )
        dec0 = None
        if safety.max_predicted_decrease is not None and loss0 is not None and plan.ctx.model.supported and loss0 > safety.loss_floor:
            with torch.enable_grad():
                dec0 = float(evaluator.first_order_decrease(evaluator.elements(start.identity)).detach())
        stability = self._stability(plan, start.identity)
        return Caps(safety, evaluator, self.record.backoff, start.n0, dec0, loss0, stability)

    def _stability(self, plan: Plan, identity: list[Tensor]) -> StabilityCap | None:
        """(sharpness of a candidate, cap) for ``SafetyConfig.stability_margin``, or None when off or impossible."""
        safety, ctx, fmodel, batch = (
            self.config.safety,
            plan.ctx,
            plan.fmodel,
            plan.request.batch,
        )
        if safety.stability_margin is None or fmodel is None or batch is None or not ctx.model.supported:
            return None
        evaluator = plan.need_evaluator()
        threshold = min(ctx.model.stability_threshold(ctx.groups[n]) for n in ctx.trainable)
        generator = torch.Generator().manual_seed(self.config.seed + 7919 * (self.record.accepted + 1))
        warm: dict[str, Any] = {"v": None}

        def sharpness(coords: Sequence[Tensor]) -> float:
            params, P = evaluator.next_step_point(evaluator.elements(coords))
            lam, warm["v"] = preconditioned_sharpness(
                lambda tensors: fmodel.loss(tensors, batch),
                params,
                P,
                safety.stability_iterations,
                generator,
                warm["v"],
            )
            return lam

        with torch.enable_grad():
            before = sharpness(identity)
        plan.report.sharpness_before = before
        return sharpness, max(safety.stability_margin * self.record.backoff * threshold, before)

    def _chosen(self, plan: Plan, start: _Start, coords: list[Tensor]) -> list[Tensor]:
        problem, report = start.problem, plan.report
        evaluator = problem.evaluator
        with torch.enable_grad():
            elements = [e.detach() for e in evaluator.elements(coords)]
            report.objective_after = float(problem.objective.value(evaluator, elements, problem.prepared).detach())
            if evaluator.moves_gradients:
                report.grad_norm_after = math.sqrt(float(evaluator.grad_norm_sq(elements).detach()))
                report.site_gains = evaluator.site_gains(elements, start.n0)
        report.elements = {s.name: e.to(torch.float64) for s, e in zip(plan.sites, elements)}
        return elements

    # ------------------------------------------------------------------ apply
    def snapshot(self, plan: Plan) -> Snapshot:
        """Everything a rollback restores: all tensors and state with the watch on, else the site members."""
        ctx = plan.ctx
        params = [p for g in self.config.optimizer.param_groups for p in g["params"]]
        if self.config.safety.watch_steps > 0:
            return Snapshot(dict(ctx.tensors), self.config.optimizer, params, grads=True)
        names = {n for s in plan.sites for n in s.tensor_names}
        member_ids = {id(ctx.tensors[n]) for n in names}
        return Snapshot(
            {n: ctx.tensors[n] for n in names},
            self.config.optimizer,
            [p for p in params if id(p) in member_ids],
            grads=True,
        )

    def apply(self, plan: Plan, elements: list[Tensor]) -> Snapshot:
        """The apply phase: snapshot, then move parameters, gradients and optimizer state to g . w."""
        snapshot = self.snapshot(plan)
        plan.report.state_decisions = dict(plan.need_evaluator().apply(elements))
        return snapshot

    # ------------------------------------------------------------------ verify
    def verify(self, plan: Plan, snapshot: Snapshot) -> Any:
        """The verify phase: accept the teleport (and watch it) or roll it back; returns the loss."""
        names = {n for s in plan.sites for n in s.tensor_names}
        ctx = plan.ctx
        moved = [ctx.tensors[n] for n in names]
        moved += [g for g in (ctx.trainable[n].grad for n in names if n in ctx.trainable) if g is not None]
        reasons = []
        # one vectorised pass, no temporaries: NaN and inf propagate through a sum (an overflowing sum of
        # finite entries would only cause a needless rollback)
        if not all(bool(torch.isfinite(t.detach().sum())) for t in moved if t.numel()):
            reasons.append("non-finite parameters or gradients")
        loss = self._loss_after(plan)
        reasons += self._drift(plan, ctx.tensors[next(iter(names))].dtype)
        self._grad_norm_after(plan)
        device = next(iter(moved)).device
        if any_rank(bool(reasons), device=device if device.type != "cpu" else None):
            snapshot.restore()
            plan.report.accepted = False
            plan.report.reason = "rolled back: " + ("; ".join(reasons) if reasons else "another rank's post-condition failed")
            return loss
        self.accept(plan, snapshot)
        return loss

    def _loss_after(self, plan: Plan) -> Any:
        """Set ``report.loss_after``; re-run the closure or recompute ``.grad`` where the apply phase did not
        move it; returns the loss to hand back."""
        request, fmodel, report = plan.request, plan.fmodel, plan.report
        loss, loss_after = request.loss, None
        if fmodel is not None and request.batch is not None:
            loss_after = float(FunctionalModel(self.config.module, self.config.loss_fn).loss({}, request.batch))
        moves = plan.need_evaluator().moves_gradients
        if not moves and request.closure is not None:
            loss = self.rerun_closure(request.closure)
            if fmodel is None and loss is not None:
                loss_after = float(loss)
        elif not moves and fmodel is not None and request.batch is not None:
            plan.ctx.fresh_gradients(fmodel, request.batch)
        elif request.closure is not None and fmodel is None:
            loss = self.rerun_closure(request.closure)
            loss_after = None if loss is None else float(loss)
        report.loss_after = loss_after
        return loss

    def rerun_closure(self, closure: Callable[[], Any]) -> Any:
        """Run the closure again at g . w with the module's buffers restored afterwards."""
        with _buffers_restored(self.config.module):
            return OptimizerWrapper._run_closure(closure)

    def _drift(self, plan: Plan, dtype: torch.dtype) -> list[str]:
        """Why the loss or held-out loss changed too much (empty: invariance held)."""
        safety, report, heldout = self.config.safety, plan.report, plan.request.heldout
        tol = safety.loss_tol if safety.loss_tol is not None else default_loss_tol(dtype)
        reasons = []
        if report.loss_before is not None and report.loss_after is not None:
            drift = abs(report.loss_after - report.loss_before) / max(abs(report.loss_before), 1e-300)
            if not drift <= tol:
                reasons.append(f"loss changed by {drift:.2e} (relative) > tolerance {tol:.1e}")
        if heldout is not None:
            report.heldout_after = float(FunctionalModel(self.config.module, self.config.loss_fn).loss({}, heldout))
            htol = safety.heldout_tol
            if htol is None and all(s.action.exactness == "exact" and not s.action.needs_data for s in plan.sites):
                htol = tol
            if htol is not None and report.heldout_before is not None:
                hdrift = abs(report.heldout_after - report.heldout_before) / max(abs(report.heldout_before), 1e-300)
                if not hdrift <= htol:
                    reasons.append(f"held-out loss changed by {hdrift:.2e} (relative) > tolerance {htol:.1e}")
        return reasons

    def _grad_norm_after(self, plan: Plan) -> None:
        if plan.report.grad_norm_after is not None:
            return
        grads = [p.grad for p in plan.ctx.trainable.values() if p.grad is not None]
        if grads:
            total = sum(
                (g.to(torch.float64).square().sum() for g in grads),
                torch.zeros((), dtype=torch.float64),
            )
            plan.report.grad_norm_after = float(torch.sqrt(total))

    def accept(self, plan: Plan, snapshot: Snapshot) -> None:
        """Count the teleport as accepted and put it under watch (``SafetyConfig.watch_steps``)."""
        report, record, safety = plan.report, self.record, self.config.safety
        report.accepted = True
        report.reason = "accepted"
        record.accepted += 1
        if safety.watch_steps > 0:
            grad_ref = max(report.grad_norm_before or 0.0, report.grad_norm_after or 0.0) ** 2
            record.watch = Watch(
                snapshot,
                record.step + safety.watch_steps,
                record.step,
                grad_ref,
                report.loss_before,
            )


class _buffers_restored:
    """Context manager: snapshot the module's buffers and restore them on exit (extra closure passes)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = [(b, b.detach().clone()) for b in self.module.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, v in self.saved:
                b.copy_(v)
