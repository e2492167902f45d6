"""The arms: one line each, arm name -> a function of the run's :class:`ArmContext` returning the optimizer.

Add an arm by adding a line to :data:`ARMS`, e.g.::

    "teleport_balance": lambda c: Teleport(c.optimizer(), c.model, "auto", objective="balance", **c.teleport_kwargs()),

``c.optimizer()`` is the configuration's tuned baseline optimizer (a fresh one per
call; ``weight_decay=`` overrides the decay on >= 2-D tensors; 1-D tensors never
decay, as in timm).  The loop sets each param group's lr from the warm-up/cosine
schedule before every step, through the returned optimizer's ``param_groups``
(wrappers share them with the base).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.detection import find_symmetries
from teleopt.integrations.qk_clip import qk_head_scalings
from teleopt.site import Site
from teleopt.syre import Syre
from teleopt.teleport import Schedule, Teleport

__all__ = ["ArmContext", "ARMS", "TELEPORT_ARMS", "DECAY_ARMS", "RoundOffOnce", "roundoff_noop", "first_default_teleport"]

ROUNDOFF_EXPONENT = 1  # the control's factor 1 + 2^-1: (x * 1.5) / 1.5 in float32 is x or a neighbour of x
SCHEDULE_HORIZON = 100_000  # the steps searched for the default's first teleport


@dataclass
class ArmContext:
    """What an arm may use to build its optimizer."""

    model: nn.Module
    family: str  # "sgd" or "adamw"
    lr: float
    base_wd: float
    decay: float  # the decay strength at which weight decay and Syre are compared
    teleport_step: int  # teleport_once's step (after warm-up)
    example_inputs: Tensor
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    batch_fn: Callable[[], tuple[Tensor, Tensor]]

    def optimizer(self, weight_decay: float | None = None) -> Optimizer:
        """The tuned baseline optimizer (decay on >= 2-D trainable tensors only)."""
        wd = self.base_wd if weight_decay is None else weight_decay
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if self.family == "sgd":
            return torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        if self.family == "adamw95":
            return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
        return torch.optim.AdamW(groups, lr=self.lr)

    def cautious(self) -> Optimizer:
        """The baseline with Cautious Weight Decay (Chen et al. 2025, arXiv:2510.12402) at the comparison decay.

        ``p <- p - lr (u + wd * 1[u * p > 0] * p)``: the decoupled decay acts only on the
        coordinates where the optimizer's update ``u`` and the weight have the same sign.
        """
        return CautiousWeightDecay(self.optimizer(weight_decay=0.0), self.decay)

    def balora(self) -> Optimizer:
        """The baseline followed, after every step, by the projection of every LoRA pair onto the balanced set."""
        from benchmarks.realistic.lm import balanced_lora_projection

        return AfterStep(self.optimizer(), lambda: balanced_lora_projection(self.model))

    def teleport_kwargs(self) -> dict[str, Any]:
        """What every Teleport arm passes besides the optimizer, model and sites."""
        return {"example_inputs": self.example_inputs, "loss_fn": self.loss_fn, "batch_fn": self.batch_fn}

    def all_sites(self) -> list[Site]:
        """Every exact continuous site detection finds, normalisation-affine rescalings included (``"auto"`` leaves
        out under AdamW those whose other weights are not scale-invariant)."""
        found = find_symmetries(self.model, (self.example_inputs,)).sites
        return [s for s in found if s.action.exactness == "exact" and s.action.continuous]

    def syre(self, **kwargs: Any) -> Syre:
        """Syre at the comparison decay in place of the optimizer's own decay (decoupled for AdamW, as its decay is)."""
        return Syre(self.optimizer(weight_decay=0.0), gamma=self.decay, decoupled=self.family == "adamw", exclude_1d=True, **kwargs)


class AfterStep(Optimizer):
    """``base.step()`` then ``after()``: a baseline that acts on the weights after every step (same param groups)."""

    def __init__(self, base: Optimizer, after: Callable[[], None]) -> None:
        self.base, self.after = base, after
        self.defaults = base.defaults
        self.param_groups = base.param_groups
        self.state = base.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        loss = self.base.step(closure)
        self.after()
        return loss


