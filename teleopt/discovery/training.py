"""``teleopt.discover``: learn a group action and its generators (Zhao et al. 2024b, Sec. 5; Zhao 2026, Sec. 6.5).

Each step draws a fresh batch of (theta, X) from the sampler, evaluates the terms
of Zhao et al. 2024b, eq. 11 (:mod:`teleopt.discovery.losses`) with ``torch.func`` and
takes one Adam step on the action network and the generators.  Training is
seeded: the network's initial weights, the generators and every sample come from
one ``torch.Generator``, so the same seed gives bitwise the same result on CPU.
The options are a :class:`~teleopt.discovery.config.DiscoveryConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from teleopt.actions.base import Params
from teleopt.discovery.action import LearnedAction
from teleopt.discovery.config import DiscoveryConfig, resolve
from teleopt.discovery.losses import TERMS, discovery_losses, loss_derivative, loss_gradient_norms, total_loss
from teleopt.discovery.network import ActionNetwork
from teleopt.discovery.problems import DiscoveryProblem
from teleopt.discovery.samples import Sampler, SampleSpec, draw

__all__ = ["discover"]

_LOGGED = (*TERMS, "associativity_first_order", "associativity_bracket", "total")


def discover(
    loss_fn: Callable[[Params, Any], Tensor] | DiscoveryProblem,
    param_shapes: Sequence[Sequence[int]] | None = None,
    sampler: Sampler | None = None,
    *,
    config: DiscoveryConfig | None = None,
    member_names: Sequence[str] | None = None,
    name: str = "learned",
    progress: bool = True,
    **options: Any,
) -> LearnedAction:
    """Learn a loss-invariant group action and ``num_generators`` generators (Zhao et al. 2024b, Sec. 5).

    Parameters
    ----------
    loss_fn:
        A :class:`~teleopt.discovery.problems.DiscoveryProblem` (then ``param_shapes``,
        ``sampler`` and the default ``member_names`` come from it), or
        ``loss_fn(params, data) -> Tensor``: the function to find symmetries of, for
        one sample (a tuple of tensors with ``param_shapes`` and the data the sampler
        returns).  A scalar loss, or a vector whose every entry must be invariant
        (Zhao et al. 2024b, Sec. 3.1, L: Param x D^d -> R^d; use the subnetwork's output to
        bind the action into larger models, Prop. 4.1).  Must work under
        ``torch.func.vmap`` and ``jvp`` (pure tensor code, no ``.item()``).
    param_shapes:
        Shapes of the parameter tensors; theta in R^p is their flattened concatenation.
    sampler:
        ``sampler(generator) -> (params, data)`` draws one sample (data: a tensor or a
        tuple of tensors of fixed shapes); called ``batch_size`` times per step.
    config, **options:
        The training options: a :class:`~teleopt.discovery.config.DiscoveryConfig`
        (default: its defaults) and keywords that replace its fields, e.g.
        ``discover(problem, steps=500, seed=1)``.  An unknown keyword raises ``TypeError``.
    member_names, name:
        Names of the parameter tensors and of the action (registry name).
    progress:
        Show a tqdm progress bar with the loss terms.
    """
    config = resolve(config, options)
    task = _task(loss_fn, param_shapes, sampler, member_names)
    if config.restarts == 1:
        return _discover_once(task, config, name, progress)
    return _best_of_restarts(task, config, name, progress)


class _Task(NamedTuple):
    """What to find symmetries of: the loss, its parameter shapes and names, and the sampler."""

    loss_fn: Callable[[Params, Any], Tensor]
    param_shapes: Sequence[Sequence[int]]
    sampler: Sampler
    member_names: Sequence[str] | None


def _task(
    loss_fn: Callable[[Params, Any], Tensor] | DiscoveryProblem,
    param_shapes: Sequence[Sequence[int]] | None,
    sampler: Sampler | None,
    member_names: Sequence[str] | None,
) -> _Task:
    """The task of a problem, or of a loss function with its shapes and sampler (both required)."""
    if isinstance(loss_fn, DiscoveryProblem):
        if param_shapes is not None or sampler is not None:
            raise TypeError("discover(problem, ...) takes its param_shapes and sampler from the problem; do not pass them")
        names = loss_fn.member_names if member_names is None else member_names
        return _task(loss_fn.loss_fn, loss_fn.param_shapes, loss_fn.sampler, names)
    if param_shapes is None or sampler is None:
        raise TypeError("discover(loss_fn, param_shapes, sampler): param_shapes and sampler are required with a loss function")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not callable(sampler):
        raise TypeError(f"sampler must be callable as sampler(generator), got {type(sampler).__name__}")
    return _Task(loss_fn, param_shapes, sampler, member_names)


def _objective(run: LearnedAction) -> float:
    """A run's training objective: the mean total loss over its last 50 steps."""
    assert run.history is not None  # discover always records the history
    return float(run.history["values"][-50:, -1].mean())


def _best_of_restarts(task: _Task, config: DiscoveryConfig, name: str, progress: bool) -> LearnedAction:
    """Train with seeds ``seed, seed + 1, ...`` and keep the run with the lowest :func:`_objective`."""
    seeds = [config.seed + i for i in range(config.restarts)]
    runs = [_discover_once(task, config.replace(seed=seed, restarts=1), name, progress) for seed in seeds]
    objectives = [_objective(run) for run in runs]
    best = runs[min(range(len(runs)), key=objectives.__getitem__)]
    best.config["restarts"] = {"seeds": seeds, "objectives": objectives}
    return best


