"""The lean balance path's plan: what every lean teleport of one configuration shares.

Built once by :func:`build_plan` and cached by :class:`~teleopt.teleport.companion.BalanceCompanion`: per site its
group, trust radius and member views (the acted-on part of each parameter, :class:`_Slot`), per optimizer-state entry
what the state policy does with it, and the sites bucketed by kind (group class, coordinate shape, radius) and their
members stacked in lanes (:class:`_Lane`: one kernel per lane); for sites that share tensors (a chain of scalings),
what the engine's weight-norm model reads (:class:`Chain`).  ``None`` where the lean path would not give the
engine's result (see the companion's module docs); sites that are not axis actions stay at the identity, as in the
engine's closed form (:func:`~teleopt.teleport.balance._admit`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import GroupAction
from teleopt.groups import Group
from teleopt.site import Site
from teleopt.teleport.balance import WeightNormModel, _admit
from teleopt.teleport.engine import TeleportEngine
from teleopt.teleport.objectives import Balance
from teleopt.teleport.optimizer_model import state_role

__all__ = ["BalancePlan", "Chain", "build_plan"]


@dataclass(repr=False)
class _Slot:
    """One member of one site: the live parameter, its acted-on part (a view) and how the site acts there."""

    site: int
    param: Tensor
    member: Member
    view: Tensor
    axis: int
    power: float
    whole: bool  # a scaling on a whole axis (statistics in the tensor's precision, as the engine's)
    storage: int = 0  # the parameter's data_ptr when planned (its views are of that storage)
    narrow: tuple[int, int, int] | None = None  # (axis, start, length) of the member's slice, if any
    shape: tuple[int, ...] | None = None  # the slice's shape split into (outer, n, inner), if it is split


@dataclass(frozen=True, repr=False)
class Chain:
    """What the engine's weight-norm model (:class:`~teleopt.teleport.balance.WeightNormModel`) reads for a plan
    whose sites share tensors: the sites' parameters by name (detached views of the live tensors) and the trainable ones."""

    tensors: dict[str, Tensor]
    counted: set[str]
    model: WeightNormModel  # built once; each teleport rereads its statistics (:meth:`WeightNormModel.reread`)


@dataclass(repr=False)
class BalancePlan:
    """What every lean teleport of one configuration shares (see module docs)."""

    sites: list[Site]
    skipped: dict[str, str]
    groups: list[Group]
    radii: list[float | None]
    slots: list[_Slot]
    buckets: list[list[int]]
    lanes: list[_Lane]
    floors: list[float]  # per site: the move below which it stays (Balance.min_move or sqrt(eps))
    state: dict[tuple[int, str], str]  # (id of the parameter, state key) -> "covector" | "second_moment" | "keep"
    decisions: dict[tuple[int, str], str]  # the same entries as the report counts them
    units: dict[int, Tensor] = field(default_factory=dict)  # scratch: per scalings' lane, each unit's squared norm
    params: list[tuple[Tensor, int, tuple[str, ...]]] = field(default_factory=list)  # per moved parameter: its
    # data_ptr and state keys when planned (a teleport checks them unchanged)
    traces: list[Tensor] = field(default_factory=list)  # scratch: per lane, the members' squared norm at w
    still: list[Tensor] = field(default_factory=list)  # trainable members of the sites that no slot moves (counted in N)
    chain: Chain | None = None  # sites that share tensors (a chain of scalings): solved together, as the engine
    signature: tuple[str, ...] = ()  # the sites by name: with the caps' backoff, what identifies it across a checkpoint
    counts: dict[str, int] = field(default_factory=dict)  # the report's state decisions (the state keys are fixed)
    matrix: bool = False  # a lane moves block matrices (GL): the group cache keeps each element's contragredient
    zeros: list[Tensor] = field(default_factory=list)  # per site, the identity's coordinates (read only)
    watch_dtypes: list[torch.dtype] = field(default_factory=list)  # per site, the dtype the watch keeps its element in
    verified: bool = False  # this plan's first teleport was checked (lean or by the engine) and accepted
    lean_step: int = -2  # the step of its last accepted lean teleport (the next step's point is near balance)
    checked_at: int = -1


