"""Data-dependent GL_h actions between layers with a bijective activation: Zhao 2026, Sec. 4.4.2.

Shapes follow ``torch.nn.Linear``: the batch X (k, n) is the input of the first layer
(h_{m-2} in the paper), W1 (h, n) and b1 (h,) map it to the hidden layer,
H = sigma(X W1^T + b1) is (k, h), and W2 (m, h) reads it.  Biases are handled as the
paper does, by appending a column of ones to X.

* :class:`DataDependentGL` is Prop. 4.4.2, eq. 4.13: the hidden activations become
  H g^T, the first layer is re-solved so that sigma(X~ W1~'^T) = H g^T, and
  W2' = W2 g^{-1}.  We solve for the *smallest change* of W1~ (a least-squares
  update), which is exact on the batch whenever X~ has full row rank (k <= n + 1)
  and, unlike the paper's h^{-1} form, satisfies the identity and composition
  axioms exactly even when k < n + 1 (the updates add up: each solves a linear
  system with the same matrix X~).
* :class:`DataDependentGLLstsq` is eq. 4.16: W1' = g W1, b1' = g b1 and W2' solves
  W2' sigma(Z g^T)^T = W2 sigma(Z)^T with ``torch.linalg.lstsq`` (again as the
  smallest change).  It is exact on the batch when sigma(Z g^T) has full row rank
  (k <= h); it satisfies the composition axiom only when k = h.  When k > h the
  system is over-determined: ``strict=True`` (default) raises, ``strict=False``
  warns with the relative residual and returns the least-squares solution.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.activations import Activation, get_activation
from teleopt.actions.base import ExampleProblem, GroupAction, Params, required
from teleopt.groups import GeneralLinear, Group

__all__ = ["DataDependentGL", "DataDependentGLLstsq", "min_norm_solve"]


def min_norm_solve(A: Tensor, B: Tensor) -> Tensor:
    """The minimum-norm least-squares solution X of A X = B (differentiable).

    ``torch.linalg.lstsq`` on CPU; on other devices, where lstsq needs a tall
    full-rank A, the normal equations of the under-determined system.
    """
    if A.device.type == "cpu":
        return torch.linalg.lstsq(A, B).solution
    if A.shape[0] <= A.shape[1]:
        return A.mT @ torch.linalg.solve(A @ A.mT, B)
    return torch.linalg.lstsq(A, B).solution


def _relative_residual(A: Tensor, X: Tensor, B: Tensor) -> float:
    with torch.no_grad():  # a diagnostic number: no graph, no autograd warning on float()
        return float((A @ X - B).norm() / B.norm().clamp_min(torch.finfo(B.dtype).tiny))


class _TwoLayerDataDependent(GroupAction):
    """Shared set-up: members (W1, b1, W2), data X (k, n), invertible activation."""

    group_name = "GL_h(R)"
    exactness = "data-dependent"
    linear = False
    group_type = GeneralLinear
    member_names = ("W1", "b1", "W2")
    optional_members = frozenset({"b1"})

    def __init__(self, activation: str | Activation = "leaky_relu", negative_slope: float | None = None) -> None:
        act = get_activation(activation, negative_slope)
        if act.inverse is None:
            raise ValueError(f"{act.name} is not invertible: the data-dependent GL action needs a bijective activation")
        self.activation = act

    def group(self, params: Params) -> Group:
        W1, b1, W2 = self.check_params(params)
        W1, W2 = required(W1, "W1"), required(W2, "W2")
        if W1.ndim != 2 or W2.ndim != 2:
            raise ValueError(f"{self.name}: W1 and W2 must be matrices, got shapes {tuple(W1.shape)}, {tuple(W2.shape)}")
        h = W1.shape[0]
        if W2.shape[1] != h:
            raise ValueError(f"{self.name}: W2 has {W2.shape[1]} columns but W1 has {h} rows")
        if b1 is not None and b1.shape != (h,):
            raise ValueError(f"{self.name}: b1 must have shape ({h},), got {tuple(b1.shape)}")
        return GeneralLinear(h)

    def _batch(self, params: Params, data: Any) -> Tensor:
        self._check_data(data)
        if not isinstance(data, Tensor):
            raise TypeError(f"{self.name}: data must be the layer input, a (batch, features) tensor")
        W1 = required(params[0], "W1")
        if data.ndim != 2 or data.shape[1] != W1.shape[1]:
            raise ValueError(
                f"{self.name}: data must have shape (batch, {W1.shape[1]}) to feed W1 {tuple(W1.shape)}, got {tuple(data.shape)}"
            )
        return data.to(W1.dtype)

    @staticmethod
    def _augmented(X: Tensor, b1: Tensor | None) -> Tensor:
        return X if b1 is None else torch.cat([X, torch.ones_like(X[:, :1])], dim=1)

    def _example(self, generator: torch.Generator | None, dtype: torch.dtype, k: int, n: int, h: int, m: int = 3) -> ExampleProblem:
        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)

        act = self.activation
        # bounded activations (tanh, sigmoid): keep sigma(z) inside its range with room for g
        x_scale = 0.3 if act.range is not None else 1.0
        W1, b1, W2, X = randn(h, n) / n**0.5, randn(h) * 0.1, randn(m, h), randn(k, n) * x_scale

        def fn(p: Params, x: Tensor) -> Tensor:
            return act(x @ required(p[0]).T + required(p[1])) @ required(p[2]).T

        return ExampleProblem((W1, b1, W2), X, fn)


class DataDependentGL(_TwoLayerDataDependent):
    """GL_h acting on (W1, b1, W2) through sigma^{-1}, exact on the batch: Zhao 2026, Prop. 4.4.2, eq. 4.13.

    Needs k <= n (+1 with a bias) samples with linearly independent (augmented)
    inputs; a larger batch raises ``ValueError``.
    """

    name = "data_dependent_gl"
    reference = "Zhao 2026, Prop. 4.4.2, eq. 4.13"

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        params = self.check_params(params)
        grp = self.group(params)
        grp.validate(g.detach())
        X = self._batch(params, data)
        W1, b1, W2 = params
        W1, W2 = required(W1, "W1"), required(W2, "W2")
        Xa = self._augmented(X, b1)
        if Xa.shape[0] > Xa.shape[1]:
            raise ValueError(
                f"{self.name}: a batch of {Xa.shape[0]} samples is too large for an exact action on inputs of "
                f"dimension {Xa.shape[1]} (eq. 4.13 needs batch <= {Xa.shape[1]}); use fewer samples"
            )
        M = W1.T if b1 is None else torch.cat([W1, b1[:, None]], dim=1).T
        Z = Xa @ M
        g = g.to(W1)
        H_new = self.activation(Z) @ g.T
        self.activation.check_in_range(H_new, "g sigma(W1 X)")
        inverse = self.activation.inverse
        assert inverse is not None, "checked at construction: the activation is invertible"
        Z_new = inverse(H_new)
        delta = min_norm_solve(Xa, Z_new - Z)
        residual = _relative_residual(Xa, delta, Z_new - Z)
        if residual > 100 * torch.finfo(W1.dtype).eps ** 0.5:
            raise ValueError(
                f"{self.name}: the batch inputs are linearly dependent (relative residual {residual:.2e}), "
                "so the action is not exact on this batch"
            )
        M_new = (M + delta).T
        W1_new = M_new if b1 is None else M_new[:, :-1]
        b1_new = None if b1 is None else M_new[:, -1]
        W2_new = GeneralLinear(grp.n).act_on_axis(g, W2, 1, -1)
        return (W1_new, b1_new, W2_new)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return self._example(generator, dtype, k=4, n=6, h=5)


class DataDependentGLLstsq(_TwoLayerDataDependent):
    """GL_h acting on (W1, b1, W2) with W2 re-solved by least squares: Zhao 2026, eq. 4.16.

    Exact on batches of at most h samples; ``strict=False`` allows larger batches
    and warns with the residual (the transformation is then approximate).
    """

    name = "data_dependent_gl_lstsq"
    reference = "Zhao 2026, eq. 4.16"

    def __init__(self, activation: str | Activation = "leaky_relu", negative_slope: float | None = None, strict: bool = True) -> None:
        super().__init__(activation, negative_slope)
        self.strict = bool(strict)

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        params = self.check_params(params)
        grp = self.group(params)
        grp.validate(g.detach())
        X = self._batch(params, data)
        W1, b1, W2 = params
        W1, W2 = required(W1, "W1"), required(W2, "W2")
        k, h = X.shape[0], grp.n
        if k > h and self.strict:
            raise ValueError(
                f"{self.name}: a batch of {k} samples is too large for an exact action on a hidden layer of width {h} "
                "(eq. 4.16 needs batch <= width); use fewer samples or strict=False for a least-squares approximation"
            )
        g = g.to(W1)
        W1_new = g @ W1
        b1_new = None if b1 is None else g @ b1
        Z = X @ W1.T if b1 is None else X @ W1.T + b1
        H, H_new = self.activation(Z), self.activation(Z @ g.T)
        rhs = H @ W2.T - H_new @ W2.T
        delta = min_norm_solve(H_new, rhs)
        residual = _relative_residual(H_new, delta, rhs)
        if residual > 100 * torch.finfo(W1.dtype).eps ** 0.5:
            if self.strict:
                raise ValueError(
                    f"{self.name}: sigma(g W1 X) is rank deficient (relative residual {residual:.2e}): not exact on this batch"
                )
            warnings.warn(f"{self.name}: least-squares residual {residual:.2e}: the action is approximate on this batch", stacklevel=2)
        return (W1_new, b1_new, W2 + delta.T)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        return self._example(generator, dtype, k=5, n=4, h=5)
