"""16-bit models teleport without round-off where the group allows it.

Multiplying a binary float by 2^k changes only its exponent, so a scaling teleport
whose scales are powers of two is exact in bfloat16 and float16 (barring overflow):
``PositiveScaling.exact_coordinates`` rounds each log-scale toward zero to a
multiple of log 2, and the engine uses it for sites with 16-bit members.  Without
it a bfloat16 teleport of the MLP below changes the outputs by 2.2e-3 (float16:
2.4e-4); with it by exactly 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.groups import GeneralLinear, PositiveScaling
from teleopt.teleport import Schedule, SearchConfig, TeleportReport

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _mlp_teleport(dtype: torch.dtype, device: str = "cpu") -> tuple[nn.Module, torch.Tensor, list[torch.Tensor], TeleportReport]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    x, y = torch.randn(32, 8, dtype=dtype), torch.randint(0, 4, (32,))
    model, x, y = model.to(device), x.to(device), y.to(device)
    # trust region 0.9: the search ends inside it, where scales are not powers of two by themselves
    opt = teleopt.Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model,
        "auto",
        loss_fn=F.cross_entropy,
        search=SearchConfig(trust_region=0.9),
        schedule=Schedule(),
    )
    F.cross_entropy(model(x).float(), y).backward()
    with torch.no_grad():
        before = [model(x)] + [p.clone() for p in model.parameters()]
    report = opt.teleport(batch=(x, y))
    return model, x, before, report


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_scaling_teleport_is_exact(dtype, device):
    model, x, before, report = _mlp_teleport(dtype, device)
    assert report.accepted and report.grad_norm_after > report.grad_norm_before
    (element,) = report.elements.values()
    k = torch.log2(element)
    assert torch.equal(k, k.round()) and bool((k != 0).any())  # powers of two, and a real move
    with torch.no_grad():
        assert torch.equal(model(x), before[0])  # bitwise: no round-off anywhere
        w1, b1, w2, b2 = model.parameters()
        c = element.to(dtype)
        assert torch.equal(w1 / c[:, None], before[1]) and torch.equal(b1 / c, before[2])
        assert torch.equal(w2 * c, before[3]) and torch.equal(b2, before[4])
    assert report.check_error == 0.0


def test_float32_scales_are_left_where_the_search_put_them():
    *_, report = _mlp_teleport(torch.float32)
    (element,) = report.elements.values()
    k = torch.log2(element)
    assert not torch.equal(k, k.round())  # snapping is for 16-bit members only
    assert 0.0 < report.check_error < 1e-6


def test_exact_coordinates_round_toward_the_identity():
    group = PositiveScaling(5)
    xi = torch.tensor([-1.5, -0.5, 0.0, 0.7, 2.2], dtype=torch.float64)
    snapped = group.exact_coordinates(xi, torch.bfloat16)
    assert torch.allclose(snapped / math.log(2), torch.tensor([-2.0, 0.0, 0.0, 1.0, 3.0], dtype=torch.float64))
    assert bool((snapped.abs() <= xi.abs()).all())  # never farther than the search went: trust region and caps hold
    assert group.exact_coordinates(xi, torch.float32) is xi
    gl = torch.randn(3, 3, dtype=torch.float64)
    assert GeneralLinear(3).exact_coordinates(gl, torch.bfloat16) is gl  # no exact elements: round-off stays