def _view(param: Tensor, member: Member) -> tuple[Tensor, int] | None:
    """The member's part of ``param`` as a view (``None`` where the layout needs a copy)."""
    if member.groups != 1:
        return None
    view, axis = member.part_view(param)
    return (view, axis) if view is param or view._is_view() else None


def _overlaps(slots: Sequence[_Slot]) -> bool | None:
    """Whether sites share a tensor: ``False`` where no two touch overlapping parts of one (disjoint slices of
    an axis), ``True`` where those that do are scalings of whole, distinct axes (a chain: their factors compose
    and the sites are solved together), ``None`` for any other overlap (the engine decides)."""
    by_tensor: dict[int, list[_Slot]] = {}
    for s in slots:
        by_tensor.setdefault(id(s.param), []).append(s)
    shared = False
    for parts in by_tensor.values():
        for i, a in enumerate(parts):
            for b in parts[i + 1 :]:
                ma, mb = a.member, b.member
                if a.site == b.site and ma.tensor_key == mb.tensor_key and ma.axis == mb.axis:
                    continue  # parts of one tensor the action composes (checked disjoint by the action)
                same_axis = ma.axis % a.param.ndim == mb.axis % b.param.ndim
                if not same_axis and a.whole and b.whole:
                    shared = True  # a row factor and a column factor: they commute and compose
                    continue
                if not same_axis or ma.start is None or mb.start is None:
                    return None
                if not (ma.stop is not None and mb.stop is not None and (ma.stop <= mb.start or mb.stop <= ma.start)):
                    return None
    return shared


def _state_plan(engine: TeleportEngine, slots: Sequence[_Slot], groups: Sequence[Group]) -> tuple[dict, dict] | None:
    """Per (parameter, state key): transported as a covector or second moment, or kept; ``None`` for a reset."""
    opt, policy = engine.config.optimizer, engine.config.policy
    how: dict[tuple[int, str], str] = {}
    said: dict[tuple[int, str], str] = {}
    for s in slots:
        st = opt.state.get(s.param)
        if not st:
            return None  # no state yet (the base initialises it lazily): the engine takes this teleport
        for key, value in st.items():
            role = state_role(opt, key)
            chosen = policy.resolve(key, role, opt)
            shaped = isinstance(value, Tensor) and value.shape == s.param.shape
            if chosen == "transport" and role == "first_moment" and shaped:
                rule, say = "covector", "transport"
            elif chosen == "transport" and role == "second_moment" and shaped and groups[s.site].second_moment_power(1.0) is not None:
                rule, say = "second_moment", "transport"
            elif chosen == "transport" and role in ("first_moment", "second_moment", "update", "unknown"):
                fallback = policy.resolve_fallback(key, role)
                rule, say = "keep", "fallback:" + fallback
                if fallback != "keep":
                    return None
            elif chosen in ("transport", "keep"):
                rule, say = "keep", "keep"
            else:
                return None
            if how.get((id(s.param), key), rule) != rule:
                return None  # one tensor, two rules (two sites' moments of one parameter): the engine decides
            how[(id(s.param), key)], said[(id(s.param), key)] = rule, say
    return how, said


def _slots(sites: Sequence[Site], groups: Sequence[Group], params: dict[str, nn.Parameter], left: dict[str, str]) -> list[_Slot] | None:
    """The members of the admitted sites as views of their parameters (``None``: a layout without a view)."""
    slots = []
    for i, (site, group) in enumerate(zip(sites, groups)):
        if site.name in left or not isinstance(site.action, AxisAction):
            continue
        for member, name in zip(site.action.members, site.members):
            if name is None:
                continue
            found = _view(params[name].data, member)
            if found is None:
                return None
            whole = group.diagonal and member.start is None and member.outer == 1 and member.inner == 1
            slot = _Slot(i, params[name], member, found[0], found[1], float(member.power), whole, params[name].data_ptr())
            slot.narrow, slot.shape = _part_of(params[name], member)
            slots.append(slot)
    return slots


