"""Gradient flow theta' = -grad L(theta) (Zhao 2026, eq. 2.10), integrated to a stated accuracy.

Conservation laws hold for gradient flow, not for gradient descent (Zhao 2026
App. A.4): checking them needs the flow itself.  :func:`integrate_gradient_flow`
integrates it with the classical fourth-order Runge-Kutta method (global error
O(dt^4)) or explicit Euler (which *is* gradient descent with learning rate dt,
global error O(dt)), on a dict of named tensors, so any ``nn.Module`` works
through ``torch.func.functional_call``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["GradientFlowTrajectory", "integrate_gradient_flow"]

Tensors = dict[str, Tensor]


@dataclass
class GradientFlowTrajectory:
    """Recorded points of a gradient-flow trajectory: ``times[i]`` and ``points[i]`` (detached tensors)."""

    times: list[float] = field(default_factory=list)
    points: list[Tensors] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.points)

    @property
    def final(self) -> Tensors:
        """The last recorded point."""
        return self.points[-1]


def _axpy(a: float, x: Tensors, y: Tensors) -> Tensors:
    return {k: y[k] + a * x[k] for k in y}


def _rk4_step(velocity: Callable[[Tensors], Tensors], theta: Tensors, dt: float) -> Tensors:
    """One classical Runge-Kutta step of theta' = velocity(theta)."""
    k1 = velocity(theta)
    k2 = velocity(_axpy(dt / 2, k1, theta))
    k3 = velocity(_axpy(dt / 2, k2, theta))
    k4 = velocity(_axpy(dt, k3, theta))
    return {k: theta[k] + dt / 6 * (k1[k] + 2 * k2[k] + 2 * k3[k] + k4[k]) for k in theta}


def _check_params(params: Any) -> None:
    if not isinstance(params, Mapping) or not params:
        raise TypeError("params must be a non-empty mapping of names to tensors")
    for k, v in params.items():
        if not isinstance(v, Tensor) or not v.is_floating_point():
            raise TypeError(f"params[{k!r}] must be a floating-point tensor")


def integrate_gradient_flow(
    loss_fn: Callable[[Tensors], Tensor],
    params: Mapping[str, Tensor],
    duration: float,
    steps: int,
    *,
    method: Literal["rk4", "euler"] = "rk4",
    record_every: int = 1,
) -> GradientFlowTrajectory:
    """Integrate theta' = -grad L(theta) from ``params`` over ``duration`` in ``steps`` equal steps.

    ``loss_fn(params) -> scalar`` takes a dict of tensors (e.g.
    ``lambda p: loss(functional_call(model, p, (x,)), y)``).  ``"rk4"`` has
    global error O(dt^4) with dt = duration / steps; ``"euler"`` is plain
    gradient descent with learning rate dt.  Every ``record_every``-th point
    (and always the first and last) is recorded.
    """
    _check_params(params)
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable(params) -> scalar tensor")
    if not isinstance(duration, (int, float)) or not math.isfinite(duration) or duration <= 0:
        raise ValueError(f"duration must be a positive finite number, got {duration!r}")
    for name, value in (("steps", steps), ("record_every", record_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if method not in ("rk4", "euler"):
        raise ValueError(f"method must be 'rk4' or 'euler', got {method!r}")

    grad_fn = torch.func.grad(loss_fn)

    def velocity(p: Tensors) -> Tensors:
        g = grad_fn(p)
        return {k: -g[k] for k in p}

    dt = float(duration) / steps
    theta = {k: v.detach().clone() for k, v in params.items()}
    out = GradientFlowTrajectory([0.0], [dict(theta)])
    with torch.enable_grad():
        for i in range(1, steps + 1):
            theta = _axpy(dt, velocity(theta), theta) if method == "euler" else _rk4_step(velocity, theta, dt)
            theta = {k: v.detach() for k, v in theta.items()}
            if i % record_every == 0 or i == steps:
                out.times.append(i * dt)
                out.points.append(dict(theta))
    return out
