"""The training options of :func:`teleopt.discover`, checked once (Zhao et al. 2024b, Sec. 5.3)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from teleopt.discovery.action import MAX_INTEGRATION_STEPS
from teleopt.discovery.losses import LossWeights

__all__ = ["DiscoveryConfig", "INVARIANCE_MODES"]

INVARIANCE_MODES = ("raw", "gradient", "cosine")
_POSITIVE_INTS = ("num_generators", "steps", "batch_size", "lr_decay_every", "integration_steps", "num_examples", "restarts")
_POSITIVE_FLOATS = ("beta", "lr", "generator_lr", "lr_decay")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How :func:`teleopt.discover` trains; every field is also a keyword of ``discover``.

    Parameters
    ----------
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
        Zhao et al. 2024b, Sec. 5.3; ``None`` means the default) and the target norm of
        the infinitesimal action (eq. 8; the papers do not state its value, 1 here).
        Coordinates of the learned group are in units of the generators, so exp(c h)
        moves theta about |c| beta.
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
    seed:
        Seeds the one ``torch.Generator`` behind initial weights, generators and samples.
    dtype:
        Training dtype (the action computes in the dtype of the parameters it is given).
    num_examples:
        Held-out samples stored with the action (for ``example()`` and diagnostics).
    restarts:
        Train this many times, with seeds ``seed, seed + 1, ...``, and keep the run
        with the lowest training objective (mean total loss over its last 50 steps).
        The objective is non-convex in the generators: a seed can leave a generator
        outside the symmetry's span (measured: ``docs/performance.md``).

    Bad values raise ``ValueError``/``TypeError`` naming the field.
    """

    num_generators: int = 1
    steps: int = 2000
    batch_size: int = 64
    hidden: Sequence[int] = (64, 64, 64)
    activation: str = "silu"
    linear_base: bool = True
    weights: LossWeights = field(default_factory=LossWeights)
    beta: float = 1.0
    lr: float = 1e-3
    generator_lr: float = 1e-2
    lr_decay: float = 0.6
    lr_decay_every: int = 1000
    second_order: bool = True
    invariance: str = "raw"
    integration_steps: int = 8
    seed: int = 0
    dtype: torch.dtype = torch.float32
    num_examples: int = 32
    restarts: int = 1

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.integration_steps > MAX_INTEGRATION_STEPS:
            raise ValueError(f"integration_steps must be at most {MAX_INTEGRATION_STEPS}, got {self.integration_steps}")
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        self._check_kinds()

    def _check_kinds(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {self.dtype}")
        if self.weights is None:  # the documented spelling of "the default weights"
            object.__setattr__(self, "weights", LossWeights())
        if not isinstance(self.weights, LossWeights):
            raise TypeError(f"weights must be a LossWeights, got {type(self.weights).__name__}")
        if self.invariance not in INVARIANCE_MODES:
            raise ValueError(f"invariance must be one of {INVARIANCE_MODES}, got {self.invariance!r}")

    def replace(self, **changes: Any) -> DiscoveryConfig:
        """A copy with ``changes`` (field names); an unknown name raises ``TypeError`` naming it."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown discovery option(s) {unknown}; the options are the fields of DiscoveryConfig")
        return dataclasses.replace(self, **changes)

    def record(self) -> dict[str, Any]:
        """The options a :class:`~teleopt.discovery.action.LearnedAction` file keeps (plain values)."""
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "num_generators": self.num_generators,
            "weights": self.weights.as_dict(),
            "beta": self.beta,
            "lr": self.lr,
            "generator_lr": self.generator_lr,
            "lr_decay": self.lr_decay,
            "lr_decay_every": self.lr_decay_every,
            "second_order": self.second_order,
            "invariance": self.invariance,
            "seed": self.seed,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def resolve(config: DiscoveryConfig | None, options: Mapping[str, Any]) -> DiscoveryConfig:
    """``config`` (default :class:`DiscoveryConfig`) with the keyword ``options`` of ``discover`` applied."""
    if config is not None and not isinstance(config, DiscoveryConfig):
        raise TypeError(f"config must be a DiscoveryConfig, got {type(config).__name__}")
    return (config or DiscoveryConfig()).replace(**options)
