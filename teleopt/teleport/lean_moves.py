"""The lean balance teleport's writes (:mod:`~teleopt.teleport.companion`): every new value computed first, then made at once.

:func:`moves` computes, for one teleport's elements, the moved parts of matrix groups' members and the factors
by which scalings' parameters, moments and gradients are multiplied in place (a chain's gradients' squared norms
after the move read a chunk of rows at a time); :func:`write` makes them with one ``torch._foreach_copy_`` and
in-place ``torch._foreach_mul_`` (an exception between the two moves the copied tensors back by the inverse elements).
:func:`unit_squares` reads a scalings' lane's statistics and :func:`grad_norms` the gradients' squared norms
before and after, in one host read.  The transport rules are the engine's (:mod:`~teleopt.teleport.transport`;
Zhao 2026, Prop. 4.5.1, eq. 4.19: parameters by the action, covectors by its inverse transpose, second moments
by the state policy's powers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from teleopt.teleport.balance_plan import BalancePlan, _Lane, _Slot

__all__ = ["Writes", "grad_norms", "moves", "unit_squares", "write"]


def unit_squares(lane: _Lane, tensors: Sequence[Tensor]) -> Tensor:
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


@dataclass
class Writes:
    """One teleport's writes: new values to copy over their targets (GL parts, gradients), factors to multiply
    targets by in place (scalings' parameters and moments), how to move each copy back (per slot that moved it:
    the slot, the power, and whether the copy is its whole tensor, of which the slot's part moves back), and the
    gradients' squared norms before and after, per lane."""

    targets: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    undo: list[list[tuple[_Slot, float, bool]]] = field(default_factory=list)  # per copy: every slot that moved it
    whole: dict[int, int] = field(default_factory=dict)  # id of a parameter (or a part's gradient) -> its chain entry
    chain: list[tuple[Tensor, list[Tensor]]] = field(default_factory=list)  # a chain's gradients, with their factors
    scaled: list[Tensor] = field(default_factory=list)
    factors: list[Tensor] = field(default_factory=list)
    grad_before: list[Tensor] = field(default_factory=list)  # the moved gradient parts, before and after
    grad_after: list[Tensor] = field(default_factory=list)
    norm_after: list[Tensor] = field(default_factory=list)  # the members' squared norm after the move, per lane
    members_after: list[Tensor] = field(default_factory=list)  # moved members whose squared norms add to it
    grad_squares: list[Tensor] = field(default_factory=list)  # squared norms after the move of in-place gradients
    #: a GL lane's moments of one kind (lane, parts, block matrices, undo per part): moved and copied at the write
    products: list[tuple[_Lane, list[Tensor], Tensor, list[list[tuple[_Slot, float, bool]]]]] = field(default_factory=list)
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


def _product(lane: _Lane, parts: list[Tensor], m: Tensor) -> list[Tensor]:
    """A GL lane's ``parts`` of one kind, stacked, moved by their block matrices ``m`` in one batched product."""
    x = torch.stack(parts)
    if lane.side == "rows":  # one block, as (S, n, rest) and (S, rest, n) views: no transposed copies
        y = (m[:, 0] @ x.reshape(len(parts), lane.n, -1)).reshape(x.shape)
    elif lane.side == "cols":
        y = (x.reshape(len(parts), -1, lane.n) @ m[:, 0].mT).reshape(x.shape)
    else:
        y = lane.back(m @ lane.columns(x), x)
    return list(y.unbind(0))


def _matrix_lane(writes: Writes, lane: _Lane, grads: list[Tensor], moments: list[tuple[list[Tensor], Tensor, float]]) -> None:
    """A GL lane's parameter parts and gradient parts moved (one batched product per kind), queued as copies;
    its moved moments (``(parts, block matrices, power)``) queued as products made at the write, one kind at a
    time (:func:`write`): never every kind's moved copy at once."""
    (_, mp, p), (_, mg, _) = moments[:2]
    params = [s.view for s in lane.slots]
    values = _product(lane, params, mp)
    moved = _product(lane, grads, mg)
    writes.targets += params + grads
    writes.values += values + moved
    writes.undo += [[(s, power, False)] for power in (p, -p) for s in lane.slots]
    writes.members_after += values
    writes.grad_before += grads
    writes.grad_after += moved
    for parts, m, power in moments[2:]:
        writes.products.append((lane, parts, m, [[(s, power, False)] for s in lane.slots]))


def moves(plan: BalancePlan, elements: Sequence[Tensor], optimizer: torch.optim.Optimizer) -> Writes:
    """Every write of the teleport, computed before any is made (module docs)."""
    writes, state, factors = Writes(elements=elements), optimizer.state, _Factors(plan, elements)
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
                _scaled_grads(writes, lane, grads, list(covector.unbind(0)))
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
    _chain_squares(writes)
    return writes


def _scaled_in_place(writes: Writes, lane: _Lane, grads: list[Tensor], covector: Tensor, units: Tensor) -> None:
    """A scalings' lane outside a chain: every gradient part is the lane's own, so it is multiplied in place with
    the parameters; the members' and the gradients' squared norms after the move come from each unit's sum of
    squares before it (``units`` for the members), with no moved copy."""
    p = lane.slots[0].power
    c = torch.stack([writes.elements[i] for i in lane.sites]).reshape(units.shape)
    writes.norm_after.append((units * c ** (2 * p)).sum())
    writes.scaled += grads
    writes.factors += covector.unbind(0)
    writes.grad_before += grads
    writes.grad_squares.append((unit_squares(lane, grads) * c ** (-2 * p)).sum())


def _scaled_grads(writes: Writes, lane: _Lane, grads: list[Tensor], factors: list[Tensor]) -> None:
    """A chain's gradient parts, multiplied in place by every factor (rows, columns); each counted once in the norms."""
    for k, (slots, _) in enumerate(lane.targets):
        key = id(slots[0].param) if lane.tiled is not None or slots[0].whole else id(grads[k])
        if key not in writes.whole:
            writes.whole[key] = len(writes.chain)
            writes.chain.append((grads[k], []))
            writes.grad_before.append(grads[k])
        writes.chain[writes.whole[key]][1].append(factors[k])
    writes.scaled += grads
    writes.factors += factors


def _chain_squares(writes: Writes, rows: int = 1 << 18) -> None:
    """Each chain gradient's squared norm after the move (times its factors), ``rows`` elements at a time."""
    squares = []
    for grad, factors in writes.chain:
        if grad.ndim == 0:  # no rows to chunk (a 0-d gradient; its factors are 0-d too)
            grad = grad.reshape(1)
            factors = [f.reshape(1) for f in factors]
        step = max(1, rows // max(1, grad[0].numel()))  # a factor has its gradient's dimensions (1 where broadcast)
        for i in range(0, grad.shape[0], step):
            part = grad[i : i + step]
            for f in factors:
                part = part * (f[i : i + step] if f.shape[0] > 1 else f)
            squares.append(torch.linalg.vector_norm(part).to(torch.float64).square())
    writes.grad_squares += [torch.stack(squares).sum()] if squares else []


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


def write(writes: Writes, plan: BalancePlan, elements: Sequence[Tensor]) -> None:
    """One ``_foreach_copy_``, each GL lane's moments per kind moved and copied, in-place ``_foreach_mul_`` (module
    docs); an exception undoes what was made (products divided out, copies moved back by the inverses)."""
    # without a chain every scaled tensor is distinct: one call
    rounds = _rounds(writes.scaled, writes.factors) if plan.chain or not writes.scaled else [(writes.scaled, writes.factors)]
    done, copied = 0, []
    try:
        if writes.targets:
            torch._foreach_copy_(writes.targets, writes.values)
            copied.append((writes.targets, writes.undo))
        writes.values, writes.grad_after, writes.members_after = [], [], []  # the moved copies, written: freed
        for lane, parts, m, back in writes.products:
            torch._foreach_copy_(parts, _product(lane, parts, m))
            copied.append((parts, back))
        for scaled, factors in rounds:
            torch._foreach_mul_(scaled, factors)
            done += 1
    except BaseException:  # (an interrupt between two products: the ones made are divided out, to round-off)
        with torch.no_grad():
            for scaled, factors in reversed(rounds[:done]):
                torch._foreach_div_(scaled, factors)
            for target, undo in ((t, u) for targets, undos in copied for t, u in zip(targets, undos)):
                for slot, power, whole in reversed(undo):
                    inverse = plan.sites[slot.site].action.inverse(elements[slot.site])
                    part = _part(slot, target) if whole else target
                    part.copy_(plan.groups[slot.site].act_on_axis(inverse, part, slot.axis, power))
        raise


def grad_norms(
    grads: list[Tensor], writes: Writes, still: list[Tensor], known: float | None = None
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
