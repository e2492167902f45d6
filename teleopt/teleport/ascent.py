"""Projected ascent on the group coordinates (Zhao 2026, Sec. 4.3, Algorithm 1 line 3).

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
    Adam moves every coordinate by about ``lr`` per step; for an n x n matrix
    generator that is a step of spectral norm up to n * lr, so each group scales the
    step (:meth:`~teleopt.groups.Group.ascent_step_size`: ``lr / n`` per entry for
    matrix groups) and moves by at most about ``lr`` in the norm its trust region
    is measured in.
    """
    xs = [c.detach().clone().requires_grad_(True) for c in coords]
    # Adam (Kingma & Ba 2015) written out with tensor ops: torch.optim's per-step
    # bookkeeping costs more than the whole objective on these tiny tensors
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    step_sizes = [grp.ascent_step_size(lr) for grp in groups]
    m = [torch.zeros_like(x) for x in xs]
    v = [torch.zeros_like(x) for x in xs]
    best = [x.detach().clone() for x in xs]
    start = best_score = float("nan")
    evaluations = 0
    with torch.enable_grad():
        for step in range(steps + 1):
            s = score(xs)
            value = float(s.detach())
            evaluations += 1
            if evaluations == 1:
                start = best_score = value
            elif value == value and not value <= best_score:  # finite improvement (or first finite value)
                best_score = value
                best = [x.detach().clone() for x in xs]
            if step == steps or not s.requires_grad:
                break
            grads = torch.autograd.grad(s, xs, allow_unused=True)
            if not all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                break
            moved = False
            t = step + 1
            for x, g, mi, vi, grp, radius, size in zip(xs, grads, m, v, groups, trust_regions, step_sizes):
                if g is None:
                    continue
                xd = x.detach()  # in-place updates outside autograd (the step's graph is already freed)
                mi.mul_(beta1).add_(g, alpha=1 - beta1)  # ascent: follow +grad
                vi.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                before = xd.clone()
                xd.add_((mi / (1 - beta1**t)) / ((vi / (1 - beta2**t)).sqrt() + eps), alpha=size)
                project_to_trust_region(xd, grp, radius)
                moved = moved or not torch.equal(xd, before)
            if not moved:
                break  # a fixed point of the projected step: every coordinate pinned at the boundary
    return AscentResult(best, start, best_score, evaluations)


def shrink_to_feasible(
    coords: Sequence[Tensor], feasible: Callable[[Sequence[Tensor]], bool], iterations: int = 12
) -> tuple[list[Tensor], float]:
    """Largest s in [0, 1] (by bisection) with ``feasible(s * coords)``; returns (s * coords, s).

    The identity (s = 0) is assumed feasible; s = 0 means the teleport is declined.  For s = 1 the
    given tensors themselves are returned (no copy: a coordinate set can be a sizeable fraction of the parameters).
    """
    if feasible(coords):
        return list(coords), 1.0
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if feasible([mid * c for c in coords]):
            lo = mid
        else:
            hi = mid
    return [lo * c for c in coords], lo
