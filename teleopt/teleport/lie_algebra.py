"""The infinitesimal action of the sites' Lie algebras on their tensors, batched over generators.

A linear action rho of a Lie group on parameters has an infinitesimal action
d rho(M) = d/dt rho(exp(t M)) at t = 0, and exp(t M) . w = exp(t d rho(M)) w, so the
orbit curve gamma_M(t) = exp(t M) . w of papers/001 Sec. 5.2.2 has

    gamma'(0) = d rho(M) w,        gamma''(0) = d rho(M)^2 w,

in closed form.  For an axis action (:class:`~teleopt.actions.axis.AxisAction`) a
member transforming on an axis by the representation ``power`` contributes

* positive scalings: ``x -> power * M * x`` along the axis (M the log-scale rates);
* GL (per block): ``x -> M x`` for ``power=+1`` and ``x -> -M^T x`` for ``power=-1``;
* O(n): ``x -> S x`` with S = (M - M^T) / 2 for either power (``Orthogonal.exp``
  uses the skew part).

Several sites generate one Lie algebra element M = sum_s M_s of the group they
generate together, with d rho(M) = sum_s d rho_s(M_s); the curve exp(t M) . w
equals the product of the sites' one-parameter subgroups when their actions
commute (different axes or tensors, the usual case).  Everything is batched over
k generators (a leading axis of length k), so eq. 5.2's average over k random
curves is a handful of tensor operations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction
from teleopt.groups import GeneralLinear, Group, Orthogonal, PositiveScaling
from teleopt.site import Site

__all__ = ["has_infinitesimal_action", "infinitesimal_action"]


def has_infinitesimal_action(site: Site) -> bool:
    """Whether :func:`infinitesimal_action` covers ``site``: axis actions of scalings, GL or O(n) whose
    members act on whole axes or slices of them (no outer/inner views or grouped layouts)."""
    action = site.action
    return (
        isinstance(action, AxisAction)
        and action.group_type in (PositiveScaling, GeneralLinear, Orthogonal)
        and all(getattr(m, f, 1) == 1 for m in action.members for f in ("outer", "inner", "groups"))
    )


def _generator_on_axis(group: Group, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
    """d rho(M) on ``axis`` of the batched ``x`` (k, ...) for k generators ``M`` (k, *coord_shape)."""
    k = x.shape[0]
    if isinstance(group, PositiveScaling):
        shape = [k] + [1] * (x.ndim - 1)
        shape[axis] = -1
        return x * (power * M.to(x.dtype)).reshape(shape)
    blocks = getattr(group, "blocks", None) or 1
    Mb = M.to(x.dtype).reshape(k, blocks, group.n, group.n)
    if isinstance(group, Orthogonal):
        A = (Mb - Mb.mT) / 2
    else:
        A = Mb if power == 1 else -Mb.mT
    moved = x.movedim(axis, 1)
    cols = moved.reshape(k, blocks, group.n, -1)
    return (A @ cols).reshape(moved.shape).movedim(1, axis)


def infinitesimal_action(
    sites: Sequence[Site], groups: Sequence[Group], generators: Sequence[Tensor], tensors: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """sum_s d rho_s(M_s) applied to batched tensors.

    ``tensors`` maps member names to batched tensors (k, *shape); ``generators[s]``
    holds k Lie algebra elements of site s (k, *coord_shape).  Returns the batched
    image of every tensor some site touches (zero where no member acts).
    """
    out: dict[str, Tensor] = {}
    for site, group, M in zip(sites, groups, generators):
        if not has_infinitesimal_action(site):
            raise TypeError(f"site {site.name!r}: no closed-form infinitesimal action for {site.action.name}")
        for member, name in zip(site.action.members, site.members):  # type: ignore[attr-defined]
            if name is None:
                continue
            x = tensors[name]
            axis = member.axis % (x.ndim - 1) + 1
            if member.start is None:
                contribution = _generator_on_axis(group, M, x, axis, member.power)
            else:
                part = x.narrow(axis, member.start, member.stop - member.start)  # type: ignore[operator]
                moved = _generator_on_axis(group, M, part, axis, member.power)
                before = torch.zeros_like(x.narrow(axis, 0, member.start))
                after = torch.zeros_like(x.narrow(axis, member.stop, x.shape[axis] - member.stop))  # type: ignore[arg-type]
                contribution = torch.cat([before, moved, after], dim=axis)
            out[name] = contribution if name not in out else out[name] + contribution
    return out
