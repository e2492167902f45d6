"""The ``balance`` teleport: the point of least weight norm on the orbit, in closed form.

The idea of equi-normalization (ENorm, Stock et al. 2019): among the points of a
symmetry orbit, pick the one with the smallest sum of squared Frobenius norms of
the site members, N(g) = sum_m ||(g . w)_m||^2 over the trainable members.  For
exact linear sites N depends on a site's element only through a small statistic
of its members (:meth:`Group.norm_statistic <teleopt.groups.Group.norm_statistic>`):
per-unit sums of squares for positive scalings, Gram matrices for GL.  With the
other sites fixed, a site's minimiser is in closed form
(:meth:`Group.balance <teleopt.groups.Group.balance>`): c_i = (b_i / a_i)^(1/4)
for a rescaling between layers (a_i the squared norm of unit i's incoming row and
bias, b_i of its outgoing column), the geometric-mean element equalising the two
Gram matrices for GL.

For a GL site such as a LoRA pair B A (``teleopt.lora_sites``) that element is the
*balanced* pair, A A^T = B^T B, where the conserved quantity of gradient flow
A A^T - B^T B (Zhao 2026, Ex. 2.5.3) vanishes: g = P^1/2 with P the matrix geometric
mean (A A^T)^-1 # B^T B, and g = (B^T B)^1/4 when A has orthonormal rows.  Plain
training never balances a pair that starts unbalanced (peft starts at B = 0), and
every g in GL_r leaves B A unchanged (Hu et al., ICLR 2022; Du, Hu and Lee,
NeurIPS 2018).  A unit or block without a balanced point, where one side is
singular to ``rcond`` relative to its largest eigenvalue or mass (B = 0 at
initialisation, a rank-deficient Gram matrix, a dead unit), keeps zero coordinates:
the norm has no minimum there, only an infimum at a singular element.

Sites that share a tensor interact (a layer's rows belong to one site, its columns
to the previous one), so the sites are solved by block-coordinate descent: a site
is solved again when a neighbour moved by more than ``tol`` in its coordinates.
Each block minimisation is exact inside the trust region (the per-unit problems
are convex in the log-scale, so clipping the minimiser to the region is the
constrained minimiser), hence N decreases monotonically; N is convex in the
log-scales (a sum of exponentials of linear functions), so the sweeps converge to
the minimum over the box.  A scaling site's step is over-relaxed (:func:`over_relaxed`:
``RELAXATION`` times the way to its block minimiser, still monotone), which reaches the
tolerance in fewer sweeps on chains, where plain sweeps converge linearly.

Work per sweep: each tensor whose acting sites are all scalings on whole axes is
reduced once to S, its sums of squares over the axes no site acts on (a Linear
weight between two rescaled layers is its own square); a site's statistic is then
a contraction of S with the other axes' factors c^(2 p) (a matrix-vector product).
Other tensors (GL sites, slices of fused tensors) are moved by the other sites'
current elements and read again.

Sites are left at the identity (and named in :attr:`BalanceResult.skipped`) when
the closed form does not apply: actions that are not :class:`~teleopt.actions.axis.AxisAction`,
groups without :meth:`~teleopt.groups.Group.balance`, a site acting on two axes of
one tensor (its units are then coupled), or a site acting on the same axis of a
tensor as an earlier site when the two do not commute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.groups import BALANCE_RCOND, Group
from teleopt.sharding import full, is_sharded, square_sum, sum_over
from teleopt.site import Site

__all__ = ["BalanceResult", "WeightNormModel", "balance_coordinates"]

_Entry = tuple[int, Member, Group]  # (site index, member, the site's group)

#: the over-relaxation factor of a scaling site's block step (:func:`over_relaxed`), in (0, 2): 1 is plain
#: block-coordinate descent; on ReLU chains 1.2 reached the sweeps' tolerance in the fewest passes
RELAXATION = 1.2


@dataclass
class BalanceResult:
    """Coordinates per site, N at the identity and (with ``trace``) after each sweep, the number of sweeps
    and the sites left at the identity with the reason."""

    coords: list[Tensor]
    norm_start: float
    sweeps: int
    norms: list[float] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _diagonal(group: Group) -> bool:
    return group.square_factor(group.identity(), 1.0) is not None


def _whole_axis(member: Member) -> bool:
    return member.start is None and member.outer == 1 and member.inner == 1 and member.groups == 1


def _commute(a: _Entry, b: _Entry, ndim: int) -> bool:
    """Whether two sites' actions on one tensor commute (so each site's statistic ignores the other's order)."""
    (_, ma, ga), (_, mb, gb) = a, b
    if ma.axis % ndim != mb.axis % ndim or (_diagonal(ga) and _diagonal(gb)):
        return True
    # disjoint slices of the axis commute whatever their outer/inner layout (it stays inside each slice)
    plain = all(m.groups == 1 and m.start is not None for m in (ma, mb))
    return plain and (ma.stop is not None and mb.stop is not None) and (ma.stop <= (mb.start or 0) or mb.stop <= (ma.start or 0))


