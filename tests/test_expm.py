"""exp(X) and exp(-X) by matrix products (teleopt.groups.expm), and GL's use of it under autograd.

Tolerances: float64 throughout.  The Taylor remainder is below the unit roundoff 2^-53 (THETA), so what is
left is the rounding of about 15 products and of s squarings, each amplifying the error by at most 2: a
relative error of a few 1e-15 for ||X||_2 <= 1, and growing like 2^s (measured 6e-14 at ||X||_2 = 30, s = 7).
matrix_exp, the reference, has errors of the same order; hence 1e-13 relative, and 1e-12 for gradients
(the backward multiplies the same products again).
"""

from __future__ import annotations

import math

import pytest
import torch

from teleopt.groups import GeneralLinear, GroupCache
from teleopt.groups.expm import THETA, expm_pair

F64 = torch.float64


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=(-2, -1)) / b.norm(dim=(-2, -1)).clamp_min(1e-300)).max())


def spectral_batch(scale: float, shape=(5, 7, 7), seed=0) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return x / torch.linalg.matrix_norm(x, 2)[..., None, None] * scale


def test_theta_is_the_largest_norm_whose_taylor_remainder_is_below_the_unit_roundoff():
    def tail(m: int, theta: float) -> float:
        return sum(theta**k / math.factorial(k) for k in range(m + 1, m + 80))

    for m, theta in THETA.items():
        assert tail(m, theta) <= 2.0**-53 * math.exp(-theta)
        assert tail(m, theta * 1.001) > 2.0**-53 * math.exp(-theta * 1.001)


# one batch per regime: the identity, each degree (4, 8, 12, 16) unscaled, and 16 with 2 and 7 squarings
@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.05, 0.25, 0.6, 3.0, 30.0])
def test_expm_pair_matches_matrix_exp_and_its_gradient(scale):
    x = spectral_batch(scale)
    plus, minus = expm_pair(x)
    assert relative(plus, torch.linalg.matrix_exp(x)) < 1e-13
    assert relative(minus, torch.linalg.matrix_exp(-x)) < 1e-13
    eye = torch.eye(7, dtype=F64).expand(x.shape)
    # an inverse to rounding, without a solve: relative to the condition number e^(2 ||X||_2) of the product
    assert relative(plus @ minus, eye) < 1e-14 * math.exp(2 * scale)

    leaf = x.clone().requires_grad_(True)
    gen = torch.Generator().manual_seed(1)
    up, down = torch.randn(x.shape, generator=gen, dtype=F64), torch.randn(x.shape, generator=gen, dtype=F64)
    ours = torch.autograd.grad(sum((a * w).sum() for a, w in zip(expm_pair(leaf), (up, down))), leaf)[0]
    exp = torch.linalg.matrix_exp
    theirs = torch.autograd.grad((exp(leaf) * up).sum() + (exp(-leaf) * down).sum(), leaf)[0]
    assert relative(ours, theirs) < 1e-12


def test_expm_pair_rejects_non_square_input_and_propagates_non_finite_entries():
    """A search declines on non-finite values: a NaN in the coordinates must come out, as through matrix_exp."""
    for bad in (torch.zeros(3, 4, dtype=F64), torch.zeros(3, dtype=F64), torch.zeros(2, 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="floating-point square matrices"):
            expm_pair(bad)
    x = spectral_batch(3.0, (2, 3, 3))  # the finite block needs scaling: its accuracy must not depend on the NaN
    x[1, 0, 2] = math.nan
    plus, minus = expm_pair(x)
    assert not bool(torch.isfinite(plus[1]).all()) and not bool(torch.isfinite(minus[1]).all())
    assert not bool(torch.isfinite(torch.linalg.matrix_exp(x)[1]).all())
    assert relative(plus[:1], torch.linalg.matrix_exp(x[:1])) < 1e-13


@pytest.mark.parametrize("blocks", [None, 3])
def test_gl_exp_under_autograd_remembers_its_contragredient(blocks):
    """Differentiated coordinates take expm_pair: exp(-xi)^T is the contragredient block_matrices returns
    (no solve), and the gradient through both equals matrix_exp's and the solve's."""
    group = GeneralLinear(6, blocks=blocks)
    xi = spectral_batch(0.8, group.coord_shape, seed=2).requires_grad_(True)
    with GroupCache().active() as cache:
        g = group.exp(xi)
        assert relative(g.detach(), torch.linalg.matrix_exp(xi.detach())) < 1e-13
        remembered = cache.get("contragredient", g, (id(g), GeneralLinear, 6))
        assert remembered is not None and group.block_matrices(g, -1) is remembered
    blocked = g.detach() if blocks else g.detach().unsqueeze(0)
    solved = torch.linalg.solve(blocked.mT, torch.eye(6, dtype=F64).expand(blocked.shape))
    assert relative(remembered.detach(), solved) < 1e-13

    k = torch.randn(group.element_shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    with cache.active():
        ours = torch.autograd.grad(((group.block_matrices(g, -1) + group.block_matrices(g, 1)) * k).sum(), xi)[0]
    leaf = xi.detach().clone().requires_grad_(True)
    e = torch.linalg.matrix_exp(leaf)
    eb = e if blocks else e.unsqueeze(0)
    theirs = torch.autograd.grad(((torch.linalg.solve(eb.mT, torch.eye(6, dtype=F64).expand(eb.shape)) + eb) * k).sum(), leaf)[0]
    assert relative(ours, theirs) < 1e-12


def test_exp_stacked_agrees_with_exp_site_by_site_and_wants_one_block_size():
    groups = [GeneralLinear(5, blocks=3), GeneralLinear(5), GeneralLinear(5, blocks=2)]
    coords = [spectral_batch(s, grp.coord_shape, seed=i).requires_grad_(True) for i, (s, grp) in enumerate(zip((0.1, 2.0, 0.7), groups))]
    stacked = GeneralLinear.exp_stacked(groups, coords)
    for grp, xi, g in zip(groups, coords, stacked):
        assert g.shape == grp.element_shape
        assert relative(g.detach(), grp.exp(xi).detach()) < 1e-13
        inverse = grp.block_matrices(g, -1).mT  # remembered: exp(-xi) of this group's blocks
        assert relative(grp._blocked(g).detach() @ inverse.detach(), torch.eye(5, dtype=F64).expand(inverse.shape)) < 1e-13
    total = sum(g.sum() for g in stacked)
    grads = torch.autograd.grad(total, coords)
    assert all(gr.shape == xi.shape and bool(torch.isfinite(gr).all()) for gr, xi in zip(grads, coords))
    with pytest.raises(ValueError, match="one block size"):
        GeneralLinear.exp_stacked([GeneralLinear(5), GeneralLinear(4)], [torch.zeros(5, 5, dtype=F64), torch.zeros(4, 4, dtype=F64)])
    with pytest.raises(ValueError, match="dtype and device"):  # mixed dtypes would be promoted silently by cat
        GeneralLinear.exp_stacked([GeneralLinear(5), GeneralLinear(5)], [torch.zeros(5, 5, dtype=F64), torch.zeros(5, 5)])
    with pytest.raises(ValueError, match="one coordinate tensor per group"):
        GeneralLinear.exp_stacked([GeneralLinear(5), GeneralLinear(5)], [torch.zeros(5, 5, dtype=F64)])
