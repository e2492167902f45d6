"""Balance as a per-step companion: the closed-form ``"balance"`` teleport without the engine's passes.

A scheduled teleport whose objective is :class:`~teleopt.teleport.objectives.Balance` (defaults) runs a lean
path here instead of :class:`~teleopt.teleport.engine.TeleportEngine` when the plan below applies:

* the **plan** (:mod:`teleopt.teleport.balance_plan`) is built once and cached on the wrapper
  (:class:`BalanceCompanion`): per site its group, trust radius and member views (the acted-on part of each
  parameter), per optimizer-state entry what the state policy does with it, and the sites bucketed by kind (group class, coordinate shape, radius).  It is rebuilt
  when the sites list, a param group (identity, parameters, ``enabled``, trust region), the caps' backoff, a
  member's storage or its state keys change;
* each teleport reads the members' statistics, solves every bucket in one batched closed-form call
  (:meth:`Group.balance_many <teleopt.groups.Group.balance_many>`; ENorm, Stock et al. 2019; the balanced pair
  A A^T = B^T B of a LoRA pair, BaLoRA, Castin et al. 2026), computes every write first (the moved parts of
  matrix groups and, in a chain, the moved gradients out of place; the scalings' factors, by which their
  parameters, moments and, outside a chain, gradients are multiplied in place, per whole parameter where the
  members tile it), then makes them with one ``torch._foreach_copy_`` and one in-place ``torch._foreach_mul_``.
  No forward or backward pass, no probe, no snapshot copies: the elements suffice to undo it.

**Chains.**  In a ReLU MLP or a conv chain the hidden layers' scaling sites share tensors (a layer's rows
belong to one site, its columns to the next).  Where every such overlap is between positive scalings of whole,
distinct axes, the plan holds a :class:`~teleopt.teleport.balance_plan.Chain` and the sites are solved together
by the engine's own solver (:func:`solve_chain`: the weight-norm model's block-coordinate sweeps,
:meth:`WeightNormModel.solve <teleopt.teleport.balance.WeightNormModel.solve>`, on a model built with the plan
whose statistics each teleport reads again); the factors on a shared tensor
compose (rows times columns): parameters and moments are multiplied in place by each, a gradient is moved once
by all of its factors, and the undo and the watch's :class:`~teleopt.teleport.watch.InverseMove` apply every
site's inverse.

It gives the engine's result (the same statistics, solve, elements and transport rules) where the engine's
extra phases are no-ops: sites pairwise independent (disjoint slices of a tensor's one axis) or a chain of
scalings as above, each balanced point inside the trust region (then the round-off amplification of Zhao
2026's GL blocks is 1, the least on the orbit, so the per-dtype bound holds), float32/float64 members, no caps
that read a loss, a state policy that transports or keeps every entry.  Anything else (a chain beside GL sites,
overlapping slices) returns ``None`` and the engine runs.

**The output check.** Balance on certified exact sites changes no output, so the companion checks once per plan:
the first teleport after each (re)build runs lean with the engine's output check around it
(:mod:`~teleopt.teleport.lean_check`: outputs and loss before and after on the first rows of ``batch_fn``'s batch,
else the probe inputs; undone by the inverse elements and reported rolled back when it fails); later teleports
are not checked once it was accepted (their elements are the same closed form on the same certified sites; the
watch still compares gradient norms each step).  Where the lean path cannot take that first teleport, the engine
does, on the same batch, and the lean path starts after it was accepted with the whole move.

**All or nothing.** Every new value is computed before the first write, so an exception before it leaves
everything bitwise as it was; an exception after the copy (before the in-place products, which allocate
nothing) moves the copied tensors back by the inverse elements (exact up to round-off: a product by g, then by
g^-1); after the writes no torch function runs before the commit.  The plan is also dropped when a member's
storage (``module.to``, ``p.data = ...``) or its optimizer-state keys changed since it was built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from teleopt.functional import Batch
from teleopt.groups import GroupCache
from teleopt.teleport.balance_plan import BalancePlan, _Lane, _Slot, build_plan
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

    def __getstate__(self) -> dict[str, Any]:  # a copy rebuilds its plan (views of its own parameters)
        return {"enabled": self.enabled, "near": self.near, "plan": None, "key": None, "builds": 0}

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
        if not self.enabled or request.batch is not None or request.heldout is not None or request.closure is not None:
            return None
        plan = None if request.loss is not None else self._plan(owner, engine)  # a loss: the caps may read it
        if plan is None:
            return None
        record = engine.record
        if not plan.verified:
            last = record.last  # (step, accepted, whole move) of the last report, saved with the record
            if last is None or plan.checked_at != last[0] or not last[1] or not last[2]:  # not the engine's accepted
                return self._checked(owner, plan, request, draw)
            plan.verified = True  # the engine checked and accepted this plan's first teleport (a fallback below)
            record.lean_check = (plan.signature, record.backoff, plan.checked_at, True, plan.lean_step)
        report = lean_teleport(engine, plan, request, near=self.near)
        return None if report is None else self._done(owner, report)

    def _checked(
        self, owner: Any, plan: BalancePlan, request: TeleportRequest, draw: Callable[[], Batch | None] | None
    ) -> TeleportReport | None:
        """A plan's first teleport: lean, with the engine's output check around it (:mod:`~teleopt.teleport.lean_check`);
        where the lean path cannot take it, the engine does (on the same batch) and lean starts if it accepts."""
        record = owner._engine.record
        check = LeanCheck.of(owner, plan, request, draw() if draw is not None else None)
        report = None if check is None else lean_teleport(owner._engine, plan, request, self.near, check.reference)
        if check is None or report is None:
            plan.checked_at = record.step  # the engine checks this one; lean from the next if accepted
            record.lean_check = (plan.signature, record.backoff, plan.checked_at, False, plan.lean_step)
            return None
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
            values = _unit_squares(lane, [t for _, t in lane.targets])
            plan.units[id(lane)] = values  # for the squared norm after the move (objective_after)
            plan.traces.append(values.sum())
        for s, value in zip(lane.slots, values.reshape(len(lane.slots), *(plan.groups[first.site].coord_shape or ())).unbind(0)):
            into = stats[s.site]
            into[s.power] = into[s.power] + value if s.power in into else value
    return stats


def _unit_squares(lane: _Lane, tensors: Sequence[Tensor]) -> Tensor:
    """A scalings' lane's statistics (S, units) in float64 of ``tensors`` (laid out as its targets: a tiled lane's
    whole parameters or gradients, else each member's part): each unit's sum of squares over the other axes, from
    one norm per tensor in its precision, as the engine's reduced terms (to their round-off): no stacked copy and
    no squared copy of the members."""
    dims = lane.reduce
    norms = torch.stack([torch.linalg.vector_norm(t, dim=dims) if dims else t.abs() for t in tensors]).to(torch.float64)
    if lane.units is None:
        return norms.square()
    squares = norms.square().reshape(lane.units[0])
    return squares.sum(lane.units[1]) if lane.units[1] else squares


def solve(plan: BalancePlan, rcond: float, near: bool = False) -> tuple[list[Tensor], list[float], float, None] | None:
    """Coordinates of every site's balanced point (one batched call per bucket), their max abs (0 for a site
    within its floor: it stays) and the summed squared norm of the members at w; ``None`` when a balanced
    point lies on the trust region's edge (the round-off bound may then shrink it: the engine decides).
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
    if flags and values[-1]:
        return None
    moves = [0.0] * len(coords)
    for i, v in zip((i for bucket in plan.buckets for i in bucket), values):
        moves[i] = v
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


