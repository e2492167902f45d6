"""Moving named tensors along a list of sites: parameters, covectors and second moments.

A teleport applies one element per site.  Sites may overlap: two positive
rescalings of adjacent hidden layers share the middle weight matrix (rows by one,
columns by the other), and a residual stream ties many tensors.  The composition
order is fixed and documented: **sites act in list order, each on the result of
the sites before it** (``g = g_n ... g_2 g_1``).  For linear actions on different
axes of a shared tensor (the usual overlap) the order does not matter, since left
and right multiplication commute; for actions on the same axis it does.

With this order, the three kinds of tensors a teleport moves follow one rule each
(Zhao 2026, Prop. 4.5.1, eq. 4.19):

* parameters (and buffers that are site members): ``action.act``;
* covectors (gradients, first moments): ``action.transport_gradient``;
* elementwise second moments: ``action.transport_second_moment`` (exact for
  scalings, signs and permutations; ``None`` otherwise, reported as "no rule").

Covectors of sites without a constant Jacobian (data-dependent, learned) have no
closed-form rule either and are reported the same way.

Members absent from the mapping (a buffer has no gradient, a fresh optimizer has
no state yet) are transported as zeros and left out of the result.  A tensor may
appear as several members of one site when they act on disjoint slices of it (q
and k rows of a fused ``qkv`` projection): an axis action that knows them as parts
of one tensor returns the whole transformed tensor for each; otherwise each
output differs from the input only in its slice and the results are merged as
x + sum_i (out_i - x).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from teleopt.site import Site

__all__ = ["transport", "transport_", "TensorKind"]

TensorKind = Literal["params", "covector", "second_moment"]


def transport(
    sites: Sequence[Site],
    elements: Sequence[Tensor],
    values: Mapping[str, Tensor],
    like: Mapping[str, Tensor],
    kind: TensorKind,
) -> tuple[dict[str, Tensor], set[str]]:
    """Move ``values`` (tensor name -> tensor) along ``sites`` in list order.

    ``like`` maps every member name to its tensor at the point the move starts from (the
    live parameter), for the shapes of members absent from ``values`` and, for covectors, the
    values that actions whose rule depends on the point read
    (:meth:`~teleopt.actions.base.GroupAction.transport_gradient_at`; after earlier sites,
    at the point those produced).  Only data-independent actions are moved here
    (data-dependent sites are applied by the general path, which computes each
    site's batch input at the parameters the sites before it produced).

    Returns the moved mapping and the names for which some site had no exact rule
    (second moments under GL, covectors under non-linear actions); those keep the
    value they had before that site.
    """
    out = dict(values)
    no_rule: set[str] = set()
    read = _read_later(sites) if kind == "covector" else [set() for _ in sites]
    point: dict[str, Tensor] = {}  # the parameters after the sites so far, where a later site's rule reads them
    for i, (site, g) in enumerate(zip(sites, elements)):
        names = site.members
        if _identity_matrix(g):
            continue
        reads = kind == "covector" and (bool(read[i]) or site.action.transport_reads_params)
        at = tuple(None if n is None else point.get(n, like[n]) for n in names) if reads else ()
        if read[i]:
            point.update((n, v) for n, v in _merged(site, at, site.action.act(g, at)).items() if n in read[i])
        if not any(n is not None and n in out for n in names):
            continue
        vals = tuple(None if n is None else (out[n] if n in out else torch.zeros_like(like[n])) for n in names)
        if kind == "params":
            new = site.action.act(g, vals)
        elif kind == "covector":
            if not site.action.has_gradient_transport:
                no_rule.update(n for n in names if n is not None and n in values)
                continue
            new = (
                site.action.transport_gradient_at(g, vals, at)
                if site.action.transport_reads_params
                else site.action.transport_gradient(g, vals)
            )
        else:
            moved = site.action.transport_second_moment(g, vals)
            if moved is None:
                no_rule.update(n for n in names if n is not None and n in values)
                continue
            new = moved
        for n, v in _merged(site, vals, new).items():
            if n in values:
                out[n] = v
    return out, no_rule


def transport_(
    sites: Sequence[Site],
    elements: Sequence[Tensor],
    values: Mapping[str, Tensor],
    like: Mapping[str, Tensor],
    kind: TensorKind,
) -> bool:
    """:func:`transport` in place, for axis actions on whole axes or slices of them; returns whether it did.

    Each tensor of ``values`` is moved along each acting site's axis in list order, part by part:
    diagonal and sign groups multiply the part by the element's factors
    (:meth:`Group.act_on_axis_ <teleopt.groups.Group.act_on_axis_>`); matrix groups (GL, O(n)) compute
    the moved part (:meth:`Group.act_on_axis`, its size only) and write it over the part.  Bitwise what
    :func:`transport` returns (the same operation on the same part), with no copy of a whole tensor: a
    fused ``qkv`` weight whose q, k and v rows two sites move is never copied or concatenated.  When some
    site moving a tensor of ``values`` is not such an action (learned or data-dependent actions, outer,
    inner or grouped layouts, a member named twice that the action does not compose as a part, second
    moments under a matrix group, sharded tensors under a matrix group), nothing is touched and ``False``
    is returned: use :func:`transport`.
    """
    from teleopt.actions.axis import AxisAction, _second_moment_power
    from teleopt.sharding import is_sharded

    plan: list[tuple[Any, Tensor, Tensor, int, float]] = []
    for site, g in zip(sites, elements):
        named = [n for n in site.members if n is not None and n in values]
        if not named:
            continue
        action = site.action
        if not isinstance(action, AxisAction) or any(named.count(n) > 1 and not _composes_parts(site, n) for n in named):
            return False
        group = action.group(tuple(None if n is None else like[n] for n in site.members))
        diagonal, idle = group.diagonal, _identity_matrix(g)
        if not diagonal and (group.block_size is None or kind == "second_moment" or any(is_sharded(values[n]) for n in named)):
            return False
        for member, n in zip(action.members, site.members):
            if n is None or n not in values:
                continue
            if member.outer != 1 or member.inner != 1 or member.groups != 1:
                return False
            x = values[n]
            if member.start is not None and is_sharded(x):  # a slice of a shard: moved whole by transport()
                return False
            axis = member.axis % x.ndim
            part = x if member.start is None or member.stop is None else x.narrow(axis, member.start, member.stop - member.start)
            power = member.power if kind == "params" else -member.power
            if idle:
                continue
            plan.append((group, g, part, axis, _second_moment_power(group, power) if kind == "second_moment" else power))
    for group, g, part, axis, power in plan:
        if not group.act_on_axis_(g, part, axis, power):  # matrix groups: the moved part, written over it
            part.copy_(group.act_on_axis(g, part, axis, power))
    return True


def _read_later(sites: Sequence[Site]) -> list[set[str]]:
    """Per site, the tensors it moves that a later site's covector rule reads the values of
    (:attr:`~teleopt.actions.base.GroupAction.transport_reads_params`)."""
    out: list[set[str]] = [set() for _ in sites]
    wanted: set[str] = set()
    for i in range(len(sites) - 1, -1, -1):
        names = {n for n in sites[i].members if n is not None}
        out[i] = names & wanted
        if sites[i].action.transport_reads_params:
            wanted |= names
    return out


def _identity_matrix(g: Tensor) -> bool:
    """Whether ``g`` is a host-side matrix element that is exactly the identity (a site the search left idle,
    :meth:`~teleopt.teleport.search.SearchProblem.idle`): it moves nothing, whatever the kind of tensor (an
    exact rule for second moments too), so a d x d product per member (the residual stream's rotation acts
    on every weight) is skipped.  Elements on a device are not read (False)."""
    if g.device.type != "cpu" or g.ndim < 2 or g.shape[-1] != g.shape[-2] or g.requires_grad:
        return False
    return bool(torch.equal(g, torch.eye(g.shape[-1], dtype=g.dtype).expand(g.shape)))


def _composes_parts(site: Site, name: str) -> bool:
    """Whether the site's action composes all members naming ``name`` itself (axis-action tensor parts)."""
    members = getattr(site.action, "members", None)
    if members is None:
        return False
    keys = {getattr(m, "tensor_key", m.name) for m, n in zip(members, site.members) if n == name}
    return len(keys) == 1


def _merged(site: Site, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor | None]) -> dict[str, Tensor]:
    """Outputs by tensor name.  Members sharing a tensor act on disjoint slices: if the action
    composes them (axis-action parts of one tensor) every output is the whole result; otherwise
    each output changed only its slice and they are merged as x + sum_i (out_i - x)."""
    merged: dict[str, Tensor] = {}
    for n, x, y in zip(site.members, inputs, outputs):
        if n is None or y is None:
            continue
        if n in merged and x is not None and not _composes_parts(site, n):  # x is None only for absent members
            merged[n] = merged[n] + (y - x)
        else:
            merged[n] = y
    return merged
