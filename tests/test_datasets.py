"""teleopt.datasets: the papers' offline problems are what the papers draw, and their sites are exact symmetries."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from teleopt.datasets import digits_mlp, hidden_rescaling_sites, load_digits, mlp_regression, regression_loss
from teleopt.testing import assert_close, group_elements


def test_mlp_regression_draws_what_the_papers_code_draws():
    # Zhao 2026, Sec. 4.6.1 code: torch.manual_seed(seed); W1, W2, W3, X, Y = torch.rand(...) in that order
    seed = 3 * 3 * 12345
    saved = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        expected = [torch.rand(6, 5), torch.rand(7, 6), torch.rand(8, 7), torch.rand(5, 4), torch.rand(8, 4)]
    finally:
        torch.random.set_rng_state(saved)
    before = torch.random.get_rng_state()
    problem = mlp_regression(seed)
    assert torch.equal(torch.random.get_rng_state(), before), "mlp_regression must not touch the global RNG"
    got = [problem.model[0].weight, problem.model[2].weight, problem.model[4].weight, problem.inputs.T, problem.targets.T]
    for g, e in zip(got, expected):
        assert torch.equal(g.detach(), e)
    assert all(m.bias is None for m in problem.model[::2])
    y_hat = problem.model(problem.inputs)
    assert torch.equal(problem.loss(), 0.5 * ((problem.targets - y_hat) ** 2).sum())
    assert torch.equal(problem.loss(), regression_loss(y_hat, problem.targets))


def test_mlp_regression_dtype_and_bad_input():
    assert mlp_regression(0, torch.float64).model[0].weight.dtype == torch.float64
    with pytest.raises(ValueError, match="seed"):
        mlp_regression(-1)
    with pytest.raises(ValueError, match="seed"):
        mlp_regression(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        mlp_regression(0, torch.int64)


def _mlp_with_biases(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.LeakyReLU(0.2), nn.Linear(6, 3)).double()


@settings(deadline=None, max_examples=10)
@given(st.sampled_from(["regression", "biases"]), st.data())
def test_hidden_rescaling_sites_are_exact_symmetries_of_the_model(kind, data):
    if kind == "regression":
        model = mlp_regression(1, torch.float64).model
    else:
        model = _mlp_with_biases(2)
    x = torch.randn(11, model[0].in_features, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sites = hidden_rescaling_sites(model)
    assert len(sites) == 2
    moved = copy.deepcopy(model)
    for site in sites:
        g = data.draw(group_elements(site.action, site.tensors(model)))
        site.apply_(moved, g)
    # exact symmetry in float64: the relative output change is rounding only (CONVENTIONS.md sec. 3: <= 1e-10)
    assert_close(moved(x), model(x), 1e-10, "model output after rescaling every hidden layer")


@example(member=0)
@given(member=st.integers(0, 2))
@settings(deadline=None, max_examples=3)
def test_each_member_of_a_rescaling_site_is_needed(member):
    # minimality: scaling all members but one changes the output (no over-tying, no missing member)
    model = _mlp_with_biases(3)
    site = hidden_rescaling_sites(model)[0]
    assert site.members == ("0.weight", "0.bias", "2.weight")
    x = torch.randn(9, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = torch.full((7,), 2.0, dtype=torch.float64)
    moved = copy.deepcopy(model)
    new = site.act(model, g)
    with torch.no_grad():
        for i, (name, value) in enumerate(zip(site.members, new)):
            if i != member:
                moved.get_parameter(name).copy_(value)
    assert (moved(x) - model(x)).abs().max() > 1e-3


def test_hidden_rescaling_sites_bad_input():
    with pytest.raises(TypeError, match="nn.Sequential"):
        hidden_rescaling_sites(nn.Linear(3, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="odd number"):
        hidden_rescaling_sites(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(ValueError, match="GELU"):
        hidden_rescaling_sites(nn.Sequential(nn.Linear(3, 3), nn.GELU(), nn.Linear(3, 2)))
    with pytest.raises(ValueError, match="nn.Linear"):
        hidden_rescaling_sites(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Identity()))


def test_load_digits_split_and_standardisation():
    d = load_digits(seed=0)
    assert d.x_train.shape == (1347, 64) and d.x_test.shape == (450, 64)
    assert d.y_train.dtype == torch.int64 and set(d.y_train.tolist()) == set(range(10))
    assert d.features == 64 and d.classes == 10
    everything = torch.cat([d.x_train, d.x_test])
    assert everything.mean(0).abs().max() < 1e-5
    assert torch.equal(load_digits(seed=0).x_train, d.x_train)
    assert not torch.equal(load_digits(seed=1).x_train, d.x_train)
    assert torch.allclose(load_digits(seed=0, alpha=3.0).x_train, 3.0 * d.x_train)
    assert load_digits(n_test=97).x_train.shape == (1700, 64)
    with pytest.raises(ValueError, match="n_test"):
        load_digits(n_test=0)
    with pytest.raises(ValueError, match="seed"):
        load_digits(seed=-2)


def test_digits_mlp_is_the_papers_network():
    before = torch.random.get_rng_state()
    model = digits_mlp(seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 16), (16, 10), (10, 10)]
    assert all(m.bias is None for m in linears)
    assert all(m.negative_slope == 0.1 for m in model if isinstance(m, nn.LeakyReLU))
    assert torch.equal(digits_mlp(seed=7)[0].weight, model[0].weight)
    assert float(model[0].weight.detach().abs().max()) <= 1 / 64**0.5
    with pytest.raises(ValueError, match="hidden"):
        digits_mlp(hidden=())


def test_digits_mlp_with_biases():
    model = digits_mlp((32, 32), seed=1, bias=True)
    assert [m.bias.shape for m in model if isinstance(m, nn.Linear)] == [(32,), (32,), (10,)]
    assert float(model[0].bias.detach().abs().max()) <= 1 / 64**0.5
    assert float(model[2].bias.detach().abs().max()) <= 1 / 32**0.5
    assert len(hidden_rescaling_sites(model)) == 2
    with pytest.raises(ValueError, match="seed"):
        digits_mlp(seed=-1)
