"""Balance as a per-step companion: the closed-form ``"balance"`` teleport without the engine's passes.

A teleport whose objective is :class:`~teleopt.teleport.objectives.Balance` (defaults), scheduled or explicit
(``teleport()``, without a closure, a loss or a held-out batch), runs a lean path here instead of :class:`~teleopt.teleport.engine.TeleportEngine` when the plan below applies:

* the **plan** (:mod:`teleopt.teleport.balance_plan`) is built once and cached on the wrapper
  (:class:`BalanceCompanion`): per site its group, trust radius and member views (the acted-on part of each
  parameter), per optimizer-state entry what the state policy does with it, and the sites bucketed by kind (group class, coordinate shape, radius).  It is rebuilt
  when the sites list, a param group (identity, parameters, ``enabled``, trust region), the caps' backoff, a
  member's storage or its state keys change;
* each teleport reads the members' statistics, solves every bucket in one batched closed-form call
  (:meth:`Group.balance_many <teleopt.groups.Group.balance_many>`; ENorm, Stock et al. 2019; the balanced pair
  A A^T = B^T B of a LoRA pair, BaLoRA, Castin et al. 2026), computes every write first (the moved parts of
  matrix groups; the scalings' factors, by which their
  parameters, moments and gradients are multiplied in place, per whole parameter where the
  members tile it), then makes them with ``torch._foreach_copy_`` and in-place ``torch._foreach_mul_`` calls
  (a tensor scaled by several sites, in a chain, gets one product per call; a GL lane's moments are moved and
  copied kind by kind).
  No backward pass, no snapshot copies: the elements suffice to undo it; an unchecked teleport runs no forward.

**Chains.**  In a ReLU MLP or a conv chain the hidden layers' scaling sites share tensors (a layer's rows
belong to one site, its columns to the next).  Where every such overlap is between positive scalings of whole,
distinct axes, the plan holds a :class:`~teleopt.teleport.balance_plan.Chain` and the sites are solved together
by the engine's own solver (:func:`solve_chain`: the weight-norm model's block-coordinate sweeps,
:meth:`WeightNormModel.solve <teleopt.teleport.balance.WeightNormModel.solve>`, on a model built with the plan
whose statistics each teleport reads again); the factors on a shared tensor
compose (rows times columns): parameters, gradients and moments are multiplied in place by each (a
gradient's squared norm after the move read a chunk of rows at a time), and the undo and the watch's :class:`~teleopt.teleport.watch.InverseMove` apply every
site's inverse.

It gives the engine's result (the same statistics, solve, elements and transport rules) where the engine's
extra phases are no-ops: sites pairwise independent (disjoint slices of a tensor's one axis) or a chain of
scalings as above, each balanced point inside the trust region (then the round-off amplification of Zhao
2026's GL blocks is 1, the least on the orbit, so the per-dtype bound holds; a plan's checked first teleport
also takes a point the trust region clipped, bounded for round-off as the engine bounds it), float32/float64
members, no caps that read a loss, a state policy that transports or keeps every entry.  Anything else (a chain
beside GL sites, overlapping slices) returns ``None`` and the engine runs.

**The output check.** Balance on certified exact sites changes no output, so a scheduled teleport is checked once
per plan: the first teleport after each (re)build runs lean with the engine's output check around it
(:mod:`~teleopt.teleport.lean_check`: outputs and loss before and after on the whole of ``batch_fn``'s batch, as
the engine's, else the probe inputs; the predicted-decrease cap and the watch read that loss; undone by the inverse elements and reported rolled back when it fails); later teleports
are not checked once it was accepted (their elements are the same closed form on the same certified sites; the
watch still compares gradient norms each step).  Where the lean path cannot take that first teleport, the engine
does, on the same batch, and the lean path starts after it was accepted with the whole move.  An explicit
``teleport(batch=...)`` (or ``teleport()`` drawing ``batch_fn``'s batch) is checked every time: it takes the same
checked lean path on its batch (the closed form, never the near-balance step), whether or not the plan was
verified.  A scheduled teleport the lean path left to the engine is not tried lean again
(``TeleportRequest.lean``), and a ``watch_restore="snapshot"`` watch leaves every teleport to the engine.

**All or nothing.** Every new value is computed before the first write, except a GL lane's moved moments
(computed kind by kind at the write, so that no two kinds' moved copies are alive at once), so an exception
before it leaves everything bitwise as it was; an exception after the first copy (in a moment kind's product,
or before the in-place products, which allocate nothing) moves the copied tensors back by the inverse elements
(exact up to round-off: a product by g, then by g^-1); after the writes no torch function runs before the commit.  The plan is also dropped when a member's
storage (``module.to``, ``p.data = ...``) or its optimizer-state keys changed since it was built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from teleopt.functional import Batch
from teleopt.groups import GroupCache
from teleopt.teleport import lean_moves
from teleopt.teleport.balance_plan import BalancePlan, build_plan
from teleopt.teleport.distributed import is_distributed
from teleopt.teleport.engine import TeleportEngine, TeleportRequest
from teleopt.teleport.lean_check import LeanCheck
from teleopt.teleport.objectives import Balance
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.search import ClosedForm
from teleopt.teleport.state_policy import restart_curvature_history
from teleopt.teleport.watch import REFERENCE_STEPS, InverseMove, Watch, reference

__all__ = ["NEAR_LIMIT", "BalanceCompanion", "BalancePlan"]

#: the longest step towards balance (||S||_F per block) taken by the cheap near-balance step; longer: closed form
NEAR_LIMIT = 0.1


class BalanceCompanion:
    """The cached plan and the lean teleport (module docs); one per ``Teleport``. ``enabled=False`` turns it off."""

    def __init__(self) -> None:
        self.enabled = True
        self.near = True  # the cheap near-balance step after a lean teleport at the step before (``solve``)
        self.plan: BalancePlan | None = None
        self.key: tuple[Any, ...] | None = None
        self.builds = 0  # how many plans were built (tests read it)
        self.tried = False  # whether the last call reached a plan (a scheduled teleport's engine turn skips lean then)

    def __getstate__(self) -> dict[str, Any]:  # a copy rebuilds its plan (views of its own parameters)
        return {"enabled": self.enabled, "near": self.near, "plan": None, "key": None, "builds": 0, "tried": False}

    @staticmethod
    def of(owner: Any) -> BalanceCompanion:
        """The companion cached on ``owner`` (a ``Teleport``), made on first use."""
        companion = owner.__dict__.get("_balance_companion")
        if companion is None:
            companion = owner.__dict__["_balance_companion"] = BalanceCompanion()
        return companion

    def teleport(self, owner: Any, request: TeleportRequest, draw: Callable[[], Batch | None] | None = None) -> TeleportReport | None:
        """Run ``owner``'s teleport on the lean path, call its hooks and return the report; ``None``: the engine's turn.
        ``draw``: the teleport batch (``batch_fn``'s) for the check of a plan's first teleport, drawn only then."""
        engine = owner._engine
        self.tried = False
        off = not self.enabled or not request.lean or request.heldout is not None or request.closure is not None or request.loss is not None
        if off or (plan := self._plan(owner, engine)) is None:  # a loss: the caps may read it (the engine's)
            return None
        self.tried, record = True, engine.record  # a plan: the lean path runs (the engine's turn after it does not)
        explicit = request.batch is not None  # teleport(batch=...) or batch_fn's batch: checked, verified or not
        if not plan.verified or explicit:
            last = record.last  # (step, accepted, whole move) of the last report, saved with the record
            if explicit or last is None or plan.checked_at != last[0] or not (last[1] and last[2]):
                return self._checked(owner, plan, request, draw)  # not after the engine's accepted whole move
            plan.verified = True  # the engine checked and accepted this plan's first teleport (a fallback below)
            record.lean_check = (plan.signature, record.backoff, plan.checked_at, True, plan.lean_step)
        report = lean_teleport(engine, plan, request, near=self.near)
        return None if report is None else self._done(owner, report)

    def _checked(
        self, owner: Any, plan: BalancePlan, request: TeleportRequest, draw: Callable[[], Batch | None] | None
    ) -> TeleportReport | None:
        """A plan's first scheduled teleport, or any explicit one (``request.batch``): lean, in closed form, with the
        engine's output check around it (:mod:`~teleopt.teleport.lean_check`); where the lean path cannot take it,
        the engine does (on the same batch) and, for an unverified plan, lean starts if it accepts."""
        record = owner._engine.record
        check = LeanCheck.of(owner, plan, request, draw() if draw is not None else request.batch)
        # the closed form, never the near-balance step: a checked teleport lands where the engine's does
        report = None if check is None else lean_teleport(owner._engine, plan, request, False, check)
        if check is None or report is None:
            if not plan.verified:  # the engine checks this one; lean from the next if accepted
                plan.checked_at, record.lean_check = record.step, (plan.signature, record.backoff, record.step, False, plan.lean_step)
            return None
        if report.accepted:  # moved, then checked (a declined teleport checked nothing)
            plan.checked_at = record.step
        return self._done(owner, check.verify(report))

    @staticmethod
    def _done(owner: Any, report: TeleportReport) -> TeleportReport:
        if report.accepted:
            restart_curvature_history(owner.innermost)
        owner._call_hooks(report)
        return report

    @staticmethod
    def _eligible(owner: Any, engine: TeleportEngine) -> bool:
        """Whether the wrapper's settings allow the lean path (read when a plan is built)."""
        cfg = engine.config
        objective = cfg.objective
        return (
            isinstance(objective, Balance)
            and all(getattr(type(objective), m) is getattr(Balance, m) for m in ("prepare", "solve"))  # its closed form
            and objective.fraction == 1.0
            and type(engine).run is TeleportEngine.run
            and not cfg.sharded
            and cfg.safety.max_gain is None
            and cfg.safety.stability_margin is None  # the sharpness cap (Hessian-vector products): the engine's
            and (cfg.safety.watch_steps <= 0 or cfg.safety.watch_restore == "inverse")  # a snapshot watch: the engine's
            and cfg.search.path in ("auto", "fast")
            and isinstance(cfg.search.strategy_for(objective, None), ClosedForm)
            and not owner._lookahead.is_lookahead
            and not is_distributed()
        )

    def _plan(self, owner: Any, engine: TeleportEngine) -> BalancePlan | None:
        trust = engine.config.trust_key
        enabled = owner.prefix + "enabled"
        groups = owner.param_groups
        key = (
            id(owner._sites),
            len(owner._sites or ()),
            engine.record.backoff,
            tuple((id(g), id(g["params"]), len(g["params"]), g[enabled], g[trust]) for g in groups),
        )
        if key != self.key:
            self.key, self.plan = key, None
            if owner._sites is None or not self._eligible(owner, engine):
                return None
            sites, skipped = owner._active_sites(None)
            self.plan = build_plan(engine, sites, skipped)
            self.builds += 1
            record = engine.record
            if self.plan is not None and record.loaded_check is not None:  # the first plan after a load: as saved
                loaded, record.loaded_check = record.loaded_check, None
                if loaded[:2] == (self.plan.signature, record.backoff):
                    self.plan.checked_at, self.plan.verified, self.plan.lean_step = loaded[2:]
            state = engine.config.optimizer.state
            if self.plan is None and not all(state.get(p) for s in sites for p in s.tensors(owner._module) if p is not None):
                self.key = None  # the base has not initialised its state yet: try again next time
        plan = self.plan
        if plan is None:
            return None
        state = engine.config.optimizer.state
        for param, storage, keys in plan.params:
            if param.data_ptr() != storage or tuple(state.get(param, ())) != keys:
                self.key = None  # new storage (module.to, p.data = ...) or new state entries: planned again next time
                return None
            grad = param.grad  # frozen, gradient-free, sparse or graph-carrying members: the engine decides
            if not param.requires_grad or grad is None or grad.is_sparse or grad.requires_grad:
                return None
        return plan


def _statistics(plan: BalancePlan) -> list[dict[float, Tensor]]:
    """Per site, its members' norm statistics summed per power (what the engine's weight-norm model reads at w):
    Gram matrices per block of each lane's stacked parts (GL), sums of squares per unit (scalings, per part)."""
    stats: list[dict[float, Tensor]] = [{} for _ in plan.sites]
    for lane in plan.lanes:
        first = lane.slots[0]
        if lane.matrix:
            x = torch.stack([s.view for s in lane.slots]).to(torch.float64)
            if lane.side is not None:  # views, no transposed copy
                x = x.reshape(len(lane.slots), lane.n, -1) if lane.side == "rows" else x.reshape(len(lane.slots), -1, lane.n).mT
                values = x @ x.mT
            else:
                cols = lane.columns(x)
                values = cols @ cols.mT
            plan.traces.append(values.diagonal(dim1=-2, dim2=-1).sum())
        else:
            values = lean_moves.unit_squares(lane, [t for _, t in lane.targets])
            plan.units[id(lane)] = values  # for the squared norm after the move (objective_after)
            plan.traces.append(values.sum())
        for s, value in zip(lane.slots, values.reshape(len(lane.slots), *(plan.groups[first.site].coord_shape or ())).unbind(0)):
            into = stats[s.site]
            into[s.power] = into[s.power] + value if s.power in into else value
    return stats


def solve(
    plan: BalancePlan, rcond: float, near: bool = False, edge: Callable[[list[Tensor]], list[Tensor]] | None = None
) -> tuple[list[Tensor], list[float], float, None] | None:
    """Coordinates of every site's balanced point (one batched call per bucket), their max abs (0 for a site
    within its floor: it stays) and the summed squared norm of the members at w.  A balanced point on the trust
    region's edge (clipped: the round-off bound may shrink it) gives ``None`` (the engine decides), or with
    ``edge`` the coordinates ``edge`` bounds (a checked teleport: the engine's round-off bound, lean).
    ``near`` (the point was balanced at the step before): a bucket whose group has a cheap step towards
    balance (:meth:`Group.balance_near_many <teleopt.groups.Group.balance_near_many>`) takes it when it is
    shorter than ``NEAR_LIMIT`` (and half the trust radius), the closed form otherwise."""
    stats = _statistics(plan)
    traces = [torch.stack(plan.traces).sum()] if plan.traces else [torch.zeros((), dtype=torch.float64)]
    plan.traces = []
    coords = list(plan.zeros)  # skipped sites: the identity
    edges, peaks = [], []  # peaks: per bucket, each site's max |xi| (one reduction per bucket, not per site)
    for bucket in plan.buckets:
        group, radius = plan.groups[bucket[0]], plan.radii[bucket[0]]
        limit = NEAR_LIMIT if radius is None else min(NEAR_LIMIT, radius / 2)
        stepped = group.balance_near_many([stats[i] for i in bucket], limit) if near else None
        solved = list(stepped) if stepped is not None else group.balance_many([stats[i] for i in bucket], radius, rcond)
        for i, xi in zip(bucket, solved):
            assert xi is not None  # admitted sites have a closed form
            coords[i] = xi
        stacked = torch.stack([coords[i] for i in bucket]).to(torch.float64)
        peaks.append(stacked.reshape(len(bucket), -1).abs().amax(1) if stacked.numel() else stacked.new_zeros(len(bucket)))
        if radius is not None and group.roundoff_growth:
            # ||xi||_F >= ||xi||_2: below the radius no eigenvalue was clipped and exp(xi) is the balanced point
            # (round-off amplification 1, the least on the orbit: within every dtype's bound)
            edges.append(stacked.reshape(-1, *stacked.shape[-2:]).square().sum((-2, -1)).amax() >= (radius * (1 - 1e-9)) ** 2)
    flags = [torch.stack(edges).any().to(torch.float64).reshape(1)] if edges else []
    values = torch.cat([*peaks, traces[0].reshape(1).to(torch.float64), *flags]).tolist()  # one read of the host
    moves = [0.0] * len(coords)
    for i, v in zip((i for bucket in plan.buckets for i in bucket), values):
        moves[i] = v
    if flags and values[-1]:
        if edge is None:
            return None
        coords = edge(coords)
        peaks = [c.abs().amax() if c.numel() else c.new_zeros(()) for c in coords]
        moves = torch.stack(peaks).to(torch.float64).tolist()  # one read of the host
    trace = values[sum(len(b) for b in plan.buckets)]
    kept = [m if m > floor else 0.0 for m, floor in zip(moves, plan.floors)]
    return [xi if m else zero for xi, m, zero in zip(coords, kept, plan.zeros)], kept, trace, None


def solve_chain(plan: BalancePlan, objective: Balance) -> tuple[list[Tensor], list[float], float, float]:
    """Coordinates of a chain's sites (:attr:`BalancePlan.chain`: sites sharing tensors) as the engine finds them:
    its weight-norm model (built with the plan, its statistics read again) solved by block-coordinate sweeps
    (:meth:`WeightNormModel.solve <teleopt.teleport.balance.WeightNormModel.solve>`) with the settings and the
    floors of :meth:`Balance.solve <teleopt.teleport.objectives.Balance.solve>` (fraction 1), each site's max
    abs, and N before and after (every counted member of the sites)."""
    chain = plan.chain
    assert chain is not None
    model = chain.model  # built with the plan: only its statistics are read again
    model.reread()
    device = next(iter(chain.tensors.values())).device
    start = [torch.zeros(g.coord_shape or (), dtype=torch.float64, device=device) for g in plan.groups]  # the identity
    found = model.solve(plan.radii, start, objective.max_sweeps, objective.tol, rcond=objective.rcond)
    # as Balance.solve (fraction 1): a site that moves by at most its floor stays at the identity
    peaks = [c.abs().amax() if c.numel() else c.new_zeros((), dtype=torch.float64) for c in found.coords]
    moves = torch.stack(peaks).to(torch.float64).tolist()  # one read of the host
    kept = [m if m > floor else 0.0 for m, floor in zip(moves, plan.floors)]
    coords = [c if m else torch.zeros_like(c) for c, m in zip(found.coords, kept)]
    after = float(model.value([g.exp(c) for g, c in zip(plan.groups, coords)]))
    return coords, kept, found.norm_start, after


def _report(engine: TeleportEngine, plan: BalancePlan, norms: list[float]) -> TeleportReport:
    cfg, record = engine.config, engine.record
    report = TeleportReport(step=record.step, path="fast", objective=cfg.objective.name, sites=list(plan.sites), skipped=dict(plan.skipped))
    report.coordinate_norms = {s.name: v for s, v in zip(plan.sites, norms)}
    report.check, report.check_detail = "none", f"lean balance: its plan's first teleport was checked (step {plan.checked_at})"
    return report


def _watch(
    engine: TeleportEngine, plan: BalancePlan, elements: Sequence[Tensor], report: TeleportReport, loss: float | None
) -> Watch | None:
    """The watch of the accepted teleport (its inverse move) joined to the open one, made before anything is written;
    ``loss``: the checked batch's loss before the move (the engine's ``report.loss_before``), else ``None``."""
    cfg, record = engine.config, engine.record
    if cfg.safety.watch_steps <= 0:
        return None
    kept = [e if e.dtype == dtype else e.to(dtype) for e, dtype in zip(elements, plan.watch_dtypes)]
    move = InverseMove(list(plan.sites), kept, cfg.module, cfg.optimizer, cfg.policy)
    recent = [v for t, v in record.recent if record.step - REFERENCE_STEPS <= t < record.step]  # take_recent, unmutated
    before, after = report.grad_norm_before, report.grad_norm_after
    gain = (after / before) ** 2 if before and after else 1.0
    return Watch(move, record.step + cfg.safety.watch_steps, record.step, reference(before, after, recent), loss).stack(record.watch, gain)


def lean_teleport(
    engine: TeleportEngine, plan: BalancePlan, request: TeleportRequest, near: bool = True, check: LeanCheck | None = None
) -> TeleportReport | None:
    """One balance teleport on ``plan`` (module docs); ``None`` where the engine must take it.  ``check`` (a plan's
    first scheduled teleport, or an explicit one: each is checked): a balanced point on the trust region's edge is bounded for round-off as the engine bounds it
    (:meth:`LeanCheck.within_roundoff`) instead of going to the engine, and :meth:`LeanCheck.reference` runs once
    the move is decided, before its first write (the outputs before it and the caps at it; ``False``: the
    engine's turn).
    It reads and writes ``.data`` views, outside autograd (``Teleport.step`` and ``teleport`` run it under
    ``no_grad``); after the writes it runs no torch function, so nothing can fail between them and the commit."""
    objective = engine.config.objective
    assert isinstance(objective, Balance)
    near = near and plan.lean_step == engine.record.step - 1
    with GroupCache().active() if plan.matrix else nullcontext():  # each GL element's contragredient kept
        return _lean(engine, plan, objective, near, check)


def _lean(engine: TeleportEngine, plan: BalancePlan, objective: Balance, near: bool, check: LeanCheck | None) -> TeleportReport | None:
    start, cfg, record = time.perf_counter(), engine.config, engine.record
    edge = None if check is None else check.within_roundoff
    found = solve_chain(plan, objective) if plan.chain else solve(plan, objective.rcond, near, edge)
    if found is None:
        return None
    coords, norms, norm_start, norm_after = found  # a chain's N counts every member (no still members to add)
    still = plan.still if plan.chain is None else []
    report = _report(engine, plan, norms)
    report.objective_before = norm_start
    if not all(math.isfinite(v) for v in norms):
        report.reason = "declined: the search returned non-finite coordinates"
    elif all(v == 0.0 for v in norms):
        report.reason = "declined: no improvement found"
    if report.reason:
        if still:  # N counts the members no slot moves, as when accepted (_grad_norms)
            report.objective_before += float(torch.stack(torch._foreach_norm(still)).to(torch.float64).square().sum())
        report.time_s = time.perf_counter() - start
        return report
    # as the engine computes them; a site that stays gets the identity (exp(0) is exactly I) without a matrix_exp
    elements = [group.exp(xi) if m else group.identity() for group, xi, m in zip(plan.groups, coords, norms)]
    known = record.read  # ||grad||^2 before, as this step's watch read it
    fresh = known is None or not math.isfinite(known)
    grads = [p.grad for g in cfg.optimizer.param_groups for p in g["params"] if p.grad is not None] if fresh else []
    if check is not None:  # the outputs before and the caps (lean_check), before the moves' copies exist
        known, grads = float(torch.stack(torch._foreach_norm(grads)).to(torch.float64).square().sum()) if grads else known, []
        report.grad_norm_before = math.sqrt(known or 0.0)
        if not check.reference(coords, report):
            return None
    writes = lean_moves.moves(plan, elements, cfg.optimizer)
    before, after, kept, members = lean_moves.grad_norms(grads, writes, still, known)
    report.grad_norm_before, report.grad_norm_after = math.sqrt(before), math.sqrt(after)
    report.objective_before = norm_start + kept
    if norm_after is None:
        norm_after = kept + (norm_start if members is None else members)
    report.objective_after = norm_after
    report.elements = {s.name: e if e.dtype == torch.float64 else e.to(torch.float64) for s, e in zip(plan.sites, elements)}
    report.state_decisions = dict(plan.counts)
    report.accepted, report.reason = True, "accepted"
    watch = _watch(engine, plan, elements, report, None if check is None else check.loss_before)
    lean_moves.write(writes, plan, elements)
    # the commit: Python assignments only, after the writes
    record.accepted += 1
    plan.lean_step = record.step
    record.lean_check = (plan.signature, record.backoff, plan.checked_at, True, record.step)
    if watch is not None:
        record.recent, record.watch = [], watch
    report.time_s = time.perf_counter() - start
    return report
