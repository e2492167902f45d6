"""The infinitesimal action of the sites' Lie algebras on their tensors, batched over generators.

A linear action rho of a Lie group on parameters has an infinitesimal action
d rho(M) = d/dt rho(exp(t M)) at t = 0, and exp(t M) . w = exp(t d rho(M)) w, so the
orbit curve gamma_M(t) = exp(t M) . w of Zhao 2026, Sec. 5.2.2 has

    gamma'(0) = d rho(M) w,        gamma''(0) = d rho(M)^2 w,

in closed form.  The action owns its infinitesimal form
(:meth:`GroupAction.infinitesimal_action <teleopt.actions.base.GroupAction.infinitesimal_action>`)
and the group its Lie-algebra action on an axis
(:meth:`Group.algebra_action <teleopt.groups.Group.algebra_action>`); for an axis
action a member transforming on an axis by the representation ``power`` contributes

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

from torch import Tensor

from teleopt.groups import Group
from teleopt.site import Site

__all__ = ["has_infinitesimal_action", "infinitesimal_action"]


def has_infinitesimal_action(site: Site) -> bool:
    """Whether :func:`infinitesimal_action` covers ``site`` (its action has a closed form)."""
    return site.action.has_infinitesimal_action


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
        if not site.action.has_infinitesimal_action:
            raise TypeError(f"site {site.name!r}: no closed-form infinitesimal action for {site.action.name}")
        batched = tuple(None if n is None else tensors[n] for n in site.members)
        for name, contribution in zip(site.members, site.action.infinitesimal_action(group, M, batched)):
            if name is None or contribution is None:
                continue
            out[name] = contribution if name not in out else out[name] + contribution
    return out