@dataclass
class _Writes:
    """One teleport's writes: new values to copy over their targets (GL parts, gradients), factors to multiply
    targets by in place (scalings' parameters and moments), how to move each copy back (per slot that moved it:
    the slot, the power, and whether the copy is its whole tensor, of which the slot's part moves back), and the
    gradients' squared norms before and after, per lane."""

    targets: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    undo: list[list[tuple[_Slot, float, bool]]] = field(default_factory=list)  # per copy: every slot that moved it
    whole: dict[int, int] = field(default_factory=dict)  # id of a parameter -> its whole gradient's copy (a chain's)
    scaled: list[Tensor] = field(default_factory=list)
    factors: list[Tensor] = field(default_factory=list)
    grad_before: list[Tensor] = field(default_factory=list)  # the moved gradient parts, before and after
    grad_after: list[Tensor] = field(default_factory=list)
    norm_after: list[Tensor] = field(default_factory=list)  # the members' squared norm after the move, per lane
    members_after: list[Tensor] = field(default_factory=list)  # moved members whose squared norms add to it
    grad_squares: list[Tensor] = field(default_factory=list)  # squared norms after the move of in-place gradients
    elements: Sequence[Tensor] = ()  # the teleport's elements, per site


class _Factors:
    """rho(g)^power of each slot's site, stacked, for one teleport's elements: (S, blocks, n, n) block matrices for
    GL (g, or g^-T for -1) to multiply :meth:`_Lane.columns`; (S, *broadcast) factors c^power for scalings, as
    ``act_on_axis`` computes them (per parameter where the lane is tiled).  Lanes of the same sites (a pair's two
    sides) share the stacks: each is made once per teleport."""

    def __init__(self, plan: BalancePlan, elements: Sequence[Tensor]) -> None:
        self.plan, self.elements = plan, elements
        self.made: dict[tuple[Any, ...], Tensor] = {}

    def _stacked(self, lane: _Lane, power: float, dtype: torch.dtype) -> Tensor:
        key = (tuple(lane.sites), lane.matrix, power, dtype)
        made = self.made.get(key)
        if made is None:
            if lane.matrix:  # the bucket's sites stacked once per power; a lane takes its sites' rows
                bucket = self.plan.buckets[lane.bucket]
                made = self.made.get((lane.bucket, power, dtype))
                if made is None:
                    stacked = self.plan.groups[bucket[0]].block_matrices_many([self.elements[i] for i in bucket], power)
                    assert stacked is not None  # a GL lane's group has block matrices
                    made = self.made[(lane.bucket, power, dtype)] = stacked.to(dtype)
                made = made if lane.rows is None else made[lane.rows]
            else:
                g = self._stacked(lane, 1.0, dtype) if power != 1 else torch.stack([self.elements[i] for i in lane.sites]).to(dtype)
                made = g if power == 1 else g**power
            self.made[key] = made
        return made

    def of(self, lane: _Lane, power: float, dtype: torch.dtype) -> Tensor:
        g = self._stacked(lane, power, dtype)
        if lane.matrix:
            return g
        g = g.reshape(lane.broadcast)
        return g if lane.tiled is None else g.expand(lane.tiled[0]).reshape(lane.tiled[1])  # per parameter


