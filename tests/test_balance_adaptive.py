"""What a balance teleport does to the training that follows it, per base optimizer.

A teleport by the per-element scales s (w -> s * w, exact for the MLP's hidden
rescalings) with the optimizer state transported (first moments / s, Adam's second
moments / s^2) is, in the original coordinates, a change of each element's learning
rate: the gradient at s * w is g / s, so

* SGD (with momentum) then steps by lr * g / s in the new coordinates, lr * g / s^2 in
  the old: the learning rate times s^-2;
* Adam and Yogi, whose steps do not scale with the gradient, step by the same vector as
  before the teleport, lr * u / s in the old coordinates: the learning rate times s^-1.

The tests check both identities for ten steps after a balance teleport in float64
(relative error <= 1e-12: ten steps of float64 rounding, about 1e-15, and Adam's eps, set far
below sqrt(v)), and that a kept second moment breaks the Adam one.  This is why a
balance teleport under an adaptive optimizer acts as a retuning of its per-layer
learning rates (docs/teleport.md, "When to use which").
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teleopt.datasets import digits_mlp, hidden_rescaling_sites
from teleopt.teleport import Schedule, Teleport

pytestmark = pytest.mark.usefixtures("one_thread")

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
ADAM: Make = lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-30)  # noqa: E731
SGD: Make = lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9)  # noqa: E731


def yogi(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """torch-optimizer's Yogi (additive second-moment update, the examples' base)."""
    return pytest.importorskip("torch_optimizer").Yogi(params, lr=1e-2, eps=1e-30)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator, dtype=torch.float64)
    return x, torch.randint(3, (64,), generator=generator)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def teleported_and_reference(make: Make, power: int, policy: str = "transport") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Ten steps after a balance teleport, mapped back by 1/s, and ten steps of the untouched run with each
    element's learning rate times s^-power (the base's step rescaled elementwise after each step)."""
    x, y = data()
    model = digits_mlp((16, 16), seed=0, inputs=8, classes=3, bias=True).double()
    sites = hidden_rescaling_sites(model)
    opt = Teleport(make(list(model.parameters())), model, sites, objective="balance", schedule=Schedule(), state_policy=policy)
    for _ in range(20):  # Adam/SGD from the initialisation unbalance the layers
        step(model, opt, x, y)
    reference, ref_opt = copy.deepcopy((model, opt.base))  # the same run, never teleported
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.teleport(batch=(x, y)).accepted
    scales = [p.detach() / b for p, b in zip(model.parameters(), before)]
    assert max(float(s.log().abs().max()) for s in scales) > 0.1  # the teleport moved the layers
    for _ in range(10):
        step(model, opt.base, x, y)
        old = [p.detach().clone() for p in reference.parameters()]
        step(reference, ref_opt, x, y)
        with torch.no_grad():
            for p, o, s in zip(reference.parameters(), old, scales):
                p.copy_(o + (p - o) / s**power)
    return [p.detach() / s for p, s in zip(model.parameters(), scales)], [p.detach() for p in reference.parameters()]


@pytest.mark.parametrize(
    ("make", "power"), [(ADAM, 1), (yogi, 1), (SGD, 2)], ids=["adam-lr-times-1/s", "yogi-lr-times-1/s", "sgd-lr-times-1/s^2"]
)
def test_a_balance_teleport_with_transported_state_is_a_per_element_learning_rate_change(make, power):
    moved, reference = teleported_and_reference(make, power)
    for a, b in zip(moved, reference):
        assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())


def test_under_adam_a_kept_second_moment_is_not_that_learning_rate_change():
    moved, reference = teleported_and_reference(ADAM, 1, policy="keep")
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(moved, reference)) > 1e-4
