"""Teleport passes the wrapper conformance suite (issue 4, CONVENTIONS.md section 3).

Bases: SGD+momentum, Adagrad, Adam, AdamW(foreach) and torch-optimizer's Yogi, with
one and two param groups.  The suite's regression uses a ReLU hidden layer here, so
the positive rescaling of the hidden units is an exact continuous symmetry and
teleports really happen during the checks (every 2 steps, fast path from ``.grad``,
with the post-teleport watch holding a snapshot that must survive state_dict,
deepcopy and pickle).  Rosenbrock's tensors carry no site: there the check is that
an idle Teleport converges like its base.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import Schedule, SearchConfig, Teleport
from teleopt.testing.conformance import CHECKS, WrapperConformance

BASES = ["sgd_momentum", "adagrad", "adam", "adamw_foreach", "yogi"]
RESCALING = get_action("positive_rescaling", activation="relu")


class Holder(nn.Module):
    """A module owning exactly the optimizer's parameters (the suite builds bare tensors).

    Its forward is the suite's regression model, so every teleport is checked on probe
    inputs (the suite computes its loss from the tensors, never calling the module).
    """

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.p0.T + self.p1) @ self.p2.T + self.p3


def _probe(params: list[nn.Parameter]) -> torch.Tensor | None:
    """Probe inputs of the regression (only the two-layer problem has a site)."""
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).to(params[0].dtype) if len(params) == 4 else None


def _params(base: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in base.param_groups for p in g["params"]]


def teleporting(base: torch.optim.Optimizer) -> Teleport:
    params = _params(base)
    model = Holder(params)
    sites = [Site(RESCALING, ("p0", "p1", "p2"))] if len(params) == 4 else []
    return Teleport(base, model, sites, every=2, example_inputs=_probe(params), search=SearchConfig(steps=5))


def idle(base: torch.optim.Optimizer) -> Teleport:
    params = _params(base)
    model = Holder(params)
    sites = [Site(RESCALING, ("p0", "p1", "p2"))] if len(params) == 4 else []
    return Teleport(base, model, sites, example_inputs=_probe(params), schedule=Schedule())  # manual: never teleports on its own


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("n_groups", [1, 2])
@pytest.mark.parametrize("base", BASES)
def test_teleport_conformance(base, n_groups, check):
    WrapperConformance(teleporting, make_transparent=idle, base=base, n_groups=n_groups, activation="relu").run(check)


def test_teleports_happen_during_the_suite_problem():
    """The conformance factory really teleports (otherwise the checks above would prove little)."""
    suite = WrapperConformance(teleporting, base="adam", activation="relu")
    params = suite.problem.params()
    _, wrapper = suite._wrapped(params)
    suite._train(wrapper, params, 0, 4)
    accepted = [r for r in wrapper.reports if r.accepted]
    assert len(accepted) == 2 and all(r.gain > 1 for r in accepted)
    assert all(r.check == "probe" and r.check_passed for r in accepted)
