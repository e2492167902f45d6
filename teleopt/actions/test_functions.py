"""Reference problems with rotational symmetry: Zhao 2026, Prop. 4.4.1 and eq. 4.33.

Each is a loss L(w) = |h(w)|^2-like function of a change of variables u = h(w) in
which L is rotation invariant, so g . w = h^{-1}(rho(g) h(w)) is an exact symmetry:

* Rosenbrock, L = 100 (x1^2 - x2)^2 + (x1 - 1)^2 with h = (10 (x1^2 - x2), x1 - 1)
  (eqs. 4.5-4.8); non-linear action;
* Booth, L = (x1 + 2 x2 - 7)^2 + (2 x1 + x2 - 5)^2 with h affine (eqs. 4.9-4.11);
  the action is affine with constant Jacobian J = M^{-1} R M;
* a positive definite quadratic L_A = w^T A w with h(w) = A^{1/2} w and O(n) acting
  as A^{-1/2} R A^{1/2} w (eq. 4.33); linear.

For the affine and linear ones the gradient transports as (J^{-1})^T grad =
M^T R M^{-T} grad (Zhao 2026, eq. 4.19).  The parameter tuple has one member ``w``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.base import ExampleProblem, GroupAction, Params, required
from teleopt.groups import Group, Orthogonal

__all__ = ["ChangeOfVariables", "ConjugatedRotation", "Rosenbrock", "Booth", "QuadraticOrthogonal", "rosenbrock", "booth"]


def rosenbrock(w: Tensor) -> Tensor:
    """The Rosenbrock function of Zhao 2026, eq. 4.3 on the last axis (2 variables)."""
    return 100 * (w[..., 0] ** 2 - w[..., 1]) ** 2 + (w[..., 0] - 1) ** 2


def booth(w: Tensor) -> Tensor:
    """The Booth function of Zhao 2026, eq. 4.4."""
    return (w[..., 0] + 2 * w[..., 1] - 7) ** 2 + (2 * w[..., 0] + w[..., 1] - 5) ** 2


@dataclass(frozen=True)
class ChangeOfVariables:
    """The bijection u = h(w) in which a loss is rotation invariant, and its inverse.

    ``M`` is the (constant) Jacobian of h when h is affine; it enables exact
    gradient transport.  ``linear`` says whether h is linear (not only affine).
    Module-level functions and partials, not closures: actions must pickle.
    """

    h: Callable[[Tensor], Tensor]
    h_inv: Callable[[Tensor], Tensor]
    M: Tensor | None = None
    linear: bool = False

    def __post_init__(self) -> None:
        if self.linear and self.M is None:
            raise ValueError("a linear change of variables needs its matrix M")


class ConjugatedRotation(GroupAction):
    """O(n) acting by g . w = h^{-1}(g h(w)) for a bijection h (``change``): Zhao 2026, Prop. 4.4.1."""

    group_type = Orthogonal
    exactness = "exact"
    member_names = ("w",)

    def __init__(
        self,
        name: str,
        n: int,
        change: ChangeOfVariables,
        loss: Callable[[Tensor], Tensor],
        start: Callable[[torch.Generator | None, torch.dtype], Tensor],
        reference: str,
    ) -> None:
        self.name, self.n, self.reference = name, n, reference
        self.group_name = "SO(2)" if n == 2 else f"O({n})"
        self._h, self._h_inv, self.loss, self._start = change.h, change.h_inv, loss, start
        self.M = change.M
        self.linear = change.linear

    @property
    def has_gradient_transport(self) -> bool:
        return self.M is not None

    def group(self, params: Params) -> Group:
        w = required(self.check_params(params)[0], "w")
        if w.shape != (self.n,):
            raise ValueError(f"{self.name}: w must have shape ({self.n},), got {tuple(w.shape)}")
        return Orthogonal(self.n)

    def act(self, g: Tensor, params: Params, data: Any = None) -> Params:
        params = self.check_params(params)
        self.group(params).validate(g.detach())
        w = required(params[0], "w")
        return (self._h_inv(g.to(w) @ self._h(w)),)

    def transport_gradient(self, g: Tensor, grads: Params) -> Params:
        if self.M is None:
            return super().transport_gradient(g, grads)
        grad = required(self.check_params(grads)[0], "w")
        M = self.M.to(grad)
        # (J^{-1})^T grad with J = M^{-1} g M:  J^{-T} = M^T g M^{-T}  (g orthogonal: g^{-T} = g)
        return (M.T @ (g.to(grad) @ torch.linalg.solve(M.T, grad)),)

    def example(self, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64) -> ExampleProblem:
        w = self._start(generator, dtype)
        return ExampleProblem((w,), None, lambda p, _: self.loss(required(p[0])), functional=False)


def _uniform_start(n: int, scale: float, generator: torch.Generator | None, dtype: torch.dtype) -> Tensor:
    return ((torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def _random_start(n: int, scale: float = 2.0) -> Callable[[torch.Generator | None, torch.dtype], Tensor]:
    # module-level functions and partials, not closures: actions must pickle
    return partial(_uniform_start, n, scale)


def _rosenbrock_h(w: Tensor) -> Tensor:
    return torch.stack([10 * (w[0] ** 2 - w[1]), w[0] - 1])


def _rosenbrock_h_inv(u: Tensor) -> Tensor:
    return torch.stack([u[1] + 1, (u[1] + 1) ** 2 - 0.1 * u[0]])


class Rosenbrock(ConjugatedRotation):
    """SO(2) symmetry of the Rosenbrock function by the change of variables of Zhao 2026, eq. 4.6."""

    def __init__(self) -> None:
        super().__init__(
            "rosenbrock_so2",
            2,
            ChangeOfVariables(_rosenbrock_h, _rosenbrock_h_inv),
            rosenbrock,
            _random_start(2),
            "Zhao 2026, Prop. 4.4.1, eq. 4.6-4.8",
        )


_BOOTH_M = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
_BOOTH_C = torch.tensor([-7.0, -5.0], dtype=torch.float64)


def _booth_h(w: Tensor) -> Tensor:
    return _BOOTH_M.to(w) @ w + _BOOTH_C.to(w)


def _booth_h_inv(u: Tensor) -> Tensor:
    return torch.linalg.solve(_BOOTH_M.to(u), u - _BOOTH_C.to(u))


class Booth(ConjugatedRotation):
    """SO(2) symmetry of the Booth function by the affine change of variables of Zhao 2026, eq. 4.9."""

    def __init__(self) -> None:
        super().__init__(
            "booth_so2",
            2,
            ChangeOfVariables(_booth_h, _booth_h_inv, M=_BOOTH_M),
            booth,
            _random_start(2, 5.0),
            "Zhao 2026, Prop. 4.4.1, eq. 4.9-4.11",
        )


def _sqrtm_pd(A: Tensor) -> Tensor:
    evals, evecs = torch.linalg.eigh(A)
    if bool((evals <= 0).any()):
        raise ValueError(f"A must be positive definite; smallest eigenvalue {float(evals.min()):.3e}")
    return evecs @ torch.diag(evals.sqrt()) @ evecs.T


def _linear_h(S: Tensor, w: Tensor) -> Tensor:
    return S.to(w) @ w


def _linear_h_inv(S: Tensor, u: Tensor) -> Tensor:
    return torch.linalg.solve(S.to(u), u)


def _quadratic(A: Tensor, w: Tensor) -> Tensor:
    return w @ (A.to(w) @ w)


class QuadraticOrthogonal(ConjugatedRotation):
    """O(n) symmetry of L_A(w) = w^T A w acting by A^{-1/2} g A^{1/2} w: Zhao 2026, eq. 4.33.

    ``A`` defaults to a fixed well-conditioned 4 x 4 positive definite matrix.
    """

    def __init__(self, A: Tensor | None = None) -> None:
        if A is None:
            gen = torch.Generator().manual_seed(433)
            Q = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64)).Q
            A = Q @ torch.diag(torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)) @ Q.T
        if not isinstance(A, Tensor) or A.ndim != 2 or A.shape[0] != A.shape[1]:
            raise ValueError("A must be a square matrix tensor")
        if not torch.allclose(A, A.T):
            raise ValueError("A must be symmetric")
        A = A.to(torch.float64)
        S = _sqrtm_pd(A)
        self.A = A

        super().__init__(
            "quadratic_orthogonal",
            A.shape[0],
            ChangeOfVariables(partial(_linear_h, S), partial(_linear_h_inv, S), M=S, linear=True),
            partial(_quadratic, A),
            _random_start(A.shape[0]),
            "Zhao 2026, eq. 4.33",
        )
