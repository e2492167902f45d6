"""One teleport as a pipeline of four phases: plan -> search -> apply -> verify (Zhao 2026, Algorithm 1, lines 2-6).

:class:`~teleopt.teleport.Teleport` is the optimizer users hold; it hands every teleport to a :class:`TeleportEngine`.
Each phase takes the previous phase's frozen value and returns the next one or a
:class:`~teleopt.teleport.phases.Declined` (:mod:`~teleopt.teleport.phases`):

* **plan** (here): the path (``"fast"``, closed-form gradient transport, or ``"general"``, through the model on a
  batch), the sites, the check and its outputs at w, the loss at w and the
  :class:`~teleopt.teleport.evaluator.Evaluator`; :class:`~teleopt.teleport.phases.Planned`;
* **search** (:mod:`~teleopt.teleport.search_phase`): group coordinates from the
  :class:`~teleopt.teleport.search.SearchStrategy`, scaled towards the identity until the caps hold
  (:class:`~teleopt.teleport.safety.Caps`), identical on every rank; :class:`~teleopt.teleport.phases.Found`;
* **apply** (:mod:`~teleopt.teleport.apply_phase`): parameters, ``.grad`` and optimizer state moved to g . w, after a
  snapshot of what a rollback restores; :class:`~teleopt.teleport.phases.Applied`;
* **verify** (:mod:`~teleopt.teleport.verify_phase`): finite tensors, unchanged model outputs on the teleport batch,
  the closure's forwards or probe inputs (:mod:`~teleopt.teleport.check`; with none of them the plan phase declines),
  and an unchanged loss (and held-out loss); :class:`~teleopt.teleport.phases.Verified`, or rolled back.

:meth:`TeleportEngine.run` stops at the first ``Declined`` and writes the report once from the last value; an
accepted teleport is then counted and watched (:class:`~teleopt.teleport.watch.Watch`).  All of it runs inside a
:class:`~teleopt.teleport.transaction.Transaction` (an exception anywhere leaves everything as it was).  The papers'
first-order teleport is another engine (``PaperCompatEngine``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor

from teleopt.functional import Batch, FunctionalModel
from teleopt.sharding import reshard
from teleopt.site import Site
from teleopt.teleport import apply_phase, search_phase, verify_phase
from teleopt.teleport.check import OutputCapture, OutputCheck, buffers_restored, forward, seeded
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import any_rank, broadcast_batch
from teleopt.teleport.fast_path import FastEvaluator, fast_path_eligible
from teleopt.teleport.general_path import GeneralEvaluator
from teleopt.teleport.phases import Applied, Declined, EngineConfig, Found, Planned, TeleportRequest, Verified, report_of
from teleopt.teleport.precision import Precision
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.transaction import Transaction
from teleopt.teleport.verdict import Failure, non_finite_gradient
from teleopt.teleport.watch import TeleportRecord
from teleopt.wrapper import OptimizerWrapper

__all__ = ["EngineConfig", "TeleportRequest", "TeleportEngine"]


class TeleportEngine:
    """Runs teleports for a ``Teleport`` (see module docs); ``record`` is the wrapper's counters."""

    def __init__(self, config: EngineConfig, record: TeleportRecord) -> None:
        self.config, self.record = config, record

    def run(self, sites: list[Site], request: TeleportRequest, transaction: Transaction | None = None) -> tuple[TeleportReport, Any]:
        """plan -> search -> apply -> verify inside ``transaction``, stopping at the first ``Declined``; returns the
        report (written once, from the last phase value) and the loss to hand back."""
        start = time.perf_counter()
        planned = self.plan(sites, request, transaction)
        end = planned if isinstance(planned, Declined) else self.execute(planned)
        head = {"step": self.record.step, "path": self.choose_path(sites), "objective": self.config.objective.name}
        head.update(sites=sites, skipped=dict(request.skipped), time_s=time.perf_counter() - start)
        report = report_of(end, head)
        if isinstance(end, Verified):
            self.accept(end, report)
        return report, end.loss

    def execute(self, planned: Planned) -> Verified | Declined:
        """search -> apply -> verify a planned teleport."""
        found = self.search(planned)
        if isinstance(found, Declined):
            return found
        planned.need_evaluator().end_search()
        return self.verify(self.apply(found))

    def search(self, planned: Planned) -> Found | Declined:
        """The search phase (:func:`~teleopt.teleport.search_phase.search`)."""
        return search_phase.search(self, planned)

    def apply(self, found: Found) -> Applied:
        """The apply phase (:func:`~teleopt.teleport.apply_phase.apply`)."""
        return apply_phase.apply(self, found)

    def verify(self, applied: Applied) -> Verified | Declined:
        """The verify phase (:func:`~teleopt.teleport.verify_phase.verify`)."""
        return verify_phase.verify(self, applied)

    def accept(self, verified: Verified, report: TeleportReport) -> None:
        """Count the accepted teleport of ``report`` and put it under watch (``SafetyConfig.watch_steps``)."""
        self.record.accepted += 1
        if verified.undo is not None:  # the teleport's elements (inverse move) or a full snapshot without gradients
            self.record.open_watch(verified.undo, self.config.safety.watch_steps, report)

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

    def plan(self, sites: list[Site], request: TeleportRequest, transaction: Transaction | None = None) -> Planned | Declined:
        """The plan phase: the path, the check and its outputs at w, the losses at w and the evaluator; or why not."""
        cfg = self.config
        if not sites:
            return Declined("declined: no active continuous sites", request.loss)
        path = self.choose_path(sites)
        self._check_path(sites, path, request.batch)
        if request.batch is not None and path != "fast":
            request = replace(request, batch=broadcast_batch(request.batch))
        ctx = TeleportContext.build(cfg.module, cfg.optimizer, cfg.policy)
        check = self.plan_check(sites, request)
        reason, out = self._declined(ctx, check, path), None
        if reason is None and check is not None:
            out = self._reference(check, request)
            reason = out if isinstance(out, str) else None
        device = ctx.tensors[sites[0].tensor_names[0]].device
        # declined on every rank or on none (the search and the apply communicate)
        if any_rank(reason is not None, device=device if device.type != "cpu" else None):
            return Declined(reason or "declined: another rank declined", request.loss)
        assert check is not None  # else a reason
        # the loss the post-condition compares: on the teleport batch when there is one, else the closure's
        fmodel = None if request.batch is None else FunctionalModel(cfg.module, cfg.loss_fn)
        if fmodel is not None and request.batch is not None:
            loss0 = self._loss_value(fmodel, out, request.batch)
        else:
            loss0 = None if request.loss is None else float(request.loss)
        heldout = None if request.heldout is None else self._heldout_loss(request.heldout, request.seed)
        planned = Planned(sites, path, request, ctx, fmodel, check, loss_before=loss0, heldout_before=heldout, transaction=transaction)
        return self.plan_evaluator(planned)

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

    def plan_evaluator(self, planned: Planned) -> Planned | Declined:
        """``planned`` with its evaluator (computing ``.grad`` from the batch if the fast path has none)."""
        cfg, ctx, batch = self.config, planned.ctx, planned.request.batch
        if planned.path != "fast":
            return replace(planned, evaluator=GeneralEvaluator(planned.sites, ctx, batch, cfg.loss_fn))
        if not ctx.grads(planned.names()):
            if cfg.sharded:  # gradients from a batch would need the functional (unsharded) model
                return Declined("declined: no gradients (call backward first: FSDP2 models teleport from .grad)", planned.loss, planned)
            if planned.fmodel is None or batch is None:
                return Declined("declined: no gradients (call backward first, or pass a closure or batch)", planned.loss, planned)
            ctx.gradients_from_batch(planned.fmodel, batch)
        needs_decrease = cfg.objective.needs_optimizer_model or (
            cfg.safety.max_predicted_decrease is not None and planned.loss_before is not None and ctx.model.supported
        )
        return replace(planned, evaluator=FastEvaluator(planned.sites, ctx, with_decrease=needs_decrease))

    def _trust_region(self, site: Site, ctx: TeleportContext) -> float | None:
        radii = [ctx.groups[n][self.config.trust_key] for n in site.tensor_names if n in ctx.groups]
        radii = [r for r in radii if r is not None]
        if not radii:
            return None
        return float(min(radii)) * self.record.backoff * float(site.info.get("trust_fraction", 1.0))  # teleopt.detection.overlap

    # ------------------------------------------------------------------ the model, as every phase runs it
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

    def rerun_closure(
        self, closure: Callable[[], Any], check: OutputCheck | None = None, precision: Precision | None = None
    ) -> tuple[Any, list[Tensor] | None]:
        """Run the closure again at g . w with the module's buffers restored afterwards, in ``precision`` (the
        training precision it ran in before); with a closure ``check``, under its RNG seed: returns the loss and
        the model's outputs recorded (``None`` without a check)."""
        module, leaves = self.config.module, None
        with buffers_restored(module), (precision or Precision()).forward():
            if check is None:
                loss = OptimizerWrapper._run_closure(closure)
            else:
                capture = OutputCapture()
                with capture.on(self.config.hook_target or module), seeded(module, check.seed):
                    loss = OptimizerWrapper._run_closure(closure)
                leaves = capture.leaves
        self._reshard()
        return loss, leaves

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

    def settle_report(
        self,
        report: TeleportReport,
        sites: list[Site],
        check: OutputCheck,
        request: TeleportRequest,
        originals: verify_phase.Originals,
        failures: list[Failure],
    ) -> list[Failure]:
        """:func:`~teleopt.teleport.verify_phase.settle_inconclusive` for a teleport made outside the engine (the
        lean check's), its float64 re-run written into ``report``; the failures that stand."""
        rerun = verify_phase.Rerun(sites, check, request, originals, [report.elements[s.name] for s in sites])
        failures, measured = verify_phase.settle_inconclusive(self, rerun, failures, report.check_detail)
        for name, value in measured.items():
            setattr(report, name, value)
        return failures
