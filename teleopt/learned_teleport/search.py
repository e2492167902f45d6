"""A trained :class:`~teleopt.learned_teleport.TeleportPolicy` as :class:`~teleopt.teleport.Teleport`'s search.

Zhao 2026, *Symmetry in Neural Networks*, Sec. 5.5: once meta-trained, the group
network chooses each teleport's element from the gradient at the current point
(one forward per site, no loss evaluation, no ascent).  Plugged in as
``SearchConfig(strategy=PolicySearch(policy))``, it goes through Teleport's
caps, its invariance check and its state transport like any other search: the
element is exp of the coordinates the policy outputs, so the teleport is exact
whatever the policy learned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from teleopt.learned_teleport.policy import TeleportPolicy
from teleopt.teleport.fast_path import FastEvaluator
from teleopt.teleport.search import SearchProblem, SearchResult

__all__ = ["PolicySearch"]


class PolicySearch:
    """Choose teleport coordinates with a trained policy; its recurrent state carries across teleports.

    The coordinates are projected onto each site's trust region (``SearchConfig(trust_region=...)``
    of ``Teleport``), as the default ascent's are.
    """

    def __init__(self, policy: TeleportPolicy) -> None:
        if not isinstance(policy, TeleportPolicy):
            raise TypeError(f"PolicySearch needs a TeleportPolicy, got {type(policy).__name__}")
        self.policy = policy
        self.state = policy.new_state()

    @torch.no_grad()
    def search(self, problem: SearchProblem) -> SearchResult:
        ctx = problem.evaluator.ctx
        grads = {n: t.grad for n, t in ctx.trainable.items() if t.grad is not None}
        features = _fast_features(problem) if isinstance(problem.evaluator, FastEvaluator) else None
        coords = self.policy.coordinates(problem.sites, ctx.tensors, grads, self.state, features=features)
        self.policy.detach_state(self.state)
        out = []
        for xi, start, group, radius in zip(coords, problem.start, problem.groups, problem.trust_regions):
            xi = xi.detach().to(dtype=start.dtype, device=start.device).reshape(start.shape).clone()
            if radius is not None:
                group.project_coordinates(xi, radius)
            out.append(xi)
        return SearchResult(out)


def _fast_features(problem: SearchProblem) -> list[Tensor]:
    """The policy's inputs, d/dxi ||grad L(exp(xi) . w)||^2 at xi = 0 per site, from the fast path's
    gradient statistics (already reduced to the groups' sizes when the evaluator was built): one
    backward over O(units) numbers.  At xi = 0 the derivative for one site involves only the
    tensors it acts on, so it equals :meth:`TeleportPolicy.coordinates`' own per-site feature."""
    evaluator = problem.evaluator
    assert isinstance(evaluator, FastEvaluator)  # the caller checked
    with torch.enable_grad():
        coords = [xi.detach().clone().requires_grad_(True) for xi in problem.start]
        value = evaluator.norm_model.value(evaluator.elements(coords))
        return list(torch.autograd.grad(value, coords, allow_unused=True, materialize_grads=True))
