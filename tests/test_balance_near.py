"""``GeneralLinear.balance_near_many``: one Newton step towards the balanced point, for every-step balance.

The step solves the balance equation P A P = B (P = g^2, g = exp(S)) to first order from the identity, so the
imbalance ||g A g - g^-1 B g^-1|| it leaves is quadratic in ||A - B||; its elements are exp(S) and exp(-S) from
matrix products, which must be the matrix exponential and its inverse to float64 round-off (any g is an exact
teleport only if the contragredient is the inverse).  Far from balance, or with one side missing, it declines.
"""

from __future__ import annotations

import torch

from teleopt.groups import GroupCache
from teleopt.groups.matrix import GeneralLinear


def _pair(scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrices (2 blocks of 6 x 6) of a balanced pair, then put off balance by exp(scale * sym)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 20, generator=gen, dtype=torch.float64)
    sym = torch.randn(2, 6, 6, generator=gen, dtype=torch.float64)
    h = torch.linalg.matrix_exp(scale * (sym + sym.mT) / 2)
    a = x @ x.mT
    return h @ a @ h, torch.linalg.inv(h) @ a @ torch.linalg.inv(h)  # A, B: balanced (A = B) at g = h^-1


def _imbalance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=(-2, -1)) / (a + b).norm(dim=(-2, -1))).max())


def test_one_newton_step_leaves_an_imbalance_quadratic_in_the_one_before() -> None:
    group = GeneralLinear(6, blocks=2)
    for scale in (1e-2, 1e-3):
        a, b = _pair(scale)
        with GroupCache().active():
            (xi,) = group.balance_near_many([{1.0: a, -1.0: b}], limit=0.1)
            g = group.exp(xi)
            inverse_t = group.block_matrices(g, -1)  # the contragredient g^-T
        assert torch.equal(xi, xi.mT)
        # exp from matrix products: the matrix exponential and its inverse to float64 round-off
        assert float((g - torch.linalg.matrix_exp(xi)).abs().max()) <= 1e-14
        assert float((inverse_t.mT @ g - torch.eye(6, dtype=torch.float64)).abs().max()) <= 1e-14
        before, after = _imbalance(a, b), _imbalance(g @ a @ g.mT, inverse_t @ b @ inverse_t.mT)
        assert before > 0.5 * scale and after <= 10 * before**2, (scale, before, after)


def test_the_step_declines_far_from_balance_or_with_one_side() -> None:
    group = GeneralLinear(6, blocks=2)
    a, b = _pair(0.5)
    assert group.balance_near_many([{1.0: a, -1.0: b}], limit=0.1) is None  # ||S|| > limit: the closed form decides
    assert group.balance_near_many([{1.0: a}], limit=0.1) is None
    dead = torch.zeros_like(a)
    assert group.balance_near_many([{1.0: dead, -1.0: dead}], limit=10.0) is None  # C singular: no balanced point
