"""Scale invariance of the weights feeding a BatchNorm: Zhao 2026, Ex. 1.2.7.

BN(c z) = (c z - c mu) / sqrt(c^2 var + eps) equals BN(z) exactly only for eps = 0,
so the action is declared ``approximate``.  Members: the weight W (h, ...) of the
layer feeding the BatchNorm (rows scaled by c), its optional bias (scaled by c), and
the BatchNorm's running mean (scaled by c) and running variance (scaled by c^2), so
eval mode is preserved as well as train mode.

Error budget: with per-channel variance v and scale c, the relative change of a
normalised output is |sqrt((v + eps) / (v + eps / c^2)) - 1| <= eps |1 - 1/c^2| / (2 v),
which :func:`batchnorm_scaling_bound` evaluates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, Params, required

__all__ = ["BatchNormScaling", "batchnorm_scaling_bound"]


def batchnorm_scaling_bound(var: Tensor, scale: Tensor, eps: float) -> float:
    """Upper bound on the relative output change of BN under input scaling (see module docs)."""
    return float((eps * (1 - scale.to(var.dtype) ** -2).abs() / (2 * var)).max())


class BatchNormScaling(AxisAction):
    """Positive scaling of the weights feeding a BatchNorm (exact up to eps): Zhao 2026, Ex. 1.2.7."""

    def __init__(self, eps: float = 1e-5) -> None:
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.eps = float(eps)
        super().__init__(
            "batchnorm_scaling",
            "diagonal",
            (
                Member("W", 0, 1),
                Member("b", 0, 1, optional=True),
                Member("running_mean", 0, 1, optional=True),
                Member("running_var", 0, 2, optional=True),
            ),
            reference="Zhao 2026, Ex. 1.2.7",
            group_name="R_{>0}^h",
            exactness="exact" if self.eps == 0 else "approximate",
        )

    def example(
        self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64, h: int = 4, n: int = 5, k: int = 16
    ) -> ExampleProblem:
        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

        W, b = randn(h, n), randn(h)
        running_mean = randn(h)
        running_var = randn(h).abs() + 0.5
        gamma, beta = randn(h), randn(h)
        X = randn(k, n)
        eps = self.eps

        def normalise(z: Tensor, mean: Tensor, var: Tensor) -> Tensor:
            # BatchNorm1d's formula, written out so that eps = 0 (exact invariance) is allowed
            return (z - mean) / torch.sqrt(var + eps) * gamma + beta

        def fn(p: Params, x: Tensor) -> Tensor:
            W, b, rm, rv = (required(t) for t in p)
            z = x @ W.T + b
            train = normalise(z, z.mean(0), z.var(0, unbiased=False))
            return torch.cat([train, normalise(z, rm, rv)], dim=0)

        return ExampleProblem((W, b, running_mean, running_var), X, fn)
