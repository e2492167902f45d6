"""Learned invariance and equivariance of linear models under data symmetries (Gideoni 2023).

A finite group ``G`` of invertible ``d x d`` matrices acts on a model's inputs as
``x -> g x`` (samples are rows, as in ``nn.Linear``: a batch ``X`` (N, d) becomes
``X g^T``).  Gideoni 2023 shows that a linear model ``x -> W x`` trained by gradient flow
on data that contains whole orbits (Assumption 1) splits into a part that respects
the symmetry and one that does not, that the two never interact, and that the
asymmetric part decays exponentially (Theorem 3.3; Theorem 4.2 for equivariance).
This module gives the pieces needed to check that on a real run:

* :class:`FiniteLinearGroup`: the group as a validated set of matrices (identity,
  closure, invertibility, a size cap), built from its elements or from generators;
* :meth:`FiniteLinearGroup.reynolds_operator`: the Reynolds operator
  ``P = (1/|G|) sum_g g`` (a projector onto the fixed vectors) or the paper's
  unnormalised ``R = sum_g g`` (Theorem 3.3);
* :func:`split_weights`: ``W = W_sym + W_asym`` with ``x -> W_sym x`` invariant
  (Theorem 3.3.2) or, given an output representation, equivariant (Theorem 4.2.2);
* :func:`asymmetry`: the asymmetry loss ``E_x |f(x) - E_g f(g x)|`` of Gideoni 2023
  Sec. 5 for any callable or ``nn.Module``;
* :func:`orbit_closure`: a dataset completed to whole orbits (Assumptions 1 and 4);
* :func:`linear_regression_flow`: the closed-form gradient flow of eqs. (3) and (5)
  with the decay rates of the asymmetric part, to compare a run with the theorem.

Conventions versus the paper.  Gideoni 2023 writes samples as row vectors acting on
weights from the left (``f_w(x) = x w``) and group elements acting from the right
(``x g``), so its ``g`` is our ``g^T``.  In our convention the invariant weights are
the fixed vectors of ``g^T`` and the symmetric part of ``W`` is ``W P`` (rows
projected by ``P^T``), which gives an exactly invariant predictor for every finite
group.  For orthogonal groups ``P = P^T`` is the orthogonal projector, ``R = R^T``,
and the split is the paper's ``ker(R)^perp (+) ker(R)``.  Theorem 3.3 needs
Assumption 3 (``g^T`` in ``G``), which for a finite group is the same as
orthogonality: ``g^T g`` is then a symmetric positive-definite element of finite
order, so it is ``I``.  For a non-orthogonal group the symmetric part is still
well defined and the trained predictor still becomes invariant, but the two parts
of gradient flow do interact, so :func:`linear_regression_flow` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from teleopt.analysis.finite_group import FiniteLinearGroup, check_float_tensor, check_inputs

__all__ = [
    "FiniteLinearGroup",
    "WeightSplit",
    "split_weights",
    "asymmetry",
    "orbit_closure",
    "LinearRegressionFlow",
    "linear_regression_flow",
]


def _check_group(group: object) -> FiniteLinearGroup:
    if not isinstance(group, FiniteLinearGroup):
        raise TypeError(f"group must be a FiniteLinearGroup, got {type(group).__name__}")
    return group


def _output_representation(group: FiniteLinearGroup, rho: Tensor | None, like: Tensor) -> Tensor | None:
    if rho is None:
        return None
    return group.check_representation(rho, "output_representation").to(dtype=like.dtype, device=like.device)


class WeightSplit(NamedTuple):
    """``weight = symmetric + asymmetric`` (Gideoni 2023, Theorem 3.3.2 / 4.2.2)."""

    symmetric: Tensor
    asymmetric: Tensor


def _project(weight: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> Tensor:
    """The Reynolds projection of weights (out, in) or (in,): onto invariant or equivariant maps."""
    g = group._like(weight)
    if rho is None:
        return weight @ g.mean(0)
    rho_inverse = rho[group._inverse.to(rho.device)]
    return torch.einsum("gab,bc,gcd->ad", rho_inverse, weight, g) / group.order


def _check_weight(w: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> Tensor:
    if w.ndim not in (1, 2) or w.shape[-1] != group.dim:
        raise ValueError(f"weight must have shape (out, {group.dim}) or ({group.dim},) in nn.Linear convention, got {tuple(w.shape)}")
    if rho is not None and (w.ndim != 2 or w.shape[0] != rho.shape[1]):
        raise ValueError(
            f"with an output representation of size {rho.shape[1]}, weight must have shape ({rho.shape[1]}, {group.dim}), got {tuple(w.shape)}"
        )
    return w


def split_weights(weight: Tensor, group: FiniteLinearGroup, *, output_representation: Tensor | None = None) -> WeightSplit:
    """Split a linear model's weights into symmetric and asymmetric parts (Gideoni 2023, Theorems 3.3.2, 4.2.2).

    ``weight`` is in ``nn.Linear`` convention: (out, in) or a vector (in,), acting as
    ``x -> W x``, with ``in = group.dim``.

    * Invariance (no ``output_representation``): ``symmetric = W P`` with the
      Reynolds operator ``P = (1/|G|) sum_g g``, so ``x -> symmetric @ x`` is
      exactly G-invariant (``P g = P``).  For orthogonal groups this is the
      orthogonal projection onto ``ker(R)^perp`` of Theorem 3.3.
    * Equivariance: given ``rho`` (|G|, out, out) aligned with ``group.elements``
      (see :meth:`FiniteLinearGroup.check_representation`),
      ``symmetric = (1/|G|) sum_g rho(g)^-1 W g``, which satisfies
      ``symmetric g = rho(g) symmetric`` (the commutant ``V_G`` of Theorem 4.2 when
      ``rho`` is the input representation itself).

    In both cases the projection is idempotent and ``asymmetric = W - symmetric``;
    the result is differentiable in ``weight``.
    """
    group = _check_group(group)
    w = check_float_tensor(weight, "weight")
    rho = _output_representation(group, output_representation, w)
    symmetric = _project(_check_weight(w, group, rho), group, rho)
    return WeightSplit(symmetric, w - symmetric)


def asymmetry(
    f: Callable[[Tensor], Tensor],
    inputs: Tensor,
    group: FiniteLinearGroup,
    *,
    output_representation: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """The asymmetry loss ``E_x |f(x) - E_g f(g x)|`` of Gideoni 2023, Sec. 5.

    ``f`` is any callable mapping a batch (M, d) to outputs (M,) or (M, ...) (an
    ``nn.Module`` included); it is called once, on all ``|G| * N`` transformed
    inputs stacked group-major, so put modules whose forward mixes samples (train
    mode BatchNorm) in eval mode first.  The expectation over ``g`` is the uniform
    (Haar) average over the finite group.  For vector outputs ``|.|`` is the
    Euclidean norm over the output entries.  With ``output_representation`` rho
    (|G|, m, m) it measures equivariance instead: ``E_x |f(x) - E_g rho(g)^-1 f(g x)|``.

    ``reduction``: ``"mean"`` (a scalar) or ``"none"`` (one value per input).  The
    result keeps the autograd graph of ``f``.  For a linear model ``f(x) = W x``
    the per-input value is ``|W_asym x|`` with ``W_asym`` from :func:`split_weights`.
    """
    group = _check_group(group)
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    x = check_inputs(inputs, group.dim, "inputs")
    n = x.shape[0]
    outputs = f(group.act(x).flatten(0, 1))
    if not isinstance(outputs, Tensor) or outputs.ndim == 0 or outputs.shape[0] != group.order * n:
        shape = tuple(outputs.shape) if isinstance(outputs, Tensor) else type(outputs).__name__
        raise ValueError(f"f must map a batch of {group.order * n} inputs to a tensor with {group.order * n} rows, got {shape}")
    outputs = outputs.reshape(group.order, n, -1)
    rho = _output_representation(group, output_representation, outputs)
    if rho is not None:
        if outputs.shape[-1] != rho.shape[1]:
            raise ValueError(f"f's outputs have {outputs.shape[-1]} entries, output_representation acts on {rho.shape[1]}")
        outputs = torch.einsum("gab,gnb->gna", rho[group._inverse.to(rho.device)], outputs)
    deviation = outputs[group.identity_index] - outputs.mean(0)
    per_input = torch.linalg.vector_norm(deviation, dim=-1)
    return per_input.mean() if reduction == "mean" else per_input


def orbit_closure(
    inputs: Tensor, group: FiniteLinearGroup, targets: Tensor | None = None, *, output_representation: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Complete a dataset to whole orbits (Gideoni 2023, Assumption 1, or Assumption 4 with ``output_representation``).

    Returns ``(X, Y)`` with ``|G| * N`` rows, group-major (the block ``i`` is
    ``elements[i]`` applied to every input): ``X`` rows ``g x``, ``Y`` rows ``y``
    (invariant labels) or ``rho(g) y`` (equivariant labels).  Training on it is
    Corollary 3.2 / 4.1: its Gram matrix ``X^T X`` is the paper's ``K_G`` of the
    representatives.  ``targets`` (N,) or (N, m); ``None`` returns ``(X, None)``.
    """
    group = _check_group(group)
    x = check_inputs(inputs, group.dim, "inputs")
    full_x = group.act(x).flatten(0, 1)
    if targets is None:
        if output_representation is not None:
            raise ValueError("output_representation needs targets to act on")
        return full_x, None
    y = check_float_tensor(targets, "targets")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},) or ({x.shape[0]}, m), got {tuple(y.shape)}")
    rho = _output_representation(group, output_representation, y)
    if rho is None:
        return full_x, y.repeat(group.order, *([1] * (y.ndim - 1)))
    if y.ndim != 2 or y.shape[1] != rho.shape[1]:
        raise ValueError(f"equivariant targets must have shape ({x.shape[0]}, {rho.shape[1]}), got {tuple(y.shape)}")
    return full_x, (y @ rho.mT).flatten(0, 1)


