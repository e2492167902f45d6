"""Functional models of the base optimizers: the roles of their state tensors and their next update.

Teleportation moves the parameters along a loss-invariant orbit, so the question it
answers is where the *next steps of the base optimizer* make the most progress.
Two things about the base optimizer are needed for that:

* what each per-parameter state tensor *is* (its role), so it can follow the
  parameters consistently: first moments (SGD momentum, Adam's ``exp_avg``) are
  covectors like gradients, second moments (Adam's ``exp_avg_sq``, Adagrad's
  ``sum``, RMSprop's ``square_avg``) are elementwise squares of covectors,
  step counters are scalars (Zhao 2026, Sec. 5.4.1; CONVENTIONS.md section 2);
* the displacement u(grad, state) its next step would subtract, computed
  functionally (without touching the real state), for the preconditioned-norm
  objective <grad, u> (Zhao 2026, eq. 4.17 with eta the optimizer's own
  preconditioner, eq. 5.7 for AdaGrad) and the one-step lookahead objective
  L(w - u).

Models exist for ``SGD`` (momentum, dampening, Nesterov, weight decay),
``Adagrad``, ``RMSprop`` (centered, momentum) and ``Adam``/``AdamW`` (amsgrad,
decoupled weight decay), including ``maximize``.  Other optimizers (e.g.
torch-optimizer's Lamb, RAdam, Yogi) still get their state roles, but objectives
that need the update raise ``TypeError``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import LBFGS, SGD, Adagrad, Adam, Optimizer, RMSprop

__all__ = ["StateRole", "state_role", "OptimizerModel"]

StateRole = Literal["first_moment", "second_moment", "step", "derived", "update", "unknown"]

# state key -> role, shared by torch.optim and torch-optimizer
_ROLES: dict[str, StateRole] = {
    "momentum_buffer": "first_moment",
    "exp_avg": "first_moment",
    "grad_avg": "first_moment",
    "exp_avg_sq": "second_moment",
    "max_exp_avg_sq": "second_moment",
    "square_avg": "second_moment",
    "sum": "second_moment",
    "exp_avg_var": "second_moment",
    "step": "step",
    # recomputed from scratch on every step (torch-optimizer's Lamb diagnostics)
    "weight_norm": "derived",
    "adam_norm": "derived",
    "trust_ratio": "derived",
    # timm Lookahead's slow weights live in the inner optimizer's state; they transform
    # like the parameters and are moved by teleopt.teleport.lookahead, not per state entry
    "lookahead_slow_buff": "derived",
}


def state_role(optimizer: Optimizer, key: str) -> StateRole:
    """The role of the per-parameter state entry ``key`` of ``optimizer`` (see module docs).

    RMSprop's ``momentum_buffer`` accumulates *updates* grad / sqrt(v), which are
    neither covectors nor their squares: its role is ``"update"`` (no exact
    transport rule; it is reset by default).  ``LBFGS`` keeps one flat curvature
    history for all parameters; it is ``"derived"`` here (left alone per tensor) and
    :class:`~teleopt.teleport.Teleport` restarts the whole history after an accepted
    teleport, since pairs of steps and gradient differences from before the teleport
    describe a different point of the orbit.
    """
    if isinstance(optimizer, LBFGS):
        return "derived"
    if key == "momentum_buffer" and isinstance(optimizer, RMSprop):
        return "update"
    return _ROLES.get(key, "unknown")


def _step_value(state: dict[str, Any]) -> float:
    step = state.get("step", 0)
    return float(step.item()) if isinstance(step, Tensor) else float(step)


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _lr_wd(group: dict[str, Any]) -> tuple[float, float]:
    """The group's learning rate and weight decay as floats."""
    return _float(group["lr"]), _float(group.get("weight_decay", 0.0))


