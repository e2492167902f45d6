"""The discovery problems of Zhao et al. 2024b, Sec. 5.3-5.4 and Zhao 2026, Sec. 6.5.5.

Each factory returns a :class:`DiscoveryProblem`: a loss function, the parameter
shapes, their names and a Gaussian sampler (Zhao et al. 2024b, Sec. 5.3: "randomly
generated set of parameters and data"; Zhao 2026, Sec. 6.5.5: i.i.d. standard
normal).  Shapes follow ``torch.nn.Linear``: data X is (k, n) with one sample per
row and W (out, in), so Zhao et al. 2024b's U sigma(V X) is sigma(X W1^T) W2^T here.

* :func:`two_layer`: L = ||sigma(X W1^T) W2^T - Y||^2 (Sec. 5.3 with sigma = identity,
  ReLU or LeakyReLU; Sec. 5.4 with sigmoid), or with ``target="output"`` the
  network output itself (a functional symmetry, which Prop. 4.1 extends to any
  network containing the block);
* :func:`three_layer`: the same with three layers (Sec. 5.4, tanh, 2x2, 2x2, 2x1);
* :func:`tiny_transformer`: Zhao 2026, Sec. 6.5.5.

Loss functions built here carry a ``spec`` (problem name and configuration) that a
saved :class:`~teleopt.discovery.action.LearnedAction` stores, so loading it
restores its loss function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.activations import get_activation
from teleopt.actions.base import Params, required

__all__ = [
    "DiscoveryProblem",
    "GaussianSampler",
    "ProblemLoss",
    "two_layer",
    "three_layer",
    "tiny_transformer",
    "build_problem",
    "rescaling_generators",
    "PROBLEMS",
]


class GaussianSampler:
    """Draws parameters and data with i.i.d. N(0, scale^2) entries from a ``torch.Generator``.

    ``data_shapes`` are the data tensors' shapes; ``data_is_tensor`` returns a single
    tensor instead of a one-element tuple.
    """

    def __init__(
        self,
        param_shapes: Sequence[Sequence[int]],
        data_shapes: Sequence[Sequence[int]],
        param_scale: float = 1.0,
        data_scale: float = 1.0,
        data_is_tensor: bool = False,
    ) -> None:
        self.param_shapes = tuple(tuple(s) for s in param_shapes)
        self.data_shapes = tuple(tuple(s) for s in data_shapes)
        if data_is_tensor and len(self.data_shapes) != 1:
            raise ValueError("data_is_tensor needs exactly one data shape")
        if not (param_scale > 0 and data_scale > 0):
            raise ValueError(f"scales must be > 0, got {param_scale}, {data_scale}")
        self.param_scale, self.data_scale = float(param_scale), float(data_scale)
        self.data_is_tensor = data_is_tensor

    def __call__(self, generator: torch.Generator) -> tuple[tuple[Tensor, ...], Any]:
        params, data = self.sample_batch(generator, 1)
        data = tuple(d[0] for d in data)
        return tuple(p[0] for p in params), (data[0] if self.data_is_tensor else data)

    def sample_batch(self, generator: torch.Generator, n: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """``n`` samples at once: parameters and data leaves stacked on a new first axis."""
        params = tuple(torch.randn((n, *s), generator=generator, dtype=torch.float64) * self.param_scale for s in self.param_shapes)
        data = tuple(torch.randn((n, *s), generator=generator, dtype=torch.float64) * self.data_scale for s in self.data_shapes)
        return params, data


class ProblemLoss:
    """A loss function ``fn(params, data)`` with the ``spec`` that rebuilds it (:func:`build_problem`)."""

    def __init__(self, fn: Callable[[tuple[Tensor, ...], Any], Tensor], spec: dict[str, Any]) -> None:
        self.fn = fn
        self.spec = spec

    def __call__(self, params: Params, data: Any) -> Tensor:
        # every member of a discovery problem is required: a None is an error, not an absent bias
        return self.fn(tuple(required(p, f"parameter {i}") for i, p in enumerate(params)), data)

    def __repr__(self) -> str:
        return f"ProblemLoss({self.spec['problem']}, {self.spec['config']})"


@dataclass(frozen=True)
class DiscoveryProblem:
    """What :func:`teleopt.discover` needs: ``loss_fn``, ``param_shapes``, ``sampler`` (and member names).

    Pass it whole: ``teleopt.discover(problem, steps=...)``.
    """

    name: str
    loss_fn: ProblemLoss
    param_shapes: tuple[tuple[int, ...], ...]
    member_names: tuple[str, ...]
    sampler: GaussianSampler


def _check_dims(**dims: int) -> None:
    for key, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _target(target: str) -> str:
    if target not in ("loss", "output"):
        raise ValueError(f"target must be 'loss' or 'output', got {target!r}")
    return target


def _mlp(params: tuple[Tensor, ...], x: Tensor, act: Callable[[Tensor], Tensor]) -> Tensor:
    *hidden, last = params
    for W in hidden:
        x = act(x @ W.T)
    return x @ last.T


def _mlp_problem(problem: str, widths: tuple[int, ...], k: int, activation: str, target: str, config: dict[str, Any]) -> DiscoveryProblem:
    act = get_activation(activation)
    shapes = tuple((b, a) for a, b in zip(widths[:-1], widths[1:]))
    names = tuple(f"W{i + 1}" for i in range(len(shapes)))
    n, m = widths[0], widths[-1]
    fn: Callable[[tuple[Tensor, ...], Any], Tensor]
    if target == "output":

        def output_fn(params: tuple[Tensor, ...], data: Tensor) -> Tensor:
            return _mlp(params, data, act)

        fn = output_fn
        sampler = GaussianSampler(shapes, [(k, n)], data_is_tensor=True)
    else:

        def loss_fn(params: tuple[Tensor, ...], data: tuple[Tensor, Tensor]) -> Tensor:
            X, Y = data
            return ((_mlp(params, X, act) - Y) ** 2).sum()

        fn = loss_fn
        sampler = GaussianSampler(shapes, [(k, n), (k, m)])
    return DiscoveryProblem(problem, ProblemLoss(fn, {"problem": problem, "config": config}), shapes, names, sampler)


def two_layer(m: int = 1, hidden: int = 1, n: int = 1, k: int = 1, activation: str = "identity", target: str = "loss") -> DiscoveryProblem:
    """Zhao et al. 2024b, Sec. 5.3-5.4: L(W1, W2, X, Y) = ||sigma(X W1^T) W2^T - Y||^2, W1 (hidden, n), W2 (m, hidden).

    X is (k, n) and Y (k, m); ``target="output"`` makes the output sigma(X W1^T) W2^T
    (k, m) the invariant quantity and the data X alone.  Sec. 5.3 uses
    m = hidden = n = k = 1 with sigma = identity (generator diag(1, -1)); Sec. 5.4 a
    sigmoid network with W1 3x3, W2 3x1 and one data point.
    """
    _check_dims(m=m, hidden=hidden, n=n, k=k)
    config = {"m": m, "hidden": hidden, "n": n, "k": k, "activation": activation, "target": target}
    return _mlp_problem("two_layer", (n, hidden, m), k, activation, _target(target), config)


def three_layer(widths: Sequence[int] = (2, 2, 2, 1), k: int = 1, activation: str = "tanh", target: str = "loss") -> DiscoveryProblem:
    """Zhao et al. 2024b, Sec. 5.4: L = ||W3 sigma(W2 sigma(W1 X)) - Y||^2 (default tanh, W1 2x2, W2 2x2, W3 2x1, one data point)."""
    widths = tuple(widths)
    if len(widths) != 4:
        raise ValueError(f"three_layer needs 4 widths (input, hidden, hidden, output), got {widths!r}")
    _check_dims(k=k, **{f"widths[{i}]": w for i, w in enumerate(widths)})
    config = {"widths": list(widths), "k": k, "activation": activation, "target": target}
    return _mlp_problem("three_layer", widths, k, activation, _target(target), config)


def _transformer(params: tuple[Tensor, ...], X: Tensor) -> Tensor:
    WQ, WK, WV, WO, W1, W2 = params
    d = X.shape[-1]
    scores = (X @ WQ) @ (X @ WK).transpose(-1, -2) / math.sqrt(d)
    Z = X + torch.softmax(scores, dim=-1) @ (X @ WV) @ WO
    return Z @ W1 @ W2


def tiny_transformer(batch: int = 8, seq: int = 2, dim: int = 2, ffn: int = 4) -> DiscoveryProblem:
    """Zhao 2026, Sec. 6.5.5: one attention block and a feedforward map, B = 8, T = 2, d = 2, d_ff = 4.

    f(X) = FFN(X + Attn(X)), Attn(X) = softmax(Q K^T / sqrt(d)) V W_O with Q = X W_Q,
    K = X W_K, V = X W_V, and FFN(Z) = Z W_1 W_2 (W_1 d x d_ff, W_2 d_ff x d; the
    printed "Z W_2 W_1" does not compose).  The loss is the mean squared error to
    Y on a batch X, Y in R^{B x T x d}.  The text lists W_Q, W_K, W_V, W_1, W_2 (28
    entries for d = 2) but gives p = 32: the 2 x 2 attention output projection W_O,
    standard in attention, accounts for the difference, so it is included.
    """
    _check_dims(batch=batch, seq=seq, dim=dim, ffn=ffn)
    shapes = ((dim, dim),) * 4 + ((dim, ffn), (ffn, dim))
    names = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")

    def fn(params: tuple[Tensor, ...], data: tuple[Tensor, Tensor]) -> Tensor:
        X, Y = data
        return ((_transformer(params, X) - Y) ** 2).mean()

    config = {"batch": batch, "seq": seq, "dim": dim, "ffn": ffn}
    sampler = GaussianSampler(shapes, [(batch, seq, dim), (batch, seq, dim)])
    loss = ProblemLoss(fn, {"problem": "tiny_transformer", "config": config})
    return DiscoveryProblem("tiny_transformer", loss, shapes, names, sampler)


PROBLEMS: dict[str, Callable[..., DiscoveryProblem]] = {
    "two_layer": two_layer,
    "three_layer": three_layer,
    "tiny_transformer": tiny_transformer,
}


def build_problem(spec: dict[str, Any]) -> DiscoveryProblem:
    """Rebuild a problem from its loss function's ``spec`` (``ValueError`` if unknown)."""
    if not isinstance(spec, dict) or spec.get("problem") not in PROBLEMS:
        raise ValueError(f"unknown discovery problem {spec!r}; known: {sorted(PROBLEMS)}")
    return PROBLEMS[spec["problem"]](**spec["config"])


def rescaling_generators(m: int, hidden: int, n: int, degree: float = 1.0) -> Tensor:
    """The known generators of the positive rescaling symmetry of :func:`two_layer` (Zhao 2026, Ex. 1.2.4).

    Unit j scales row j of W1 by c and column j of W2 by c^{-degree}: on
    theta = (vec W1, vec W2) its generator is the diagonal matrix with 1 on row j of
    W1 and -degree on column j of W2.  Returns (hidden, p, p).
    """
    _check_dims(m=m, hidden=hidden, n=n)
    p = hidden * n + m * hidden
    out = torch.zeros(hidden, p, p, dtype=torch.float64)
    for j in range(hidden):
        w1 = torch.zeros(hidden, n, dtype=torch.float64)
        w1[j] = 1.0
        w2 = torch.zeros(m, hidden, dtype=torch.float64)
        w2[:, j] = -degree
        out[j] = torch.diag(torch.cat([w1.reshape(-1), w2.reshape(-1)]))
    return out