@dataclass(frozen=True)
class LinearRegressionFlow:
    """Gradient flow of linear least squares on symmetric data, in closed form (Gideoni 2023, Theorems 3.3, 4.2).

    For ``L = (loss_scale / 2) sum_n |y_n - W x_n|^2`` gradient flow is
    ``dW/dt = loss_scale (C - W K)`` with ``K = X^T X`` (``kernel``; on orbit-closed
    data this is the paper's ``K_G = sum_g g^T X^T X g`` over representatives) and
    ``C = Y^T X`` (``moment``; the paper's ``R^T X^T y`` resp. ``C_G``).  On data that
    satisfies Assumption 1 (resp. 4) for an orthogonal group, ``K`` commutes with
    every ``g`` and ``C`` is symmetric, so the symmetric and asymmetric parts of
    :func:`split_weights` evolve independently (Theorem 3.3.2) and
    ``W_asym(t) = W_asym(0) exp(-loss_scale K t)`` (Theorem 3.3.3): each asymmetric
    mode decays at one of ``asymmetric_rates`` (the eigenvalues of
    ``loss_scale * K`` on the asymmetric subspace), the slowest at ``decay_rate``.

    Weights are vectors (in,) when the targets were (N,), else (out, in).  With no
    output representation every output row has the same rates, listed once.
    ``data_asymmetry`` is the relative distance of the data from Assumption 1/4
    (``max_g |g K g^T - K| / |K|`` and ``|C - C_sym| / (|X| |Y|)``, the larger).
    """

    group: FiniteLinearGroup
    output_representation: Tensor | None
    kernel: Tensor
    moment: Tensor
    loss_scale: float
    asymmetric_rates: Tensor
    symmetric_rates: Tensor
    data_asymmetry: float

    @property
    def decay_rate(self) -> float:
        """Slowest asymmetric rate (``inf`` when the asymmetric subspace is empty; ``0`` means no decay: ``K`` singular there)."""
        return float(self.asymmetric_rates[0]) if len(self.asymmetric_rates) else math.inf

    def _times(self, times: Tensor | float | Sequence[float]) -> Tensor:
        t = torch.as_tensor(times, dtype=self.kernel.dtype, device=self.kernel.device).reshape(-1)
        if not bool((t >= 0).all()):
            raise ValueError("times must be non-negative")
        return t

    def _initial(self, initial: Tensor) -> Tensor:
        w = check_float_tensor(initial, "initial")
        if w.shape != self.moment.shape:
            raise ValueError(f"initial weights must have shape {tuple(self.moment.shape)}, got {tuple(w.shape)}")
        return w.to(self.kernel.dtype)

    def weights(self, initial: Tensor, times: Tensor | float | Sequence[float]) -> Tensor:
        """``W(t)`` for each time (eq. (3), or eq. (5) for equivariance): (T, *initial.shape).

        ``W(t) = W0 exp(-sKt) + C K^+ (I - exp(-sKt))``, with ``K^+ (I - exp(-sKt))``
        read as ``s t`` on the null space of ``K`` (``s = loss_scale``).
        """
        w0, t = self._initial(initial), self._times(times)
        lam, vec = torch.linalg.eigh(self.kernel)
        st = self.loss_scale * t[:, None]
        decay = torch.exp(-st * lam)
        growth = torch.where(lam == 0, st, -torch.expm1(-st * lam) / torch.where(lam == 0, 1, lam))
        w0v, cv = w0 @ vec, self.moment @ vec
        return (w0v.unsqueeze(0) * _broadcast(decay, w0) + cv.unsqueeze(0) * _broadcast(growth, w0)) @ vec.T

    def asymmetric_part(self, initial: Tensor, times: Tensor | float | Sequence[float]) -> Tensor:
        """``W_asym(t) = W_asym(0) exp(-sKt)`` (Theorem 3.3.3 / 4.2.3): (T, *initial.shape), independent of the labels."""
        w0, t = self._initial(initial), self._times(times)
        asym = split_weights(w0, self.group, output_representation=self.output_representation).asymmetric
        lam, vec = torch.linalg.eigh(self.kernel)
        decay = torch.exp(-self.loss_scale * t[:, None] * lam)
        return ((asym @ vec).unsqueeze(0) * _broadcast(decay, w0)) @ vec.T

    def limit(self, initial: Tensor) -> Tensor:
        """``W(t -> inf)``: the least-squares solution plus ``W0``'s component in ``ker K`` (Corollary 3.4 / 4.3)."""
        w0 = self._initial(initial)
        lam, vec = torch.linalg.eigh(self.kernel)
        null = lam <= lam.abs().max() * self.kernel.shape[0] * torch.finfo(lam.dtype).eps
        inv = torch.where(null, 0, 1 / torch.where(null, 1, lam))
        return ((w0 @ vec) * null + (self.moment @ vec) * inv) @ vec.T


