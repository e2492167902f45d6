"""Algorithm 3 of Zhao 2026 (Sec. 5.5), "Learning to teleport": meta-train a TeleportPolicy.

For each training problem (drawn from the user's sampler) run ``steps`` steps of
w <- g_t . (w + f_t) from its initial parameters; every ``unroll`` steps update the
policy's weights by back-propagating the accumulated loss sum_{i in window} L(w_i)
through the unrolled steps, then truncate the graph.  Gradients fed to the
networks are treated as inputs (no second derivatives), as in Andrychowicz et
al. (2016).  Departure from the thesis: each trajectory's losses are divided by its
initial loss, so that random problems of different scales weigh alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from teleopt.learned_teleport.policy import TeleportPolicy
from teleopt.learned_teleport.problems import MetaProblem

__all__ = ["MetaTrainResult", "meta_train", "rollout"]

Sampler = Callable[[torch.Generator], MetaProblem]


@dataclass
class MetaTrainResult:
    """What :func:`meta_train` did: per-trajectory mean normalised loss, and the time taken."""

    trajectory_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def _check_problem(problem: object) -> MetaProblem:
    if not isinstance(problem, MetaProblem):
        raise TypeError(f"the sampler must return a MetaProblem, got {type(problem).__name__}")
    return problem


def rollout(policy: TeleportPolicy, problem: MetaProblem, steps: int = 100) -> list[float]:
    """Losses L(w_0), ..., L(w_steps) of the policy on one problem (no meta-gradient)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    problem = _check_problem(problem)
    w = {n: p.detach().clone() for n, p in problem.params.items()}
    state = policy.new_state()
    losses = []
    for _ in range(steps):
        w = {n: p.requires_grad_(True) for n, p in w.items()}
        loss = problem.loss(w)
        losses.append(float(loss.detach()))
        grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
        with torch.no_grad():
            w = {n: p.detach() for n, p in policy.step(problem.sites, {n: p.detach() for n, p in w.items()}, grads, state).items()}
    with torch.no_grad():
        losses.append(float(problem.loss(w)))
    return losses


@dataclass
class _MetaOptimizer:
    """Adam on the policy's networks (m1 at ``lr_update``, m2 at ``lr_group``), meta-gradients clipped."""

    opt: torch.optim.Optimizer
    params: list[Tensor]
    max_grad_norm: float

    @classmethod
    def of(cls, policy: TeleportPolicy, lr_update: float, lr_group: float, max_grad_norm: float) -> _MetaOptimizer:
        groups: list[dict[str, Any]] = []
        params: list[Tensor] = []
        for net, lr in ((policy.update_net, lr_update), (policy.group_net, lr_group)):
            if net is not None:
                net_params = list(net.parameters())
                groups.append({"params": net_params, "lr": lr})
                params.extend(net_params)
        if not groups:
            raise ValueError("this policy has nothing to learn (update='gd', teleport=False)")
        return cls(torch.optim.Adam(groups), params, max_grad_norm)

    def update(self, acc: Tensor | float) -> float:
        """One meta-step on the accumulated loss ``acc`` (skipped unless it is finite and has a graph); returns it."""
        self.opt.zero_grad()
        if isinstance(acc, Tensor) and acc.requires_grad and torch.isfinite(acc):
            acc.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.opt.step()
        return float(acc.detach()) if isinstance(acc, Tensor) else float(acc)


def _trajectory(policy: TeleportPolicy, problem: MetaProblem, steps: int, unroll: int, meta: _MetaOptimizer) -> float:
    """Roll ``policy`` out on ``problem`` for ``steps`` steps, a meta-step every ``unroll``; the mean scaled loss."""
    w = {n: p.detach().clone() for n, p in problem.params.items()}
    state = policy.new_state()
    with torch.no_grad():
        scale = float(problem.loss(w)) or 1.0
    acc: Tensor | float = 0.0
    total = 0.0
    for t in range(1, steps + 1):
        w_in = {n: p if p.requires_grad else p.detach().requires_grad_(True) for n, p in w.items()}
        loss = problem.loss(w_in)
        grads = dict(zip(w_in, torch.autograd.grad(loss, list(w_in.values()), retain_graph=True)))
        w = policy.step(problem.sites, w_in, grads, state)
        acc = acc + problem.loss(w) / scale
        if t % unroll == 0 or t == steps:
            total += meta.update(acc)
            acc = 0.0
            w = {n: p.detach() for n, p in w.items()}
            policy.detach_state(state)
    return total / steps


def meta_train(  # noqa: PLR0913  Algorithm 3's hyperparameters (Zhao 2026, Sec. 5.5), one keyword each
    policy: TeleportPolicy,
    sampler: Sampler,
    trajectories: int = 100,
    steps: int = 100,
    unroll: int = 10,
    lr_update: float = 1e-4,
    lr_group: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    max_grad_norm: float = 10.0,
) -> MetaTrainResult:
    """Meta-train ``policy`` in place by Algorithm 3 of Zhao 2026, Sec. 5.5.

    ``sampler(generator)`` returns a fresh :class:`MetaProblem` (random data and initial
    parameters); ``trajectories`` problems are drawn from a generator seeded by
    ``seed``.  Adam with ``lr_update`` for m1 and ``lr_group`` for m2 (the thesis:
    1e-4 and 1e-3); meta-gradients clipped to ``max_grad_norm``.  A tqdm progress bar
    is shown when ``progress``.
    """
    if trajectories < 1 or steps < 1 or unroll < 1:
        raise ValueError(f"trajectories, steps and unroll must be >= 1, got {trajectories}, {steps}, {unroll}")
    if not callable(sampler):
        raise TypeError("sampler must be callable: sampler(generator) -> MetaProblem")
    meta = _MetaOptimizer.of(policy, lr_update, lr_group, max_grad_norm)
    gen = torch.Generator().manual_seed(seed)
    result = MetaTrainResult()
    start = time.perf_counter()
    iterations: Iterable[int] = range(trajectories)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        iterations = bar = tqdm(iterations, desc="meta-training", unit="traj")
    for _ in iterations:
        mean_loss = _trajectory(policy, _check_problem(sampler(gen)), steps, unroll, meta)
        result.trajectory_losses.append(mean_loss)
        if bar is not None:
            bar.set_postfix(loss=f"{mean_loss:.3g}")
    result.seconds = time.perf_counter() - start
    return result


def evaluate(policy: TeleportPolicy, problems: Sequence[MetaProblem], steps: int = 100) -> list[list[float]]:
    """:func:`rollout` on each of ``problems``."""
    return [rollout(policy, p, steps) for p in problems]
