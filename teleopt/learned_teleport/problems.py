"""The problem distribution of Zhao 2026, Sec. 5.5: two-layer LeakyReLU networks on random data.

L(W1, W2) = ||Y - W2 sigma(W1 X)||_2 (Frobenius norm), sigma = LeakyReLU(0.1), all
matrices 20 x 20 in the thesis.  In teleopt's row convention (``torch.nn.Linear``) the
loss is ||Y - sigma(X W1^T) W2^T||, the same function of the same matrices.  The
exact symmetry used for teleports is the positive rescaling of the hidden units,
(W1, W2) -> (diag(c) W1, W2 diag(c)^{-1}) (Zhao 2026, Ex. 1.2.4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction
from teleopt.actions.feedforward import GLLinear, PositiveRescaling
from teleopt.site import Site

__all__ = ["MetaProblem", "TwoLayerProblems"]


@dataclass
class MetaProblem:
    """One training or test problem: a loss of named tensors, initial values and the sites.

    ``loss(tensors)`` returns a scalar for a mapping of tensor names to values
    (differentiable); ``params`` are the initial values; ``sites`` the symmetries
    (exact, with gradient transport) the policy teleports along.
    """

    loss: Callable[[Mapping[str, Tensor]], Tensor]
    params: dict[str, Tensor]
    sites: tuple[Site, ...]
    data: dict[str, Tensor] = field(default_factory=dict)


class TwoLayerProblems:
    """A sampler of the thesis' problems: ``sampler(generator) -> MetaProblem``.

    ``n`` inputs, ``h`` hidden units, ``m`` outputs, ``k`` samples (all 20 in the
    thesis); X, Y, W1, W2 have i.i.d. standard normal entries (times ``init_scale``
    for the weights).  ``activation="leaky_relu"`` uses the positive rescaling
    site; ``"identity"`` (a linear network) uses GL_h.
    """

    def __init__(
        self,
        n: int = 20,
        h: int = 20,
        m: int = 20,
        k: int = 20,
        negative_slope: float = 0.1,
        activation: str = "leaky_relu",
        init_scale: float = 1.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, v in (("n", n), ("h", h), ("m", m), ("k", k)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if activation not in ("leaky_relu", "identity"):
            raise ValueError(f"activation must be 'leaky_relu' or 'identity', got {activation!r}")
        self.n, self.h, self.m, self.k = n, h, m, k
        self.negative_slope = float(negative_slope)
        self.activation = activation
        self.init_scale = float(init_scale)
        self.dtype = dtype
        action: AxisAction
        if activation == "leaky_relu":
            action = PositiveRescaling("leaky_relu", negative_slope=self.negative_slope)
        else:
            action = GLLinear()
        self.site = Site(action, ("W1", None, "W2"), name=f"{action.name}@hidden")

    def sigma(self, z: Tensor) -> Tensor:
        if self.activation == "identity":
            return z
        return torch.nn.functional.leaky_relu(z, self.negative_slope)

    def __call__(self, generator: torch.Generator | None = None) -> MetaProblem:
        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(self.dtype)

        X, Y = randn(self.k, self.n), randn(self.k, self.m)
        W1, W2 = self.init_scale * randn(self.h, self.n), self.init_scale * randn(self.m, self.h)

        def loss(t: Mapping[str, Tensor]) -> Tensor:
            x = X.to(t["W1"].dtype)
            y = Y.to(t["W1"].dtype)
            return torch.linalg.norm(y - self.sigma(x @ t["W1"].T) @ t["W2"].T)

        return MetaProblem(loss, {"W1": W1, "W2": W2}, (self.site,), {"X": X, "Y": Y})
