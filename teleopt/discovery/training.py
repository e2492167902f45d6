"""``teleopt.discover``: learn a group action and its generators (Zhao et al. 2024b, Sec. 5; Zhao 2026, Sec. 6.5).

Each step draws a fresh batch of (theta, X) from the sampler, evaluates the terms
of Zhao et al. 2024b, eq. 11 (:mod:`teleopt.discovery.losses`) with ``torch.func`` and
takes one Adam step on the action network and the generators.  Training is
seeded: the network's initial weights, the generators and every sample come from
one ``torch.Generator``, so the same seed gives bitwise the same result on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from teleopt.actions.base import Params
from teleopt.discovery.action import MAX_INTEGRATION_STEPS, LearnedAction
from teleopt.discovery.losses import TERMS, LossWeights, discovery_losses, loss_derivative, loss_gradient_norms, total_loss
from teleopt.discovery.network import ActionNetwork
from teleopt.discovery.problems import DiscoveryProblem
from teleopt.discovery.samples import Sampler, SampleSpec, draw

__all__ = ["discover"]

INVARIANCE_MODES = ("raw", "gradient", "cosine")
_LOGGED = (*TERMS, "associativity_first_order", "associativity_bracket", "total")


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


def _objective(run: LearnedAction) -> float:
    """A run's training objective: the mean total loss over its last 50 steps."""
    assert run.history is not None  # discover always records the history
    return float(run.history["values"][-50:, -1].mean())