def _part_of(param: Tensor, member: Member) -> tuple[tuple[int, int, int] | None, tuple[int, ...] | None]:
    """How :meth:`Member.part_view <teleopt.actions.axis.Member.part_view>` takes the member's part of a tensor
    shaped as ``param`` (its gradient, its moments): the slice (axis, start, length) and the split shape, so a
    teleport takes the parts of the live tensors without the member's lookups (``groups == 1`` here)."""
    axis = member.axis % param.ndim
    narrow = None if member.start is None or member.stop is None else (axis, member.start, member.stop - member.start)
    if member.outer == 1 and member.inner == 1:
        return narrow, None
    shape = list(param.shape)
    if narrow is not None:
        shape[axis] = narrow[2]
    n = shape[axis] // (member.outer * member.inner)
    return narrow, (*shape[:axis], member.outer, n, member.inner, *shape[axis + 1 :])


def _floors(objective: Balance, sites: Sequence[Site], params: dict[str, nn.Parameter]) -> list[float]:
    """Per site, the move below which it stays (:class:`Balance`'s ``min_move``, else sqrt(eps) of its dtype)."""
    if objective.min_move is not None:
        return [objective.min_move] * len(sites)
    return [math.sqrt(torch.finfo(params[next(n for n in s.members if n is not None)].dtype).eps) for s in sites]


def _lanes_agree(lanes: Sequence[_Lane], rules: dict[tuple[int, str], str], optimizer: torch.optim.Optimizer) -> bool:
    """Whether every lane's parameters have the same state keys under the same rules (one kernel per key)."""
    for lane in lanes:
        keys = {tuple((k, rules[(id(s.param), k)]) for k in optimizer.state[s.param]) for s in lane.slots}
        if len(keys) != 1:
            return False
    return True


def build_plan(engine: TeleportEngine, sites: list[Site], skipped: dict[str, str]) -> BalancePlan | None:
    """The plan of ``sites`` (module docs), or ``None`` where the lean path does not give the engine's result."""
    cfg = engine.config
    objective = cfg.objective
    assert isinstance(objective, Balance)
    params = dict(cfg.module.named_parameters())
    if not sites or any(isinstance(s.action, AxisAction) and type(s.action).exp is not GroupAction.exp for s in sites):
        return None  # other actions stay at the identity, as in the engine's closed form (``_admit``)
    names = [n for s in sites for n in s.members if n is not None]
    if any(n not in params or params[n].dtype not in (torch.float32, torch.float64) for n in names):
        return None  # a buffer member (the engine moves it), or a 16-bit one (elements exact in its dtype)
    groups = [s.action.group(tuple(None if n is None else params[n] for n in s.members)) for s in sites]
    _, left = _admit(sites, groups, params, set(params))  # sites the closed form leaves at the identity, as the engine does
    slots = _slots(sites, groups, params, left)
    coupled = None if slots is None else _overlaps(slots)
    if coupled and any(not g.diagonal for s, g in zip(sites, groups) if s.name not in left):
        coupled = None  # a chain of scalings beside other groups: the engine decides
    states = None if slots is None or coupled is None else _state_plan(engine, slots, groups)
    if slots is None or states is None:
        return None
    radii = [engine._trust_region(s, _Groups(cfg.optimizer, params)) for s in sites]  # type: ignore[arg-type]
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(groups):
        if sites[i].name not in left:
            buckets.setdefault((type(g), g.coord_shape, radii[i]), []).append(i)
    buckets_of = list(buckets.values())
    bucket_of = {i: b for b, members in enumerate(buckets_of) for i in members}
    lanes = _lanes(slots, groups, bucket_of)
    for lane in lanes:  # where a GL lane's sites sit in their bucket's stacked block matrices
        places = [buckets_of[lane.bucket].index(i) for i in lane.sites]
        if lane.matrix and places != list(range(len(buckets_of[lane.bucket]))):
            lane.rows = torch.tensor(places, device=lane.slots[0].view.device)
    if not _lanes_agree(lanes, states[0], cfg.optimizer):
        return None
    plan = BalancePlan(sites, dict(skipped), groups, radii, slots, buckets_of, lanes, _floors(objective, sites, params), *states)
    unique = {id(s.param): s.param for s in slots}.values()
    plan.params = [(p, p.data_ptr(), tuple(cfg.optimizer.state[p])) for p in unique]
    plan.signature, plan.matrix = tuple(s.name for s in sites), any(lane.matrix for lane in lanes)
    plan.zeros = [torch.zeros(g.coord_shape or (), dtype=torch.float64) for g in groups]
    # as the engine's watch_elements: a site's first tensor's dtype, float32 at least (elements are float64)
    first = {s.site: s.param.dtype for s in reversed(slots)}  # a site with no such tensor: its first moved member
    dtypes = [params[s.tensor_names[0]].dtype if s.tensor_names[0] in params else first.get(i, torch.float64) for i, s in enumerate(sites)]
    plan.watch_dtypes = [torch.promote_types(d, torch.float32) for d in dtypes]
    _fix_state(plan, cfg.optimizer)
    trainable = {id(p) for g in cfg.optimizer.param_groups for p in g["params"] if p.requires_grad}
    if coupled:  # what the engine's weight-norm model reads: the live tensors and the trainable names
        tensors = {n: params[n].detach() for site in sites for n in site.tensor_names if n in params}
        counted = {n for n in tensors if id(params[n]) in trainable}
        plan.chain = Chain(tensors, counted, WeightNormModel(sites, groups, tensors, counted))
    moved = {id(s.param) for s in slots}
    still = {n for site in sites for n in site.tensor_names if n in params and id(params[n]) in trainable}
    plan.still = [params[n].data for n in sorted(still) if id(params[n]) not in moved]  # as WeightNormModel.still
    return plan


