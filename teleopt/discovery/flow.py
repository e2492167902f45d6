"""Finite group elements from a learned infinitesimal action: integrating its flow.

For a group action a_X, the curve gamma(t) = a_X(exp(t A), theta) is the integral
curve of the vector field xi_A(theta) = D_g a_X|_{I,theta}(A) through theta:
d/dt gamma(t) = d/ds a_X(exp(s A), gamma(t))|_{s=0} = xi_A(gamma(t)) (Zhao et al. 2024b
Sec. 3.2, proof of Theorem 3.1; Zhao 2026, Sec. 6.5.4 plots the loss along these
curves).  teleopt acts with finite elements by integrating this ODE with the classic
fourth-order Runge-Kutta method, so a learned action composes exactly along one
generator (a flow is a one-parameter group) up to the integration error O(dt^4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["rk4"]


def rk4(field: Callable[[Tensor], Tensor], y0: Tensor, t: float = 1.0, steps: int = 16, path: bool = False) -> Tensor:
    """Integrate dy/dt = field(y) from y0 over [0, t] with ``steps`` classic RK4 steps.

    Returns y(t), or with ``path=True`` the states at the ``steps + 1`` grid points
    stacked along a new first axis.  Differentiable in ``y0`` and in anything
    ``field`` closes over.  The global error is O((t / steps)^4).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    dt = float(t) / steps
    y, states = y0, [y0]
    for _ in range(steps):
        k1 = field(y)
        k2 = field(y + (0.5 * dt) * k1)
        k3 = field(y + (0.5 * dt) * k2)
        k4 = field(y + dt * k3)
        y = y + (dt / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
        if path:
            states.append(y)
    if path:
        return torch.stack(states)
    return y
