"""Teleport over bases the conformance suite's plain optimizers do not reach.

Each test reproduces a defect found by running Teleport against peers' test
suites (sparse gradients, NovoGrad's 0-d second moment, Adahessian's
create_graph gradients, Lookahead's inner state and slow weights) and fails on
the code before its fix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from teleopt import find_symmetries
from teleopt.teleport import SafetyConfig, Schedule, Teleport

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def train(opt, model, x, steps, create_graph=False):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward(create_graph=create_graph)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_a_site_with_a_sparse_gradient_sits_out_and_the_others_teleport():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6, sparse=True), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    x = torch.randint(0, 10, (8,))
    sites = find_symmetries(model, x).continuous_sites
    embedding_sites = [s.name for s in sites if "0.weight" in s.tensor_names]
    assert embedding_sites and len(sites) > len(embedding_sites)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, every=1)
    before = model[0].weight.detach().clone()
    model(x).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="sparse gradient"):
        opt.step()
    report = opt.reports[-1]
    assert report.accepted
    assert not set(report.elements) & set(embedding_sites)
    # the embedding moved by its SGD step only (sparse rows), not by a teleport
    assert torch.equal(model[0].weight[x.unique()].ne(before[x.unique()]).any(1), torch.ones(len(x.unique()), dtype=torch.bool))


@pytest.mark.parametrize("make", ["timm", "torch_optimizer"])
def test_novograd_zero_dim_second_moment_falls_back_instead_of_crashing(make):
    if make == "timm":
        timm_optim = pytest.importorskip("timm.optim")
        build = timm_optim.NvNovoGrad
    else:
        build = pytest.importorskip("torch_optimizer").NovoGrad
    model, x = mlp(), torch.randn(8, 4)
    opt = Teleport(
        build(model.parameters(), lr=0.01), model, find_symmetries(model, x).continuous_sites, every=2, safety=SafetyConfig(watch_steps=0)
    )
    train(opt, model, x, 4)
    assert [r.accepted for r in opt.reports] == [True, True]
    assert opt.reports[-1].state_decisions.get("fallback:keep", 0) > 0  # the 0-d exp_avg_sq, kept


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_gradients_decline_the_teleport_with_the_reason():
    torch_optimizer = pytest.importorskip("torch_optimizer")
    model, x = mlp(), torch.randn(8, 4)
    opt = Teleport(torch_optimizer.Adahessian(model.parameters(), lr=0.01), model, find_symmetries(model, x).continuous_sites, every=2)
    losses = train(opt, model, x, 4, create_graph=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert [r.accepted for r in opt.reports] == [False, False]
    assert "create_graph=True" in opt.reports[0].reason


def lookaheads():
    out = []
    try:
        from timm.optim import Lookahead

        out.append(pytest.param(lambda base: Lookahead(base, k=2), "lookahead_slow_buff", id="timm"))
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch_optimizer

        out.append(pytest.param(lambda base: torch_optimizer.Lookahead(base, k=2), "slow_param", id="torch_optimizer"))
    except ImportError:  # pragma: no cover
        pass
    return out


@pytest.mark.parametrize(("wrap", "slow_key"), lookaheads())
def test_lookahead_slow_weights_follow_the_teleport(wrap, slow_key):
    """With lr = 0 only teleports and syncs move the weights: the function must never change."""
    model, x = mlp(), torch.randn(8, 4)
    base = wrap(torch.optim.SGD(model.parameters(), lr=0.0))
    opt = Teleport(base, model, find_symmetries(model, x).continuous_sites, every=3, safety=SafetyConfig(watch_steps=0))
    with torch.no_grad():
        reference = model(x).clone()
    for _ in range(7):
        train(opt, model, x, 1)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference, rtol=1e-5, atol=1e-6)
    assert sum(r.accepted for r in opt.reports) >= 2
    weights = dict(model.named_parameters())
    moved = [n for n in opt.reports[0].sites[0].tensor_names if n in weights]
    assert moved


def test_lookahead_inner_state_is_transported():
    """timm's Lookahead keeps an empty state of its own: momentum lives in the inner SGD and must be transported."""
    timm_optim = pytest.importorskip("timm.optim")
    model, x = mlp(), torch.randn(8, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = Teleport(
        timm_optim.Lookahead(inner, k=5), model, find_symmetries(model, x).continuous_sites, every=3, safety=SafetyConfig(watch_steps=0)
    )
    train(opt, model, x, 4)
    report = opt.reports[-1]
    assert report.accepted and report.state_decisions.get("transport", 0) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "unknown state entry" warning for the slow buffer
        train(opt, model, x, 3)


def test_a_watch_rollback_puts_the_lookahead_slow_weights_back():
    torch_optimizer = pytest.importorskip("torch_optimizer")
    model, x = mlp(), torch.randn(8, 4)
    base = torch_optimizer.Lookahead(torch.optim.SGD(model.parameters(), lr=0.0), k=2)
    opt = Teleport(
        base,
        model,
        find_symmetries(model, x).continuous_sites,
        safety=SafetyConfig(watch_steps=2, watch_factor=1e-6),
        schedule=Schedule(at=[3]),
    )
    train(opt, model, x, 3)  # Lookahead syncs at steps 0 and 2
    slow = {n: base.state[p]["slow_param"].clone() for n, p in model.named_parameters()}
    train(opt, model, x, 1)  # teleport at step 3: the slow weights follow it
    assert opt.reports[0].accepted
    assert any(not torch.equal(base.state[p]["slow_param"], slow[n]) for n, p in model.named_parameters())
    train(opt, model, x, 1)  # the watch (factor 1e-6: any gradient norm trips it) rolls back at step 4
    assert opt.reports[-1].reason.startswith("rolled back")
    for n, p in model.named_parameters():
        torch.testing.assert_close(base.state[p]["slow_param"], slow[n], rtol=0, atol=0)


def test_scheduled_grad_norm_teleports_under_a_scale_free_base_warn_and_balance_does_not():
    model, x = mlp(), torch.randn(8, 4)
    sites = find_symmetries(model, x).continuous_sites
    with pytest.warns(UserWarning, match="Prefer objective='balance'"):
        Teleport(torch.optim.Adam(model.parameters()), model, sites, every=50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Teleport(torch.optim.Adam(model.parameters()), model, sites, objective="balance", every=50)
        Teleport(torch.optim.Adam(model.parameters()), model, sites, schedule=Schedule())  # manual: only when asked
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites, every=50)
