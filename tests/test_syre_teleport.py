"""Syre composed with Teleport (issue 4): same steps in either order; teleports keep the data loss, not the decay."""

from __future__ import annotations

import pytest
import torch

from teleopt import Site, get_action
from teleopt.syre import Syre
from teleopt.teleport import SearchConfig, Teleport
from teleopt.testing.conformance import WrapperConformance


def params_from(tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def train(opt, params, loss, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss(params).backward()
        opt.step()


class Holder(torch.nn.Module):
    """A module owning exactly the given parameters (Teleport needs the model); its forward is
    the ReLU regression's, so teleports are checked on probe inputs (the loss never calls it)."""

    def __init__(self, params):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)

    def forward(self, x):
        return torch.relu(x @ self.p0.T + self.p1) @ self.p2.T + self.p3


PROBE = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


def relu_problem(seed: int = 11):
    """A ReLU regression with biases: positive rescaling of the 6 hidden units is an exact symmetry."""
    g = torch.Generator().manual_seed(seed)
    init = [
        torch.randn(6, 4, generator=g) * 0.5,
        torch.randn(6, generator=g) * 0.1,
        torch.randn(2, 6, generator=g) * 0.4,
        torch.randn(2, generator=g) * 0.1,
    ]
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)

    def loss(ws):
        return ((torch.relu(x @ ws[0].T + ws[1]) @ ws[2].T + ws[3] - y) ** 2).mean()

    return init, loss


def teleporting(optimizer, params, **kwargs):
    site = Site(get_action("positive_rescaling", activation="relu"), ("p0", "p1", "p2"))
    return Teleport(optimizer, Holder(params), [site], every=2, example_inputs=PROBE, **kwargs, search=SearchConfig(steps=5))


@pytest.mark.parametrize("decoupled", [False, True])
def test_syre_outside_and_inside_teleport_take_the_same_steps(decoupled):
    """The decay acts right before the innermost update, after the teleport, in either order."""
    init, loss = relu_problem()
    finals, teleports = [], []
    for order in ("syre_outside", "syre_inside"):
        ps = params_from(init)
        base = torch.optim.SGD(ps, lr=0.05, momentum=0.9)
        if order == "syre_outside":
            teleport = teleporting(base, ps)
            optimizer = Syre(teleport, gamma=0.3, sigma0=1.0, decoupled=decoupled, exclude_1d=True)
        else:
            syre = Syre(base, gamma=0.3, sigma0=1.0, decoupled=decoupled, exclude_1d=True)
            optimizer = teleport = teleporting(syre, ps)
        train(optimizer, ps, loss, 6)
        finals.append(ps)
        teleports.append(sum(r.accepted for r in teleport.reports))
    assert teleports[0] == teleports[1] == 3, f"teleports must really happen: {teleports}"
    assert all(torch.equal(p, q) for p, q in zip(*finals))


def test_teleport_keeps_the_data_loss_and_changes_the_syre_penalty():
    """Syre breaks the symmetries teleportation moves along; the data loss keeps them (Ziyin et al. 2025 Thm. 1)."""
    init, loss = relu_problem(12)
    ps = params_from(init)
    teleport = teleporting(torch.optim.SGD(ps, lr=0.05), ps)
    syre = Syre(teleport, gamma=0.3, sigma0=1.0, exclude_1d=True)

    def closure():
        syre.zero_grad()
        value = loss(ps)
        value.backward()
        return value

    with torch.no_grad():
        before_loss, before_penalty = float(loss(ps)), float(syre.penalty())
    report = teleport.teleport(closure)
    assert report.accepted
    with torch.no_grad():
        assert float(loss(ps)) == pytest.approx(before_loss, rel=1e-5)  # float32 invariance of the data loss
        assert abs(float(syre.penalty()) - before_penalty) > 1e-3 * before_penalty


@pytest.mark.parametrize("check", ["resume", "deepcopy", "pickle", "hooks", "grad_scaler", "add_param_group"])
def test_syre_around_teleport_conformance(check):
    def factory(base):
        params = [p for g in base.param_groups for p in g["params"]]
        return Syre(teleporting(base, params), gamma=0.05, sigma0=0.5, exclude_1d=True)

    WrapperConformance(factory, base="adam", n_groups=2, activation="relu").run(check)