def _part(slot: _Slot, t: Tensor) -> Tensor:
    """The slot's part of ``t`` (its parameter, gradient or a moment) as the member's ``part_view`` takes it."""
    if slot.narrow is not None:
        t = t.narrow(*slot.narrow)
    return t if slot.shape is None else t.reshape(slot.shape)


def _grad(slot: _Slot, whole: bool = False) -> Tensor:
    """The slot's part of its parameter's gradient (``whole``: the whole gradient)."""
    grad = slot.param.grad
    assert grad is not None  # the plan's guard: every member has a gradient
    return grad if whole or (slot.narrow is None and slot.shape is None) else _part(slot, grad)


def _matrix_lane(writes: _Writes, lane: _Lane, grads: list[Tensor], moments: list[tuple[list[Tensor], Tensor, float]]) -> None:
    """A GL lane's parameter parts, gradient parts and moved moments (``(parts, block matrices, power)``) moved by
    one batched product of all of them stacked, queued as copies: per tensor kind, not one product each."""
    n, parts = len(lane.slots), [s.view for s in lane.slots] + grads
    mats, powers = [m for _, m, _ in moments], [p for _, _, p in moments]
    for more, _, _ in moments[2:]:  # the first two are the parameters' and the gradients' (parts above)
        parts += more
    x, m = torch.stack(parts), torch.cat(mats)
    if lane.side == "rows":  # one block, as (S, n, rest) and (S, rest, n) views: no transposed copies
        y = (m[:, 0] @ x.reshape(len(parts), lane.n, -1)).reshape(x.shape)
    elif lane.side == "cols":
        y = (x.reshape(len(parts), -1, lane.n) @ m[:, 0].mT).reshape(x.shape)
    else:
        y = lane.back(m @ lane.columns(x), x)
    values = y.unbind(0)
    writes.targets += parts
    writes.values += values
    writes.undo += [[(s, power, False)] for power in powers for s in lane.slots]
    writes.members_after += values[:n]
    writes.grad_before.append(x[n : 2 * n])
    writes.grad_after += values[n : 2 * n]


