"""Scalar activations and the properties the symmetries of Zhao 2026, Ch. 1 and 4 rely on.

* positively homogeneous of degree alpha (sigma(c z) = c**alpha sigma(z) for c > 0):
  ReLU, LeakyReLU, identity (Ex. 1.2.4);
* odd (sigma(-z) = -sigma(z)): tanh, identity, LeakyReLU is not (Ex. 1.2.5);
* bijective with an inverse (Prop. 4.4.2 needs sigma^{-1}): LeakyReLU, identity,
  and tanh/sigmoid on their ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Activation", "get_activation", "ACTIVATIONS"]


@dataclass(frozen=True)
class Activation:
    """A pointwise activation with the structure symmetries need.

    ``inverse`` is defined on ``range`` (open interval, ``None`` = all reals);
    ``degree`` is the homogeneity degree alpha, or ``None`` if not homogeneous.
    """

    name: str
    fn: Callable[[Tensor], Tensor]
    inverse: Callable[[Tensor], Tensor] | None = None
    degree: float | None = None
    odd: bool = False
    range: tuple[float, float] | None = None

    def __call__(self, z: Tensor) -> Tensor:
        return self.fn(z)

    def check_in_range(self, y: Tensor, what: str) -> None:
        """Raise ``ValueError`` if ``y`` leaves the domain of ``inverse``."""
        if self.range is None:
            return
        lo, hi = self.range
        if bool(((y <= lo) | (y >= hi)).any()):
            raise ValueError(
                f"{what} leaves the range ({lo}, {hi}) of {self.name}, so sigma^-1 is undefined there: use a smaller group element"
            )


def _identity(z: Tensor) -> Tensor:
    return z


def _leaky_relu(slope: float, z: Tensor) -> Tensor:
    return F.leaky_relu(z, slope)


def _leaky_relu_inverse(slope: float, y: Tensor) -> Tensor:
    return torch.where(y >= 0, y, y / slope)


def _leaky(slope: float) -> Activation:
    # module-level functions and partials, not lambdas: activations (and the actions holding them) pickle
    return Activation(
        name=f"leaky_relu({slope})",
        fn=partial(_leaky_relu, slope),
        inverse=partial(_leaky_relu_inverse, slope),
        degree=1.0,
    )


ACTIVATIONS: dict[str, Activation] = {
    "identity": Activation("identity", _identity, _identity, degree=1.0, odd=True),
    "relu": Activation("relu", torch.relu, degree=1.0),
    "leaky_relu": _leaky(0.1),
    "tanh": Activation("tanh", torch.tanh, torch.atanh, odd=True, range=(-1.0, 1.0)),
    "sigmoid": Activation("sigmoid", torch.sigmoid, torch.logit, range=(0.0, 1.0)),
    "gelu": Activation("gelu", F.gelu),
    "silu": Activation("silu", F.silu),
}


def get_activation(activation: str | Activation, negative_slope: float | None = None) -> Activation:
    """Look up an activation by name (``"leaky_relu"`` takes ``negative_slope``, default 0.1)."""
    if isinstance(activation, Activation):
        return activation
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a name or an Activation, got {type(activation).__name__}")
    if activation == "leaky_relu" and negative_slope is not None:
        if not negative_slope > 0:
            raise ValueError(f"negative_slope must be > 0 for an invertible LeakyReLU, got {negative_slope}")
        return _leaky(float(negative_slope))
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}") from None
