"""The balancing element of GL and scaling sites (``AxisAction.balancing_coordinates``) and ``Balance``.

Closed form: M P M = Q with M = g^T g is solved by the matrix geometric mean
M = P^{-1/2} (P^{1/2} Q P^{1/2})^{1/2} P^{-1/2}; g = M^{1/2}.  Checked in float64:
the product (the model) is unchanged, the Gram matrices agree afterwards, and a
balanced pair does not move again.
"""

from __future__ import annotations

import pytest
import torch

import teleopt
from teleopt import get_action
from teleopt.actions.axis import AxisAction, Member
from teleopt.teleport import Balance, SafetyConfig, SearchConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("seed, scale_b", [(0, 1.0), (1, 1e-3), (2, 30.0)])
def test_lora_pair_is_balanced_and_unchanged(seed, scale_b):
    action = get_action("lora_gl")  # U (out, r) = B, V (r, in) = A
    g = _gen(seed)
    B = torch.randn(9, 4, generator=g, dtype=torch.float64) * scale_b
    A = torch.randn(4, 7, generator=g, dtype=torch.float64)
    xi = action.balancing_coordinates((B, A))
    assert xi is not None and torch.allclose(xi, xi.mT, atol=1e-14)  # symmetric: g = exp(xi) is SPD
    B2, A2 = action.act(torch.linalg.matrix_exp(xi), (B, A))
    assert _rel(B2 @ A2, B @ A) <= 1e-13  # the symmetry: B A unchanged
    assert _rel(A2 @ A2.T, B2.T @ B2) <= 1e-12  # balanced: A A^T = B^T B (measured ~5e-15)
    again = action.balancing_coordinates((B2, A2))
    assert again is not None and float(again.abs().max()) <= 1e-12


def test_orthonormal_rows_give_the_fourth_root():
    """With A A^T = I the balancing element is (B^T B)^{1/4}."""
    action = get_action("lora_gl")
    g = _gen(3)
    A = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0].T  # (3, 8), orthonormal rows
    B = torch.randn(5, 3, generator=g, dtype=torch.float64)
    xi = action.balancing_coordinates((B, A))
    assert xi is not None
    lam, vec = torch.linalg.eigh(B.T @ B)
    fourth_root = (vec * lam**0.25) @ vec.T
    assert _rel(torch.linalg.matrix_exp(xi), fourth_root) <= 1e-12


def test_singular_gram_matrix_does_not_move():
    """LoRA's initialisation B = 0 has no balancing element in GL_r: zero coordinates."""
    action = get_action("lora_gl")
    A = torch.randn(4, 7, generator=_gen(4), dtype=torch.float64)
    xi = action.balancing_coordinates((torch.zeros(9, 4, dtype=torch.float64), A))
    assert xi is not None and float(xi.abs().max()) == 0.0


def test_blocks_and_slices_balance_per_block():
    """Per-head GL (blocks) on slices of a fused tensor: each block balanced on its own."""
    h, d = 2, 3
    action = AxisAction(
        "heads",
        "general",
        (Member("qkv", 0, 1, start=0, stop=h * d), Member("out", 1, -1)),
        blocks=h,
    )
    g = _gen(5)
    qkv = torch.randn(3 * h * d, 4, generator=g, dtype=torch.float64)
    out = torch.randn(5, h * d, generator=g, dtype=torch.float64) * 0.1
    xi = action.balancing_coordinates((qkv, out))
    assert xi is not None and xi.shape == (h, d, d)
    qkv2, out2 = action.act(torch.linalg.matrix_exp(xi), (qkv, out))
    assert torch.equal(qkv2[h * d :], qkv[h * d :])  # outside the slice: untouched
    for b in range(h):
        rows = qkv2[b * d : (b + 1) * d]
        cols = out2[:, b * d : (b + 1) * d]
        assert _rel(rows @ rows.T, cols.T @ cols) <= 1e-12
    assert _rel(out2 @ qkv2[: h * d], out @ qkv[: h * d]) <= 1e-13


def test_positive_rescaling_balances_each_unit():
    action = get_action("positive_rescaling", activation="relu")  # W1 rows and b1 by c, W2 columns by 1/c
    g = _gen(6)
    W1, b1, W2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(6, 4), (6,), (3, 6)])
    xi = action.balancing_coordinates((W1, b1, W2))
    assert xi is not None and xi.shape == (6,)
    W1b, b1b, W2b = action.act(torch.exp(xi), (W1, b1, W2))
    writers = W1b.square().sum(1) + b1b.square()
    assert _rel(writers, W2b.square().sum(0)) <= 1e-13


def test_other_groups_have_no_closed_form():
    assert get_action("hidden_permutation").balancing_coordinates(get_action("hidden_permutation").example().params) is None


def test_balance_validates_its_arguments():
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="fraction"):
            Balance(fraction=bad)
    with pytest.raises(ValueError, match="rcond"):
        Balance(rcond=0)
    with pytest.raises(ValueError, match="min_move"):
        Balance(min_move=-1)


def _linear_net(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(4, 6, bias=False)).to(dtype)


def test_balance_teleport_in_teleport_is_exact_and_moves_state():
    """``Balance`` as Teleport's search: outputs unchanged, balanced, exp_avg moved like the gradient."""
    model = _linear_net()
    site = teleopt.Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    opt = teleopt.Teleport(
        torch.optim.Adam(model.parameters(), lr=0.05),
        model,
        [site],
        search=SearchConfig(strategy=Balance(), trust_region=None),
        safety=SafetyConfig(max_predicted_decrease=None),
    )
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    out = model(x).detach()
    W1, W2 = model[0].weight, model[1].weight
    m1, v1 = (opt.state[W1][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    report = opt.teleport()
    assert report.accepted and report.state_decisions.get("transport") and report.state_decisions.get("fallback:keep")
    assert _rel(model(x).detach(), out) <= 1e-12
    assert _rel(W1 @ W1.T, W2.T @ W2) <= 1e-12
    g = report.elements[site.name]
    assert _rel(opt.state[W1]["exp_avg"], torch.linalg.solve(g.T, m1)) <= 1e-12  # covector: g^{-T} m
    assert torch.equal(opt.state[W1]["exp_avg_sq"], v1)  # no exact rule under GL: kept (the default fallback)
    assert not opt.teleport().accepted  # already balanced: declined


def test_trust_region_clips_the_balance():
    model = _linear_net()
    with torch.no_grad():
        model[1].weight.mul_(1e-3)  # far from balanced
    site = teleopt.Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    x = torch.randn(8, 5, dtype=torch.float64)
    opt = teleopt.Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, [site], search=SearchConfig(strategy=Balance()))
    model(x).square().sum().backward()
    report = opt.teleport()
    assert report.accepted and report.coordinate_norms[site.name] <= torch.log(torch.tensor(4.0)).item() + 1e-12
