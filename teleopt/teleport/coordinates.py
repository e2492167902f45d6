"""Lie-algebra coordinates of the sites' groups and the trust region teleportation stays in.

Teleportation searches over group elements g = exp(xi) of the continuous sites
(papers/001 Sec. 4.3: "parameterizing and performing gradient ascent on g").  The
gradient norm is unbounded on non-compact orbits (GL, positive scalings: it grows
without limit as an element degenerates), so the search is confined to a trust
region on the coordinates:

* positive scalings: every log-scale |xi_i| <= r, so each scale lies in [e^-r, e^r];
* GL (per block): spectral norm ||xi||_2 <= r, so every singular value of
  exp(xi) and of its inverse is at most e^r (condition number <= e^{2r});
* compact groups (O(n)) need no bound; translations use |xi_i| <= r.

The coordinates are float64 whatever the model's dtype: the group computations are
tiny and exact elements (``torch.linalg.matrix_exp``, ``exp``) in float64 keep the
teleport loss-preserving to rounding of the final cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

from teleopt.groups import GeneralLinear, Group, Orthogonal, PositiveScaling, Translation
from teleopt.site import Site

__all__ = ["zero_coordinates", "project_to_trust_region"]


def zero_coordinates(site: Site, group: Group, device: torch.device) -> Tensor:
    """Coordinates of the identity (all zeros, float64) for ``site``'s group."""
    shape = group.coord_shape
    if shape is None:
        raise TypeError(f"site {site.name!r}: {type(group).__name__} is discrete, it has no Lie algebra coordinates")
    return torch.zeros(shape, dtype=torch.float64, device=device)


def project_to_trust_region(xi: Tensor, group: Group, radius: float | None) -> None:
    """Project ``xi`` (a tensor outside autograd, e.g. ``x.detach()``) in place onto the trust region."""
    if radius is None or isinstance(group, Orthogonal):
        return
    if isinstance(group, (PositiveScaling, Translation)):
        xi.clamp_(-radius, radius)
        return
    if isinstance(group, GeneralLinear):
        if float(torch.linalg.matrix_norm(xi).max()) <= radius:  # spectral <= Frobenius: nothing to clip
            return
        U, S, Vh = torch.linalg.svd(xi, full_matrices=False)
        if bool((S > radius).any()):
            xi.copy_(U @ torch.diag_embed(S.clamp(max=radius)) @ Vh)
        return
    # a group teleopt does not know (e.g. a learned action's): Euclidean ball
    norm = xi.norm()
    if float(norm) > radius:
        xi.mul_(radius / norm)
