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

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from teleopt.site import Site, lookup_tensor
from teleopt.teleport import distributed
from teleopt.teleport.ascent import ascend, shrink_to_feasible
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import zero_coordinates
from teleopt.teleport.fast_path import FastEvaluator, fast_path_eligible, member_tensors
from teleopt.functional import FunctionalModel, LossFn, as_batch
from teleopt.teleport.general_path import GeneralEvaluator
from teleopt.teleport.objectives import Objective, get_objective
from teleopt.teleport.paper_compat import check_paper_compat_sites, paper_compat_teleport
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import SafetyConfig, Snapshot, default_loss_tol, preconditioned_sharpness
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transport import transport
from teleopt.wrapper import OptimizerWrapper

__all__ = ["Teleport"]

Path = Literal["auto", "fast", "general"]
TeleportHook = Callable[["Teleport", TeleportReport], None]


def _check_int(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _check_float(value: Any, what: str, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a positive finite number{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


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
        model; needs ``example_inputs`` or a first teleport batch) or a list of
        :class:`~teleopt.site.Site` naming tensors of ``model.state_dict()``; sites act
        in list order.  Discrete sites (permutations, signs) are not searched.
    objective:
        ``"grad_norm"`` (default), ``"preconditioned_norm"``, ``"lookahead"``,
        ``"sharpness"``, ``"curvature"`` or an :class:`~teleopt.teleport.objectives.Objective`.
    every, at, when, warmup, batches, max_teleports:
        The schedule (:class:`~teleopt.teleport.schedule.Schedule`); none of
        ``every``/``at``/``when`` means teleports happen only when
        :meth:`teleport` is called.  Alternatively pass ``schedule=``.
    ascent_steps, ascent_lr:
        Projected Adam on the group coordinates: number of steps and step size
        (in coordinates, e.g. log-scales).
    trust_region:
        Bound on the coordinates (|log-scale| <= r, spectral norm of GL
        generators <= r); stored per param group as ``teleopt_teleport_trust_region``
        (a site uses the smallest over its parameters' groups).  Default log 4.
    state_policy, state_fallback:
        Optimizer-state policies (:class:`~teleopt.teleport.state_policy.StatePolicy`).
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
    path:
        ``"auto"`` (fast when every site and the objective allow it), ``"fast"`` or ``"general"``.
    safety:
        :class:`~teleopt.teleport.safety.SafetyConfig` (caps, tolerances, watch).
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
        every: int | None = None,
        at: Sequence[int] | None = None,
        when: Callable[[int], bool] | None = None,
        warmup: int = 0,
        batches: int = 1,
        max_teleports: int | None = None,
        schedule: Schedule | None = None,
        ascent_steps: int = 100,
        ascent_lr: float = 0.2,
        trust_region: float | None = math.log(4),
        state_policy: str | dict[str, str] | None = None,
        state_fallback: str | dict[str, str] | None = None,
        loss_fn: LossFn | None = None,
        batch_fn: Callable[[], Any] | None = None,
        heldout_batch: Any = None,
        example_inputs: Any = None,
        path: Path = "auto",
        safety: SafetyConfig | None = None,
        paper_compat: bool = False,
        seed: int = 0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Teleport needs the model (an nn.Module) whose parameters the optimizer updates, got {type(model).__name__}")
        distributed.check_not_fsdp(model)
        _check_float(trust_region, "trust_region", allow_none=True)
        super().__init__(optimizer, {"enabled": True, "trust_region": trust_region})
        self._module = distributed.unwrap(model)
        self._check_model_matches_optimizer()
        if schedule is None:
            schedule = Schedule(every=every, at=at, when=when, warmup=warmup, batches=batches, max_teleports=max_teleports)
        elif not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a teleopt Schedule, got {type(schedule).__name__}")
        elif any(v is not None for v in (every, at, when, max_teleports)) or warmup or batches != 1:
            raise ValueError("give either schedule= or every/at/when/warmup/batches/max_teleports, not both")
        self._schedule = schedule
        self._objective = get_objective(objective)
        self._ascent_steps = _check_int(ascent_steps, "ascent_steps", 0)
        self._ascent_lr = _check_float(ascent_lr, "ascent_lr")
        self._policy = StatePolicy(state_policy, state_fallback)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target) -> loss, got {type(loss_fn).__name__}")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable() -> (inputs, target), got {type(batch_fn).__name__}")
        if schedule.batches > 1 and batch_fn is None:
            raise ValueError(f"batches={schedule.batches} needs batch_fn to draw the teleport batches")
        self._loss_fn = loss_fn
        self._batch_fn = batch_fn
        self._heldout = None if heldout_batch is None else as_batch(heldout_batch)
        if path not in ("auto", "fast", "general"):
            raise ValueError(f"path must be 'auto', 'fast' or 'general', got {path!r}")
        self._path = path
        if safety is None:
            safety = SafetyConfig()
        elif not isinstance(safety, SafetyConfig):
            raise TypeError(f"safety must be a SafetyConfig, got {type(safety).__name__}")
        self._safety = safety
        self._paper_compat = bool(paper_compat)
        if self._objective.needs_optimizer_model:
            TeleportContext.build(self._module, optimizer, self._policy).model.require(f"objective {self._objective.name!r}")
        self._example_inputs = example_inputs
        self._sites: list[Site] | None = None
        if isinstance(sites, str):
            if sites != "auto":
                raise ValueError(f"sites must be 'auto' or a list of Site, got {sites!r}")
            if example_inputs is not None:
                self._sites = self._detect(example_inputs)
        else:
            self._sites = self._validate_sites(sites, given=True)
        if self._paper_compat:
            if self._sites is None:
                raise ValueError("paper_compat needs explicit GL sites (sites='auto' finds exact ones only)")
            check_paper_compat_sites(self._sites)
        self._seed = _check_int(seed, "seed", 0)
        self._generator = torch.Generator().manual_seed(self._seed)
        self._step_count = 0
        self._accepted = 0
        self._rollbacks = 0
        self._backoff = 1.0
        self._watch: dict[str, Any] | None = None
        self._hooks: OrderedDict[int, TeleportHook] = OrderedDict()
        self.reports: list[TeleportReport] = []

    # ------------------------------------------------------------------ set-up checks
    def _check_model_matches_optimizer(self) -> None:
        optimized = {id(p) for g in self.param_groups for p in g["params"]}
        params = list(self._module.parameters())
        if not params or not any(id(p) in optimized for p in params):
            raise ValueError(
                f"the optimizer does not update any parameter of the model ({type(self._module).__name__}): "
                "pass the model whose parameters were given to the optimizer"
            )

    def _resolve_name(self, name: str) -> str:
        try:
            lookup_tensor(self._module, name)
            return name
        except KeyError:
            if name.startswith("module."):
                return self._resolve_name(name[len("module.") :])
            raise ValueError(f"site member {name!r} is not a parameter or buffer of {type(self._module).__name__}") from None

    def _validate_sites(self, sites: Sequence[Site], given: bool) -> list[Site]:
        if isinstance(sites, (str, Site)) or not isinstance(sites, Sequence):
            raise TypeError(f"sites must be 'auto' or a list of Site, got {type(sites).__name__}")
        optimized = {id(p) for g in self.param_groups for p in g["params"]}
        params = {n: p for n, p in self._module.named_parameters()}
        out = []
        for site in sites:
            if not isinstance(site, Site):
                raise TypeError(f"sites must contain teleopt Site objects, got {type(site).__name__}")
            if not site.action.continuous:
                if given:
                    raise ValueError(
                        f"site {site.name!r} has a discrete group ({site.action.group_name}): Teleport searches "
                        "continuous groups by ascent on Lie-algebra coordinates"
                    )
                continue
            members = tuple(None if m is None else self._resolve_name(m) for m in site.members)
            if members != site.members:
                site = Site(site.action, members, site.name, site.data_input, dict(site.info))
            devices, dtypes = set(), set()
            for m in site.tensor_names:
                t = lookup_tensor(self._module, m)
                devices.add(t.device)
                dtypes.add(t.dtype)
                if m in params:
                    p = params[m]
                    if not p.requires_grad:
                        raise ValueError(f"site {site.name!r} acts on the frozen parameter {m!r} (requires_grad=False)")
                    if id(p) not in optimized:
                        raise ValueError(f"site {site.name!r}: parameter {m!r} is not updated by the optimizer")
                if not t.is_floating_point():
                    raise TypeError(f"site {site.name!r}: member {m!r} has dtype {t.dtype}; teleports need floating point")
            if len(devices) > 1:
                raise ValueError(f"site {site.name!r} has members on several devices ({sorted(map(str, devices))}); move them to one")
            if len(dtypes) > 1:
                raise ValueError(f"site {site.name!r} mixes dtypes ({sorted(map(str, dtypes))}); teleports need one dtype per site")
            if site.action.needs_data and site.data_input is None:
                raise ValueError(f"site {site.name!r} is data-dependent but names no data_input module")
            site.action.group(site.tensors(self._module))  # shape check, raises ValueError on mismatch
            out.append(site)
        return out

    def _detect(self, example_inputs: Any) -> list[Site]:
        try:
            from teleopt.detection import find_symmetries
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ImportError("sites='auto' needs teleopt.detection (find_symmetries); pass a list of sites instead") from exc
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        found = find_symmetries(self._module, inputs)
        # exact sites only: an approximate site (BatchNorm input scaling, exact up to eps) would fail the
        # invariance post-condition; pass such sites explicitly with a loss tolerance
        return self._validate_sites([s for s in found.sites if s.action.exactness == "exact"], given=False)

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
    def objective(self) -> Objective:
        """The teleport objective."""
        return self._objective

    @property
    def safety(self) -> SafetyConfig:
        """The safety settings."""
        return self._safety

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
        report, _ = self._teleport_now(loss, closure, None if batch is None else as_batch(batch), heldout)
        return report

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Teleport if scheduled (or roll back a teleport that went wrong), then step the base optimizer."""
        loss = self._run_closure(closure)
        t = self._step_count
        if self._watch is not None and self._watch_triggered(loss):
            self._rollback_watch(t)
            self._step_count += 1
            return loss
        if self._enabled() and self._schedule.due(t, self._accepted):
            for _ in range(self._schedule.batches):
                batch = None if self._batch_fn is None else as_batch(self._batch_fn())
                # the closure already ran once (torch's contract: at most once per step)
                self._teleport_now(loss, None, batch, self._heldout)
        self._base.step()
        self._step_count += 1
        if self._watch is not None and self._step_count > self._watch["until"]:
            self._watch = None
        return loss

    # ------------------------------------------------------------------ teleport
    def _enabled(self) -> bool:
        return any(bool(self.group_value(g, "enabled")) for g in self.param_groups)

    def _active_sites(self, batch: Any) -> list[Site]:
        if self._sites is None:
            inputs = self._example_inputs if self._example_inputs is not None else (None if batch is None else batch[0])
            if inputs is None:
                raise ValueError("sites='auto' needs example inputs: pass example_inputs= to Teleport or a batch to teleport()")
            self._sites = self._detect(inputs)
        enabled = {id(p) for g in self.param_groups if self.group_value(g, "enabled") for p in g["params"]}
        params = dict(self._module.named_parameters())
        return [s for s in self._sites if all(n not in params or id(params[n]) in enabled for n in s.tensor_names)]

    def _trust_region(self, site: Site, ctx: TeleportContext) -> float | None:
        radii = [self.group_value(ctx.groups[n], "trust_region") for n in site.tensor_names if n in ctx.groups]
        radii = [r for r in radii if r is not None]
        if not radii:
            return None
        return float(min(radii)) * self._backoff

    def _call_hooks(self, report: TeleportReport) -> None:
        self.reports.append(report)
        for hook in list(self._hooks.values()):
            hook(self, report)

    def _teleport_now(
        self, loss: Any, closure: Callable[[], Any] | None, batch: Any, heldout: Any
    ) -> tuple[TeleportReport, Any]:
        start = time.perf_counter()
        sites = self._active_sites(batch)
        objective = self._objective
        fast_ok = bool(sites) and all(fast_path_eligible(s) for s in sites) and not objective.needs_batch
        path = "paper_compat" if self._paper_compat else (("fast" if fast_ok else "general") if self._path == "auto" else self._path)
        report = TeleportReport(step=self._step_count, path=path, objective=objective.name, sites=sites)
        if not sites:
            report.reason = "declined: no active continuous sites"
            self._call_hooks(report)
            return report, loss
        if path == "fast" and not fast_ok:
            bad = [s.name for s in sites if not fast_path_eligible(s)]
            why = f"sites {bad} are not exact linear sites" if bad else f"objective {objective.name!r} needs a batch"
            raise ValueError(f"path='fast' is not possible: {why}; use path='general' with a batch")
        if path != "fast" and batch is None:
            needs = "paper_compat" if path == "paper_compat" else (
                f"objective {objective.name!r}" if objective.needs_batch else f"sites {[s.name for s in sites if not fast_path_eligible(s)]}"
            )
            raise ValueError(
                f"{needs} need(s) a teleport batch (the general path evaluates the model on it): pass "
                "teleport(batch=(inputs, target)) or Teleport(..., batch_fn=...)"
            )
        if batch is not None and path != "fast":
            batch = distributed.broadcast_batch(batch)
        ctx = TeleportContext.build(self._module, self._base, self._policy)
        # the loss the post-condition compares: on the teleport batch when there is one, else the closure's
        fmodel = None if batch is None else FunctionalModel(self._module, self._loss_fn)
        loss0 = float(fmodel.loss({}, batch)) if fmodel is not None else (None if loss is None else float(loss))
        heldout_model = None if heldout is None else FunctionalModel(self._module, self._loss_fn)
        if heldout_model is not None:
            report.heldout_before = float(heldout_model.loss({}, heldout))
        report.loss_before = loss0

        if path == "paper_compat":
            return self._paper_compat_teleport(sites, ctx, fmodel, batch, closure, report, start)

        if path == "fast":
            if not ctx.grads({n for s in sites for n in s.tensor_names}):
                if batch is None:
                    report.reason = "declined: no gradients (call backward first, or pass a closure or batch)"
                    self._call_hooks(report)
                    return report, loss
                self._gradients_from_batch(ctx, fmodel, batch)  # type: ignore[arg-type]
            needs_decrease = objective.needs_optimizer_model or (
                self._safety.max_predicted_decrease is not None and loss0 is not None and ctx.model.supported
            )
            evaluator: Any = FastEvaluator(sites, ctx, with_decrease=needs_decrease)
        else:
            evaluator = GeneralEvaluator(sites, ctx, batch, self._loss_fn)

        # search
        device = next(ctx.tensors[n] for n in sites[0].tensor_names).device
        like = {n: ctx.tensors[n] for s in sites for n in s.tensor_names}
        groups = [s.action.group(member_tensors(s, like)) for s in sites]
        coords0 = [zero_coordinates(s, g, device) for s, g in zip(sites, groups)]
        prepared = objective.prepare(evaluator, self._generator)
        identity = [c.clone() for c in coords0]
        with torch.enable_grad():
            n0 = float(evaluator.grad_norm_sq(evaluator.elements(identity)).detach())
        report.grad_norm_before = math.sqrt(n0)
        result = ascend(
            lambda xs: objective.score(evaluator, evaluator.elements(xs), prepared),
            coords0,
            groups,
            self._ascent_steps,
            self._ascent_lr,  # type: ignore[arg-type]
            [self._trust_region(s, ctx) for s in sites],
        )
        report.objective_before = result.score_start if objective.direction == "increase" else -result.score_start
        dec0 = None
        if self._safety.max_predicted_decrease is not None and loss0 is not None and ctx.model.supported and loss0 > self._safety.loss_floor:
            with torch.enable_grad():
                dec0 = float(evaluator.first_order_decrease(evaluator.elements(identity)).detach())
        stability = self._stability_check(evaluator, ctx, fmodel, batch, identity, report)
        coords, shrink = shrink_to_feasible(result.coords, lambda xs: self._feasible(evaluator, xs, n0, dec0, loss0, stability))
        coords = self._sync_coords(coords)
        report.shrink = shrink
        report.coordinate_norms = {s.name: float(c.abs().max()) if c.numel() else 0.0 for s, c in zip(sites, coords)}
        if all(float(c.abs().max()) == 0.0 for c in coords if c.numel()):
            report.reason = "declined: the caps allow no move" if shrink == 0.0 else "declined: no improvement found"
            report.time_s = time.perf_counter() - start
            self._call_hooks(report)
            return report, loss
        with torch.enable_grad():
            elements = [e.detach() for e in evaluator.elements(coords)]
            report.objective_after = float(objective.value(evaluator, elements, prepared).detach())
            if path == "fast":
                report.grad_norm_after = math.sqrt(float(evaluator.grad_norm_sq(elements).detach()))
                report.site_gains = self._site_gains(evaluator, elements, n0)
        report.elements = {s.name: e.to(torch.float64) for s, e in zip(sites, elements)}

        # apply, check, maybe roll back
        snapshot = self._snapshot(ctx, sites)
        if path == "fast":
            decisions = self._apply_fast(ctx, sites, elements)
        else:
            decisions = self._apply_general(ctx, evaluator, elements)
        report.state_decisions = dict(decisions)
        loss = self._post_check(report, ctx, sites, fmodel, batch, heldout_model, heldout, closure, loss, path, snapshot)
        report.time_s = time.perf_counter() - start
        self._call_hooks(report)
        return report, loss

    def _gradients_from_batch(self, ctx: TeleportContext, fmodel: FunctionalModel, batch: Any) -> None:
        names = list(ctx.trainable)
        with torch.enable_grad():
            tensors = {n: ctx.trainable[n].detach().requires_grad_(True) for n in names}
            loss = fmodel.loss(tensors, batch)
            grads = torch.autograd.grad(loss, [tensors[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            ctx.trainable[n].grad = torch.zeros_like(ctx.trainable[n]) if g is None else g.detach()

    def _stability_check(
        self, evaluator: Any, ctx: TeleportContext, fmodel: FunctionalModel | None, batch: Any, identity: list[Tensor], report: TeleportReport
    ) -> tuple[Callable[[Sequence[Tensor]], float], float] | None:
        """(sharpness of a candidate, cap) for ``SafetyConfig.stability_margin``, or None when off or impossible."""
        safety = self._safety
        if safety.stability_margin is None or fmodel is None or not ctx.model.supported:
            return None
        threshold = min(ctx.model.stability_threshold(ctx.groups[n]) for n in ctx.trainable)
        generator = torch.Generator().manual_seed(self._seed + 7919 * (self._accepted + 1))
        warm: dict[str, Any] = {"v": None}

        def sharpness(coords: Sequence[Tensor]) -> float:
            params, P = evaluator.next_step_point(evaluator.elements(coords))
            lam, warm["v"] = preconditioned_sharpness(
                lambda tensors: fmodel.loss(tensors, batch), params, P, safety.stability_iterations, generator, warm["v"]
            )
            return lam

        with torch.enable_grad():
            report.sharpness_before = sharpness(identity)
        cap = max(safety.stability_margin * self._backoff * threshold, report.sharpness_before)
        return sharpness, cap

    def _feasible(
        self,
        evaluator: Any,
        coords: Sequence[Tensor],
        n0: float,
        dec0: float | None,
        loss0: float | None,
        stability: tuple[Callable[[Sequence[Tensor]], float], float] | None = None,
    ) -> bool:
        """The caps of :class:`SafetyConfig` at ``coords`` (``dec0``: predicted decrease at the identity)."""
        safety = self._safety
        if stability is not None:
            sharpness, cap = stability
            with torch.enable_grad():
                if not sharpness(coords) <= cap:
                    return False
        with torch.enable_grad():
            elements = evaluator.elements(coords)
            if safety.max_gain is not None:
                n = float(evaluator.grad_norm_sq(elements).detach())
                if not n <= safety.max_gain * n0:
                    return False
            if dec0 is not None and loss0 is not None:
                # at most the cap, or what the current point already has (the identity stays feasible)
                cap = max(safety.max_predicted_decrease * self._backoff * (loss0 - safety.loss_floor), dec0)  # type: ignore[operator]
                if not float(evaluator.first_order_decrease(elements).detach()) <= cap:
                    return False
        return True

    @staticmethod
    def _site_gains(evaluator: FastEvaluator, elements: list[Tensor], n0: float) -> dict[str, float | None]:
        if n0 == 0:
            return {s.name: None for s in evaluator.sites}
        return {s.name: evaluator.site_gain(i, e, n0) for i, (s, e) in enumerate(zip(evaluator.sites, elements))}

    def _sync_coords(self, coords: list[Tensor]) -> list[Tensor]:
        distributed.broadcast_(coords)
        return coords

    def _snapshot(self, ctx: TeleportContext, sites: list[Site]) -> Snapshot:
        """Everything a rollback restores: all tensors and state with the watch on, else the site members."""
        params = [p for g in self.param_groups for p in g["params"]]
        if self._safety.watch_steps > 0:
            return Snapshot(dict(ctx.tensors), self._base, params, grads=True)
        names = {n for s in sites for n in s.tensor_names}
        member_ids = {id(ctx.tensors[n]) for n in names}
        return Snapshot({n: ctx.tensors[n] for n in names}, self._base, [p for p in params if id(p) in member_ids], grads=True)

    def _apply_fast(self, ctx: TeleportContext, sites: list[Site], elements: list[Tensor]) -> Counter:
        names = {n for s in sites for n in s.tensor_names}
        like = {n: ctx.tensors[n] for n in names}
        grads = ctx.grads(names)
        states = ctx.states(names)
        moved_grads, _ = transport(sites, elements, grads, like, "covector")
        moved_state = self._policy.move(self._base, sites, elements, states, like, ctx.groups)
        new_params, _ = transport(sites, elements, like, like, "params")
        for n, t in like.items():
            t.copy_(new_params[n])
        for n, g in moved_grads.items():
            ctx.trainable[n].grad.copy_(g)  # type: ignore[union-attr]
        StatePolicy.write(states, moved_state)
        return Counter(d for dec in moved_state.decisions.values() for d in dec.values())

    def _apply_general(self, ctx: TeleportContext, evaluator: GeneralEvaluator, elements: list[Tensor]) -> Counter:
        sites = evaluator.sites
        names = evaluator.names
        like = evaluator.like
        states = ctx.states(names)
        with torch.enable_grad():
            new_params = evaluator.params(elements)
        moved_state = self._policy.move(self._base, sites, elements, states, like, ctx.groups)
        for n in names:
            ctx.tensors[n].copy_(new_params[n].detach())
        distributed.broadcast_([ctx.tensors[n] for n in sorted(names)])
        StatePolicy.write(states, moved_state)
        return Counter(d for dec in moved_state.decisions.values() for d in dec.values())

    def _fresh_gradients(self, ctx: TeleportContext, fmodel: FunctionalModel, batch: Any) -> None:
        """Replace ``.grad`` by the gradient at the (new) live point on ``batch`` (general path)."""
        had = [n for n, p in ctx.trainable.items() if p.grad is not None]
        if not had:
            return
        self._gradients_from_batch(ctx, fmodel, batch)
        distributed.all_reduce_mean_([ctx.trainable[n].grad for n in had])  # type: ignore[misc]

    def _post_check(
        self,
        report: TeleportReport,
        ctx: TeleportContext,
        sites: list[Site],
        fmodel: FunctionalModel | None,
        batch: Any,
        heldout_model: FunctionalModel | None,
        heldout: Any,
        closure: Callable[[], Any] | None,
        loss: Any,
        path: str,
        snapshot: Snapshot,
    ) -> Any:
        names = {n for s in sites for n in s.tensor_names}
        reasons = []
        dtype = ctx.tensors[next(iter(names))].dtype
        tol = self._safety.loss_tol if self._safety.loss_tol is not None else default_loss_tol(dtype)
        moved = [ctx.tensors[n] for n in names]
        moved += [ctx.trainable[n].grad for n in names if n in ctx.trainable and ctx.trainable[n].grad is not None]  # type: ignore[misc]
        # one vectorised pass, no temporaries: NaN and inf propagate through a sum (an overflowing sum of
        # finite entries would only cause a needless rollback)
        if not all(bool(torch.isfinite(t.detach().sum())) for t in moved if t.numel()):
            reasons.append("non-finite parameters or gradients")
        loss_after = None
        if fmodel is not None:
            loss_after = float(FunctionalModel(self._module, self._loss_fn).loss({}, batch))
        if path != "fast" and closure is not None:
            with _buffers_restored(self._module):
                loss = self._run_closure(closure)
            if fmodel is None and loss is not None:
                loss_after = float(loss)
        elif path != "fast" and fmodel is not None:
            self._fresh_gradients(ctx, fmodel, batch)
        elif closure is not None and fmodel is None:
            with _buffers_restored(self._module):
                loss = self._run_closure(closure)
            loss_after = None if loss is None else float(loss)
        report.loss_after = loss_after
        if report.loss_before is not None and loss_after is not None:
            drift = abs(loss_after - report.loss_before) / max(abs(report.loss_before), 1e-300)
            if not drift <= tol:
                reasons.append(f"loss changed by {drift:.2e} (relative) > tolerance {tol:.1e}")
        if heldout_model is not None:
            report.heldout_after = float(FunctionalModel(self._module, self._loss_fn).loss({}, heldout))
            htol = self._safety.heldout_tol
            if htol is None and all(s.action.exactness == "exact" and not s.action.needs_data for s in sites):
                htol = tol
            if htol is not None and report.heldout_before is not None:
                hdrift = abs(report.heldout_after - report.heldout_before) / max(abs(report.heldout_before), 1e-300)
                if not hdrift <= htol:
                    reasons.append(f"held-out loss changed by {hdrift:.2e} (relative) > tolerance {htol:.1e}")
        if report.grad_norm_after is None:
            grads = [ctx.trainable[n].grad for n in ctx.trainable if ctx.trainable[n].grad is not None]
            if grads:
                report.grad_norm_after = float(torch.sqrt(sum(g.to(torch.float64).square().sum() for g in grads)))  # type: ignore[misc]
        device = next(iter(moved)).device
        if distributed.any_rank(bool(reasons), device=device if device.type != "cpu" else None):
            snapshot.restore()
            report.accepted = False
            report.reason = "rolled back: " + ("; ".join(reasons) if reasons else "another rank's post-condition failed")
            return loss
        report.accepted = True
        report.reason = "accepted"
        self._accepted += 1
        if self._safety.watch_steps > 0:
            self._watch = {
                "snapshot": snapshot,
                "until": self._step_count + self._safety.watch_steps,
                "teleport_step": self._step_count,
                "grad_ref": max(report.grad_norm_before or 0.0, report.grad_norm_after or 0.0) ** 2,
                "loss_ref": report.loss_before,
            }
        return loss

    def _paper_compat_teleport(
        self,
        sites: list[Site],
        ctx: TeleportContext,
        fmodel: FunctionalModel | None,
        batch: Any,
        closure: Callable[[], Any] | None,
        report: TeleportReport,
        start: float,
    ) -> tuple[TeleportReport, Any]:
        assert fmodel is not None
        live = {n: ctx.tensors[n] for n in ctx.trainable}
        for s in sites:
            live.update({n: ctx.tensors[n] for n in s.tensor_names})
        paper_compat_teleport(fmodel, sites, batch, list(ctx.trainable), live, self._ascent_steps, self._ascent_lr)  # type: ignore[arg-type]
        report.loss_after = float(FunctionalModel(self._module, self._loss_fn).loss({}, batch))
        loss: Any = report.loss_after
        if closure is not None:
            with _buffers_restored(self._module):
                loss = self._run_closure(closure)
        else:
            self._fresh_gradients(ctx, fmodel, batch)
        report.accepted = True
        report.reason = "accepted (paper_compat: not loss-preserving, no checks)"
        self._accepted += 1
        report.time_s = time.perf_counter() - start
        self._call_hooks(report)
        return report, loss

    # ------------------------------------------------------------------ watch
    def _watch_triggered(self, loss: Any) -> bool:
        watch = self._watch
        assert watch is not None
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        why = None
        if grads:
            norms = torch.stack([n.to(torch.float64).cpu() for n in torch._foreach_norm(grads)])
            sq = float(norms.square().sum())
            if not math.isfinite(sq):
                why = "non-finite gradient"
            elif watch["grad_ref"] > 0 and sq > self._safety.watch_factor * watch["grad_ref"]:
                why = f"squared gradient norm grew to {sq / watch['grad_ref']:.1f}x its value at the teleport"
        if why is None and loss is not None and watch["loss_ref"] is not None:
            value = float(loss)
            if not math.isfinite(value):
                why = "non-finite loss"
            elif watch["loss_ref"] > 0 and value > self._safety.watch_factor * watch["loss_ref"]:
                why = f"loss grew to {value / watch['loss_ref']:.1f}x its pre-teleport value"
        device = grads[0].device if grads else None
        triggered = distributed.any_rank(why is not None, device=device if device is not None and device.type != "cpu" else None)
        if triggered:
            watch["why"] = why or "another rank's watch triggered"
        return triggered

    def _rollback_watch(self, step: int) -> None:
        watch = self._watch
        assert watch is not None
        watch["snapshot"].restore()
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None
        self._watch = None
        self._rollbacks += 1
        self._backoff *= self._safety.backoff
        report = TeleportReport(step=step, path="watch", objective=self._objective.name, sites=list(self._sites or []))
        report.reason = (
            f"rolled back after {step - watch['teleport_step']} step(s): {watch['why']}; parameters and optimizer state "
            f"restored to before the teleport at step {watch['teleport_step']}, caps scaled by {self._backoff:g}"
        )
        self._call_hooks(report)

    # ------------------------------------------------------------------ state
    def _param_list(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        top: dict[str, Any] = {
            "step": self._step_count,
            "accepted": self._accepted,
            "rollbacks": self._rollbacks,
            "backoff": self._backoff,
            "rng": self._generator.get_state(),
        }
        if self._watch is not None:
            top["watch"] = {
                "snapshot": self._watch["snapshot"].to_state(),
                "until": self._watch["until"],
                "teleport_step": self._watch["teleport_step"],
                "grad_ref": self._watch["grad_ref"],
                "loss_ref": self._watch["loss_ref"],
            }
        return {}, top

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        self._step_count = int(top.get("step", 0))
        self._accepted = int(top.get("accepted", 0))
        self._rollbacks = int(top.get("rollbacks", 0))
        self._backoff = float(top.get("backoff", 1.0))
        if "rng" in top:
            self._generator.set_state(top["rng"].to(torch.uint8).cpu())
        watch = top.get("watch")
        if watch is None:
            self._watch = None
        else:
            tensors = {n: lookup_tensor(self._module, n) for n in watch["snapshot"]["tensors"]}
            self._watch = {
                "snapshot": Snapshot.from_state(watch["snapshot"], tensors, self._base, self._param_list()),
                "until": int(watch["until"]),
                "teleport_step": int(watch["teleport_step"]),
                "grad_ref": float(watch["grad_ref"]),
                "loss_ref": None if watch["loss_ref"] is None else float(watch["loss_ref"]),
            }

    def __repr__(self) -> str:
        n = "auto" if self._sites is None else len(self._sites)
        return f"Teleport({self._base!r}, sites={n}, objective={self._objective.name!r}, schedule={self._schedule!r})"


class _buffers_restored:
    """Context manager: snapshot the module's buffers and restore them on exit (extra closure passes)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.saved = [(b, b.detach().clone()) for b in self.module.buffers()]

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, v in self.saved:
                b.copy_(v)
