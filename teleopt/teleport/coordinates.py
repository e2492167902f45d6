"""Lie-algebra coordinates of the sites' groups and the trust region teleportation stays in.

Teleportation searches over group elements g = exp(xi) of the continuous sites
(Zhao 2026, Sec. 4.3: "parameterizing and performing gradient ascent on g").  The
gradient norm is unbounded on non-compact orbits (GL, positive scalings: it grows
without limit as an element degenerates), so the search is confined to a trust
region on the coordinates:

* positive scalings: every log-scale |xi_i| <= r, so each scale lies in [e^-r, e^r];
* GL (per block): spectral norm ||xi||_2 <= r, so every singular value of
  exp(xi) and of its inverse is at most e^r (condition number <= e^{2r});
* compact groups (O(n)) need no bound; translations use |xi_i| <= r;
* any other group: the Euclidean ball ||xi|| <= r.

Each group owns its rule (:meth:`teleopt.groups.Group.project_coordinates`).

The coordinates are float64 whatever the model's dtype: the group computations are
tiny and exact elements (``torch.linalg.matrix_exp``, ``exp``) in float64 keep the
teleport loss-preserving to rounding of the final cast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from teleopt.groups import Group
from teleopt.numerics import read_together
from teleopt.sharding import is_sharded
from teleopt.site import Site

__all__ = ["ROUNDOFF_CAPS", "zero_coordinates", "project_to_trust_region", "exact_in_dtype", "within_roundoff", "max_abs"]

#: 16-bit float dtypes, whose round-off a teleport avoids where the group allows (:meth:`Group.exact_coordinates`).
_HALF = (torch.bfloat16, torch.float16)

#: Per dtype the forward computes a site's products in, the round-off amplification
#: (:meth:`Group.roundoff_amplification <teleopt.groups.Group.roundoff_amplification>`, 1 at the balanced point) a
#: teleport may lead a block to, unless it is already above it (then: not above its value now).  In 16-bit
#: precisions the round-off of the untouched model is the whole budget of the check, so a block may not
#: amplify it by more than 1.25; float32's check allows about 100 unit round-offs.
ROUNDOFF_CAPS = {torch.float64: 1e4, torch.float32: 16.0, torch.bfloat16: 1.25, torch.float16: 1.25}


def zero_coordinates(site: Site, group: Group, device: torch.device) -> Tensor:
    """Coordinates of the identity (all zeros, float64) for ``site``'s group."""
    shape = group.coord_shape
    if shape is None:
        raise TypeError(f"site {site.name!r}: {type(group).__name__} is discrete, it has no Lie algebra coordinates")
    return torch.zeros(shape, dtype=torch.float64, device=device)


def project_to_trust_region(xi: Tensor, group: Group, radius: float | None) -> None:
    """Project ``xi`` (a tensor outside autograd, e.g. ``x.detach()``) in place onto the trust region
    (:meth:`Group.project_coordinates <teleopt.groups.Group.project_coordinates>`; ``None``: unbounded)."""
    if radius is not None:
        group.project_coordinates(xi, radius)


def exact_in_dtype(sites: Sequence[Site], groups: Sequence[Group], coords: Sequence[Tensor], tensors: Mapping[str, Tensor]) -> list[Tensor]:
    """Each site's coordinates moved to an element that acts on its 16-bit members (``tensors`` by name) without
    round-off (:meth:`Group.exact_coordinates <teleopt.groups.Group.exact_coordinates>`: powers of two for
    scalings); other sites' unchanged."""
    out = []
    for site, group, xi in zip(sites, groups, coords):
        half = [tensors[n].dtype for n in site.tensor_names if tensors[n].dtype in _HALF]
        out.append(group.exact_coordinates(xi, half[0]) if half and xi.numel() else xi)
    return out


def within_roundoff(
    sites: Sequence[Site],
    groups: Sequence[Group],
    coords: Sequence[Tensor],
    params: Sequence[Sequence[Tensor | None]],
    dtypes: Sequence[torch.dtype],
) -> list[Tensor]:
    """Each site's coordinates, each block scaled towards the identity (bisection on s in [0, 1] for s xi, per block)
    until its round-off amplification at exp(s xi) . w is at most max(its value at w, ``ROUNDOFF_CAPS[dtype]``),
    ``dtypes`` being the precision each site's products are computed in (autocast's, or the members').

    Bounds the conditioning of the moved members, not only of the element, so repeated teleports cannot compound:
    the bound holds at every point a teleport leads to.  Groups without round-off growth (scalings, O(n)),
    actions without norm statistics and sites with sharded (FSDP2) members keep their coordinates."""
    out = []
    for site, group, xi, members, dtype in zip(sites, groups, coords, params, dtypes):
        statistics = getattr(site.action, "norm_statistics", None)
        # sharded (FSDP2) members: no bound yet (their Gram matrices would need the whole members on every rank)
        sharded = any(is_sharded(m) for m in members if m is not None)
        usable = statistics is not None and group.roundoff_growth and xi.numel() and not sharded
        stats = statistics(group, members) if statistics is not None and usable else None
        # on the search's device (the host for GL sites of a GPU model): the bisection then reads nothing back
        iota = None if not stats else group.roundoff_amplification({p: v.to(xi.device) for p, v in stats.items()}, xi)
        if iota is None:
            out.append(xi)
            continue
        now = iota(torch.zeros(1, dtype=torch.float64)).cpu()
        bound = now.clamp_min(ROUNDOFF_CAPS.get(dtype, ROUNDOFF_CAPS[torch.float32]))
        ok = iota(torch.ones_like(now)).cpu() <= bound
        if bool(ok.all()):
            out.append(xi)
            continue
        lo, hi = ok.to(torch.float64), torch.ones_like(now)
        for _ in range(12):
            mid = torch.where(ok, hi, 0.5 * (lo + hi))
            fits = iota(mid).cpu() <= bound
            lo, hi = torch.where(fits, mid, lo), torch.where(fits | ok, hi, mid)
        flat = xi.reshape(now.numel(), -1)
        out.append((flat * lo.to(flat).unsqueeze(1)).reshape(xi.shape))
    return out


def max_abs(coords: Sequence[Tensor]) -> list[float]:
    """max |xi_i| of each site's coordinates (0 for none; NaN or inf where a coordinate is), read together
    (:func:`~teleopt.numerics.read_together`)."""
    values = iter(read_together([c.detach().abs().amax() for c in coords if c.numel()]))
    return [next(values) if c.numel() else 0.0 for c in coords]