def discover(
    loss_fn: Callable[[Params, Any], Tensor] | DiscoveryProblem,
    param_shapes: Sequence[Sequence[int]] | None = None,
    sampler: Sampler | None = None,
    *,
    num_generators: int = 1,
    steps: int = 2000,
    batch_size: int = 64,
    hidden: Sequence[int] = (64, 64, 64),
    activation: str = "silu",
    linear_base: bool = True,
    weights: LossWeights | None = None,
    beta: float = 1.0,
    lr: float = 1e-3,
    generator_lr: float = 1e-2,
    lr_decay: float = 0.6,
    lr_decay_every: int = 1000,
    second_order: bool = True,
    invariance: str = "raw",
    integration_steps: int = 8,
    member_names: Sequence[str] | None = None,
    name: str = "learned",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_examples: int = 32,
    progress: bool = True,
    restarts: int = 1,
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
    num_generators:
        n, the number of Lie algebra elements to learn.
    steps, batch_size:
        Adam steps, and samples per step (Zhao et al. 2024b, Sec. 5.3: 10000 samples).
    hidden, activation, linear_base:
        The action MLP (Zhao et al. 2024b, Sec. 5.3: 64, 64, 64; Zhao 2026: 128, 128, 128)
        and whether it is added to the linear action g theta
        (:class:`~teleopt.discovery.network.ActionNetwork`).
    weights, beta:
        gamma_1..gamma_6 (:class:`~teleopt.discovery.losses.LossWeights`, default
        Zhao et al. 2024b, Sec. 5.3) and the target norm of the infinitesimal action (eq. 8;
        the papers do not state its value, 1 here).  Coordinates of the learned group
        are in units of the generators, so exp(c h) moves theta about |c| beta.
    lr, lr_decay, lr_decay_every:
        Adam learning rate of the network and its step decay (Zhao et al. 2024b, Sec. 5.3:
        1e-3, x0.6 every 1000 steps).
    generator_lr:
        Adam learning rate of the generators (they must travel O(1) in a few hundred
        steps while the network stays near its start; 1e-2).
    second_order:
        Include the Lie bracket associativity term (see :mod:`teleopt.discovery.losses`).
    invariance:
        How eq. 5 weighs samples: ``"raw"`` is |D_theta L . xi_h| as printed (its
        scale is the loss gradient's, so gamma_1 means different things for
        different losses and samples with large gradients dominate);
        ``"gradient"`` divides each sample (and output entry) by |D_theta L_j|, the
        component of xi_h along the level set's normal; ``"cosine"`` also divides by
        |xi_h|: the |cosine| between the orbit and the loss gradient, scale-free, so it
        cannot be lowered by shrinking xi_h against the norm term (eq. 8).  The
        normalisers depend on the samples only (computed by vjp, not trained through).
    integration_steps:
        RK4 steps per unit time of the learned action's finite elements.
    member_names, name:
        Names of the parameter tensors and of the action (registry name).
    seed:
        Seeds the one ``torch.Generator`` behind initial weights, generators and samples.
    dtype:
        Training dtype (the action computes in the dtype of the parameters it is given).
    num_examples:
        Held-out samples stored with the action (for ``example()`` and diagnostics).
    progress:
        Show a tqdm progress bar with the loss terms.
    restarts:
        Train this many times, with seeds ``seed, seed + 1, ...``, and keep the run
        with the lowest training objective (mean total loss over its last 50 steps).
        The objective is non-convex in the generators: a seed can leave a generator
        outside the symmetry's span (measured: ``docs/performance.md``).
    """
    if isinstance(loss_fn, DiscoveryProblem):
        if param_shapes is not None or sampler is not None:
            raise TypeError("discover(problem, ...) takes its param_shapes and sampler from the problem; do not pass them")
        if member_names is None:
            member_names = loss_fn.member_names
        # no new local names here: restarts re-call discover(**locals())
        param_shapes, sampler = loss_fn.param_shapes, loss_fn.sampler
        loss_fn = loss_fn.loss_fn
    if param_shapes is None or sampler is None:
        raise TypeError("discover(loss_fn, param_shapes, sampler): param_shapes and sampler are required with a loss function")
    restarts = _positive_int(restarts, "restarts")
    if restarts > 1:
        arguments = dict(locals())
        arguments.pop("restarts")
        runs = [discover(**(arguments | {"seed": seed + i})) for i in range(restarts)]
        objectives = [_objective(run) for run in runs]
        best = runs[min(range(restarts), key=objectives.__getitem__)]
        best.config["restarts"] = {"seeds": [seed + i for i in range(restarts)], "objectives": objectives}
        return best
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not callable(sampler):
        raise TypeError(f"sampler must be callable as sampler(generator), got {type(sampler).__name__}")
    num_generators = _positive_int(num_generators, "num_generators")
    steps = _positive_int(steps, "steps")
    batch_size = _positive_int(batch_size, "batch_size")
    lr_decay_every = _positive_int(lr_decay_every, "lr_decay_every")
    integration_steps = _positive_int(integration_steps, "integration_steps")
    if integration_steps > MAX_INTEGRATION_STEPS:
        raise ValueError(f"integration_steps must be at most {MAX_INTEGRATION_STEPS}, got {integration_steps}")
    num_examples = _positive_int(num_examples, "num_examples")
    beta, lr, generator_lr = _positive_float(beta, "beta"), _positive_float(lr, "lr"), _positive_float(generator_lr, "generator_lr")
    lr_decay = _positive_float(lr_decay, "lr_decay")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    weights = LossWeights() if weights is None else weights
    if not isinstance(weights, LossWeights):
        raise TypeError(f"weights must be a LossWeights, got {type(weights).__name__}")
    if invariance not in INVARIANCE_MODES:
        raise ValueError(f"invariance must be one of {INVARIANCE_MODES}, got {invariance!r}")

    gen = torch.Generator().manual_seed(seed)
    _, first_data = sampler(torch.Generator().manual_seed(seed))
    spec = SampleSpec.from_sample(param_shapes, member_names, first_data)
    p = spec.num_params
    network = ActionNetwork(p, spec.data_features, hidden, activation, generator=gen, dtype=dtype, linear_base=linear_base)
    generators = torch.nn.Parameter(torch.randn(num_generators, p, p, generator=gen, dtype=torch.float64).to(dtype) * (beta / p))
    groups: list[dict[str, Any]] = [{"params": list(network.parameters())}, {"params": [generators], "lr": generator_lr}]
    optimizer = torch.optim.Adam(groups, lr=lr)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=lr_decay_every, gamma=lr_decay)

    loss_jvp = loss_derivative(loss_fn, spec.unflatten, spec.rebuild_data)
    grad_norms = loss_gradient_norms(loss_fn, spec.unflatten, spec.rebuild_data)
    history = torch.empty(steps, len(_LOGGED), dtype=torch.float64)
    bar = tqdm(range(steps), desc=f"discover {name}", disable=not progress, leave=False)
    for step in bar:
        theta, leaves = draw(sampler, gen, batch_size, spec, dtype)
        x = spec.features(leaves, batch_dims=1)
        try:
            norms = grad_norms(theta, leaves).detach() if invariance != "raw" else None
            terms = discovery_losses(network, loss_jvp, theta, leaves, x, generators, beta, second_order, norms, invariance == "cosine")
        except RuntimeError as e:
            if step == 0 and ("vmap" in str(e) or "jvp" in str(e) or "forward AD" in str(e)):
                raise TypeError(f"loss_fn must work under torch.func.vmap and jvp (pure tensor code): {e}") from e
            raise
        total = total_loss(terms, weights)
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
        if progress and (step % 10 == 0 or step == steps - 1):
            bar.set_postfix(total=f"{row[-1]:.3g}", inv=f"{row[0]:.3g}", id=f"{row[1]:.2g}", assoc=f"{row[2]:.2g}", norm=f"{row[3]:.2g}")
    bar.close()

    theta, leaves = draw(sampler, torch.Generator().manual_seed(seed + 1), num_examples, spec, dtype)
    problem_spec = getattr(loss_fn, "spec", None)
    config = {
        "steps": steps,
        "batch_size": batch_size,
        "num_generators": num_generators,
        "weights": weights.as_dict(),
        "beta": beta,
        "lr": lr,
        "generator_lr": generator_lr,
        "lr_decay": lr_decay,
        "lr_decay_every": lr_decay_every,
        "second_order": second_order,
        "invariance": invariance,
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "problem": problem_spec if isinstance(problem_spec, dict) else None,
    }
    return LearnedAction(
        network,
        generators.detach().to(torch.float64),
        spec,
        name=name,
        integration_steps=integration_steps,
        loss_fn=loss_fn,
        examples=(theta, leaves),
        config=config,
        history={"terms": list(_LOGGED), "values": history},
    )