def _fix_state(plan: BalancePlan, optimizer: torch.optim.Optimizer) -> None:
    """What a teleport reads of the state policy's decisions (the state keys are checked unchanged before each):
    per lane the moved entries with their rule, and the report's counts (per parameter, as the engine counts)."""
    for lane in plan.lanes:
        first, p = lane.slots[0].param, -lane.slots[0].power  # moments move as the gradient, a covector
        for key in optimizer.state[first]:
            rule = plan.state[(id(first), key)]
            power = p if rule == "covector" else plan.groups[lane.sites[0]].second_moment_power(p)
            if rule != "keep":
                assert power is not None  # the plan admits second moments only where the rule exists
                lane.moments.append((key, rule, power))
    counts: dict[str, int] = {}
    for param in {id(s.param): s.param for s in plan.slots}.values():
        for key in optimizer.state[param]:
            said = plan.decisions[(id(param), key)]
            counts[said] = counts.get(said, 0) + 1
    plan.counts = counts


class _Groups:
    """What :meth:`TeleportEngine._trust_region` reads of a context: each parameter's group by name."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter]) -> None:
        by_id = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.groups = {n: by_id[id(p)] for n, p in params.items() if id(p) in by_id}


@dataclass(repr=False)
class _Lane:
    """Slots of one bucket that stack: the same group kind, view shape, axis, power and dtype (one kernel each)."""

    slots: list[_Slot]
    blocks: int  # the acted-on axis viewed as (blocks, n): GL blocks, or one unit per "block" for scalings
    n: int
    matrix: bool  # block matrices (GL, stacked); else elementwise factors (scalings, in place)
    others: tuple[int, ...] = ()  # the view's axes the group does not act on (a scaling's statistic sums over them)
    broadcast: tuple[int, ...] = ()  # the shape (S, ...) a scaling's stacked factors take to multiply the views
    sites: list[int] = field(default_factory=list)  # each slot's site
    moments: list[tuple[str, str, float]] = field(default_factory=list)  # the state entries it moves: rule, power
    #: what a scalings' lane multiplies: per target its slots and the tensor (a member's view); where the slots tile
    #: their parameters (:func:`_tiles`), each whole parameter (its ``.data``) with the factors of its slots
    targets: list[tuple[list[_Slot], Tensor]] = field(default_factory=list)
    tiled: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the stacked factors' expanded and per-target shapes
    #: a scalings' statistics from one norm per target: the target's axes reduced, then (tiled) the norms' squares
    #: as (S, outer, n, inner) and the split axes summed (``()``: none); untiled, each view's other axes
    reduce: tuple[int, ...] = ()
    units: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: a one-block GL lane whose acted-on axis has only unit axes before it (``"rows"``) or after it (``"cols"``): its
    #: stacked parts multiply as (S, n, rest) or (S, rest, n) views, with no transposed copy (:meth:`columns`)
    side: str | None = None
    bucket: int = 0  # the bucket of its sites
    rows: Tensor | None = None  # a GL lane: its slots' sites' places in their bucket (``None``: the bucket in order)

    def columns(self, x: Tensor) -> Tensor:
        """Stacked parts (S, *view) as (S, blocks, n, rest)."""
        moved = x.movedim(self.slots[0].axis + 1, 1)
        return moved.reshape(moved.shape[0], self.blocks, self.n, -1)

    def back(self, y: Tensor, x: Tensor) -> Tensor:
        """:meth:`columns` undone: ``y`` in the layout of the stacked parts ``x``."""
        moved = x.movedim(self.slots[0].axis + 1, 1)
        return y.reshape(moved.shape).movedim(1, self.slots[0].axis + 1)


def _lanes(slots: Sequence[_Slot], groups: Sequence[Group], bucket_of: dict[int, int]) -> list[_Lane]:
    lanes: dict[tuple[Any, ...], list[_Slot]] = {}
    for s in slots:
        key = (bucket_of[s.site], tuple(s.view.shape), s.axis, s.power, s.view.dtype, s.whole)
        lanes.setdefault(key, []).append(s)
    out = []
    for members in lanes.values():
        group = groups[members[0].site]
        size = group.block_size
        matrix = size is not None and not group.diagonal
        lane = _Lane(members, group.dim // size if matrix and size else group.dim, size if matrix and size else 1, matrix)
        axis, ndim = members[0].axis, members[0].view.ndim
        lane.others = tuple(d for d in range(ndim) if d != axis)
        lane.broadcast = (len(members), *(lane.blocks if d == axis else 1 for d in range(ndim)))
        lane.sites, lane.bucket = [s.site for s in members], bucket_of[members[0].site]
        if matrix and lane.blocks == 1:
            shape = members[0].view.shape
            lane.side = "rows" if all(d == 1 for d in shape[:axis]) else "cols" if all(d == 1 for d in shape[axis + 1 :]) else None
        tiles = None if matrix else _tiles(members)
        lane.targets = [([s], s.view) for s in members] if tiles is None else [(t, t[0].param.data) for t in tiles]
        if tiles is not None:
            lane.tiled = _tiled_shapes(lane, tiles)
            first = members[0]
            axis, split = first.member.axis % first.param.ndim, first.shape is not None
            lane.reduce = tuple(d for d in range(first.param.ndim) if d != axis)
            lane.units = ((len(members), *first.view.shape[axis : axis + 3]), (1, 3)) if split else ((len(members), lane.blocks), ())
        elif not matrix:
            lane.reduce = lane.others
        out.append(lane)
    return out


def _tiles(slots: Sequence[_Slot]) -> list[list[_Slot]] | None:
    """The slots per parameter where they tile their parameters: each parameter's slots consecutive, in the
    order of their parts along the acted-on axis, covering it, as many for every parameter (a scaling of each
    head's rows of q, say); then a teleport multiplies whole tensors, without taking each member's part."""
    tiles: list[list[_Slot]] = []
    for s in slots:
        if tiles and tiles[-1][0].param is s.param:
            tiles[-1].append(s)
        elif any(t[0].param is s.param for t in tiles):
            return None
        else:
            tiles.append([s])
    for tile in tiles:
        param, axis = tile[0].param, tile[0].member.axis % tile[0].param.ndim
        length = param.shape[axis] if tile[0].narrow is None else tile[0].narrow[2]
        starts = [0 if s.narrow is None else s.narrow[1] for s in tile]
        if len(tile) != len(tiles[0]) or starts != [j * length for j in range(len(tile))] or length * len(tile) != param.shape[axis]:
            return None
    return tiles


def _tiled_shapes(lane: _Lane, tiles: list[list[_Slot]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stacked factors (S, *broadcast) expanded over the slot's split (outer, inner) and the shape that makes them
    per parameter: (P, 1, ..., axis length, ..., 1), the slots' parts in order along the axis."""
    first = lane.slots[0]
    param, axis = first.param, first.member.axis % first.param.ndim
    split = () if first.shape is None else (axis, axis + 2)  # the view's outer and inner axes
    expand = (len(lane.slots), *(first.view.shape[d] if d in split else size for d, size in enumerate(lane.broadcast[1:])))
    whole = (len(tiles), *(param.shape[d] if d == axis else 1 for d in range(param.ndim)))
    return expand, whole
