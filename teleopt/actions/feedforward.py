"""Symmetries of two-layer networks, Zhao 2026, Table 1.1 (Ex. 1.2.2, 1.2.4-1.2.6, 1.2.9, 1.2.10).

Shapes follow ``torch.nn.Linear``: data X is (k, n) with one sample per row,
W1 is (h, n), b1 is (h,), W2 is (m, h); the network is
f(X) = sigma(X W1^T + b1) W2^T (+ b2, which no action touches).  In the papers'
column convention this is W2 sigma(W1 X + b1); the actions are identical:

* GL_h:            (W2 g^{-1}, g W1, g b1), sigma = identity          (Ex. 1.2.2)
* R_{>0}^h:        (W2 g^{-alpha}, g W1, g b1), sigma homogeneous      (Ex. 1.2.4)
* Z_2^h:           (W2 g^{-1}, g W1, g b1), sigma odd                  (Ex. 1.2.5)
* O(h):            (W2 g^{-1}, g W1, g b1), sigma radial rescaling     (Ex. 1.2.6)
* S_h:             (W2 g^{-1}, g W1, g b1), sigma any pointwise         (Ex. 1.2.9)
* S_k on RBF components (w_i, b_i, c_i)                                 (Ex. 1.2.10)
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from teleopt.actions.activations import Activation, get_activation
from teleopt.actions.axis import AxisAction, Member
from teleopt.actions.base import ExampleProblem, Params, required

__all__ = [
    "GLLinear",
    "PositiveRescaling",
    "SignFlipAction",
    "RadialOrthogonal",
    "HiddenPermutation",
    "RBFPermutation",
    "two_layer_example",
]


def _randn(shape, generator, dtype) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def two_layer_example(
    activation: Activation,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    m: int = 3,
    h: int = 5,
    n: int = 4,
    k: int = 7,
) -> ExampleProblem:
    """Random (W1, b1, W2) and X for f(X) = act(X W1^T + b1) W2^T."""
    params = (_randn((h, n), generator, dtype), _randn((h,), generator, dtype), _randn((m, h), generator, dtype))
    X = _randn((k, n), generator, dtype)

    def fn(p: Params, x: Tensor) -> Tensor:
        W1, b1, W2 = required(p[0], "W1"), p[1], required(p[2], "W2")
        z = x @ W1.T if b1 is None else x @ W1.T + b1
        return activation(z) @ W2.T

    return ExampleProblem(params, X, fn)


def _relu_power(alpha: float, z: Tensor) -> Tensor:
    return torch.relu(z) ** alpha


def _hidden_members(reader_power: float) -> tuple[Member, ...]:
    return (Member("W1", 0, 1), Member("b1", 0, 1, optional=True), Member("W2", 1, reader_power))


class _TwoLayerAction(AxisAction):
    """An action on a two-layer network through ``activation``; its example problem is one."""

    activation: Activation

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return two_layer_example(self.activation, generator, dtype)


class GLLinear(_TwoLayerAction):
    """GL_h acting between two linear layers with biases: Zhao 2026, Ex. 1.2.2.

    g . (W1, b1, W2) = (g W1, g b1, W2 g^{-1}).
    """

    def __init__(self) -> None:
        self.activation = get_activation("identity")
        super().__init__(
            "gl_linear",
            "general",
            _hidden_members(-1),
            reference="Zhao 2026, Ex. 1.2.2",
            group_name="GL_h(R)",
        )


class PositiveRescaling(_TwoLayerAction):
    """Positive rescaling through a homogeneous activation of degree alpha: Zhao 2026, Ex. 1.2.4.

    g . (W1, b1, W2) = (g W1, g b1, W2 g^{-alpha}) for g in R_{>0}^h.  ``activation``
    is ``"relu"``, ``"leaky_relu"`` (with ``negative_slope``) or ``"identity"``
    (degree 1), or ``"relu_power"`` for z -> relu(z)**alpha with any alpha > 0.
    """

    def __init__(self, activation: str = "leaky_relu", alpha: float | None = None, negative_slope: float = 0.1) -> None:
        if activation == "relu_power":
            alpha = 2.0 if alpha is None else float(alpha)
            if not alpha > 0:
                raise ValueError(f"alpha must be > 0, got {alpha}")
            act = Activation(f"relu^{alpha}", partial(_relu_power, alpha), degree=alpha)
        else:
            act = get_activation(activation, negative_slope if activation == "leaky_relu" else None)
            if act.degree is None:
                raise ValueError(f"{activation} is not positively homogeneous: no positive rescaling symmetry")
            if alpha is not None and alpha != act.degree:
                raise ValueError(f"{activation} has degree {act.degree}, not {alpha}")
            alpha = act.degree
        self.activation = act
        self.alpha = alpha
        super().__init__(
            "positive_rescaling",
            "diagonal",
            _hidden_members(-alpha),
            reference="Zhao 2026, Ex. 1.2.4",
            group_name="R_{>0}^h",
        )


class SignFlipAction(_TwoLayerAction):
    """Sign flips Z_2^h through an odd activation (tanh): Zhao 2026, Ex. 1.2.5."""

    def __init__(self, activation: str = "tanh") -> None:
        act = get_activation(activation)
        if not act.odd:
            raise ValueError(f"{activation} is not odd: no sign-flip symmetry")
        self.activation = act
        super().__init__(
            "sign_flip",
            "sign",
            _hidden_members(-1),
            reference="Zhao 2026, Ex. 1.2.5",
            group_name="Z_2^h",
        )


def radial_rescaling(z: Tensor) -> Tensor:
    """A radial rescaling activation sigma(z) = f(|z|) z with f(r) = 1 / (1 + r) (per sample)."""
    return z / (1.0 + z.norm(dim=-1, keepdim=True))


class RadialOrthogonal(_TwoLayerAction):
    """O(h) through a radial rescaling activation sigma(z) = f(|z|) z: Zhao 2026, Ex. 1.2.6."""

    def __init__(self) -> None:
        self.activation = Activation("radial", radial_rescaling)
        super().__init__(
            "radial_orthogonal",
            "orthogonal",
            _hidden_members(-1),
            reference="Zhao 2026, Ex. 1.2.6",
            group_name="O(h)",
        )


class HiddenPermutation(_TwoLayerAction):
    """Permutations S_h of hidden units through any pointwise activation: Zhao 2026, Ex. 1.2.9."""

    def __init__(self, activation: str = "gelu") -> None:
        self.activation = get_activation(activation)
        super().__init__(
            "hidden_permutation",
            "permutation",
            _hidden_members(1),
            reference="Zhao 2026, Ex. 1.2.9",
            group_name="S_h",
        )


def _rbf_example(generator: torch.Generator | None, dtype: torch.dtype, k: int = 6, n: int = 3, samples: int = 5) -> ExampleProblem:
    w = _randn((k,), generator, dtype)
    b = _randn((k,), generator, dtype).abs() + 0.5
    c = _randn((k, n), generator, dtype)
    X = _randn((samples, n), generator, dtype)

    def fn(p: Params, x: Tensor) -> Tensor:
        w, b, c = (required(t) for t in p)
        r = torch.cdist(x, c) / b
        return torch.exp(-(r**2)) @ w

    return ExampleProblem((w, b, c), X, fn)


class RBFPermutation(AxisAction):
    """Permutations S_k of radial-basis components (w_i, b_i, c_i): Zhao 2026, Ex. 1.2.10.

    f(x) = sum_i w_i phi(|x - c_i| / b_i); members w (k,), b (k,), c (k, n).
    """

    def __init__(self) -> None:
        super().__init__(
            "rbf_permutation",
            "permutation",
            (Member("w", 0), Member("b", 0), Member("c", 0)),
            reference="Zhao 2026, Ex. 1.2.10",
            group_name="S_k",
        )

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return _rbf_example(generator, dtype)
