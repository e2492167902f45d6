"""One site per symmetry: continuous sites acting on the same axis of a tensor are merged or composed.

Detection's rules can propose one symmetry twice: with separate q/k/v/o projections the
generic rule finds a ``gl_linear`` site on the value rows and the output projection's
columns (one GL(d_head) shared by every head), and the attention rule finds
``attention_vo_gl`` on the same axes (a GL(d_head) per head, which contains it).  A
teleport searching both composes their elements on that axis, each at its own trust
region's boundary, so the move of the axis is bounded by twice the radius, not by the
documented trust region (Zhao 2026, Sec. 4.3: the search stays in a region of the group
coordinates).  :func:`merge_overlapping` therefore

* **merges** a GL site into another that contains it (the same parts of the same tensor
  axes, the larger acting by independent contiguous blocks that each hold whole blocks of
  the smaller, with powers equal or all flipped): the smaller is left out, and the report
  names the site it was merged into;
* **composes** the continuous sites that still act on a common part of an axis (scalings of
  one axis in two layouts, sites whose members differ): each keeps its group, and
  ``site.info["trust_fraction"] = 1 / k`` (k the sites of its connected component of the
  overlap graph) scales its trust region, so the combined move of every axis stays within
  one radius (log-scales add; singular values of a product of k elements multiply to at
  most e^(k r / k)).

Sites on different axes of one tensor (a layer's rows and its columns) compose as the
papers' layer-wise teleports do and are left as they are; so are actions that do not say
which axes they act on (no :class:`~teleopt.actions.axis.AxisAction` members).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from teleopt.site import Site, lookup_tensor

__all__ = ["compose_overlapping", "footprint", "merge_overlapping"]

#: (tensor name, axis, start, stop): a part of one axis of one tensor a site acts on
Part = tuple[str, int, int, int]


def footprint(model: nn.Module, site: Site) -> list[Part] | None:
    """The parts of tensor axes ``site`` acts on (``None``: its action does not say)."""
    members = getattr(site.action, "members", None)
    if members is None:
        return None
    parts = []
    for member, name in zip(members, site.members):
        axis = getattr(member, "axis", None)
        if name is None or axis is None or getattr(member, "power", 1) == 0:  # power 0: read, not moved
            continue
        tensor = lookup_tensor(model, name)
        length = tensor.shape[axis] if -tensor.ndim <= axis < tensor.ndim else 0
        start = member.start if member.start is not None else 0
        stop = member.stop if member.stop is not None else length
        parts.append((name, axis % max(tensor.ndim, 1), start, stop))
    return parts


def _overlap(a: Sequence[Part], b: Sequence[Part]) -> Part | None:
    for name, axis, lo, hi in a:
        for name2, axis2, lo2, hi2 in b:
            if name == name2 and axis == axis2 and max(lo, lo2) < min(hi, hi2):
                return (name, axis, max(lo, lo2), min(hi, hi2))
    return None


def _contains(model: nn.Module, big: Site, small: Site) -> bool:
    """Whether GL site ``big`` contains ``small``'s action (see module docs), both acting on the same parts."""
    gb, gs = (s.action.group(s.tensors(model)) for s in (big, small))
    if gb.kind != "general" or gs.kind != "general" or gb.n % gs.n:
        return False
    mine = {part: m for part, m in zip(footprint(model, big) or [], _members(big))}
    theirs = {part: m for part, m in zip(footprint(model, small) or [], _members(small))}
    if set(mine) != set(theirs) or not all(m.outer == m.inner == 1 and m.groups == 1 for m in mine.values()):
        return False
    if not all(m.inner == 1 and m.groups == 1 for m in theirs.values()):
        return False
    flips = {theirs[p].power / mine[p].power for p in mine if mine[p].power}
    return flips in ({1.0}, {-1.0})


def _members(site: Site) -> list:
    return [
        m for m, name in zip(getattr(site.action, "members", ()), site.members) if name is not None and getattr(m, "axis", None) is not None
    ]


def _size(model: nn.Module, site: Site) -> int:
    shape = site.action.group(site.tensors(model)).coord_shape
    return math.prod(shape) if shape is not None else 0


def merge_overlapping(model: nn.Module, sites: Sequence[Site]) -> tuple[list[Site], list[tuple[str, str, str]]]:
    """``sites`` with GL sites contained in a larger overlapping one merged into it and the other overlapping
    continuous sites composed under one trust region (see module docs), in their order; and a note
    ``("site", name, reason)`` per site merged away."""
    parts = [footprint(model, s) if s.action.continuous else None for s in sites]
    order = sorted(range(len(sites)), key=lambda i: -(_size(model, sites[i]) if parts[i] is not None else 0))
    dropped: dict[int, str] = {}
    for a, i in enumerate(order):
        for j in order[a + 1 :]:
            if j in dropped or i in dropped or parts[i] is None or parts[j] is None:
                continue
            clash = _overlap(parts[j] or (), parts[i] or ())
            if clash is not None and _contains(model, sites[i], sites[j]):
                name, axis, lo, hi = clash
                dropped[j] = (
                    f"merged into {sites[i].name}: both act on axis {axis} of {name} [{lo}:{hi}] and its group contains this "
                    "one's, so one element bounded by one trust region moves those axes"
                )
    kept = compose_overlapping(model, [s for i, s in enumerate(sites) if i not in dropped])
    return kept, [("site", sites[j].name, why) for j, why in sorted(dropped.items())]


def compose_overlapping(model: nn.Module, sites: Sequence[Site]) -> list[Site]:
    """``sites`` with every continuous site that shares a part of an axis with another given
    ``info["trust_fraction"] = 1 / k``, k the sites of its connected component of the overlap graph
    (see module docs); the others as they are."""
    parts = [footprint(model, s) if s.action.continuous else None for s in sites]
    live = [i for i in range(len(sites)) if parts[i] is not None]
    root = {i: i for i in live}

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for a, i in enumerate(live):
        for j in live[a + 1 :]:
            if _overlap(parts[i] or (), parts[j] or ()) is not None:
                root[find(j)] = find(i)
    size = {r: sum(find(i) == r for i in live) for r in set(map(find, live))}
    out = []
    for i, site in enumerate(sites):
        k = size[find(i)] if i in root else 1
        out.append(site if k == 1 else replace(site, info={**site.info, "trust_fraction": 1.0 / k}))
    return out
