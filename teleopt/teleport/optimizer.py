"""``Teleport``: symmetry teleportation as a drop-in ``torch.optim`` wrapper (papers/001 Algorithm 1).

::

    opt = teleopt.Teleport(torch.optim.AdamW(model.parameters()), model, sites, every=100)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # teleports before the update on schedule, then steps

On a schedule, ``step()`` moves the parameters along loss-invariant group orbits
to where the chosen objective is best (papers/001 Sec. 4.3, Ch. 5), moves
``.grad`` and the optimizer state consistently, checks that the loss did not
change, and then lets the base optimizer step from the teleported point.  See
:mod:`teleopt.teleport` for the paths, objectives, state policies and safety.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from teleopt.functional import Batch, LossFn, as_batch
from teleopt.site import Site
from teleopt.teleport.config import (
    Shortcuts,
    check_shortcuts,
    resolve_schedule,
    resolve_search,
    resolve_state_policy,
)
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import check_not_fsdp, unwrap
from teleopt.teleport.engine import EngineConfig, TeleportEngine, TeleportRequest
from teleopt.teleport.objectives import Objective, get_objective
from teleopt.teleport.paper_compat import PaperCompatEngine, check_paper_compat_sites
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.search import SearchConfig
from teleopt.teleport.sites import (
    check_model_matches_optimizer,
    detect_sites,
    normalization_affine,
    scale_free_updates,
    validate_sites,
)
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.watch import TeleportRecord
from teleopt.wrapper import OptimizerWrapper

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Teleport"]

TeleportHook = Callable[["Teleport", TeleportReport], None]


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Teleport needs the model (an nn.Module) whose parameters the optimizer updates, got {type(model).__name__}")
    check_not_fsdp(model)


def _check_safety(safety: Any) -> SafetyConfig:
    if safety is None:
        return SafetyConfig()
    if not isinstance(safety, SafetyConfig):
        raise TypeError(f"safety must be a SafetyConfig, got {type(safety).__name__}")
    return safety


def _check_seed(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"seed must be an int >= 0, got {value!r}")
    return value


def restart_curvature_history(optimizer: Optimizer) -> None:
    """Make an ``LBFGS`` start its curvature history afresh at its next step.

    ``LBFGS`` stores one flat history of steps and gradient differences; after a
    teleport those pairs belong to another point of the orbit, so the next step
    begins again from a scaled gradient step (``n_iter`` 0 is how ``LBFGS`` itself
    starts).  Other optimizers are left alone.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        for state in optimizer.state.values():
            state["n_iter"] = 0


