"""Projected ascent on the group coordinates (papers/001 Sec. 4.3, Algorithm 1 line 3).

The teleport target argmax_g objective(g . w) is searched by Adam on the Lie
algebra coordinates xi (g = exp(xi)), starting at the identity, with every
iterate projected onto the trust region
(:func:`~teleopt.teleport.coordinates.project_to_trust_region`).  Adam's
per-coordinate normalisation makes the step size a distance in coordinates
(log-scales for scalings), whatever the objective's units, which is what a trust
region radius is measured in.  The best point seen is returned, not the last.

The search stops early when a step no longer moves the coordinates (every
coordinate pinned at the trust-region boundary, the typical solution for the
gradient norm, which is convex in the log-scales).

:func:`shrink_to_feasible` then scales the result towards the identity until
the safety caps hold (bisection on s in [0, 1] for s * xi).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from teleopt.groups import Group
from teleopt.teleport.coordinates import project_to_trust_region

__all__ = ["AscentResult", "ascend", "shrink_to_feasible"]


@dataclass
class AscentResult:
    """Best coordinates found, the score at the identity and there, and the number of evaluations."""

    coords: list[Tensor]
    score_start: float
    score_best: float
    evaluations: int


def ascend(
    score: Callable[[Sequence[Tensor]], Tensor],
    coords: Sequence[Tensor],
    groups: Sequence[Group],
    steps: int,
    lr: float,
    trust_regions: Sequence[float | None],
) -> AscentResult:
    """Maximise ``score(coords)`` by projected Adam from ``coords`` (the identity).

    ``groups`` and ``trust_regions`` give each coordinate tensor's group and radius.
    """
    xs = [c.detach().clone().requires_grad_(True) for c in coords]
    opt = torch.optim.Adam(xs, lr=lr)
    best = [x.detach().clone() for x in xs]
    start = best_score = float("nan")
    evaluations = 0

    def evaluate() -> Tensor:
        nonlocal best, best_score, start, evaluations
        with torch.enable_grad():
            s = score(xs)
        evaluations += 1
        value = float(s.detach())
        if evaluations == 1:
            start = best_score = value
        elif value == value and not value <= best_score:  # finite improvement (or first finite value)
            best_score = value
            best = [x.detach().clone() for x in xs]
        return s

    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        s = evaluate()
        if step == steps or not s.requires_grad:
            break
        with torch.enable_grad():
            (-s).backward()
        if not all(x.grad is None or bool(torch.isfinite(x.grad).all()) for x in xs):
            break
        before = [x.detach().clone() for x in xs]
        opt.step()
        for x, grp, radius in zip(xs, groups, trust_regions):
            project_to_trust_region(x.data, grp, radius)
        if all(torch.equal(x.detach(), b) for x, b in zip(xs, before)):
            break  # a fixed point of the projected step: every coordinate pinned at the boundary
    return AscentResult(best, start, best_score, evaluations)


def shrink_to_feasible(
    coords: Sequence[Tensor], feasible: Callable[[Sequence[Tensor]], bool], iterations: int = 20
) -> tuple[list[Tensor], float]:
    """Largest s in [0, 1] (by bisection) with ``feasible(s * coords)``; returns (s * coords, s).

    The identity (s = 0) is assumed feasible; s = 0 means the teleport is declined.
    """
    if feasible(coords):
        return [c.clone() for c in coords], 1.0
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if feasible([mid * c for c in coords]):
            lo = mid
        else:
            hi = mid
    return [lo * c for c in coords], lo