class _Reduced:
    """A tensor acted on by scalings on whole, distinct axes, kept as its sums of squares S over the other axes
    (a plain tensor acted on along every axis: read a chunk of rows at a time, :meth:`_einsum`, never kept), in the
    tensor's own precision (float32 at least): the statistics it yields are read in float64."""

    def __init__(self, tensor: Tensor, entries: list[_Entry]) -> None:
        axes = [m.axis % tensor.ndim for _, m, _ in entries]
        other = [d for d in range(tensor.ndim) if d not in axes]
        t, self.dtype = tensor.detach(), torch.float64 if tensor.dtype == torch.float64 else torch.float32
        self.lazy = not other and not is_sharded(t)  # DTensors (FSDP2): reduced on the shards, then gathered
        self.S = None if self.lazy else full(sum_over(t.to(self.dtype).square(), other))
        self.source, self.other = t, other
        order = sorted(axes)
        self.letters = "abcdefghij"[: len(axes)]
        self.positions = [order.index(a) for a in axes]
        self.entries = entries

    def reread(self) -> None:
        """S again from the (plain, unsharded) tensor's current values, from its norms (no squared copy)."""
        if not self.lazy:
            self.S = torch.linalg.vector_norm(self.source.to(self.dtype), dim=self.other).square()

    def _einsum(self, operands: str, out: str, factors: list[Tensor]) -> Tensor:
        """``einsum(operands -> out, S, *factors)``; a lazy S by chunks of rows (letter ``a``: joined, else summed)."""
        if self.S is not None:
            return torch.einsum(operands + "->" + out, self.S, *factors)
        t, letters, rows, parts = self.source, operands.split(",")[1:], max(1, _CHUNK // max(1, self.source[0].numel())), []
        for i in range(0, t.shape[0], rows):
            fs = [f[i : i + rows] if letter == "a" else f for f, letter in zip(factors, letters)]
            parts.append(torch.einsum(operands + "->" + out, t[i : i + rows].to(self.dtype).square(), *fs))
        return torch.cat(parts) if out == "a" else torch.stack(parts).sum(0)

    def _factors(self, elements: Sequence[Tensor]) -> list[Tensor]:  # diagonal groups only: a square factor each
        return [cast(Tensor, grp.square_factor(elements[i], m.power)).to(self.dtype) for i, m, grp in self.entries]

    def add_stats(self, site: int, elements: Sequence[Tensor], stats: dict[float, Tensor]) -> None:
        factors = self._factors(elements)
        for k, (i, m, _) in enumerate(self.entries):
            if i != site:
                continue
            others = [j for j in range(len(self.entries)) if j != k]
            operands = self.letters + "".join("," + self.letters[self.positions[j]] for j in others)
            marginal = self._einsum(operands, self.letters[self.positions[k]], [factors[j] for j in others])
            _add(stats, float(m.power), marginal.to(torch.float64))

    def value(self, elements: Sequence[Tensor]) -> Tensor:
        return self._einsum(self.letters + "".join("," + self.letters[p] for p in self.positions), "", self._factors(elements))


#: elements per chunk of rows of a tensor whose whole square a weight-norm term reads (:meth:`_Reduced._einsum`)
_CHUNK = 1 << 20


class _Explicit:
    """Any other tensor: moved by the other sites' current elements, then read by the site's group."""

    def __init__(self, tensor: Tensor, entries: list[_Entry]) -> None:
        self.source = tensor.detach()
        self.tensor = full(self.source).to(torch.float64)
        self.entries = sorted(entries, key=lambda e: e[0])  # sites act in list order

    def reread(self) -> None:
        """The (plain, unsharded) tensor's current values again."""
        self.tensor = self.source.to(torch.float64)

    def moved(self, elements: Sequence[Tensor], skip: int | None = None) -> Tensor:
        x = self.tensor
        for i, m, grp in self.entries:
            if i != skip:
                x = m.transform(x, _acting(grp, elements[i], m.power))
        return x

    def add_stats(self, site: int, elements: Sequence[Tensor], stats: dict[float, Tensor]) -> None:
        x = self.moved(elements, skip=site)
        for i, m, grp in self.entries:
            if i == site:
                stat = grp.norm_statistic(*m.part_view(x))
                assert stat is not None  # checked when the site was admitted
                _add(stats, float(m.power), stat)

    def value(self, elements: Sequence[Tensor]) -> Tensor:
        return self.moved(elements).square().sum()


def _acting(group: Group, g: Tensor, power: float) -> Callable[[Tensor, int], Tensor]:
    return lambda part, axis: group.act_on_axis(g, part, axis, power)


def _add(stats: dict[float, Tensor], power: float, value: Tensor) -> None:
    stats[power] = stats[power] + value if power in stats else value


def _admit(
    sites: Sequence[Site], groups: Sequence[Group], tensors: Mapping[str, Tensor], counted: set[str]
) -> tuple[dict[str, list[_Entry]], dict[str, str]]:
    """Per counted tensor, the entries of the sites the closed form solves; and the skipped sites with why."""
    skipped: dict[str, str] = {}
    entries: dict[str, list[_Entry]] = {}
    for i, (site, grp) in enumerate(zip(sites, groups)):
        action = site.action
        if not isinstance(action, AxisAction):
            skipped[site.name] = f"{type(action).__name__} is not an axis action"
            continue
        mine = [(n, m) for n, m in zip(site.members, action.members) if n is not None and n in counted]
        if not mine:
            skipped[site.name] = "no trainable member"
            continue
        if not grp.has_balance:
            skipped[site.name] = f"{grp!r} has no closed-form minimum norm"
            continue
        axes: dict[str, set[int]] = {}
        for n, m in mine:
            axes.setdefault(n, set()).add(m.axis % tensors[n].ndim)
        if any(len(a) > 1 for a in axes.values()):
            skipped[site.name] = "acts on two axes of one tensor (its units are coupled)"
            continue
        clash = [n for n, m in mine for e in entries.get(n, []) if not _commute(e, (i, m, grp), tensors[n].ndim)]
        if clash:
            skipped[site.name] = f"does not commute with an earlier site on {clash[0]!r}"
            continue
        for n, m in mine:
            entries.setdefault(n, []).append((i, m, grp))
    return entries, skipped


class WeightNormModel:
    """N(g) = sum of squared norms of the ``counted`` members of ``sites`` at g . w, prepared once per teleport.

    ``tensors`` maps every member name to its tensor.  :meth:`value` is differentiable in the elements
    (an ascent may use it); :meth:`solve` is the block-coordinate minimisation of the module docs.
    """

    def __init__(self, sites: Sequence[Site], groups: Sequence[Group], tensors: Mapping[str, Tensor], counted: set[str]) -> None:
        self.sites, self.groups = list(sites), list(groups)
        #: per site, the dtype of its first member (what rounding a balanced site shows)
        self.dtypes = [next(tensors[n].dtype for n in s.members if n is not None) for s in sites]
        entries, self.skipped = _admit(sites, groups, tensors, counted)
        self.terms: list[_Reduced | _Explicit] = []
        self.terms_of: dict[int, list[_Reduced | _Explicit]] = {}
        for n, es in entries.items():
            reducible = all(_diagonal(grp) and _whole_axis(m) for _, m, grp in es)
            term: _Reduced | _Explicit = _Reduced(tensors[n], es) if reducible else _Explicit(tensors[n], es)
            self.terms.append(term)
            for i in {i for i, _, _ in es}:
                self.terms_of.setdefault(i, []).append(term)
        self.neighbours = {i: {j for t in ts for j, _, _ in t.entries} - {i} for i, ts in self.terms_of.items()}
        others = {n for s in sites for n in s.tensor_names if n in counted} - set(entries)
        self.others = [tensors[n].detach() for n in sorted(others)]
        self.still = square_sum(self.others)  # sharded: summed over ranks (same order everywhere)

    def reread(self) -> None:
        """The statistics again from the tensors' current values, for a model built once and kept (the lean
        balance path's plan, :mod:`~teleopt.teleport.balance_plan`): the tensors must be plain (unsharded), in
        place since it was built.  Values as a model built now, up to the order of summation of :attr:`still`."""
        for t in self.terms:
            t.reread()
        if self.others:
            self.still = float(torch.stack(torch._foreach_norm(self.others)).to(torch.float64).square().sum())

    def value(self, elements: Sequence[Tensor]) -> Tensor:
        """N at the elements (float64)."""
        total = torch.zeros((), dtype=torch.float64, device=elements[0].device if elements else None) + self.still
        for t in self.terms:
            total = total + t.value(elements).to(torch.float64)
        return total

    def _stats(self, site: int, elements: Sequence[Tensor]) -> dict[float, Tensor]:
        """Site ``site``'s statistics with the other sites at ``elements``."""
        stats: dict[float, Tensor] = {}
        for t in self.terms_of[site]:
            t.add_stats(site, elements, stats)
        return stats

    def _move(self, i: int, new: Tensor | None, coords: list[Tensor], elements: list[Tensor]) -> float:
        """Site ``i`` to its solved coordinates; returns how far they moved (max abs change)."""
        assert new is not None  # admitted sites have a closed form
        new = new.to(coords[i])
        change = _change(new, coords[i])
        coords[i], elements[i] = new, self.groups[i].exp(new)
        return change

    def solve(
        self,
        radii: Sequence[float | None],
        start: Sequence[Tensor],
        max_sweeps: int = 50,
        tol: float = 1e-3,
        trace: bool = False,
        rcond: float = BALANCE_RCOND,
    ) -> BalanceResult:
        """Coordinates minimising N, each site's inside its radius (``None``: unbounded), from ``start`` (the
        identity's coordinates).  A site is solved again while a neighbour's coordinates moved by more than
        ``tol`` (max abs change), at most ``max_sweeps`` passes; with ``trace``, N after each pass is recorded.
        Units and blocks singular to ``rcond`` stay (:meth:`Group.balance <teleopt.groups.Group.balance>`)."""
        groups = self.groups
        coords = [c.detach().clone() for c in start]
        elements = [grp.exp(c) for grp, c in zip(groups, coords)]
        norm_start = float(self.value(elements))
        norms = [norm_start] if trace else []
        dirty = set(self.terms_of)
        order = sorted(self.terms_of)
        sweeps = 0
        while dirty and sweeps < max_sweeps:
            sweeps += 1
            # sites sharing no tensor with another are independent: those of one kind and size are solved together
            # (Group.balance_many: LoRA pairs of one rank, attention blocks of one head size); the rest in order
            alone = [i for i in order if i in dirty and not self.neighbours[i]]
            for batch in _alike(alone, groups, coords, radii):
                stats = [self._stats(i, elements) for i in batch]
                for i, new in zip(batch, groups[batch[0]].balance_many(stats, radii[batch[0]], rcond)):
                    dirty.discard(i)  # no neighbours to mark
                    self._move(i, new, coords, elements)
            for i in order:
                if i in dirty:
                    dirty.discard(i)
                    mine = self._stats(i, elements)
                    best = groups[i].balance(mine, radii[i], rcond)
                    new = over_relaxed(groups[i], best, coords[i], mine, radii[i])
                    if new is not best and _change(best, coords[i]) <= tol:
                        new = best  # near the minimum: the block minimiser itself, as without relaxation
                    if self._move(i, new, coords, elements) > tol:  # an over-relaxed site is past its minimiser: again
                        dirty |= self.neighbours[i] if new is best else self.neighbours[i] | {i}
            if trace:
                norms.append(float(self.value(elements)))
        return BalanceResult(coords, norm_start, sweeps, norms, dict(self.skipped))


def _change(new: Tensor | None, old: Tensor) -> float:
    """max |new - old| (0 for empty coordinates)."""
    assert new is not None  # admitted sites have a closed form
    return float((new.to(old) - old).abs().max()) if new.numel() else 0.0


def over_relaxed(group: Group, new: Tensor | None, old: Tensor, stats: Mapping[float, Tensor], radius: float | None) -> Tensor | None:
    """A scaling site's block step over-relaxed (successive over-relaxation, Young 1950): ``old + RELAXATION *
    (new - old)``, clipped to the trust region, where ``new`` is its block minimiser with the neighbours fixed.

    Only for diagonal groups whose statistics have two powers p and -p (a unit's writer and reader: ReLU chains,
    conv chains): along unit i, N is then const + 2 sqrt(a_i b_i) cosh(2 p (x_i - x_i*)), symmetric about the
    minimiser x_i*, so a step by any factor in (0, 2) of the way to it does not increase N, and neither does its
    clip to the box (a point between ``old``, inside, and the step).  The fixed point is the block minimiser's, the
    minimum of N; the sweeps reach a tolerance in fewer passes (the Gauss-Seidel sweeps' linear rate on a chain
    is their slowest part).  Units the closed form leaves at 0 (no balanced point) stay at 0.  Other sites: ``new``."""
    powers = [p for p in stats if p != 0]
    if new is None or RELAXATION == 1.0 or not _diagonal(group) or len(powers) != 2 or powers[0] != -powers[1]:
        return new
    new = new.to(old)
    step = torch.where(new != 0, old + RELAXATION * (new - old), new)
    return step if radius is None else step.clamp(-radius, radius)


def _alike(sites: Sequence[int], groups: Sequence[Group], coords: Sequence[Tensor], radii: Sequence[float | None]) -> list[list[int]]:
    """``sites`` bucketed by group class, coordinate shape and dtype, and radius (what one ``balance_many`` takes)."""
    buckets: dict[tuple[object, ...], list[int]] = {}
    for i in sites:
        buckets.setdefault((type(groups[i]), tuple(coords[i].shape), coords[i].dtype, radii[i]), []).append(i)
    return list(buckets.values())


def balance_coordinates(
    sites: Sequence[Site],
    groups: Sequence[Group],
    tensors: Mapping[str, Tensor],
    counted: set[str],
    radii: Sequence[float | None],
    start: Sequence[Tensor],
    max_sweeps: int = 50,
    tol: float = 1e-3,
    trace: bool = False,
    rcond: float = BALANCE_RCOND,
) -> BalanceResult:
    """:meth:`WeightNormModel.solve` of a fresh model: coordinates minimising the squared norm of the
    ``counted`` members over the sites' orbits (see module docs)."""
    return WeightNormModel(sites, groups, tensors, counted).solve(radii, start, max_sweeps, tol, trace, rcond)
