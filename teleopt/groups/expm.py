"""exp(X) and exp(-X) of square matrices with matrix products only, for autograd through the exponential.

``torch.linalg.matrix_exp`` differentiates by the exponential of a 2n x 2n block
matrix, and a projected ascent through GL elements (Zhao 2026, Algorithm 1
line 3) pays it at every step.  :func:`expm_pair` evaluates the Taylor polynomial
of degree m in {4, 8, 12, 16} of A = X / 2^s by the Paterson-Stockmeyer scheme
(powers A^2, A^3, A^4, then Horner in A^4) and squares it s times (Higham 2005,
"The scaling and squaring method for the matrix exponential revisited"; here with
Taylor rather than Pade approximants, so that nothing but products and sums enter
the graph).  exp(-X) shares every power: its polynomial is the even part minus
the odd part.  Autograd then differentiates the computed function exactly, at
about twice the products of the forward (timings: ``docs/performance.md``).

The degree and the scaling are chosen from ||X||_1 (the largest column sum of
absolute values over the whole batch) so that the Taylor remainder of the scaled
matrix is below the unit roundoff of float64 relative to the exponential
(:data:`THETA`), as accurate as ``matrix_exp`` (tested to about 1e-14).  Callers
outside autograd keep ``matrix_exp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["THETA", "expm_pair", "expm_pair_horner"]

#: Degree m -> the largest theta = ||A||_1 for which sum_{k > m} theta^k / k! <= 2^-53 e^-theta: the remainder of
#: the Taylor polynomial of degree m is below float64's unit roundoff relative to ||exp(A)|| >= e^-theta.
THETA: Mapping[int, float] = MappingProxyType(
    {4: 0.0016778312117956388, 8: 0.06939604586415658, 12: 0.3269045734215958, 16: 0.7873811561929019}
)


def _degree_and_scaling(norm: float) -> tuple[int, int]:
    """The smallest degree in :data:`THETA` that covers ``norm``, else 16 with the fewest halvings s that do."""
    for m, theta in THETA.items():
        if norm <= theta:
            return m, 0
    return 16, max(0, math.ceil(math.log2(norm / THETA[16])))


def expm_pair(X: Tensor, norm: float | None = None) -> tuple[Tensor, Tensor]:
    """``(exp(X), exp(-X))`` of ``X`` (..., n, n), differentiable by autograd through matrix products only.

    Accurate to float64 rounding like ``torch.linalg.matrix_exp`` (see module docs); exp(-X) is not
    computed as an inverse, so exp(X) exp(-X) = I holds to rounding, not bit for bit.  A NaN or inf
    entry gives non-finite results, as ``matrix_exp`` does, rather than an error.  ``norm``: ||X||_1 over
    the batch (the largest column sum of absolute values) where the caller has read it already.
    """
    if X.dim() < 2 or X.shape[-1] != X.shape[-2] or not X.is_floating_point():
        raise ValueError(f"expm_pair takes floating-point square matrices (..., n, n), got shape {tuple(X.shape)} of {X.dtype}")
    # the finite blocks' norm: a NaN or inf entry propagates to its own blocks' results (as through matrix_exp; a
    # search declines on non-finite values, it does not raise), and the other blocks stay accurate
    if norm is None or not math.isfinite(norm):
        columns = torch.nan_to_num(X.detach().abs().sum(-2), nan=0.0, posinf=0.0)
        norm = float(columns.amax()) if X.numel() else 0.0
    m, s = _degree_and_scaling(norm)
    A = X / 2**s if s else X
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device).expand(X.shape)
    A2 = A @ A
    A3 = A2 @ A
    A4 = A2 @ A2
    c = [1.0 / math.factorial(k) for k in range(m + 1)]
    plus = minus = c[m] * A4  # the top chunk: c_m A^m = c_m (A^4)^(m/4), even
    for j in range(m // 4 - 1, -1, -1):  # Horner in A^4 over the chunks sum_{i<4} c_{4j+i} A^i
        even = c[4 * j] * eye + c[4 * j + 2] * A2
        odd = c[4 * j + 1] * A + c[4 * j + 3] * A3
        plus = (A4 @ plus if j < m // 4 - 1 else plus) + even + odd
        minus = (A4 @ minus if j < m // 4 - 1 else minus) + even - odd
    for _ in range(s):
        plus, minus = plus @ plus, minus @ minus
    return plus, minus


def expm_pair_horner(X: Tensor, norm: float) -> tuple[Tensor, Tensor]:
    """``(exp(X), exp(-X))`` of a batch ``X`` (k, n, n) with ||X||_1 = ``norm``: :func:`expm_pair`'s Taylor
    polynomial (the same degree and scaling), evaluated as even and odd parts by Horner in X^2, each level one
    fused ``baddbmm`` (c I + X^2 P): exp(+-X) = E +- O.  More products than Paterson-Stockmeyer but about a
    third of the calls, which is what small blocks cost (the near-balance step's; for blocks above 16 the extra
    products cost more than the calls saved)."""
    if X.dim() != 3 or X.shape[-1] != X.shape[-2] or not X.is_floating_point():
        raise ValueError(f"expm_pair_horner takes a floating-point batch (k, n, n), got shape {tuple(X.shape)} of {X.dtype}")
    m, s = _degree_and_scaling(norm if math.isfinite(norm) else 0.0)
    A = X / 2**s if s else X
    eye = torch.eye(X.shape[-1], dtype=X.dtype, device=X.device)
    start = eye.expand(X.shape)
    A2 = A @ A
    c = [1.0 / math.factorial(k) for k in range(m + 1)]
    even = torch.baddbmm(eye, A2, start, beta=c[m - 2], alpha=c[m])  # c_{m-2} I + c_m X^2
    for k in range(m - 4, -1, -2):
        even = torch.baddbmm(eye, A2, even, beta=c[k])
    odd = torch.baddbmm(eye, A2, start, beta=c[m - 3], alpha=c[m - 1])
    for k in range(m - 5, 0, -2):
        odd = torch.baddbmm(eye, A2, odd, beta=c[k])
    odd = A @ odd
    plus, minus = even + odd, even - odd
    for _ in range(s):
        plus, minus = plus @ plus, minus @ minus
    return plus, minus
