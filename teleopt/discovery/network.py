"""The action network a_X(g, theta) of Zhao et al. 2024b, Sec. 5.

Zhao et al. 2024b, Sec. 5.3 parametrises the group action by an MLP that "takes a group
element, parameter, and data as input and outputs transformed parameters" (4 layers,
hidden widths 64, 64, 64; Zhao 2026, Sec. 6.5.3 uses 128, 128, 128).  teleopt's
network is that MLP added to the defining linear representation of GL(p):

    a_X(g, theta) = g theta + MLP(vec(g - I), theta, vec(X)).

The linear term is a parametrisation, not a constraint: the MLP can cancel it.  It
gives the learned generators a meaning (when the loss has a linear symmetry, the
generator itself can carry it, and the ``linearity`` regulariser of
:class:`~teleopt.discovery.losses.LossWeights` prefers that), which Zhao et al. 2024b Sec.
5.3 notes a bare MLP does not.  ``linear_base=False`` gives the papers' bare form
(as a residual, theta + MLP(...)): every symmetry must then come from the MLP.
Inputs are batched on leading axes; the group input is vec(g - I), so the identity
element is the zero vector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ActionNetwork", "NETWORK_ACTIVATIONS"]

NETWORK_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "tanh": torch.tanh, "gelu": F.gelu, "softplus": F.softplus}


class ActionNetwork(nn.Module):
    """a_X(g, theta) = g theta + MLP(vec(g - I), theta, vec(X)) (Zhao et al. 2024b, Sec. 5.3).

    The default parametrisation of the papers' action network (see the module docs).

    Parameters
    ----------
    num_params:
        p, the length of the flattened parameter vector theta.
    data_features:
        The number of data entries the action reads (0 for a data-independent action).
    hidden:
        Hidden widths of the MLP (Zhao et al. 2024b: 64, 64, 64; Zhao 2026: 128, 128, 128).
    activation:
        A smooth activation (``silu``, ``tanh``, ``gelu``, ``softplus``): the
        associativity loss differentiates the network twice.
    init_scale:
        Scale of the last layer at initialisation (the MLP starts as a small
        perturbation of the linear action).
    generator:
        Draws the initial weights (the global RNG is not touched).
    linear_base:
        Add the linear action g theta (default) or not (theta + MLP only).
    """

    def __init__(
        self,
        num_params: int,
        data_features: int,
        hidden: Sequence[int] = (64, 64, 64),
        activation: str = "silu",
        init_scale: float = 0.1,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        linear_base: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 1:
            raise ValueError(f"num_params must be a positive int, got {num_params!r}")
        if isinstance(data_features, bool) or not isinstance(data_features, int) or data_features < 0:
            raise ValueError(f"data_features must be a non-negative int, got {data_features!r}")
        hidden = tuple(hidden)
        if not hidden or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in hidden):
            raise ValueError(f"hidden must be a non-empty sequence of positive ints, got {hidden!r}")
        if activation not in NETWORK_ACTIVATIONS:
            raise ValueError(f"unknown network activation {activation!r}; choose one of {sorted(NETWORK_ACTIVATIONS)}")
        if not (math.isfinite(init_scale) and init_scale >= 0):
            raise ValueError(f"init_scale must be finite and >= 0, got {init_scale!r}")
        self.num_params, self.data_features = num_params, data_features
        self.hidden, self.activation = hidden, activation
        self.linear_base = bool(linear_base)
        widths = (num_params * num_params + num_params + data_features, *hidden, num_params)
        self.layers = nn.ModuleList(nn.utils.skip_init(nn.Linear, a, b, dtype=dtype) for a, b in zip(widths[:-1], widths[1:]))
        with torch.no_grad():
            for i, layer in enumerate(self.linears):
                bound = 1.0 / math.sqrt(layer.in_features)  # torch's default nn.Linear range
                scale = init_scale if i == len(self.layers) - 1 else 1.0
                for tensor in (layer.weight, layer.bias):
                    draw = torch.rand(tensor.shape, generator=generator, dtype=torch.float64)
                    tensor.copy_((2 * draw - 1) * bound * scale)

    @property
    def linears(self) -> Sequence[nn.Linear]:
        """``layers`` as the linear layers they are."""
        # nn.ModuleList is not generic in torch's annotations: its items are typed Module
        return cast("Sequence[nn.Linear]", self.layers)

    def config(self) -> dict:
        """Plain-data constructor arguments (for saving)."""
        return {
            "num_params": self.num_params,
            "data_features": self.data_features,
            "hidden": list(self.hidden),
            "activation": self.activation,
            "linear_base": self.linear_base,
        }

    def forward(self, g_offset: Tensor, theta: Tensor, x: Tensor) -> Tensor:
        """a_X(g, theta) for g = I + unvec(g_offset); shapes (..., p*p), (..., p), (..., d) -> (..., p)."""
        p = self.num_params
        z = torch.cat([g_offset, theta, x], dim=-1)
        act = NETWORK_ACTIVATIONS[self.activation]
        # matmul + add rather than nn.Linear.__call__: under torch.func.jvp, F.linear is
        # decomposed in Python, which is slower for these small layers
        linears = self.linears
        for layer in linears[:-1]:
            z = act(z @ layer.weight.T + layer.bias)
        last = linears[-1]
        correction = z @ last.weight.T + last.bias
        if not self.linear_base:
            return theta + correction
        linear = theta + (g_offset.unflatten(-1, (p, p)) @ theta.unsqueeze(-1)).squeeze(-1)
        return linear + correction