class OptimizerModel:
    """The next update of a known base optimizer as a pure function (see module docs).

    ``update(group, param, grad, state)`` returns the displacement u such that the
    base optimizer's next step would set ``param <- param - u`` given gradient
    ``grad`` and per-parameter ``state`` (tensors may carry autograd history; the
    real optimizer state is never modified).  ``supported`` is False for optimizers
    without a model.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.family: str | None
        if isinstance(optimizer, Adam):  # AdamW subclasses Adam
            self.family = "adam"
        elif isinstance(optimizer, SGD):
            self.family = "sgd"
        elif isinstance(optimizer, Adagrad):
            self.family = "adagrad"
        elif isinstance(optimizer, RMSprop):
            self.family = "rmsprop"
        else:
            self.family = None
        self.optimizer_name = type(optimizer).__name__

    @property
    def supported(self) -> bool:
        """Whether the next update of this optimizer can be computed functionally."""
        return self.family is not None

    def require(self, what: str) -> None:
        """Raise ``TypeError`` naming ``what`` if the optimizer has no model."""
        if not self.supported:
            raise TypeError(
                f"{what} needs a functional model of the base optimizer's update, which teleopt has for "
                f"SGD, Adagrad, RMSprop, Adam and AdamW, not {self.optimizer_name}; use objective='grad_norm'"
            )

    def update(self, group: dict[str, Any], param: Tensor, grad: Tensor, state: dict[str, Any]) -> Tensor:
        """The displacement of the next step (``param_next = param - update``)."""
        self.require("this objective")
        maximize = bool(group.get("maximize", False))
        g = -grad if maximize else grad
        if self.family == "sgd":
            return self._sgd(group, param, g, state)
        if self.family == "adagrad":
            return self._adagrad(group, param, g, state)
        if self.family == "rmsprop":
            return self._rmsprop(group, param, g, state)
        return self._adam(group, param, g, state)

    @staticmethod
    def _sgd(group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Any]) -> Tensor:
        lr, wd = _lr_wd(group)
        d = g + wd * p if wd else g
        mu = float(group.get("momentum", 0.0))
        if mu:
            buf = state.get("momentum_buffer")
            buf = d if buf is None else mu * buf + (1.0 - float(group.get("dampening", 0.0))) * d
            d = d + mu * buf if group.get("nesterov", False) else buf
        return lr * d

    @staticmethod
    def _adagrad(group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Any]) -> Tensor:
        lr, wd = _lr_wd(group)
        step = _step_value(state) + 1
        clr = lr / (1.0 + (step - 1) * float(group.get("lr_decay", 0.0)))
        if wd:
            g = g + wd * p
        acc = state.get("sum")
        if acc is None:
            acc = torch.full_like(p, float(group.get("initial_accumulator_value", 0.0)))
        acc = acc + g * g
        return clr * g / (acc.sqrt() + float(group["eps"]))

    @staticmethod
    def _rmsprop(group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Any]) -> Tensor:
        lr, wd = _lr_wd(group)
        if wd:
            g = g + wd * p
        alpha, eps = float(group["alpha"]), float(group["eps"])
        sq = state.get("square_avg")
        sq = (1 - alpha) * g * g if sq is None else alpha * sq + (1 - alpha) * g * g
        if group.get("centered", False):
            ga = state.get("grad_avg")
            ga = (1 - alpha) * g if ga is None else alpha * ga + (1 - alpha) * g
            avg = (sq - ga * ga).sqrt() + eps
        else:
            avg = sq.sqrt() + eps
        mu = float(group.get("momentum", 0.0))
        if mu > 0:
            buf = state.get("momentum_buffer")
            buf = g / avg if buf is None else mu * buf + g / avg
            return lr * buf
        return lr * g / avg

    @staticmethod
    def _adam(group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Any]) -> Tensor:
        lr, wd = _lr_wd(group)
        beta1, beta2 = (_float(b) for b in group["betas"])
        eps = float(group["eps"])
        step = _step_value(state) + 1
        decoupled = bool(group.get("decoupled_weight_decay", False))
        decay = lr * wd * p if (wd and decoupled) else None
        if wd and not decoupled:
            g = g + wd * p
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        m = (1 - beta1) * g if m is None else beta1 * m + (1 - beta1) * g
        v = (1 - beta2) * g * g if v is None else beta2 * v + (1 - beta2) * g * g
        if group.get("amsgrad", False):
            vmax = state.get("max_exp_avg_sq")
            v = v if vmax is None else torch.maximum(vmax, v)
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        u = (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
        return u if decay is None else u + decay

    # -- linear stability (the "edge of stability" of each update rule) ----------------------
    def preconditioner(self, group: dict[str, Any], param: Tensor, grad: Tensor, state: dict[str, Any]) -> Tensor:
        """Diagonal P of the next step linearised in the gradient (the step is about P * grad).

        SGD: lr; Adagrad: lr / (sqrt(sum + g^2) + eps); RMSprop: lr / (sqrt(v') + eps);
        Adam/AdamW: lr / (sqrt(v_hat') + eps) (momentum is accounted for in
        :meth:`stability_threshold`).  Constant in the parameters' values, as in the
        analyses of adaptive methods at the edge of stability (Cohen et al. 2022).
        """
        self.require("the stability check")
        lr = _float(group["lr"])
        g = grad.detach()
        if self.family == "sgd":
            return torch.full_like(g, lr)
        if self.family == "adagrad":
            step = _step_value(state) + 1
            clr = lr / (1.0 + (step - 1) * float(group.get("lr_decay", 0.0)))
            acc = state.get("sum")
            acc = torch.full_like(g, float(group.get("initial_accumulator_value", 0.0))) if acc is None else acc.detach()
            return clr / ((acc + g * g).sqrt() + float(group["eps"]))
        if self.family == "rmsprop":
            alpha = float(group["alpha"])
            sq = state.get("square_avg")
            sq = (1 - alpha) * g * g if sq is None else alpha * sq.detach() + (1 - alpha) * g * g
            if group.get("centered", False):
                ga = state.get("grad_avg")
                ga = (1 - alpha) * g if ga is None else alpha * ga.detach() + (1 - alpha) * g
                sq = sq - ga * ga
            return lr / (sq.clamp_min(0).sqrt() + float(group["eps"]))
        beta1, beta2 = (_float(b) for b in group["betas"])
        step = _step_value(state) + 1
        v = state.get("exp_avg_sq")
        v = (1 - beta2) * g * g if v is None else beta2 * v.detach() + (1 - beta2) * g * g
        if group.get("amsgrad", False) and state.get("max_exp_avg_sq") is not None:
            v = torch.maximum(state["max_exp_avg_sq"].detach(), v)
        return lr / ((v / (1 - beta2**step)).sqrt() + float(group["eps"]))

    def stability_threshold(self, group: dict[str, Any]) -> float:
        """The largest eigenvalue of P H (P from :meth:`preconditioner`) at which the update rule is
        linearly stable on a quadratic: 2 for GD and Adagrad, (2 + 2 mu) / (1 - dampening) for heavy-ball
        momentum, (2 + 2 mu) / (1 + 2 mu) for Nesterov, 2 (1 + beta1) / (1 - beta1) for Adam."""
        self.require("the stability check")
        if self.family == "sgd":
            mu = float(group.get("momentum", 0.0))
            if group.get("nesterov", False):
                return (2 + 2 * mu) / (1 + 2 * mu)
            return (2 + 2 * mu) / max(1.0 - float(group.get("dampening", 0.0)), 1e-12)
        if self.family == "rmsprop":
            return 2 + 2 * float(group.get("momentum", 0.0))
        if self.family == "adam":
            beta1 = _float(group["betas"][0])
            return 2 * (1 + beta1) / (1 - beta1)
        return 2.0
