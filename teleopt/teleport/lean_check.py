"""The output check of a checked lean balance teleport: the engine's verify phase, without the engine.

Balance on certified exact sites changes no output (ENorm, Stock et al. 2019; Zhao 2026, Prop. 4.5.1), so
the lean path (:mod:`~teleopt.teleport.companion`) checks a plan's first scheduled teleport, and every one with
a teleport batch (``teleport(batch=...)``, or ``teleport()`` drawing ``batch_fn``'s).  That teleport takes the lean move and around it the check :class:`~teleopt.teleport.engine.TeleportEngine`
runs (:mod:`~teleopt.teleport.check`, :mod:`~teleopt.teleport.verdict`): the model's outputs and loss before and
after, on the whole teleport batch (``batch_fn``'s or the explicit one, as the engine's: the predicted-decrease
cap, the report and the watch read that loss), else on the probe inputs, both forwards under ``no_grad``, a forked RNG with one seed and the module's buffers restored;
the same tolerance table, the same float64 re-run of an inconclusive check below float64.

A check that fails undoes the move by the inverse elements (gradients, then optimizer state and parameters:
exact up to round-off, one product by g and one by g^-1) and puts back the counters and the watch, and the
report says ``"rolled back: ..."`` as the engine's would.  An exception after the move (an interrupt in the
forward after it) undoes it the same way before it propagates.  A check that passes verifies the plan: its
later scheduled teleports run lean and unchecked (a teleport with a batch is checked again; an explicit
``teleport()`` with neither a batch nor ``batch_fn`` runs unchecked on a verified plan, as a scheduled one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from teleopt.detection.certify import output_leaves
from teleopt.functional import Batch, FunctionalModel
from teleopt.numerics import all_finite_sums
from teleopt.sharding import write_
from teleopt.teleport.balance_plan import BalancePlan
from teleopt.teleport.check import OutputCheck
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import within_roundoff
from teleopt.teleport.engine import TeleportEngine, TeleportRequest
from teleopt.teleport.fast_path import FastEvaluator
from teleopt.teleport.precision import full_precision
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import Caps
from teleopt.teleport.transport import transport, transport_
from teleopt.teleport.verdict import Failure, loss_failures, output_failures
from teleopt.teleport.watch import InverseMove

__all__ = ["LeanCheck"]


@dataclass
class _Originals:
    """The site members before the move, computed from g . w by the inverse elements (the float64 re-run's
    ``snapshot.saved``; only an inconclusive check asks)."""

    sites: list[Any]
    inverses: list[Tensor]
    like: dict[str, Tensor]

    @property
    def saved(self) -> dict[str, Tensor]:
        return transport(self.sites, self.inverses, self.like, self.like, "params")[0]


@dataclass
class LeanCheck:
    """One checked lean teleport: the outputs and the batch loss before it, and the counters to put back."""

    owner: Any
    plan: BalancePlan
    request: TeleportRequest
    check: OutputCheck
    fmodel: FunctionalModel | None
    loss_before: float | None
    kept: tuple[Any, ...]

    @classmethod
    def of(cls, owner: Any, plan: BalancePlan, request: TeleportRequest, batch: Batch | None) -> LeanCheck | None:
        """The check of ``owner``'s lean teleport on ``batch`` (all of it, as the engine's: its outputs and its
        loss, which the cap, the report and the watch read), else the probe inputs; ``None`` with neither (the
        engine declines it, saying why)."""
        engine: TeleportEngine = owner._engine
        probe, source = owner._probe_inputs()
        request = replace(request, batch=batch, probe=probe, probe_source=source, precision=owner._precision.training())
        check = engine.plan_check(plan.sites, request)
        if check is None:
            return None
        fmodel = None if batch is None else FunctionalModel(engine.config.module, engine.config.loss_fn)
        record = engine.record
        kept = (record.accepted, record.watch, list(record.recent), record.lean_check, plan.lean_step)
        return cls(owner, plan, request, check, fmodel, None, kept)

    def reference(self, coords: Sequence[Tensor], report: TeleportReport) -> bool:
        """The outputs (and loss) before the move, once it is decided and before its first write, then the caps at
        ``coords`` (:meth:`caps_hold`); ``False`` where the engine must take the teleport (probe inputs the model
        does not take, or a cap that binds: the engine's bisection shrinks the move)."""
        owner, batch = self.owner, self.request.batch
        engine: TeleportEngine = owner._engine
        if owner._keywords is not None:
            owner._keywords.warn_if_different(stacklevel=6)
        try:  # nothing is written yet: a forward that raises here leaves the teleport to the engine
            with owner._probe.pause(), owner._precision.pause(), full_precision():
                out = engine._reference(self.check, self.request)
        except Exception:  # noqa: BLE001 - the engine runs on the whole batch and reports what fails there
            return False
        if isinstance(out, str):
            return False
        self.loss_before = None if self.fmodel is None or batch is None else engine._loss_value(self.fmodel, out, batch)
        return self.caps_hold(coords, report)

    def within_roundoff(self, coords: list[Tensor]) -> list[Tensor]:
        """``coords`` with each GL block's round-off amplification bounded for the dtype its site's products are
        computed in, as the engine bounds a balanced point that the trust region clipped
        (:func:`~teleopt.teleport.coordinates.within_roundoff`); the check then verifies the outputs."""
        engine = self.owner._engine
        params = dict(engine.config.module.named_parameters())
        members = [tuple(None if n is None else params.get(n) for n in s.members) for s in self.plan.sites]
        dtypes = [self.request.precision.compute_dtype(m) for m in members]
        return within_roundoff(self.plan.sites, self.plan.groups, coords, members, dtypes)

    def caps_hold(self, coords: Sequence[Tensor], report: TeleportReport) -> bool:
        """Whether the engine's predicted-decrease cap (``SafetyConfig.max_predicted_decrease``, :class:`Caps`)
        holds at the lean point: the base optimizer's modelled next step from g . w decreases the loss, to first
        order, by at most ``max_predicted_decrease`` times the loss (or what the current point has), evaluated
        once, as the engine's first bisection round does (a closed-form bound where one exists, else one modelled
        update).  Off (``True``) without a loss on the check's batch, below ``loss_floor`` or for an optimizer the
        model does not know, as in the engine; ``False`` where some member has no gradient."""
        engine = self.owner._engine
        cfg, loss0 = engine.config, self.loss_before
        safety = cfg.safety
        if safety.max_predicted_decrease is None or loss0 is None or not loss0 > safety.loss_floor:
            return True
        ctx = TeleportContext.build(cfg.module, cfg.optimizer, cfg.policy)
        if not ctx.model.supported:
            return True
        if any(ctx.trainable[n].grad is None for s in self.plan.sites for n in s.tensor_names if n in ctx.trainable):
            return False
        evaluator = FastEvaluator(list(self.plan.sites), ctx, with_decrease=True)
        n0 = (report.grad_norm_before or 0.0) ** 2
        caps = Caps(safety, evaluator, engine.record.backoff, n0, None, loss0, None, True, list(self.plan.zeros))
        return caps.feasible(coords)

    def verify(self, report: TeleportReport) -> TeleportReport:
        """Check the lean ``report``'s teleport (made already): accepted and the plan verified, or undone and
        rolled back; a declined one (nothing moved) is returned as it is."""
        engine, plan, check = self.owner._engine, self.plan, self.check
        if not report.accepted:  # declined before the move: nothing to check
            return report
        report.check, report.check_detail = check.kind, f"lean balance, checked: {check.describe()}"
        report.loss_before = self.loss_before
        try:
            with self.owner._probe.pause(), self.owner._precision.pause(), full_precision():
                failures = self._failures(report)
        except BaseException:
            self._undo(report)
            raise
        record = engine.record
        if failures:
            self._undo(report)
            report.accepted = False
            report.reason = "rolled back: " + "; ".join(f.reason for f in failures)
        plan.verified = not failures  # a verified plan whose explicit teleport failed is checked again from the next
        record.lean_check = (plan.signature, record.backoff, record.step, plan.verified, plan.lean_step)
        return report

    def _failures(self, report: TeleportReport) -> list[Failure]:
        """The engine's post-conditions (``TeleportEngine.verify``): finite moved tensors, loss and outputs."""
        engine, plan, check, safety = self.owner._engine, self.plan, self.check, self.owner._engine.config.safety
        out = engine.check_forward(check)
        batch = self.request.batch
        if self.fmodel is not None and batch is not None:
            report.loss_after = engine._loss_value(self.fmodel, out, batch)
        members = list({id(s.param): s.param for s in plan.slots}.values())
        after = report.grad_norm_after
        if not all_finite_sums(members) or after is None or not math.isfinite(after):
            return [Failure("non-finite parameters or gradients", math.inf, 0.0, torch.float64)]
        failures = loss_failures(report, safety, plan.sites, members[0].dtype)
        failures += output_failures(check, output_leaves(out), report, plan.sites, safety.loss_tol)
        if failures:
            ctx = TeleportContext.build(engine.config.module, engine.config.optimizer, engine.config.policy)
            sites, inverses, _ = self._inverses(report)
            like = {n: ctx.tensors[n] for s in sites for n in s.tensor_names}
            failures = engine.settle_report(report, list(plan.sites), check, self.request, _Originals(sites, inverses, like), failures)
        return failures

    def _inverses(self, report: TeleportReport) -> tuple[list[Any], list[Tensor], list[Tensor]]:
        """The sites in reverse order, their inverse elements, and the elements in the sites' order (each in its
        first member's precision, float32 at least, as the watch keeps them)."""
        first = {s.site: s.param.dtype for s in reversed(self.plan.slots)}
        elements = [
            report.elements[site.name].to(torch.promote_types(first.get(i, torch.float32), torch.float32))
            for i, site in enumerate(self.plan.sites)
        ]
        sites = list(self.plan.sites)[::-1]
        return sites, [site.action.inverse(e) for site, e in zip(sites, elements[::-1])], elements

    def _undo(self, report: TeleportReport) -> None:
        """Move gradients, optimizer state and parameters back by the inverse elements; put back the counters,
        the watch and the lean check as they were before the move."""
        cfg, record = self.owner._engine.config, self.owner._engine.record
        sites, inverses, elements = self._inverses(report)
        with torch.no_grad():
            params = {n: p for n, p in cfg.module.named_parameters()}
            names = {n for s in sites for n in s.tensor_names if n in params}
            like = {n: params[n].detach() for n in names}
            grads = {n: g for n in names if (g := params[n].grad) is not None}
            if not transport_(sites, inverses, grads, like, "covector"):
                for n, g in transport(sites, inverses, grads, like, "covector")[0].items():
                    write_(grads[n], g)
            InverseMove(list(self.plan.sites), elements, cfg.module, cfg.optimizer, cfg.policy).restore()
        record.accepted, record.watch, record.recent, record.lean_check, self.plan.lean_step = self.kept
