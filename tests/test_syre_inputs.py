"""Syre on whatever a model and a checkpoint bring: biases, complex weights, second-order bases, extreme scales.

Criteria: any model trains with the defaults (1-D tensors are left alone, timm's
convention); complex parameters decay in their real view; Adahessian's
``backward(create_graph=True)`` gradients keep their graph, so coupled Syre is
Adahessian on ``loss + penalty()``; anchors and decay that would overflow the
parameter dtype are refused with ``ValueError``; malformed state dicts raise
``ValueError`` and change nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from teleopt.syre import Syre

# Adahessian needs backward(create_graph=True); torch warns about the parameter <-> .grad cycle it makes.
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")


def mlp(dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=g, dtype=dtype), torch.randn(16, 2, generator=g, dtype=dtype)


# -- 1-D tensors ------------------------------------------------------------------------------


def test_a_model_with_biases_and_norms_works_out_of_the_box_and_its_1d_tensors_take_the_bare_step():
    model, reference = mlp(), mlp()
    x, y = data()
    syre = Syre(torch.optim.SGD(model.parameters(), lr=0.1), gamma=0.5)
    bare = torch.optim.SGD(reference.parameters(), lr=0.1)
    for opt, net in ((syre, model), (bare, reference)):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q) == (p.dim() < 2), name
    assert sorted(syre.state_dict()["state"]) == [0, 4]


def test_1d_tensors_decay_with_their_length_as_width_when_not_excluded():
    bias = torch.nn.Parameter(torch.zeros(10000))
    scalar = torch.nn.Parameter(torch.zeros(()))
    syre = Syre(torch.optim.SGD([bias, scalar], lr=0.1), gamma=0.5, sigma0=1.0, exclude_1d=False)
    assert abs(float(syre.anchor(bias).std()) * math.sqrt(10000) - 1) < 0.05  # sigma0 / sqrt(d)
    assert syre.anchor(scalar).shape == ()


# -- complex parameters -----------------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("store_anchors", [True, False])
def test_complex_parameters_decay_in_their_real_view(decoupled, store_anchors):
    p = torch.nn.Parameter(torch.randn(6, 5, dtype=torch.complex128))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.5, sigma0=1.0, decoupled=decoupled, store_anchors=store_anchors)
    anchor = syre.anchor(p)
    assert anchor.dtype == torch.complex128 and anchor.shape == p.shape
    start = (p - anchor).detach()
    p.grad = torch.zeros_like(p)
    syre.step()
    torch.testing.assert_close((p - anchor).detach(), 0.95 * start, rtol=1e-12, atol=1e-12)
    assert torch.equal(p.grad, torch.zeros_like(p)), "the data gradient is left in .grad"
    fresh = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.5, sigma0=1.0, decoupled=decoupled, store_anchors=store_anchors)
    fresh.load_state_dict(syre.state_dict())
    assert torch.equal(fresh.anchor(p), anchor)


def test_complex_parameters_with_gamma_zero_are_bitwise_the_base():
    p, q = (torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64)) for _ in range(2))
    with torch.no_grad():
        q.copy_(p)
    syre, bare = Syre(torch.optim.Adam([p], lr=0.1), gamma=0.0), torch.optim.Adam([q], lr=0.1)
    for opt, t in ((syre, p), (bare, q)):
        t.grad = torch.ones_like(t)
        opt.step()
    assert torch.equal(p, q)


# -- Adahessian ---------------------------------------------------------------------------------


def bias_free(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 2, bias=False)).double()


def adahessian_run(mode: str, steps: int = 3):
    """Adahessian steps on a float64 MLP: through coupled/decoupled Syre, or bare on loss (+ penalty)."""
    torch_optimizer = pytest.importorskip("torch_optimizer")
    model = bias_free()
    x, y = data(torch.float64)
    base = torch_optimizer.Adahessian(model.parameters(), lr=0.05)
    syre = Syre(base, gamma=0.3, sigma0=0.5, decoupled=mode == "decoupled")
    optimizer = syre if mode in ("coupled", "decoupled") else base
    torch.manual_seed(5)  # Adahessian's Rademacher vectors
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if mode == "bare + penalty":
            loss = loss + syre.penalty()
        loss.backward(create_graph=True)
        optimizer.step()
    return model, syre


def test_coupled_syre_around_adahessian_is_adahessian_on_loss_plus_penalty():
    model, _ = adahessian_run("coupled")
    reference, _ = adahessian_run("bare + penalty")
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12)


def test_decoupled_syre_around_adahessian_is_its_step_minus_lr_gamma_times_w_minus_anchor():
    start = [p.detach().clone() for p in bias_free().parameters()]
    model, syre = adahessian_run("decoupled", steps=1)
    reference, _ = adahessian_run("bare", steps=1)
    for p, q, s in zip(model.parameters(), reference.parameters(), start):
        expected = q.detach() - 0.05 * 0.3 * (s - syre.anchor(p))
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-14)


# -- scales that do not fit the dtype -------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "kwargs"),
    [
        (torch.float32, {"gamma": 0.1, "sigma0": 1e40}),
        (torch.float16, {"gamma": 0.1, "sigma0": 1e5}),
        (torch.float32, {"gamma": 1e38}),
        (torch.bfloat16, {"gamma": 1e39}),
    ],
)
def test_anchors_or_decay_that_overflow_the_dtype_are_refused(dtype, kwargs):
    p = torch.nn.Parameter(torch.randn(3, 3).to(dtype))
    with pytest.raises(ValueError, match="overflow"):
        Syre(torch.optim.SGD([p], lr=0.1), **kwargs)


def test_the_same_scales_fit_float64():
    p = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=1e38, sigma0=1e40)
    assert torch.isfinite(syre.anchor(p)).all()


def test_an_overflowing_gamma_set_later_fails_at_step_before_any_change():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1)
    syre.param_groups[0][Syre.prefix + "gamma"] = 1e39
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="overflow"):
        syre.step()
    assert torch.equal(p, before)


# -- malformed state dicts ------------------------------------------------------------------------


def trained():
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4))
    syre = Syre(torch.optim.Adam([w, b], lr=0.1), gamma=0.1, diagonal_eps=0.2, exclude_1d=True)
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    syre.step()
    return syre


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda sd: sd["param_groups"][0].update({Syre.prefix + "gamma": "big"}), "gamma must be a finite real number"),
        (lambda sd: sd["param_groups"][0].update({Syre.prefix + "gamma": -1.0}), "gamma must be >= 0"),
        (lambda sd: sd["param_groups"][0].update({Syre.prefix + "sigma0": 1e40}), "overflow"),
        (lambda sd: sd["param_groups"][0].update({Syre.prefix + "gama": 0.1}), "unknown syre keys"),
        (lambda sd: sd["param_groups"][0].update({Syre.prefix + "fan_in": 0}), "fan_in must be a positive int"),
        (lambda sd: sd["state"][0].update({Syre.prefix + "anchor": torch.full((4, 3), float("nan"))}), "non-finite"),
        (lambda sd: sd["state"][0].update({Syre.prefix + "diagonal": torch.zeros(4, 3)}), "non-positive"),
        (lambda sd: sd["state"][0].update({Syre.prefix + "anchor": torch.zeros(4, 3, dtype=torch.int64)}), "dtype"),
        (lambda sd: sd["state"][0].update({Syre.prefix + "anchor": [0.0]}), "unexpected entry"),
        (lambda sd: sd["state"][0].update({Syre.prefix + "anchor": torch.zeros(3)}), r"has shape \(3,\)"),
    ],
)
def test_malformed_syre_state_raises_value_error_and_changes_nothing(mutate, match):
    syre = trained()
    sd = syre.state_dict()
    sd = {"state": {i: dict(e) for i, e in sd["state"].items()}, "param_groups": [dict(g) for g in sd["param_groups"]]}
    mutate(sd)
    before = syre.state_dict()
    with pytest.raises(ValueError, match=match):
        syre.load_state_dict(sd)
    after = syre.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, entries in before["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