@dataclass(frozen=True)
class _Run:
    """One training run: the task, its sample layout, the options, the generator every draw
    comes from, and the loss's derivatives (:func:`~teleopt.discovery.losses.loss_derivative`)."""

    task: _Task
    spec: SampleSpec
    config: DiscoveryConfig
    gen: torch.Generator
    loss_jvp: Callable[[Tensor, tuple[Tensor, ...], Tensor], Tensor]
    grad_norms: Callable[[Tensor, tuple[Tensor, ...]], Tensor]

    @classmethod
    def start(cls, task: _Task, config: DiscoveryConfig) -> _Run:
        _, first_data = task.sampler(torch.Generator().manual_seed(config.seed))
        spec = SampleSpec.from_sample(task.param_shapes, task.member_names, first_data)
        loss_jvp = loss_derivative(task.loss_fn, spec.unflatten, spec.rebuild_data)
        grad_norms = loss_gradient_norms(task.loss_fn, spec.unflatten, spec.rebuild_data)
        return cls(task, spec, config, torch.Generator().manual_seed(config.seed), loss_jvp, grad_norms)


def _discover_once(task: _Task, config: DiscoveryConfig, name: str, progress: bool) -> LearnedAction:
    """One seeded training run, returned as a :class:`LearnedAction` with its held-out examples."""
    run = _Run.start(task, config)
    network, generators = _initial_action(run)
    history = _train(run, network, generators, name, progress)
    theta, leaves = draw(task.sampler, torch.Generator().manual_seed(config.seed + 1), config.num_examples, run.spec, config.dtype)
    problem_spec = getattr(task.loss_fn, "spec", None)
    return LearnedAction(
        network,
        generators.detach().to(torch.float64),
        run.spec,
        name=name,
        integration_steps=config.integration_steps,
        loss_fn=task.loss_fn,
        examples=(theta, leaves),
        config=config.record() | {"problem": problem_spec if isinstance(problem_spec, dict) else None},
        history={"terms": list(_LOGGED), "values": history},
    )


def _initial_action(run: _Run) -> tuple[ActionNetwork, torch.nn.Parameter]:
    """The action network and the generators (scaled to norm about beta) drawn from the run's generator."""
    config, p = run.config, run.spec.num_params
    network = ActionNetwork(
        p, run.spec.data_features, config.hidden, config.activation, generator=run.gen, dtype=config.dtype, linear_base=config.linear_base
    )
    draws = torch.randn(config.num_generators, p, p, generator=run.gen, dtype=torch.float64)
    return network, torch.nn.Parameter(draws.to(config.dtype) * (config.beta / p))


def _train(run: _Run, network: ActionNetwork, generators: torch.nn.Parameter, name: str, progress: bool) -> Tensor:
    """Adam on the network and the generators for ``config.steps`` steps; returns the logged terms (steps, len(_LOGGED))."""
    config = run.config
    groups: list[dict[str, Any]] = [{"params": list(network.parameters())}, {"params": [generators], "lr": config.generator_lr}]
    optimizer = torch.optim.Adam(groups, lr=config.lr)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_decay_every, gamma=config.lr_decay)
    history = torch.empty(config.steps, len(_LOGGED), dtype=torch.float64)
    bar = tqdm(range(config.steps), desc=f"discover {name}", disable=not progress, leave=False)
    for step in bar:
        terms = _terms(run, network, generators, step)
        total = total_loss(terms, config.weights)
        if not bool(torch.isfinite(total)):
            raise FloatingPointError(
                f"the discovery loss became non-finite at step {step} "
                f"({', '.join(f'{k}={float(v):.3g}' for k, v in terms.items())}); lower lr/generator_lr or beta"
            )
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        schedule.step()
        row = [float(terms[k].detach()) for k in _LOGGED[:-1]] + [float(total.detach())]
        history[step] = torch.tensor(row, dtype=torch.float64)
        if progress and (step % 10 == 0 or step == config.steps - 1):
            bar.set_postfix(total=f"{row[-1]:.3g}", inv=f"{row[0]:.3g}", id=f"{row[1]:.2g}", assoc=f"{row[2]:.2g}", norm=f"{row[3]:.2g}")
    bar.close()
    return history


def _terms(run: _Run, network: ActionNetwork, generators: Tensor, step: int) -> dict[str, Tensor]:
    """The terms of Zhao et al. 2024b, eq. 11 on a fresh batch; a ``loss_fn`` that ``vmap``/``jvp``
    cannot trace raises ``TypeError`` at step 0."""
    config = run.config
    theta, leaves = draw(run.task.sampler, run.gen, config.batch_size, run.spec, config.dtype)
    x = run.spec.features(leaves, batch_dims=1)
    try:
        norms = run.grad_norms(theta, leaves).detach() if config.invariance != "raw" else None
        scale_free = config.invariance == "cosine"
        return discovery_losses(network, run.loss_jvp, theta, leaves, x, generators, config.beta, config.second_order, norms, scale_free)
    except RuntimeError as e:
        if step == 0 and ("vmap" in str(e) or "jvp" in str(e) or "forward AD" in str(e)):
            raise TypeError(f"loss_fn must work under torch.func.vmap and jvp (pure tensor code): {e}") from e
        raise
