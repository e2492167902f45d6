"""The simulated decrease cap's memory: one site tensor at a time, not the model at once.

:meth:`FastEvaluator.first_order_decrease` under Adam moves each site tensor's gradient
and moments along the sites that act on it, reduces <grad, u> and frees them before
the next.  Its peak of new tensor bytes is then a few times the largest site tensor
(a moved gradient, two moved moments, under weight decay the moved parameter, and the
modelled Adam update's temporaries: 8.0x under Adam and 10.0x under AdamW for a float64
tensor, bounded at 12x here), where moving everything at once held every site tensor's
moved copies together (28.6x and 39.0x the largest on this 8-layer chain).
The sum is the one the joint transport gives, in the same order: equal bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_benchmark
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.coordinates import zero_coordinates
from teleopt.teleport.fast_path import FastEvaluator
from teleopt.teleport.state_policy import StatePolicy

F64 = torch.float64
WIDTH, LAYERS = 32, 8


def _live_bytes():  # type: ignore[no-untyped-def]
    """The benchmark's counter of new storages still alive (``peak``: the most at once)."""
    return load_benchmark("teleport_cost").LiveBytes()


def chain(optimizer: str) -> tuple[FastEvaluator, list[torch.Tensor]]:
    """A ReLU chain of 8 square layers (scaling sites between them, a GL site before the first ReLU) after
    two Adam(W) steps, the gradient of a third batch in ``.grad``, and random coordinates for every site."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    for _ in range(LAYERS - 1):
        layers += [nn.ReLU(), nn.Linear(WIDTH, WIDTH)]
    model = nn.Sequential(*layers).to(F64)
    relu = get_action("positive_rescaling")
    sites = [Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight"))]  # no ReLU between 0 and 2 below
    model[1] = nn.Identity()
    sites += [Site(relu, (f"{2 * i}.weight", f"{2 * i}.bias", f"{2 * i + 2}.weight")) for i in range(1, LAYERS - 1)]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, WIDTH, generator=gen, dtype=F64), torch.randn(16, WIDTH, generator=gen, dtype=F64)
    weight_decay = 0.1 if optimizer == "adamw" else 0.0
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=weight_decay)
    for step in range(3):
        base.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if step < 2:
            base.step()
    evaluator = FastEvaluator(sites, TeleportContext.build(model, base, StatePolicy()), with_decrease=True)
    coords = []
    for site, group in zip(sites, evaluator.groups):
        zero = zero_coordinates(site, group, torch.device("cpu"))
        scale = 0.2 if zero.dim() == 2 else math.log(4)
        coords.append((2 * torch.rand(zero.shape, generator=gen, dtype=F64) - 1) * scale)
    return evaluator, coords


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_simulated_decrease_holds_a_few_times_the_largest_site_tensor(optimizer):
    evaluator, coords = chain(optimizer)
    elements = evaluator.elements(coords)
    counter = _live_bytes()
    with counter:
        evaluator.first_order_decrease(elements)
    largest = max(t.numel() * t.element_size() for t in evaluator.like.values())
    site_bytes = sum(t.numel() * t.element_size() for t in evaluator.like.values())
    assert site_bytes >= 7 * largest  # the bound is far under the whole model's moved copies (3x these)
    assert counter.peak <= 12 * largest, counter.peak / largest


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_the_decrease_one_tensor_at_a_time_is_the_joint_one_bit_for_bit(optimizer):
    evaluator, coords = chain(optimizer)
    elements = evaluator.elements(coords)
    alone = evaluator.first_order_decrease(elements)
    together = evaluator._decrease_together(elements)
    assert alone.dtype == F64 and torch.isfinite(alone)
    assert torch.equal(alone, together), (float(alone), float(together))
    assert float(alone) != float(evaluator.first_order_decrease(evaluator.elements([0 * c for c in coords])))