def _broadcast(per_mode: Tensor, like: Tensor) -> Tensor:
    """(T, in) factors -> broadcastable against (T, *like.shape)."""
    return per_mode if like.ndim == 1 else per_mode[:, None, :]


def _subspace_rates(operator: Tensor, projector: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues of a symmetric ``operator`` restricted to ``im(projector)`` and to its orthogonal complement."""
    occupancy, basis = torch.linalg.eigh((projector + projector.mT) / 2)
    inside = occupancy > 0.5
    rates = []
    for keep in (inside, ~inside):
        q = basis[:, keep]
        rates.append(torch.linalg.eigvalsh(q.mT @ operator @ q) if q.shape[1] else operator.new_zeros(0))
    return rates[0], rates[1]


def _check_orthogonality(group: FiniteLinearGroup, rho: Tensor | None, y: Tensor) -> None:
    """Gideoni 2023, Assumptions 3 and 5: the group and the output representation are orthogonal."""
    if not group.is_orthogonal():
        raise ValueError(
            "the group is not orthogonal: Gideoni 2023, Assumption 3 (g^T in G; for a finite group the same as g^T g = I) "
            "fails, and gradient flow then mixes the symmetric and asymmetric parts"
        )
    if rho is None:
        return
    if y.ndim != 2 or y.shape[1] != rho.shape[1]:
        raise ValueError(f"equivariant targets must have shape ({y.shape[0]}, {rho.shape[1]}), got {tuple(y.shape)}")
    eye = torch.eye(rho.shape[1], dtype=y.dtype, device=rho.device)
    if float(torch.linalg.matrix_norm(rho.mT @ rho - eye).max()) > group.tol * math.sqrt(rho.shape[1]):
        raise ValueError("output_representation is not orthogonal (Gideoni 2023, Assumption 5)")


def _data_asymmetry(x: Tensor, y: Tensor, kernel: Tensor, moment: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> float:
    """How far the data is from Gideoni 2023, Assumption 1 / 4: the larger relative residual of K = X^T X
    (invariant under g K g^T) and of the moment C (equal to its projection)."""
    g = group._like(kernel)
    kernel_residual = float(torch.linalg.matrix_norm(g @ kernel @ g.mT - kernel).max() / torch.linalg.matrix_norm(kernel).clamp_min(1e-300))
    moment_sym = _project(moment, group, rho)
    # relative to |X| |Y| >= |C|: C itself may be 0 (no invariant weights), then only round-off remains
    moment_residual = float((moment - moment_sym).norm() / (x.norm() * y.norm()).clamp_min(1e-300))
    return max(kernel_residual, moment_residual)


def _flow_rates(operator: Tensor, group: FiniteLinearGroup, rho: Tensor | None) -> tuple[Tensor, Tensor]:
    """Decay rates of the asymmetric and the symmetric part under the flow's ``operator`` (s K)."""
    g = group._like(operator)
    dtype, device = operator.dtype, operator.device
    if rho is None:
        return _subspace_rates(operator, torch.eye(group.dim, dtype=dtype, device=device) - g.mean(0).T)
    out = rho.shape[1]
    # Row-major vec: Pi(W)[a, d] = mean_g sum_bc rho(g)^-1[a, b] W[b, c] g[c, d], i.e. vec(A W B) = (A kron B^T) vec(W).
    rho_inverse = rho[group._inverse.to(rho.device)]
    projector = torch.einsum("gab,gcd->adbc", rho_inverse, g).reshape(out * group.dim, out * group.dim) / group.order
    big = torch.kron(torch.eye(out, dtype=dtype, device=device), operator)
    return _subspace_rates(big, torch.eye(out * group.dim, dtype=dtype, device=device) - projector)


def linear_regression_flow(
    inputs: Tensor,
    targets: Tensor,
    group: FiniteLinearGroup,
    *,
    output_representation: Tensor | None = None,
    loss_scale: float = 1.0,
    strict: bool = True,
) -> LinearRegressionFlow:
    """Theorem 3.3 (invariance) or 4.2 (with ``output_representation``) for a linear model on this training set.

    ``inputs`` (N, d) and ``targets`` (N,) or (N, out) are the data the model is
    trained on, already orbit-closed (see :func:`orbit_closure`); the model is
    ``x -> W x`` without bias (append a constant feature, fixed by the group, as in
    Example 3.1).  ``loss_scale`` s sets the loss ``(s/2) sum |y - W x|^2``: 1 is the
    paper's total squared error, ``2`` is ``MSELoss(reduction="sum")``,
    ``2 / (N * out)`` is ``MSELoss()``.  Gradient descent with step ``eta`` follows
    the flow at time ``t = k * eta`` with per-step factors ``1 - eta * rate``, i.e. a
    relative rate error of about ``eta * rate / 2``.

    Raises ``ValueError`` if the group (or the output representation) is not
    orthogonal (Assumption 3 / 5: without it the two parts interact), and, when
    ``strict``, if the data is further than the group's ``tol`` from Assumption 1
    / 4.  With ``strict=False`` the result is computed anyway and
    ``data_asymmetry`` says how far off it is: the closed form :meth:`weights` is
    still exact gradient flow, but the parts then interact, so
    ``asymmetric_part`` and the rates (``K`` compressed to the asymmetric subspace)
    are approximations (Gideoni 2023, App. D observes the decay on data that is
    symmetric only on average).
    """
    group = _check_group(group)
    x = check_inputs(inputs, group.dim, "inputs")
    y = check_float_tensor(targets, "targets")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"targets must have shape ({x.shape[0]},) or ({x.shape[0]}, out), got {tuple(y.shape)}")
    if not (isinstance(loss_scale, (int, float)) and loss_scale > 0 and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
    dtype = torch.promote_types(x.dtype, y.dtype)
    x, y = x.to(dtype), y.to(dtype)
    rho = _output_representation(group, output_representation, y)
    _check_orthogonality(group, rho, y)
    kernel = x.T @ x
    moment = y.T @ x if y.ndim == 2 else y @ x
    data_asymmetry = _data_asymmetry(x, y, kernel, moment, group, rho)
    if strict and data_asymmetry > group.tol:
        raise ValueError(
            f"the data is not symmetric (Gideoni 2023, Assumption {1 if rho is None else 4}): relative residual "
            f"{data_asymmetry:.2e} > tol {group.tol:.1e}; complete it with orbit_closure or pass strict=False"
        )
    asym_rates, sym_rates = _flow_rates(loss_scale * kernel, group, rho)
    return LinearRegressionFlow(
        group=group,
        output_representation=rho,
        kernel=kernel,
        moment=moment,
        loss_scale=float(loss_scale),
        asymmetric_rates=asym_rates,
        symmetric_rates=sym_rates,
        data_asymmetry=data_asymmetry,
    )