class Teleport(OptimizerWrapper):
    """Symmetry teleportation around any ``torch.optim`` optimizer (papers/001 Algorithm 1, Ch. 5).

    Parameters
    ----------
    optimizer:
        The base optimizer; it keeps its param groups and state.
    model:
        The model whose parameters ``optimizer`` updates (DDP wrappers are unwrapped).
    sites:
        ``"auto"`` (the exact continuous sites ``teleopt.find_symmetries`` finds on the
        model; needs ``example_inputs`` or a first teleport batch; under optimizers with
        scale-free steps (Adam family, Adagrad, RMSprop, unmodelled ones) without the
        rescalings of normalisation layers' affine parameters, with a warning) or a list of
        :class:`~teleopt.site.Site` naming tensors of ``model.state_dict()``; sites act
        in list order.  Discrete sites (permutations, signs) are not searched.
    objective:
        ``"grad_norm"`` (default), ``"preconditioned_norm"``, ``"lookahead"``,
        ``"sharpness"``, ``"curvature"``, ``"balance"`` (least weight norm on the orbit, in
        closed form) or an :class:`~teleopt.teleport.objectives.Objective`.
    schedule:
        When to teleport (:class:`~teleopt.teleport.schedule.Schedule`); shortcuts
        ``every``, ``at``, ``when``, ``warmup``, ``batches``, ``max_teleports``.  Without
        ``every``/``at``/``when`` the objective's default applies: ``"balance"`` every 50
        steps from step 50; every other objective (the default ``"grad_norm"`` included)
        only when :meth:`teleport` is called.  No default teleports at step 0.
    search:
        How elements are chosen (:class:`~teleopt.teleport.search.SearchConfig`: ascent
        steps and step size, trust region, path, strategy); shortcuts ``ascent_steps``,
        ``ascent_lr``, ``trust_region`` (stored per param group as
        ``teleopt_teleport_trust_region``; default log 4) and ``path``.
    safety:
        :class:`~teleopt.teleport.safety.SafetyConfig` (caps, tolerances, watch).
    state_policy:
        What happens to the optimizer state (:class:`~teleopt.teleport.state_policy.StatePolicy`,
        or its ``policy`` argument); shortcut ``state_fallback``.
    loss_fn:
        ``loss_fn(model(*inputs), target)``, needed by the general path and by
        loss checks on explicit batches.
    batch_fn:
        ``batch_fn() -> (inputs, target)`` supplying teleport batches for scheduled
        teleports (general path, loss checks and the stability cap).
    heldout_batch:
        A batch on which invariance is also checked.
    example_inputs:
        Inputs for ``sites="auto"`` detection.
    paper_compat:
        Reproduce the papers' first-order, non-invariant teleport
        (:mod:`~teleopt.teleport.paper_compat`); for comparisons only.
    seed:
        Seed of the generator that draws the random directions of the sharpness
        and curvature objectives (its state is saved in ``state_dict``).
    """

    prefix = "teleopt_teleport_"

    def __init__(
        self,
        optimizer: Optimizer,
        model: nn.Module,
        sites: str | Sequence[Site] = "auto",
        *,
        objective: str | Objective = "grad_norm",
        schedule: Schedule | None = None,
        search: SearchConfig | None = None,
        safety: SafetyConfig | None = None,
        state_policy: StatePolicy | str | dict[str, str] | None = None,
        loss_fn: LossFn | None = None,
        batch_fn: Callable[[], Any] | None = None,
        heldout_batch: Any = None,
        example_inputs: Any = None,
        paper_compat: bool = False,
        seed: int = 0,
        **shortcuts: Unpack[Shortcuts],
    ) -> None:
        _check_model(model)
        check_shortcuts(shortcuts)
        search = resolve_search(search, shortcuts)
        super().__init__(optimizer, {"enabled": True, "trust_region": search.trust_region})
        self._module = unwrap(model)
        check_model_matches_optimizer(self._module, self.param_groups)
        self._objective = get_objective(objective)
        self._schedule = resolve_schedule(schedule, shortcuts, self._objective.default_schedule())
        self._search = search
        self._policy = resolve_state_policy(state_policy, shortcuts)
        self._set_data(loss_fn, batch_fn, heldout_batch, example_inputs)
        self._safety = _check_safety(safety)
        if self._objective.needs_optimizer_model:
            TeleportContext.build(self._module, optimizer, self._policy).model.require(f"objective {self._objective.name!r}")
        self._sites = self._initial_sites(sites, example_inputs, bool(paper_compat))
        self._seed = _check_seed(seed)
        self._generator = torch.Generator().manual_seed(self._seed)
        self._record = TeleportRecord()
        self._engine = self._make_engine(bool(paper_compat))
        self._hooks: OrderedDict[int, TeleportHook] = OrderedDict()
        self.reports: list[TeleportReport] = []

    def _make_engine(self, paper_compat: bool) -> TeleportEngine:
        """The engine every teleport runs on: the papers' first-order one with ``paper_compat``."""
        config = EngineConfig(
            module=self._module,
            optimizer=self._base,
            objective=self._objective,
            search=self._search,
            safety=self._safety,
            policy=self._policy,
            loss_fn=self._loss_fn,
            generator=self._generator,
            seed=self._seed,
            trust_key=self.prefix + "trust_region",
        )
        return (PaperCompatEngine if paper_compat else TeleportEngine)(config, self._record)

    def _set_data(self, loss_fn: LossFn | None, batch_fn: Callable[[], Any] | None, heldout_batch: Any, example_inputs: Any) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target) -> loss, got {type(loss_fn).__name__}")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable() -> (inputs, target), got {type(batch_fn).__name__}")
        if self._schedule.batches > 1 and batch_fn is None:
            raise ValueError(f"batches={self._schedule.batches} needs batch_fn to draw the teleport batches")
        self._loss_fn = loss_fn
        self._batch_fn = batch_fn
        self._heldout = None if heldout_batch is None else as_batch(heldout_batch)
        self._example_inputs = example_inputs

    def _initial_sites(self, sites: str | Sequence[Site], example_inputs: Any, paper_compat: bool) -> list[Site] | None:
        found: list[Site] | None = None
        if isinstance(sites, str):
            if sites != "auto":
                raise ValueError(f"sites must be 'auto' or a list of Site, got {sites!r}")
            if example_inputs is not None:
                found = self._detect(example_inputs)
        else:
            found = validate_sites(sites, self._module, self.param_groups, given=True)
        if paper_compat:
            if found is None:
                raise ValueError("paper_compat needs explicit GL sites (sites='auto' finds exact ones only)")
            check_paper_compat_sites(found)
        return found

    def _detect(self, inputs: Any) -> list[Site]:
        """``sites="auto"``: the detected exact continuous sites, less the normalisation-affine rescalings
        when the base optimizer's steps are scale-free (they collapsed a ViT under AdamW; see the class docs)."""
        found = detect_sites(self._module, self.param_groups, inputs)
        if not scale_free_updates(self.innermost):
            return found
        norm = [s.name for s in found if normalization_affine(s, self._module)]
        if norm:
            shown = ", ".join(norm[:3]) + (f" and {len(norm) - 3} more" if len(norm) > 3 else "")
            warnings.warn(
                f"Teleport(sites='auto') leaves out {len(norm)} normalisation-affine rescaling site(s) ({shown}): under "
                f"{type(self.innermost).__name__}, whose steps do not scale with the gradient, rescaling a norm's gain "
                "changes its effective learning rate (it collapsed a ViT under AdamW). Pass the sites explicitly to "
                "include them.",
                stacklevel=4,
            )
        left_out = set(norm)
        return [s for s in found if s.name not in left_out]

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

    @property
    def _step_count(self) -> int:
        return self._record.step

    @property
    def _backoff(self) -> float:
        return self._record.backoff

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
        teleported point).  ``batch`` is a teleport batch for the general path and
        for loss checks (with ``loss_fn``).  Inside ``step()`` the closure runs once
        only: checks then need ``batch_fn``, and the general path leaves the
        teleport batch's gradient in ``.grad``.
        """
        loss = self._run_closure(closure)
        heldout = self._heldout if heldout_batch is None else as_batch(heldout_batch)
        report, _ = self._teleport_now(TeleportRequest(loss, closure, None if batch is None else as_batch(batch), heldout))
        return report

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Teleport if scheduled (or roll back a teleport that went wrong), then step the base optimizer.

        A base that evaluates the closure itself (``LBFGS``) gets it; when a teleport is
        due, the closure runs once more beforehand so the teleport sees fresh gradients.
        """
        loss = self._closure_before_step(closure)  # None when the base evaluates the closure
        record = self._record
        due = self._enabled() and self._schedule.due(record.step, record.accepted)
        if self.base_needs_closure and (due or record.watch is not None):
            loss = self._run_closure(closure)
        if record.watch is not None and record.watch.triggered(self._grads(), loss, self._safety.watch_factor):
            self._rollback_watch(record.step)
            record.step += 1
            return loss
        if due:
            for _ in range(self._schedule.batches):
                batch = None if self._batch_fn is None else as_batch(self._batch_fn())
                # the closure already ran once (torch's contract: at most once per step)
                self._teleport_now(TeleportRequest(loss, None, batch, self._heldout))
        loss = self._step_base(closure, loss)
        record.step += 1
        if record.watch is not None and record.step > record.watch.until:
            # a teleport that came through its watch undoes one backoff: a rollback is not permanent
            record.watch = None
            record.backoff = min(1.0, record.backoff / self._safety.backoff)
        return loss

    # ------------------------------------------------------------------ teleport
    def _enabled(self) -> bool:
        return any(bool(self.group_value(g, "enabled")) for g in self.param_groups)

    def _active_sites(self, batch: Batch | None) -> list[Site]:
        if self._sites is None:
            inputs = self._example_inputs if self._example_inputs is not None else (None if batch is None else batch[0])
            if inputs is None:
                raise ValueError("sites='auto' needs example inputs: pass example_inputs= to Teleport or a batch to teleport()")
            self._sites = self._detect(inputs)
        enabled = {id(p) for g in self.param_groups if self.group_value(g, "enabled") for p in g["params"]}
        params = dict(self._module.named_parameters())
        return [s for s in self._sites if all(n not in params or id(params[n]) in enabled for n in s.tensor_names)]

    def _teleport_now(self, request: TeleportRequest) -> tuple[TeleportReport, Any]:
        report, loss = self._engine.run(self._active_sites(request.batch), request)
        if report.accepted:
            restart_curvature_history(self.innermost)
        self._call_hooks(report)
        return report, loss

    def _call_hooks(self, report: TeleportReport) -> None:
        self.reports.append(report)
        for hook in list(self._hooks.values()):
            hook(self, report)

    # ------------------------------------------------------------------ watch
    def _grads(self) -> list[Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    def _rollback_watch(self, step: int) -> None:
        record = self._record
        watch = record.watch
        assert watch is not None
        watch.snapshot.restore()
        for p in self._param_list():
            p.grad = None
        record.watch = None
        record.rollbacks += 1
        record.backoff *= self._safety.backoff
        report = TeleportReport(step=step, path="watch", objective=self._objective.name, sites=list(self._sites or []))
        report.reason = (
            f"rolled back after {step - watch.teleport_step} step(s): {watch.why}; parameters and optimizer state "
            f"restored to before the teleport at step {watch.teleport_step}, caps scaled by {record.backoff:g}"
        )
        self._call_hooks(report)

    # ------------------------------------------------------------------ state
    def _param_list(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        return {}, self._record.to_state(self._generator.get_state())

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        if "rng" in top:
            self._generator.set_state(top["rng"].to(torch.uint8).cpu())
        self._record.load_state(top, self._module, self._base, self._param_list())

    def __repr__(self) -> str:
        n = "auto" if self._sites is None else len(self._sites)
        return f"Teleport({self._base!r}, sites={n}, objective={self._objective.name!r}, schedule={self._schedule!r})"
