"""A closed-form search: teleport every GL or scaling site to its *balanced* point.

For a GL site (two linear maps, a LoRA pair B A) the balanced point of the orbit
is where the writers' and readers' Gram matrices agree, A A^T = B^T B, i.e. where
the conserved quantity of gradient flow P - Q (papers/001 Ex. 2.5.3) vanishes;
for positive scalings through ReLU it is |w_in,i| = |w_out,i| per unit.  The
element is closed form (:meth:`teleopt.actions.axis.AxisAction.balancing_coordinates`:
g = (P^{-1} # Q)^{1/2}, the matrix geometric mean; g = (B^T B)^{1/4} when A has
orthonormal rows), so :class:`Balance` needs no objective evaluations and no batch.

Balancing is the standard remedy for the scale imbalance of LoRA factors: with
B = 0 at initialisation and A random, the factors start far from balanced, and
gradient descent keeps the imbalance forever (the conserved quantity); a
balanced pair makes the gradients of A and B commensurate (Du, Hu and Lee,
NeurIPS 2018; for LoRA: Hu et al., ICLR 2022, initialise B = 0 precisely because
B A is all that matters, and every g in GL_r leaves it unchanged).

Use it as the search strategy of any :class:`~teleopt.teleport.Teleport`::

    Teleport(opt, model, sites, every=100, search=SearchConfig(strategy=Balance(), trust_region=None))

Everything else stays as in every teleport: the element is applied exactly,
``.grad`` and first moments are transported by the covector rule, elementwise
second moments follow the state policy's fallback (kept by default), the safety
caps may scale the element towards the identity, and the loss check and watch
run.  With a trust region the balancing move is clipped to it (a partial balance
along each eigendirection); ``trust_region=None`` balances exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction
from teleopt.teleport.coordinates import project_to_trust_region
from teleopt.teleport.fast_path import member_tensors
from teleopt.teleport.search import SearchProblem, SearchResult

__all__ = ["Balance"]


@dataclass(frozen=True)
class Balance:
    """Search strategy: the balancing element of every GL / positive-scaling site (see module docs).

    Parameters
    ----------
    fraction:
        Move ``exp(fraction * xi)`` of the way (1: balanced; 0.5: halfway along the
        geodesic of symmetric elements).
    rcond:
        A block whose Gram matrix P or Q has eigenvalues below ``rcond`` times its
        largest (e.g. LoRA's B = 0 at initialisation) is left where it is.
    min_move:
        A site whose coordinates are all within ``min_move`` of zero is already
        balanced and does not move (when no site moves, the teleport is declined).
        Default: sqrt(eps) of the members' dtype (1.5e-8 in float64, 3.5e-4 in
        float32), above the rounding a balanced pair shows (measured 1e-15 and
        7e-8) and far below any move that matters to training.
    """

    fraction: float = 1.0
    rcond: float = 1e-10
    min_move: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if isinstance(self.rcond, bool) or not isinstance(self.rcond, (int, float)) or not 0 < self.rcond < 1:
            raise ValueError(f"rcond must be in (0, 1), got {self.rcond!r}")
        if self.min_move is not None and (
            isinstance(self.min_move, bool) or not isinstance(self.min_move, (int, float)) or not self.min_move >= 0
        ):
            raise ValueError(f"min_move must be a number >= 0 or None, got {self.min_move!r}")

    def search(self, problem: SearchProblem) -> SearchResult:
        """Balancing coordinates per site (zeros for sites without a closed form), clipped to the trust regions.

        Sites that share a tensor are each balanced at w; their composition need not be balanced.
        """
        params = problem.evaluator.like  # the members at w (sites balance independently of each other)
        coords: list[Tensor] = []
        for site, group, start, radius in zip(problem.sites, problem.groups, problem.start, problem.trust_regions):
            members = member_tensors(site, params)
            xi = None
            if isinstance(site.action, AxisAction):
                with torch.no_grad():
                    xi = site.action.balancing_coordinates(members, rcond=self.rcond)
            dtype = next(t for t in members if t is not None).dtype
            floor = self.min_move if self.min_move is not None else math.sqrt(torch.finfo(dtype).eps)
            if xi is None or xi.shape != start.shape or not (xi.numel() and float(xi.abs().max()) > floor):
                coords.append(torch.zeros_like(start))
                continue
            xi = (self.fraction * xi).to(start)
            project_to_trust_region(xi, group, radius)
            coords.append(xi)
        return SearchResult(coords)