@torch.no_grad()
def roundoff_noop(params: list[Tensor], exponent: int = ROUNDOFF_EXPONENT) -> tuple[int, float]:
    """Multiply each tensor by ``f = 1 + 2^-exponent`` and divide it by ``f``, in place: the identity in exact
    arithmetic, so the only change is floating-point round-off: the rounded product errs by at most half an ulp
    of the product, at most one ulp of the element, so the exact quotient lies within one ulp of the element and
    rounds to it or to a neighbour.  Returns the number of elements changed and the largest relative change."""
    if not isinstance(exponent, int) or exponent < 1:
        raise ValueError(f"exponent must be an int >= 1, got {exponent!r}")
    factor, changed, largest = 1.0 + 2.0**-exponent, 0, 0.0
    for p in params:
        before = p.detach().clone()
        p.mul_(factor).div_(factor)
        moved = p != before
        changed += int(moved.sum())
        if bool(moved.any()):
            largest = max(largest, float(((p - before)[moved] / before[moved]).abs().max()))
    return changed, largest


def first_default_teleport(c: ArmContext) -> int | None:
    """The step of the first teleport on the schedule of the ``teleport_default`` arm (built on a copy of the model,
    so nothing is registered on the model trained), or ``None`` when it schedules none."""
    twin = replace(c, model=copy.deepcopy(c.model))
    default = ARMS["teleport_default"](twin)
    if not isinstance(default, Teleport):
        raise TypeError(f"the teleport_default arm builds a Teleport, got {type(default).__name__}")
    schedule = default.schedule
    return next((t for t in range(SCHEDULE_HORIZON) if schedule.due(t, 0)), None)


class RoundOffOnce(AfterStep):
    """A control, not a teleopt configuration: the base optimizer, with :func:`roundoff_noop` applied once to every
    parameter before the base update of step ``at`` (steps counted from 0, when ``Teleport`` teleports).

    It measures how far float32 round-off alone, at the step where the default ``Teleport`` first acts, moves
    a run: a teleport that lands on the same elements up to round-off can do no better than this.
    ``perturbation`` holds ``(step, elements changed, largest relative change)`` once it has happened.
    """

    def __init__(self, base: Optimizer, at: int | None, exponent: int = ROUNDOFF_EXPONENT) -> None:
        super().__init__(base, lambda: None)
        self.at, self.exponent, self.steps = at, exponent, 0
        self.perturbation: tuple[int, int, float] | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.steps == self.at:
            params = [p for g in self.param_groups for p in g["params"]]
            self.perturbation = (self.steps, *roundoff_noop(params, self.exponent))
        self.steps += 1
        return self.base.step(closure)


class CautiousWeightDecay(AfterStep):
    """Decoupled decay masked by the sign agreement of the update and the weight (see ``ArmContext.cautious``)."""

    def __init__(self, base: Optimizer, decay: float) -> None:
        super().__init__(base, lambda: None)
        self.decay = decay

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        decayed = [p for g in self.param_groups for p in g["params"] if p.grad is not None and p.ndim >= 2]
        before = [p.detach().clone() for p in decayed]
        loss = self.base.step(closure)
        lr = {id(p): g["lr"] for g in self.param_groups for p in g["params"]}
        for p, w in zip(decayed, before):
            update = w - p  # the step is p <- w - lr * u, so u has the sign of w - p
            p.sub_(lr[id(p)] * self.decay * w * (update * w > 0))
        return loss


