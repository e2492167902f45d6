"""Translation symmetry of softmax inputs: Zhao 2026, Ex. 1.2.8.

softmax(z + t 1) = softmax(z): adding one vector g in R^n to every row of the
weight W (m, n) of a layer followed by softmax (or cross-entropy), and one scalar s
to every entry of its bias, adds x . g + s to every logit of a sample.  The action
is affine with Jacobian J = I, so gradients and optimizer state are unchanged by it
(Zhao 2026, eq. 4.19 with J = I): it never changes the gradient norm, only where
the parameters sit (useful for the sharpness/curvature objectives and for keeping
logits centred).  The element is (g, s) concatenated, of length n + 1 with a bias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from teleopt.actions.base import ExampleProblem, GroupAction, Params, required
from teleopt.groups import Group, Translation

__all__ = ["SoftmaxTranslation"]


class SoftmaxTranslation(GroupAction):
    """(W_i + g, b_i + s) for every row i: the (R^n, +) symmetry of Zhao 2026, Ex. 1.2.8."""

    name = "softmax_translation"
    group_name = "(R^n, +)"
    reference = "Zhao 2026, Ex. 1.2.8"
    exactness = "exact"
    linear = False
    group_type = Translation
    member_names = ("W", "b")
    optional_members = frozenset({"b"})

    @property
    def has_gradient_transport(self) -> bool:
        return True

    def group(self, params: Params) -> Group:
        W, b = self.check_params(params)
        W = required(W, "W")
        if W.ndim != 2:
            raise ValueError(f"{self.name}: W must be a matrix (classes, features), got shape {tuple(W.shape)}")
        if b is not None and b.shape != W.shape[:1]:
            raise ValueError(f"{self.name}: b must have shape {tuple(W.shape[:1])}, got {tuple(b.shape)}")
        return Translation(W.shape[1] + (b is not None))

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        params = self.check_params(params)
        self.group(params).validate(g.detach())
        W, b = params
        W = required(W, "W")
        n = W.shape[1]
        g = g.to(W)
        return (W + g[:n], None if b is None else b + g[n])

    def transport_gradient(self, g: Tensor, grads: Params) -> Params:
        """J = I: gradients are unchanged."""
        return self.check_params(grads)

    def transport_second_moment(self, g: Tensor, moments: Params) -> Params | None:
        """J = I: second moments are unchanged."""
        return self.check_params(moments)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

        W, b, X = randn(5, 4), randn(5), randn(6, 4)
        return ExampleProblem((W, b), X, lambda p, x: torch.log_softmax(x @ required(p[0]).T + required(p[1]), dim=-1))
