"""Example 4: teleopt's property tests in *your* CI, on *your* model and optimizer setup.

Copy this file into your test folder (as ``test_symmetries.py``) and adapt the three
parts marked YOURS.  It needs the ``testing`` extra, ``pip install "/path/to/teleopt[testing]"`` (hypothesis and
pytest; the ``teleopt`` pytest plugin loads by itself).  Run it with
``python -m pytest examples/04_ci_property_tests.py``.

It checks, with hypothesis drawing random group elements (bounded Lie-algebra
coordinates: scales log-uniform within [1/4, 4]):

* every symmetry site you rely on leaves the model's output unchanged, in float64,
  one site at a time and all together (relative error <= 1e-10);
* each site needs all its members (acting on all but one changes the output): a
  site that ties too little or too much is caught;
* the transformed ``state_dict`` loads into a fresh model and gives the same
  outputs (no hidden state);
* gradients move by the declared covector rule (Zhao 2026, Prop. 4.5.1), the rule
  Teleport's fast path and its optimizer-state transport rely on;
* your optimizer stack (here ``Syre(Teleport(AdamW))`` with your AdamW settings)
  passes teleopt's wrapper conformance suite: it is a drop-in ``torch.optim``
  optimizer (shared param groups and state, exact resume, LR scheduler,
  GradScaler, deepcopy/pickle, hooks, convergence).

Needs: the ``testing`` extra (hypothesis, pytest): ``pip install -e ".[testing]"``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import teleopt
from teleopt.teleport import SearchConfig
from teleopt.testing import assert_close, assert_gradient_transport, group_elements
from teleopt.testing.conformance import CHECKS, BaseOptimizer, WrapperConformance


# ---------------------------------------------------------------------------- YOURS: the model
class MyModel(nn.Module):
    """A small model with biases and two LeakyReLU hidden layers (stand-in for yours)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.1), nn.Linear(16, 12), nn.LeakyReLU(0.1))
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


# ---------------------------------------------------------------------------- YOURS: its symmetry sites
RESCALING = teleopt.get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def my_sites() -> list[teleopt.Site]:
    """The sites your training relies on (by hand here; ``teleopt.find_symmetries`` finds them for you)."""
    return [
        teleopt.Site(RESCALING, ("encoder.0.weight", "encoder.0.bias", "encoder.2.weight"), name="hidden1"),
        teleopt.Site(RESCALING, ("encoder.2.weight", "encoder.2.bias", "head.weight"), name="hidden2"),
    ]


# ---------------------------------------------------------------------------- YOURS: the optimizer stack
MY_ADAMW = BaseOptimizer(
    "my_adamw",
    lambda groups, lr: torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
    lr=0.01,
    rosenbrock_lr=0.05,
    rosenbrock_steps=800,
)


class _Holder(nn.Module):
    """The conformance suite hands the factory a bare optimizer; Teleport also needs the module that owns its tensors."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)


def my_optimizer_stack(base: torch.optim.Optimizer, enabled: bool = True) -> torch.optim.Optimizer:
    """What your training script builds around the base optimizer (features off: a transparent stack)."""
    params = [p for g in base.param_groups for p in g["params"]]
    holder = _Holder(params)
    # the suite's problem is W1 (8, 4), b1 (8,), W2 (3, 8), b2 (3,) with a ReLU hidden layer
    sites = [teleopt.Site(teleopt.get_action("positive_rescaling", activation="relu"), ("p0", "p1", "p2"))] if len(params) == 4 else []
    teleport = teleopt.Teleport(base, holder, sites, every=2 if enabled else None, search=SearchConfig(steps=5))
    return teleopt.Syre(teleport, gamma=1e-3 if enabled else 0.0, exclude_1d=True)


# ---------------------------------------------------------------------------- the tests
def _model_and_inputs() -> tuple[MyModel, torch.Tensor]:
    torch.manual_seed(0)
    model = MyModel().double()
    x = torch.randn(32, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, x


@settings(deadline=None, max_examples=15)
@given(data=st.data(), which=st.sampled_from(["each", "all"]))
def test_sites_are_symmetries_of_my_model(data, which):
    model, x = _model_and_inputs()
    sites = my_sites()
    chosen = sites if which == "all" else [data.draw(st.sampled_from(sites), label="site")]
    moved = copy.deepcopy(model)
    for site in chosen:
        g = data.draw(group_elements(site.action, site.tensors(moved)), label=site.name)
        site.apply_(moved, g)
    # exact symmetry in float64: only rounding may change the output (relative error <= 1e-10)
    assert_close(moved(x), model(x), 1e-10, "model output after the group action")
    # no hidden state: the transformed weights alone reproduce the outputs in a fresh model
    fresh = MyModel().double()
    fresh.load_state_dict(moved.state_dict())
    assert_close(fresh(x), model(x), 1e-10, "fresh model loaded from the transformed state_dict")


@pytest.mark.parametrize("site_index", [0, 1])
@pytest.mark.parametrize("left_out", [0, 1, 2])
def test_every_member_of_a_site_is_needed(site_index, left_out):
    model, x = _model_and_inputs()
    site = my_sites()[site_index]
    g = torch.exp(torch.linspace(-1.0, 1.0, site.tensors(model)[0].shape[0], dtype=torch.float64))
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for i, (name, value) in enumerate(zip(site.members, site.act(model, g))):
            if i != left_out:
                moved.get_parameter(name).copy_(value)
    assert (moved(x) - model(x)).abs().max() > 1e-6, f"{site.name}: acting without {site.members[left_out]} changed nothing"


@settings(deadline=None, max_examples=10)
@given(data=st.data())
def test_gradients_follow_the_covector_rule(data):
    model, x = _model_and_inputs()
    y = torch.randn(32, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    site = data.draw(st.sampled_from(my_sites()), label="site")
    frozen = {n: p.detach() for n, p in model.named_parameters()}

    def loss(params, batch):  # the training loss as a function of the site's members only
        tensors = dict(frozen, **{n: p for n, p in zip(site.members, params) if n is not None})
        inputs, target = batch
        return ((functional_call(model, tensors, (inputs,)) - target) ** 2).mean()

    params = tuple(t.detach() for t in site.tensors(model))
    g = data.draw(group_elements(site.action, params), label="g")
    assert_gradient_transport(site.action, g, params, loss, (x, y))


@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("check", CHECKS)
def test_my_optimizer_stack_is_a_drop_in(check, n_groups):
    WrapperConformance(
        my_optimizer_stack,
        make_transparent=lambda base: my_optimizer_stack(base, enabled=False),
        base=MY_ADAMW,
        n_groups=n_groups,
        activation="relu",
    ).run(check)
