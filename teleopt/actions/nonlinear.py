"""The nonlinear data-dependent GL_h action of Zhao et al. 2023, Theorem 2.4.1 (Theorem 4.1 there).

For a two-layer network F(x) = U sigma(V x + b) and one input x, with R_z any
matrix such that R_z e_1 = z and R_z / |z| is orthogonal,

    g . (U, V, b) = (U R_{sigma(Vx+b)} R_{sigma(g(Vx+b))}^{-1}, g V, g b)

keeps F(x) unchanged: R_y^{-1} y = e_1, so the new output is
U R_{sigma(Vx+b)} e_1 = U sigma(Vx + b).  Identity and composition hold for *any*
such choice of R (the R factors telescope), so instead of the paper's spherical
coordinates we build R_z = |z| Q_z from one Householder reflection, choosing the
reflection that never divides by a small number; R_z^{-1} = Q_z^T / |z|.  The action
needs sigma(z) != 0 (true for the sigmoid; for tanh and LeakyReLU away from z = 0),
and it is exact for one sample at a time: batches of more than one sample raise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from teleopt.actions.activations import Activation, get_activation
from teleopt.actions.base import ExampleProblem, GroupAction, Params, required
from teleopt.groups import GeneralLinear, Group

__all__ = ["NonlinearGL", "householder_frame"]


def householder_frame(z: Tensor) -> Tensor:
    """An orthogonal Q with Q e_1 = z / |z| (a Householder reflection, up to sign)."""
    u = z / z.norm()
    e1 = torch.zeros_like(u)
    e1[0] = 1
    if bool(u[0] >= 0):
        v = e1 + u  # H_v e_1 = -u, so Q = -H_v
        sign = -1.0
    else:
        v = e1 - u  # H_v e_1 = u
        sign = 1.0
    H = torch.eye(u.numel(), dtype=u.dtype, device=u.device) - 2 * torch.outer(v, v) / (v @ v)
    return sign * H


class NonlinearGL(GroupAction):
    """GL_h acting on (U, V, b) nonlinearly, exact at one input: Zhao et al. 2023, Theorem 2.4.1.

    Members: U (m, h), V (h, n), b (h,) optional; data: one input x of shape (n,) or (1, n).
    """

    name = "nonlinear_gl"
    group_name = "GL_h(R)"
    reference = "Zhao et al. 2023, Theorem 2.4.1 (eq. 7)"
    exactness = "data-dependent"
    linear = False
    group_type = GeneralLinear
    member_names = ("U", "V", "b")
    optional_members = frozenset({"b"})

    def __init__(self, activation: str | Activation = "sigmoid") -> None:
        self.activation = get_activation(activation)

    def group(self, params: Params) -> Group:
        U, V, b = self.check_params(params)
        U, V = required(U, "U"), required(V, "V")
        if U.ndim != 2 or V.ndim != 2 or U.shape[1] != V.shape[0]:
            raise ValueError(f"{self.name}: need U (m, h) and V (h, n), got {tuple(U.shape)} and {tuple(V.shape)}")
        if b is not None and b.shape != V.shape[:1]:
            raise ValueError(f"{self.name}: b must have shape {tuple(V.shape[:1])}, got {tuple(b.shape)}")
        return GeneralLinear(V.shape[0])

    def _sample(self, params: Params, data: Any) -> Tensor:
        self._check_data(data)
        if not isinstance(data, Tensor):
            raise TypeError(f"{self.name}: data must be one input vector (a tensor)")
        x = data.reshape(-1) if data.ndim == 2 and data.shape[0] == 1 else data
        if x.ndim != 1:
            raise ValueError(f"{self.name}: the action is exact for a single sample only; got a batch of shape {tuple(data.shape)}")
        V = required(params[1], "V")
        if x.shape[0] != V.shape[1]:
            raise ValueError(f"{self.name}: input has {x.shape[0]} features but V expects {V.shape[1]}")
        return x.to(V.dtype)

    def _R(self, z: Tensor, what: str) -> tuple[Tensor, Tensor]:
        y = self.activation(z)
        r = y.norm()
        if not bool(r > torch.finfo(y.dtype).tiny):
            raise ValueError(f"{self.name}: sigma({what}) = 0, where the action is undefined")
        return y, r

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        params = self.check_params(params)
        self.group(params).validate(g.detach())
        x = self._sample(params, data)
        U, V, b = params
        U, V = required(U, "U"), required(V, "V")
        g = g.to(V)
        z = V @ x if b is None else V @ x + b
        y, r = self._R(z, "V x + b")
        y_new, r_new = self._R(g @ z, "g (V x + b)")
        # U R_y R_{y'}^{-1} = U (r Q_y) (Q_{y'}^T / r')
        U_new = U @ (householder_frame(y) @ householder_frame(y_new).T) * (r / r_new)
        return (U_new, g @ V, None if b is None else g @ b)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

        U, V, b, x = randn(3, 4), randn(4, 5), randn(4), randn(5)
        act = self.activation
        return ExampleProblem((U, V, b), x, lambda p, x: required(p[0]) @ act(required(p[1]) @ x + required(p[2])))
