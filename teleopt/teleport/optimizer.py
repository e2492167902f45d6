"""``Teleport``: symmetry teleportation as a drop-in ``torch.optim`` wrapper (Zhao 2026, Algorithm 1).

::

    opt = teleopt.Teleport(torch.optim.AdamW(model.parameters()), model, sites, every=100)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # teleports before the update on schedule, then steps

On a schedule, ``step()`` moves the parameters along loss-invariant group orbits
to where the chosen objective is best (Zhao 2026, Sec. 4.3, Ch. 5), moves
``.grad`` and the optimizer state consistently, checks that the model outputs did
not change (on the teleport batch, the closure's forwards or probe inputs:
:mod:`teleopt.teleport.check`), and then lets the base optimizer step from the
teleported point.  See :mod:`teleopt.teleport` for the paths, objectives, state
policies and safety.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from teleopt.functional import Batch, LossFn
from teleopt.groups import GroupCache
from teleopt.sharding import reshard, sharded_module, unsupported_layout
from teleopt.site import Site
from teleopt.teleport.check import KeywordCheck, OutputCapture, ProbeRecorder, seeded
from teleopt.teleport.companion import BalanceCompanion
from teleopt.teleport.config import (
    Shortcuts,
    checked_batch,
    reject_moved_keywords,
    resolve_data,
    resolve_objective,
    resolve_safety,
    resolve_schedule,
    resolve_search,
    resolve_state_policy,
)
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import check_supported_sharding
from teleopt.teleport.engine import EngineConfig, TeleportEngine, TeleportRequest
from teleopt.teleport.lookahead import LookaheadView
from teleopt.teleport.objectives import Objective, get_objective
from teleopt.teleport.paper_compat import PaperCompatEngine
from teleopt.teleport.precision import PrecisionRecorder, full_precision
from teleopt.teleport.record_check import check_groups, check_record
from teleopt.teleport.report import Tally, TeleportReport
from teleopt.teleport.rollback import rollback_watch, watch_fires
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.scheduled import scheduled_teleports
from teleopt.teleport.search import SearchConfig
from teleopt.teleport.site_selection import AutoSites, check_sharded_support
from teleopt.teleport.sites import (
    active_sites,
    check_model_matches_optimizer,
    movable_sites,
    warn_scale_free_objective,
)
from teleopt.teleport.state_policy import StatePolicy, restart_curvature_history
from teleopt.teleport.transaction import Transaction
from teleopt.teleport.watch import REFERENCE_STEPS, TeleportRecord, keeps_copies
from teleopt.unwrap import hook_target, unwrap
from teleopt.wrapper import OptimizerWrapper, no_grad_step, torch_initialising_step

__all__ = ["Teleport"]

TeleportHook = Callable[["Teleport", TeleportReport], None]


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Teleport needs the model (an nn.Module) whose parameters the optimizer updates, got {type(model).__name__}")
    check_supported_sharding(model)


class Teleport(OptimizerWrapper):
    """Symmetry teleportation around any ``torch.optim`` optimizer (Zhao 2026, Algorithm 1, Ch. 5).

    Parameters
    ----------
    optimizer:
        The base optimizer; it keeps its param groups and state.
    model:
        The model whose parameters ``optimizer`` updates (``DistributedDataParallel``,
        ``DataParallel`` and ``torch.compile`` wrappers are unwrapped).  A forward
        pre-hook records the inputs of its last forward as probe inputs (see below).
    sites:
        ``"auto"`` (the exact continuous sites ``teleopt.find_symmetries`` finds on the
        model, with ``example_inputs``/``example_kwargs``, else the first teleport batch
        or the last forward's inputs; sites whose parameters the optimizer does not
        update are left out with a warning and listed in ``report.skipped``; under
        optimizers with scale-free steps (Adam family, Adagrad, RMSprop, unmodelled
        ones) the rescalings of normalisation layers' affine parameters are left out
        too, with a warning) or a list of :class:`~teleopt.site.Site` naming tensors of
        ``model.state_dict()``; sites act in list order.  Discrete sites (permutations,
        signs) are not searched.  A site whose parameter is frozen
        (``requires_grad=False``) after the wrapper was built is left out of the
        teleports while it is frozen.
    objective:
        ``"grad_norm"``, ``"preconditioned_norm"``, ``"lookahead"``, ``"sharpness"``,
        ``"curvature"``, ``"balance"`` (least weight norm on the orbit, in closed form) or an
        :class:`~teleopt.teleport.objectives.Objective`.  Default (``None``): ``"balance"``
        on its default schedule when no schedule is given either, else ``"grad_norm"``.
    schedule:
        When to teleport (:class:`~teleopt.teleport.schedule.Schedule`: ``every``, ``at``,
        ``when``, ``warmup``, ``batches``, ``max_teleports``).  Without a schedule or ``every``
        the objective's default applies: ``"balance"`` every 200 steps from step 200; every
        other objective only when :meth:`teleport` is called (a ``UserWarning`` says so; an
        explicit ``schedule=Schedule()`` chooses it without one).  No default teleports at
        step 0.
    every:
        Shortcut for ``schedule=Schedule(every=every)`` (not given with ``schedule``).
    search:
        How elements are chosen (:class:`~teleopt.teleport.search.SearchConfig`: ascent
        steps and step size, trust region (stored per param group as
        ``teleopt_teleport_trust_region``; default log 4), path, strategy, the seed of the
        random draws, and ``paper_compat``, the papers' first-order, non-invariant teleport
        for comparisons).
    safety:
        :class:`~teleopt.teleport.safety.SafetyConfig` (caps, tolerances, a held-out batch
        on which invariance is also checked, watch).
    state_policy:
        What happens to the optimizer state (:class:`~teleopt.teleport.state_policy.StatePolicy`,
        or its ``policy`` argument).
    loss_fn:
        ``loss_fn(model(*inputs, **kwargs), target)``, needed by the general path and
        by loss checks on explicit batches; ``None`` when the output is the loss or
        carries it as ``.loss`` (transformers models given ``labels``).
    batch_fn:
        ``batch_fn() -> batch`` supplying teleport batches for scheduled teleports
        (general path, the check, loss checks and the stability cap).  A batch is
        ``(inputs, target)`` with ``inputs`` a tensor, a tuple or a mapping of keyword
        inputs (``model(**inputs)``), ``(inputs, target, kwargs)`` with the keyword
        arguments the model is called with in training, or a mapping of keyword inputs
        alone (target ``None``); see :func:`teleopt.functional.as_batch`.  Every
        evaluation on it draws the same dropout masks.
    example_inputs, example_kwargs:
        Inputs (a tensor, a tuple, or a mapping of keyword inputs of a transformers
        model) and keyword arguments for ``sites="auto"`` detection, and the *probe
        inputs* of teleports that have no batch and no closure.  Every teleport is
        checked (:mod:`teleopt.teleport.check`): on its batch, else on the closure's
        forwards, else on the probe inputs (these, or else the first up to 8 rows of
        the last forward's inputs, copied), in eval mode; with none of them it is
        declined, never accepted unchecked.  A training forward whose arguments differ
        from these is warned about (neither detection nor the check saw them).

    Keywords that moved into the config objects (``ascent_steps``, ``at``, ``seed``,
    ``heldout_batch``, ...) raise a ``TypeError`` naming where they went.
    """

    prefix = "teleopt_teleport_"

    @reject_moved_keywords
    def __init__(  # noqa: PLR0913  the public constructor, bounded at 15 parameters by tests/test_teleport_signature.py
        self,
        optimizer: Optimizer,
        model: nn.Module,
        sites: str | Sequence[Site] = "auto",
        *,
        objective: str | Objective | None = None,
        schedule: Schedule | None = None,
        every: int | None = None,
        search: SearchConfig | None = None,
        safety: SafetyConfig | None = None,
        state_policy: StatePolicy | str | Mapping[str, str] | None = None,
        loss_fn: LossFn | None = None,
        batch_fn: Callable[[], Any] | None = None,
        example_inputs: Any = None,
        example_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        _check_model(model)
        self._search = resolve_search(search)
        super().__init__(optimizer, {"enabled": True, "trust_region": self._search.trust_region, "state": ""})  # state: see wrapper
        self._module = unwrap(model)
        self._hook_target = hook_target(model)
        check_model_matches_optimizer(self._module, self.param_groups)
        shortcut: Shortcuts = {"every": every}
        self._objective = get_objective(resolve_objective(objective, schedule, shortcut, self._search.paper_compat))
        self._schedule = resolve_schedule(schedule, shortcut, self._objective.default_schedule())
        warn_scale_free_objective(self._objective.name, self._schedule, self.innermost)
        self._policy = resolve_state_policy(state_policy)
        self._safety = resolve_safety(safety)
        data = resolve_data(loss_fn, batch_fn, self._safety.heldout_batch, example_inputs, example_kwargs, batches=self._schedule.batches)
        self._loss_fn, self._batch_fn, self._heldout, self._example = data
        self._set_up_sites(sites)
        self._generator = torch.Generator().manual_seed(self._search.seed)
        self._record = TeleportRecord()
        self._lookahead = LookaheadView.of(self.innermost)
        self._engine = self._make_engine()
        self._start_recording()

    def _set_up_sites(self, sites: str | Sequence[Site]) -> None:
        """The sites (``None`` until ``"auto"`` detection), after what the objective and a sharded model need."""
        if self._objective.needs_optimizer_model:
            TeleportContext.build(self._module, self._base, self._policy).model.require(f"objective {self._objective.name!r}")
        self._sharded = sharded_module(self._module)
        layout = unsupported_layout(self._module) if self._sharded else None
        if layout is not None:  # before "auto" detection gathers the model
            raise ValueError(f"Teleport on a sharded model supports FSDP2's layout (a 1-D mesh, Shard(0)); not {layout}")
        self._auto = AutoSites(self._module, self.innermost, not self._objective.closed_form, self._sharded)
        self._sites, self._auto_skipped = self._auto.initial(sites, self.param_groups, self._example, self._search.paper_compat)
        if self._sharded:
            check_sharded_support(self._sites, self._search, self._objective, self._safety)

    def _start_recording(self) -> None:
        """Teleport hooks, reports, their tally, and the forward pre-hooks.

        With ``example_inputs`` the check probes those and the probe pre-hook is not registered: any
        forward hook takes a module off torch's fast call path (cost: ``docs/performance.md``).  A
        one-shot pre-hook (:class:`KeywordCheck`) reads the arguments of one training forward after
        construction and after each teleport instead.
        """
        self._hooks: OrderedDict[int, TeleportHook] = OrderedDict()
        self.reports: list[TeleportReport] = []
        self._tally = Tally()
        self._sparse_warned: set[str] = set()
        self._probe, self._precision = ProbeRecorder(), PrecisionRecorder()  # the latter: the training forward's autocast
        weakref.finalize(self, self._hook_target.register_forward_pre_hook(self._precision).remove)
        self._keywords = None if self._example is None else KeywordCheck(self._hook_target, self._example, self._probe)
        if self._keywords is not None:
            self._keywords.arm()  # one forward at a time: the keywords the training loop passes
        else:
            handle = self._hook_target.register_forward_pre_hook(self._probe, with_kwargs=True)
            weakref.finalize(self, handle.remove)  # the hook goes when the wrapper does

    def _make_engine(self) -> TeleportEngine:
        """The engine every teleport runs on: the papers' first-order one with ``paper_compat``."""
        config = EngineConfig(
            module=self._module,
            optimizer=self._lookahead.inner if self._lookahead.is_lookahead else self._base,
            objective=self._objective,
            search=self._search,
            safety=self._safety,
            policy=self._policy,
            loss_fn=self._loss_fn,
            generator=self._generator,
            seed=self._search.seed,
            trust_key=self.prefix + "trust_region",
            sharded=self._sharded,
            hook_target=self._hook_target,
        )
        return (PaperCompatEngine if self._search.paper_compat else TeleportEngine)(config, self._record)

    # ------------------------------------------------------------------ public API
    @property
    def module(self) -> nn.Module:
        """The (unwrapped) model."""
        return self._module

    @property
    def sites(self) -> list[Site] | None:
        """The continuous sites searched (``None`` until ``"auto"`` detection ran)."""
        return None if self._sites is None else list(self._sites)

    @property
    def schedule(self) -> Schedule:
        """The teleport schedule."""
        return self._schedule

    @property
    def search(self) -> SearchConfig:
        """The search settings."""
        return self._search

    @property
    def objective(self) -> Objective:
        """The teleport objective."""
        return self._objective

    @property
    def safety(self) -> SafetyConfig:
        """The safety settings."""
        return self._safety

    @property
    def state_policy(self) -> StatePolicy:
        """The optimizer-state policies."""
        return self._policy

    @property
    def record(self) -> TeleportRecord:
        """Steps, accepted teleports, rollbacks, the caps' backoff and the watch in progress."""
        return self._record

    def summary(self) -> str:
        """One line on what the teleports came to (:class:`~teleopt.teleport.report.Tally`), e.g. ``"12 teleports:
        8 accepted, 7 kept, 1 rolled back, 0 undone by the check, 4 declined"``; saved in ``state_dict``."""
        return self._tally.summary()

    def register_teleport_hook(self, hook: TeleportHook) -> RemovableHandle:
        """Call ``hook(wrapper, report)`` after every teleport, declined one and rollback.

        Owners of averaged copies (EMA, SWA, Lookahead slow weights) use
        ``report.apply_to(ema_model)`` on accepted reports and restore or re-sync
        on rollbacks.
        """
        if not callable(hook):
            raise TypeError("hook must be callable(wrapper, report)")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    @torch.no_grad()
    def teleport(self, closure: Callable[[], Any] | None = None, batch: Any = None, heldout_batch: Any = None) -> TeleportReport:
        """Teleport now and return the report (the base optimizer does not step).

        ``closure`` (torch's meaning: re-evaluates the same batch, returns the loss,
        fills ``.grad``) is called before the teleport, for the gradient and loss at
        w, and once more after it (verifying the loss and leaving ``.grad`` at the
        teleported point).  Both runs are under a forked RNG with the same seed
        (Dropout draws the same masks) and the model's outputs in them are compared
        (the first up to 8 rows of each output leaf).  ``batch`` (see
        :func:`teleopt.functional.as_batch`; keyword arguments too) is a teleport
        batch for the general path and for the check; it takes precedence over the
        closure for the check; without both, ``batch_fn()`` gives it.  With none, the check runs on probe inputs, and
        without those the teleport is declined.  Inside ``step()`` the closure runs
        once only: checks then use ``batch_fn`` or probe inputs (the closure's own
        forward is the last forward), and the general path leaves the teleport
        batch's gradient in ``.grad``.
        """
        seed = self._check_seed()
        outputs = None
        if batch is None and closure is None and self._batch_fn is not None:
            batch = self._batch_fn()  # an unscheduled teleport takes its batch where scheduled ones do
        if closure is None:
            loss = self._run_closure(closure)
        else:
            capture = OutputCapture()
            with capture.on(self._hook_target), seeded(self._module, seed):
                loss = self._run_closure(closure)
            outputs = capture.leaves
        heldout = self._heldout if heldout_batch is None else checked_batch(heldout_batch, "heldout_batch")
        request = TeleportRequest(loss, closure, checked_batch(batch, "batch"), heldout, seed=seed, closure_outputs=outputs)
        report, _ = self._teleport_now(request)
        return report

    @no_grad_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Teleport if scheduled (or roll back a teleport that went wrong), then step the base optimizer.  A base
        that evaluates the closure itself (``LBFGS``) gets it; a due teleport runs it once more for fresh gradients."""
        record = self._record
        # a quiet step (nothing to read, check or teleport; the base has state: not torch's initialising step)
        if closure is None and record.watch is None and not self.base_needs_closure and self.innermost.state:
            if self._schedule.quiet(record.step, record.accepted, REFERENCE_STEPS):  # two int comparisons, mostly
                record.read = None
                self._step_base()
                record.step += 1
                return None
        if torch_initialising_step(self):  # torch's lr-0 step creating the state: not a training step
            return self._step_base(closure, self._closure_before_step(closure))
        loss = self._closure_before_step(closure)  # None when the base evaluates the closure
        due = self._enabled() and self._schedule.due(record.step, record.accepted)
        if self.base_needs_closure and (due or record.watch is not None):
            loss = self._run_closure(closure)
        try:  # ||grad||^2 is read once: the lean balance takes the watch's or the sample's (record.read)
            if record.watch is None and self._schedule.soon(record.step, record.accepted, REFERENCE_STEPS):
                record.sample(self._grads())  # the watch's reference for the next teleport
            elif record.watch is not None and watch_fires(self, loss):
                with full_precision():
                    self._rollback_watch(record.step)
                record.step += 1
                return loss
            if due:  # lean balance where it can be (no batch_fn call), else the engine on batch_fn's batch
                scheduled_teleports(self, loss)
        finally:
            record.read = None
        loss = self._step_base(closure, loss)
        record.step += 1
        record.settle(self._safety.backoff)  # teleports that came through their watch window leave it
        return loss

    # ------------------------------------------------------------------ teleport
    def _enabled(self) -> bool:
        key = self.prefix + "enabled"
        for group in self.param_groups:  # a loop, not any() over a generator: this runs every step
            if group[key]:
                return True
        return False

    def _check_seed(self) -> int:
        """The RNG seed of this teleport's check forwards (from the seed and the counters, so resumable)."""
        record = self._record
        return (self._search.seed * 1_000_003 + 7_919 * record.step + record.accepted + 31 * record.rollbacks) % (1 << 62)

    def _probe_inputs(self) -> tuple[Batch | None, str]:
        """The probe inputs (``example_inputs``/``example_kwargs``, else the last forward's) and their source."""
        if self._example is not None:
            return self._example, "example_inputs"
        if self._probe.batch is not None:
            return self._probe.batch, "the last forward's inputs"
        return None, ""

    def _active_sites(self, batch: Batch | None) -> tuple[list[Site], dict[str, str]]:
        """The sites this teleport moves, and those left out with the reason."""
        if self._sites is None:
            inputs = self._example if self._example is not None else batch if batch is not None else self._probe.batch
            if inputs is None:
                raise ValueError(
                    "sites='auto' needs example inputs: pass example_inputs= to Teleport or a batch to teleport(), or run the model once"
                )
            with self._probe.pause():
                self._sites, self._auto_skipped = self._auto.detect(inputs, self.param_groups)
        return active_sites(self._sites, self._module, self.param_groups, self.prefix + "enabled", self._auto_skipped)

    def _teleport_now(self, request: TeleportRequest) -> tuple[TeleportReport, Any]:
        if (lean := BalanceCompanion.of(self).teleport(self, request)) is not None:  # closed-form balance, no passes
            return lean, request.loss
        if any(p.grad is not None and p.grad.requires_grad for p in self._param_list()):
            reason = (
                "declined: the gradients carry an autograd graph (backward(create_graph=True), as Adahessian needs); "
                "moving the parameters in place would invalidate the graph the base optimizer differentiates next"
            )
            report = TeleportReport(step=self._record.step, path="none", objective=self._objective.name, reason=reason)
            self._call_hooks(report)
            return report, request.loss
        if self._sharded:
            # FSDP2 leaves the root unsharded after a forward pass without backward; the teleport
            # reads and writes the shards the optimizer holds
            reshard(self._module)
        sites, skipped = self._active_sites(request.batch)
        movable = movable_sites(sites, self._module, self._sparse_warned)
        skipped.update({s.name: "a member has a sparse gradient" for s in sites if s not in movable})
        if self._keywords is not None:
            self._keywords.warn_if_different(stacklevel=4)
        probe, source = self._probe_inputs()
        request = replace(request, probe=probe, probe_source=source, skipped=skipped, precision=self._precision.training())
        # all or nothing up to the report (teleport.transaction), hooks after; group caches live for this teleport;
        # autocast never computes a teleport
        with self._probe.pause(), self._precision.pause(), full_precision(), GroupCache().active(), self._atomic() as transaction:
            report, loss = self._engine.run(movable, request, transaction)
            if report.accepted:
                restart_curvature_history(self.innermost)
                self._lookahead.follow(report, self._module)
        self._call_hooks(report)
        return report, loss

    def _atomic(self) -> Transaction:
        optimizers = (self._engine.config.optimizer, self.innermost, self._lookahead.slow_owner)
        atomic = Transaction.of(self._module, optimizers, self._record, self._generator)
        atomic.keep(self._lookahead, "_before")
        return atomic

    def _call_hooks(self, report: TeleportReport) -> None:
        self.reports.append(report)
        self._record.last = (report.step, report.accepted, report.shrink >= 1.0)
        self._tally.count(report)
        for hook in list(self._hooks.values()):
            hook(self, report)

    # ------------------------------------------------------------------ watch
    def _grads(self) -> list[Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _rollback_watch(self, step: int) -> None:
        rollback_watch(self, step)

    # ------------------------------------------------------------------ state
    def _param_list(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        return {}, {**self._record.to_state(self._generator.get_state()), "tally": self._tally.to_state()}

    def _check_loaded(
        self,
        saved_groups: Sequence[dict[str, Any]],
        current: list[dict[str, Any]],
        per_param: dict[int, dict[str, Any]],
        top: dict[str, Any],
    ) -> None:
        super()._check_loaded(saved_groups, current, per_param, top)
        check_groups(saved_groups, per_param, self.prefix, "Teleport.load_state_dict")
        check_record(top, self._module, self._param_list(), self._sites or (), "Teleport.load_state_dict")

    def _portable_state(self, top: dict[str, Any]) -> dict[str, Any]:
        # a snapshot watch (3x the parameters) stays out of the param group; the elements travel
        return {k: v for k, v in top.items() if not (k == "watch" and keeps_copies(v))}

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        if "rng" in top:
            self._generator.set_state(top["rng"].to(torch.uint8).cpu())
        self._tally = Tally.from_state(top.get("tally"))
        self._record.load_state(top, self._module, self._base, self._param_list(), self._policy, self._sites or ())

    def __repr__(self) -> str:
        n = "auto" if self._sites is None else len(self._sites)
        return f"Teleport({self._base!r}, sites={n}, objective={self._objective.name!r}, schedule={self._schedule!r})"
