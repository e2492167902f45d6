"""The predicted-decrease cap decided without simulating the base optimizer per candidate.

In float64.  For SGD under scalings the reduced decrease is exact (the same sums in
another order: 1e-10 relative).  For Adam it is an upper bound that differs from the
simulated decrease only through eps (dropped from positive terms, eps / f_min in
negative ones), about eps / sqrt(v) relative: with eps = 1e-8 against sqrt(v) of
1e-3 or more here it is within 1e-6 (measured: 3e-7 to 6e-7), asserted within 1e-5,
and never below it.  Under GL sites SGD's momentum term is bounded by
Cauchy-Schwarz: never below.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import zero_coordinates
from teleopt.teleport.fast_path import FastEvaluator
from teleopt.teleport.state_policy import StatePolicy

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd momentum decay": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "sgd dampened": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.3),
}


def mlp(seed: int, gl: bool = False) -> tuple[nn.Sequential, list[Site]]:
    torch.manual_seed(seed)
    first = nn.Identity() if gl else nn.LeakyReLU(0.1)
    model = nn.Sequential(nn.Linear(5, 6), first, nn.Linear(6, 7), nn.LeakyReLU(0.1), nn.Linear(7, 3)).double()
    head = Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight")) if gl else Site(LEAKY, ("0.weight", "0.bias", "2.weight"))
    return model, [head, Site(LEAKY, ("2.weight", "2.bias", "4.weight"))]


def trained(
    name: str, seed: int, gl: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, list[Site], tuple[torch.Tensor, torch.Tensor]]:
    """A model after three steps of ``name``, with the gradient of a fourth batch in ``.grad``."""
    model, sites = mlp(seed, gl)
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)
    base = OPTIMIZERS[name](model.parameters())
    for _ in range(4):
        base.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if _ < 3:
            base.step()
    return model, base, sites, (x, y)


def random_coordinates(evaluator: FastEvaluator, sites: list[Site], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    coords = []
    for site, group in zip(sites, evaluator.groups):
        zero = zero_coordinates(site, group, torch.device("cpu"))
        scale = 0.2 if zero.dim() == 2 else math.log(4)
        coords.append((2 * torch.rand(zero.shape, generator=gen, dtype=zero.dtype) - 1) * scale)
    return coords


def evaluator_of(model: nn.Module, base: torch.optim.Optimizer, sites: list[Site]) -> FastEvaluator:
    return FastEvaluator(sites, TeleportContext.build(model, base, StatePolicy()), with_decrease=True)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_reduced_decrease_is_the_simulated_one_or_just_above_it(name, seed):
    """At a random element and at the points between it and the identity (the caps' bisection)."""
    model, base, sites, _ = trained(name, seed)
    evaluator = evaluator_of(model, base, sites)
    coords = random_coordinates(evaluator, sites, seed)
    for s in (1.0, 0.5, 0.125, 0.0):
        elements = evaluator.elements([s * c for c in coords])
        exact = float(evaluator.first_order_decrease(elements).detach())
        bound = evaluator.decrease_bound(elements)
        assert bound is not None and evaluator.decrease_bound_tight
        if name.startswith("sgd"):
            assert bound == pytest.approx(exact, rel=1e-10)
        else:
            assert exact <= bound <= exact + 1e-5 * abs(exact)
    assert evaluator.decrease_at_identity() == pytest.approx(
        float(evaluator.first_order_decrease(evaluator.elements([0 * c for c in coords])).detach()), rel=1e-10
    )


@pytest.mark.parametrize("name", ["sgd momentum decay", "sgd nesterov"])
def test_under_gl_sites_sgd_momentum_is_bounded_by_cauchy_schwarz(name):
    model, base, sites, _ = trained(name, 3, gl=True)
    evaluator = evaluator_of(model, base, sites)
    coords = random_coordinates(evaluator, sites, 3)
    for s in (1.0, 0.5, 0.0):
        elements = evaluator.elements([s * c for c in coords])
        exact = float(evaluator.first_order_decrease(elements).detach())
        bound = evaluator.decrease_bound(elements)
        assert bound is not None and not evaluator.decrease_bound_tight
        assert bound >= exact * (1 - 1e-12)


def test_adam_under_gl_sites_has_no_bound_and_the_cap_simulates():
    model, base, sites, _ = trained("adam", 4, gl=True)
    evaluator = evaluator_of(model, base, sites)
    assert evaluator.decrease_bound(evaluator.elements(random_coordinates(evaluator, sites, 4))) is None


@pytest.mark.parametrize("name", ["adam", "sgd momentum decay"])
def test_a_capped_checked_teleport_never_simulates_the_optimizer_and_decides_as_it_would(name, monkeypatch):
    """The cap binds (shrink < 1); the decision is the simulated cap's, found without one simulated update."""

    def teleport(simulate: bool):
        model, base, sites, batch = trained(name, 5)
        if simulate:
            monkeypatch.setattr(FastEvaluator, "decrease_bound", lambda self, elements: None)
        opt = Teleport(
            base,
            model,
            sites,
            loss_fn=lambda out, y: ((out - y) ** 2).mean(),
            safety=SafetyConfig(max_predicted_decrease=0.05, watch_steps=0),
            search=SearchConfig(trust_region=3.0),
            schedule=Schedule(),
        )
        calls = []
        simulated = FastEvaluator.first_order_decrease
        monkeypatch.setattr(FastEvaluator, "first_order_decrease", lambda self, elements: calls.append(1) or simulated(self, elements))
        report = opt.teleport(batch=batch)
        monkeypatch.undo()
        return report, len(calls)

    reduced, reduced_calls = teleport(simulate=False)
    simulated, simulated_calls = teleport(simulate=True)
    assert reduced.accepted and 0 < reduced.shrink < 1
    assert reduced_calls == 0 and simulated_calls >= 10
    assert reduced.shrink == pytest.approx(simulated.shrink, abs=2**-11)


def test_large_weights_between_two_sites_keep_half_precision_weights_rounded_up(monkeypatch):
    """Above ``_COMPACT`` entries a weight between two sites keeps its per-entry weights in float16, each rounded
    towards +inf (with a power-of-two unit per chunk of rows): still never below the simulated decrease, and
    above it by at most the rounding, 2^-11 relative per entry (asserted: 2^-9 of the total)."""
    import teleopt.teleport.decrease_bound as reduced

    monkeypatch.setattr(reduced, "_COMPACT", 0)
    monkeypatch.setattr(reduced, "_CHUNK", 14)  # several chunks of rows, each its own unit
    model, base, sites, _ = trained("adam", 6)
    evaluator = evaluator_of(model, base, sites)
    coords = random_coordinates(evaluator, sites, 6)
    for s in (1.0, 0.5):
        elements = evaluator.elements([s * c for c in coords])
        exact = float(evaluator.first_order_decrease(elements).detach())
        bound = evaluator.decrease_bound(elements)
        assert bound is not None
        assert exact <= bound <= exact + 2**-9 * abs(exact)
    assert any(term.units for term in evaluator.__dict__["_bound"].linear)


def test_elements_farther_out_than_the_first_candidate_get_weights_of_their_own():
    """Adam's weights assume every factor at least the first candidate's smallest (the bisection only moves
    inwards); a candidate farther out (the gain cap passed a smaller step first) is bounded afresh, not
    declared infeasible."""
    model, base, sites, _ = trained("adam", 7)
    evaluator = evaluator_of(model, base, sites)
    coords = random_coordinates(evaluator, sites, 7)
    evaluator.decrease_bound(evaluator.elements([0.25 * c for c in coords]))
    elements = evaluator.elements(coords)
    exact = float(evaluator.first_order_decrease(elements).detach())
    assert exact <= evaluator.decrease_bound(elements) <= exact + 1e-5 * abs(exact)