def _moves(plan: BalancePlan, elements: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> _Writes:
    """Every write of the teleport, computed before any is made (module docs)."""
    writes, state, factors = _Writes(elements=elements), optimizer.state, _Factors(plan, elements)
    for lane in plan.lanes:
        first = lane.slots[0]
        dtype, p = first.view.dtype, first.power
        grads = [_grad(s) for s in lane.slots] if lane.tiled is None else [_grad(t[0], whole=True) for t, _ in lane.targets]
        covector = factors.of(lane, -p, dtype)
        moments: list[tuple[list[Tensor], Tensor, float]] = [([], factors.of(lane, p, dtype), p), ([], covector, -p)]
        if not lane.matrix:
            writes.scaled += [view for _, view in lane.targets]
            writes.factors += factors.of(lane, p, dtype).unbind(0)
            units = plan.units.pop(id(lane), None)  # None: a chain (N after the move from its weight-norm model)
            if units is None:
                _scaled_grads(writes, lane, grads, list(covector.unbind(0)), -p)
            else:
                _scaled_in_place(writes, lane, grads, covector, units)
        for key, rule, power in lane.moments:
            if lane.tiled is not None:  # whole tensors
                parts = [state[t[0].param][key] for t, _ in lane.targets]
            else:
                parts = [_part(s, state[s.param][key]) for s in lane.slots]
            m = covector if rule == "covector" else factors.of(lane, power, dtype)
            if lane.matrix:
                moments.append((parts, m, power))
            else:
                writes.scaled += parts
                writes.factors += m.unbind(0)
        if lane.matrix:
            _matrix_lane(writes, lane, grads, moments)
    return writes


def _scaled_in_place(writes: _Writes, lane: _Lane, grads: list[Tensor], covector: Tensor, units: Tensor) -> None:
    """A scalings' lane outside a chain: every gradient part is the lane's own, so it is multiplied in place with
    the parameters; the members' and the gradients' squared norms after the move come from each unit's sum of
    squares before it (``units`` for the members), with no moved copy."""
    p = lane.slots[0].power
    c = torch.stack([writes.elements[i] for i in lane.sites]).reshape(units.shape)
    writes.norm_after.append((units * c ** (2 * p)).sum())
    writes.scaled += grads
    writes.factors += covector.unbind(0)
    writes.grad_before += grads
    writes.grad_squares.append((_unit_squares(lane, grads) * c ** (-2 * p)).sum())


def _scaled_grads(writes: _Writes, lane: _Lane, grads: list[Tensor], factors: list[Tensor], power: float) -> None:
    """A scalings' lane's gradient parts times their factors, queued as copies.  A whole gradient that an earlier
    site of a chain already moved (its rows, say; this site its columns) is multiplied again in its queued copy:
    the factors compose, and the gradient is copied (and counted in the norms) once."""
    tiled = lane.tiled is not None  # one whole gradient per target, moved by its slots' factors
    whole = [tiled or slots[0].whole for slots, _ in lane.targets]
    fresh = [k for k, (slots, _) in enumerate(lane.targets) if not (whole[k] and id(slots[0].param) in writes.whole)]
    again = [k for k in range(len(lane.targets)) if k not in fresh]
    if again:
        at = [writes.whole[id(lane.targets[k][0][0].param)] for k in again]
        torch._foreach_mul_([writes.values[i] for i in at], [factors[k] for k in again])  # queued copies, not live
        for i, k in zip(at, again):
            writes.undo[i] += [(s, power, True) for s in lane.targets[k][0]]
    moved = torch._foreach_mul([grads[k] for k in fresh], [factors[k] for k in fresh]) if fresh else []
    for k, value in zip(fresh, moved):
        slots = lane.targets[k][0]
        if whole[k]:
            writes.whole[id(slots[0].param)] = len(writes.targets)
        writes.targets.append(grads[k])
        writes.values.append(value)
        writes.undo.append([(s, power, tiled) for s in slots])
    writes.grad_before += [grads[k] for k in fresh]
    writes.grad_after += moved


def _rounds(targets: list[Tensor], factors: list[Tensor]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """The in-place products split into calls in which each tensor appears once (a chain's shared tensor is
    scaled by several sites: one factor per call)."""
    rounds: list[tuple[set[int], list[Tensor], list[Tensor]]] = []
    for t, f in zip(targets, factors):
        free = next((r for r in rounds if t.data_ptr() not in r[0]), None)
        if free is None:
            free = (set(), [], [])
            rounds.append(free)
        free[0].add(t.data_ptr())
        free[1].append(t)
        free[2].append(f)
    return [(r[1], r[2]) for r in rounds]


def _write(writes: _Writes, plan: BalancePlan, elements: Sequence[Tensor]) -> None:
    """The writes: one ``_foreach_copy_``, then in-place ``_foreach_mul_`` (one per factor a tensor takes; they
    allocate nothing).  An exception (an interrupt) during them divides the products already made out again and
    moves what the copy wrote back by the inverse elements (of every site that moved it), exact up to round-off."""
    # without a chain every scaled tensor is distinct: one call
    rounds = _rounds(writes.scaled, writes.factors) if plan.chain or not writes.scaled else [(writes.scaled, writes.factors)]
    done = 0
    try:
        if writes.targets:
            torch._foreach_copy_(writes.targets, writes.values)
        for scaled, factors in rounds:
            torch._foreach_mul_(scaled, factors)
            done += 1
    except BaseException:  # (an interrupt between two products: the ones made are divided out, to round-off)
        with torch.no_grad():
            for scaled, factors in reversed(rounds[:done]):
                torch._foreach_div_(scaled, factors)
            for target, value, undo in zip(writes.targets, writes.values, writes.undo):
                if torch.equal(target, value):
                    for slot, power, whole in reversed(undo):
                        inverse = plan.sites[slot.site].action.inverse(elements[slot.site])
                        part = _part(slot, target) if whole else target
                        part.copy_(plan.groups[slot.site].act_on_axis(inverse, part, slot.axis, power))
        raise


def _grad_norms(
    grads: list[Tensor], writes: _Writes, still: list[Tensor], known: float | None = None
) -> tuple[float, float, float, float | None]:
    """||grad||^2 over all gradients before the teleport and after it (the moved parts replaced), the squared
    norm of the ``still`` members and the members' squared norm after the move (``None`` without one), in one
    read; ``known``: ||grad||^2 before, as this step's watch read it."""
    reuse = known is not None and math.isfinite(known)
    grads = [] if reuse else grads
    parts = [grads, writes.grad_before, writes.grad_after, still, writes.members_after]
    norms = torch._foreach_norm([t for part in parts for t in part])
    squares = torch.stack(norms).to(torch.float64).square()
    a, b = len(grads), len(grads) + len(writes.grad_before)
    c, d = b + len(writes.grad_after), b + len(writes.grad_after) + len(still)
    moved = squares[b:c].sum()
    if writes.grad_squares:  # the gradients moved in place
        moved = moved + torch.stack(writes.grad_squares).sum()
    members = squares[d:].sum() + (torch.stack(writes.norm_after).sum() if writes.norm_after else 0.0)
    none = not (writes.norm_after or writes.members_after)
    sums = torch.stack([squares[:a].sum(), squares[a:b].sum(), moved, squares[c:d].sum(), members])
    before, old, new, kept, after = (float(v) for v in sums)
    before = known if reuse and known is not None else before
    return before, max(before - old + new, 0.0), kept, None if none else after


def _report(engine: TeleportEngine, plan: BalancePlan, norms: list[float]) -> TeleportReport:
    cfg, record = engine.config, engine.record
    report = TeleportReport(step=record.step, path="fast", objective=cfg.objective.name, sites=list(plan.sites), skipped=dict(plan.skipped))
    report.coordinate_norms = {s.name: v for s, v in zip(plan.sites, norms)}
    report.check, report.check_detail = "none", f"lean balance: its plan's first teleport was checked (step {plan.checked_at})"
    return report


def _watch(engine: TeleportEngine, plan: BalancePlan, elements: Sequence[Tensor], report: TeleportReport) -> Watch | None:
    """The watch of the accepted teleport (its inverse move) joined to the open one, made before anything is written."""
    cfg, record = engine.config, engine.record
    if cfg.safety.watch_steps <= 0:
        return None
    kept = [e if e.dtype == dtype else e.to(dtype) for e, dtype in zip(elements, plan.watch_dtypes)]
    move = InverseMove(list(plan.sites), kept, cfg.module, cfg.optimizer, cfg.policy)
    recent = [v for t, v in record.recent if record.step - REFERENCE_STEPS <= t < record.step]  # take_recent, unmutated
    before, after = report.grad_norm_before, report.grad_norm_after
    gain = (after / before) ** 2 if before and after else 1.0
    return Watch(move, record.step + cfg.safety.watch_steps, record.step, reference(before, after, recent), None).stack(record.watch, gain)


def lean_teleport(
    engine: TeleportEngine, plan: BalancePlan, request: TeleportRequest, near: bool = True, reference: Callable[[], bool] | None = None
) -> TeleportReport | None:
    """One balance teleport on ``plan`` (module docs); ``None`` where the engine must take it.  ``reference`` runs
    once the move is decided, before its first write (the check's outputs before it; ``False``: the engine's turn).
    It reads and writes ``.data`` views, outside autograd (``Teleport.step`` and ``teleport`` run it under
    ``no_grad``); after the writes it runs no torch function, so nothing can fail between them and the commit."""
    objective = engine.config.objective
    assert isinstance(objective, Balance)
    near = near and plan.lean_step == engine.record.step - 1
    with GroupCache().active() if plan.matrix else nullcontext():  # each GL element's contragredient kept
        return _lean(engine, plan, objective, near, reference)


def _lean(
    engine: TeleportEngine, plan: BalancePlan, objective: Balance, near: bool, reference: Callable[[], bool] | None
) -> TeleportReport | None:
    start, cfg, record = time.perf_counter(), engine.config, engine.record
    found = solve_chain(plan, objective) if plan.chain else solve(plan, objective.rcond, near=near)
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
    writes = _moves(plan, elements, cfg.optimizer)
    known = record.read  # ||grad||^2 before, as this step's watch read it
    grads = (
        []
        if known is not None and math.isfinite(known)
        else [p.grad for g in cfg.optimizer.param_groups for p in g["params"] if p.grad is not None]
    )
    before, after, kept, members = _grad_norms(grads, writes, still, known)
    report.grad_norm_before, report.grad_norm_after = math.sqrt(before), math.sqrt(after)
    report.objective_before = norm_start + kept
    if norm_after is None:
        norm_after = kept + (norm_start if members is None else members)
    report.objective_after = norm_after
    report.elements = {s.name: e if e.dtype == torch.float64 else e.to(torch.float64) for s, e in zip(plan.sites, elements)}
    report.state_decisions = dict(plan.counts)
    report.accepted, report.reason = True, "accepted"
    if reference is not None and not reference():  # the output check's outputs before (teleopt.teleport.lean_check)
        return None
    watch = _watch(engine, plan, elements, report)
    _write(writes, plan, elements)
    # the commit: Python assignments only, after the writes
    record.accepted += 1
    plan.lean_step = record.step
    record.lean_check = (plan.signature, record.backoff, plan.checked_at, True, record.step)
    if watch is not None:
        record.recent, record.watch = [], watch
    report.time_s = time.perf_counter() - start
    return report