ARMS: dict[str, Callable[[ArmContext], Optimizer]] = {
    "baseline": lambda c: c.optimizer(),
    # exactly the documented drop-in call: whatever the library's defaults are at run time
    "teleport_default": lambda c: Teleport(
        c.optimizer(), c.model, "auto", example_inputs=c.example_inputs, loss_fn=c.loss_fn, batch_fn=c.batch_fn
    ),
    # the default on every exact continuous site (normalisation-affine rescalings too: "auto" leaves out under AdamW
    # those against weights that are not scale-invariant, such as a LayerNorm's consumers)
    "teleport_default_allsites": lambda c: Teleport(c.optimizer(), c.model, c.all_sites(), **c.teleport_kwargs()),
    "teleport_once": lambda c: Teleport(c.optimizer(), c.model, "auto", **c.teleport_kwargs(), schedule=Schedule(at=[c.teleport_step])),
    "teleport_once_allsites": lambda c: Teleport(
        c.optimizer(), c.model, c.all_sites(), **c.teleport_kwargs(), schedule=Schedule(at=[c.teleport_step])
    ),
    "teleport_every200": lambda c: Teleport(c.optimizer(), c.model, "auto", every=200, **c.teleport_kwargs()),
    # least weight norm on the orbit (closed form) every 50 steps from step 50 (its default schedule until 2026-11-27),
    # with the baseline's weight decay
    "balance_every": lambda c: Teleport(
        c.optimizer(), c.model, "auto", objective="balance", schedule=Schedule(every=50, warmup=50), **c.teleport_kwargs()
    ),
    # the same, 4x less often: 10 teleports in 2000 steps, each costing ~10 iterations on the MLPs
    "balance_every200": lambda c: Teleport(c.optimizer(), c.model, "auto", objective="balance", every=200, **c.teleport_kwargs()),
    # the same, every 200 steps from step 200 (after every configuration's lr warm-up; none at initialisation)
    "balance_every200_from200": lambda c: Teleport(
        c.optimizer(), c.model, "auto", objective="balance", schedule=Schedule(every=200, warmup=200), **c.teleport_kwargs()
    ),
    # the same on every exact site, normalisation-affine rescalings included
    "balance_every_allsites": lambda c: Teleport(
        c.optimizer(), c.model, c.all_sites(), objective="balance", schedule=Schedule(every=50, warmup=50), **c.teleport_kwargs()
    ),
    # the decay comparison (Ziyin et al. 2025): plain decay towards zero vs towards a random static anchor, same strength
    "weight_decay": lambda c: c.optimizer(weight_decay=c.decay),
    "syre_default": lambda c: c.syre(),
    "syre_sigma1": lambda c: c.syre(sigma0=1.0),
    # the language models' decay comparison: Cautious Weight Decay at the same strength
    "cautious_wd": lambda c: c.cautious(),
    # LoRA: every pair projected onto the balanced set after every step (a baseline of its own, tuned on its own grid)
    "balora": lambda c: c.balora(),
    # a control, not a teleopt configuration: the baseline with float32 round-off (x * 1.5 / 1.5 on every parameter)
    # at the default Teleport's first teleport step; how much round-off alone moves the baseline
    "baseline_roundoff": lambda c: RoundOffOnce(c.optimizer(), first_default_teleport(c)),
    # teleopt's balance on every step
    "balance_every1": lambda c: Teleport(c.optimizer(), c.model, "auto", objective="balance", every=1, **c.teleport_kwargs()),
    # QK-clip's invariant half (Kimi K2): per key/value group, ||W_Q|| = ||W_K|| by c W_Q, W_K / c, on attention only
    "qk_balance_every1": lambda c: Teleport(
        c.optimizer(), c.model, qk_head_scalings(c.model), objective="balance", every=1, **c.teleport_kwargs()
    ),
    "qk_balance_every50": lambda c: Teleport(
        c.optimizer(),
        c.model,
        qk_head_scalings(c.model),
        objective="balance",
        schedule=Schedule(every=50, warmup=50),
        **c.teleport_kwargs(),
    ),
}
"""Arm name -> optimizer factory.  Order is the default run order (rotated per seed)."""

TELEPORT_ARMS = tuple(a for a in ARMS if a.startswith("teleport"))
DECAY_ARMS = ("weight_decay", "syre_default", "syre_sigma1")
