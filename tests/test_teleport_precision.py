"""Teleports are exact in the precision the model trains in (float32, or bfloat16 under autocast).

The check runs its forwards in full precision (autocast off, whatever the caller's region) and,
when the model trains under autocast, in that precision too, without autocast's weight cache; the
teleport's own arithmetic never runs under autocast.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.registry import get_action
from teleopt.site import Site
from teleopt.teleport.precision import Precision, PrecisionRecorder

HEADS, DIM = 4, 32


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v, o projections and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, HEADS, DIM // HEADS).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS), dim=-1)
        out = self.o((att @ v).transpose(1, 2).reshape(b, t, DIM))
        return self.head(out).mean(1)


def _sites() -> list[Site]:
    qk, vo = get_action("attention_qk_gl", num_heads=HEADS), get_action("attention_vo_gl", num_heads=HEADS)
    return [Site(qk, ("q.weight", "q.bias", "k.weight", "k.bias"), name="qk"), Site(vo, ("v.weight", "v.bias", "o.weight"), name="vo")]


def _setup(seed: int = 0) -> tuple[nn.Module, teleopt.Teleport, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = Attention()
    g = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(16, 6, DIM, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt = teleopt.Teleport(torch.optim.Adam(model.parameters(), 1e-3), model, _sites(), loss_fn=F.cross_entropy, example_inputs=x[:4])
    return model, opt, x, y


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bf16(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        return model(x).float()


def test_a_teleport_inside_an_autocast_region_moves_the_float32_weights_exactly():
    model, opt, x, y = _setup()
    with torch.no_grad():
        before = model(x)
    with torch.autocast("cpu", torch.bfloat16):
        F.cross_entropy(model(x), y).backward()
        report = opt.teleport()
        inside = model(x).detach().float()  # a forward after the teleport, in the same region
    # accepted, or rolled back by the check in the training precision: never accepted on autocast's stale copies
    assert report.accepted or "in the training precision (bfloat16 autocast on cpu)" in report.reason, report.reason
    with torch.no_grad():
        after = model(x)
    # float32 round-off of the element (main: 8-10% with check_error 0.0, the check read autocast's cached copies)
    assert _relative(after, before) <= 1e-5
    # autocast's cache of the old weights never stands in for the new ones, in the region either
    assert torch.equal(inside, _bf16(model, x))
    assert "bfloat16 autocast" in report.check_detail


def test_the_precision_recorder_keeps_the_training_forward_not_an_evaluation():
    model, recorder = nn.Linear(3, 2), PrecisionRecorder()
    model.register_forward_pre_hook(recorder)
    x = torch.randn(2, 3)
    assert recorder.training() == Precision()
    with torch.autocast("cpu", torch.bfloat16):
        model(x)
    with torch.no_grad():
        model(x)  # an evaluation in float32 is not the training forward
    assert recorder.training() == Precision((("cpu", torch.bfloat16),))
    assert recorder.training().compute_dtype([model.weight]) == torch.bfloat16
    assert Precision().compute_dtype([model.weight]) == torch.float32
