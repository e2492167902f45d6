"""``keep_float64``: the float64 copy that certification runs keeps the model's float32 casts in float64.

A model written for half precision computes some steps in float32 whatever its dtype,
and not only from float64 tensors: transformers' rotary table casts the integer
``position_ids`` with ``.float()`` and multiplies them with the (float64, in the copy)
inverse frequencies (transformers 5.17 does exactly this; a mixed float64 @ float32
matmul raises).  Inside ``keep_float64`` a cast of a float64 tensor to float32 keeps
float64, and a matrix product of float64 and float32 operands computes in float64;
everything else, a float32 model's forward included, runs as without the mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import teleopt
from teleopt.detection.float64 import keep_float64


@pytest.mark.parametrize("cast", ["float", "to_dtype", "to_kw", "type"])
def test_a_cast_to_float32_of_a_float64_tensor_keeps_float64(cast):
    t = torch.arange(4, dtype=torch.float64)
    with keep_float64():
        out = {
            "float": lambda: t.float(),
            "to_dtype": lambda: t.to(torch.float32),
            "to_kw": lambda: t.to(dtype=torch.float32),
            "type": lambda: t.type(torch.float32),
        }[cast]()
    assert out.dtype == torch.float64
    assert torch.equal(out, t)


@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_other_casts_are_untouched(source):
    t = torch.ones(3, dtype=source)
    with keep_float64():
        assert t.float().dtype == torch.float32
        assert t.to(torch.float32).dtype == torch.float32
        assert torch.ones(3, dtype=torch.float64).to(torch.float16).dtype == torch.float16


@pytest.mark.parametrize("product", ["operator", "matmul", "mm", "bmm"])
def test_a_product_of_float64_and_float32_operands_computes_in_float64(product):
    a = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b = torch.arange(8).reshape(1, 4, 2).expand(2, 4, 2).float()  # integer positions cast with .float()
    fn = {
        "operator": lambda x, y: x @ y,
        "matmul": torch.matmul,
        "mm": lambda x, y: torch.mm(x[0], y[0]),
        "bmm": torch.bmm,
    }[product]
    with pytest.raises(RuntimeError):
        fn(a, b)  # outside the mode torch refuses the mixed product
    with keep_float64():
        out = fn(a, b)
        assert fn(a.float(), b).dtype == torch.float64  # a float32 view of a float64 tensor keeps float64
        assert fn(b.transpose(-1, -2), b).dtype == torch.float32  # a float32 model's products are untouched
    assert out.dtype == torch.float64
    assert torch.equal(out, fn(a, b.double()))


class _RotaryLike(nn.Module):
    """A linear map fed through a rotary-style table built as transformers 5.17 builds it: integer positions
    cast with ``.float()`` and multiplied by a buffer of inverse frequencies (float64 in the certification copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float) / 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0], device=x.device)[:, None].float()
        freqs = positions @ self.inv_freq[None, :].to(dtype=torch.float)
        phase = torch.cat((freqs, freqs), dim=-1).cos().to(x.dtype)
        return self.fc2(torch.relu(self.fc1(x))) * phase


def test_certification_runs_a_model_that_casts_integer_positions():
    torch.manual_seed(0)
    model = _RotaryLike()
    report = teleopt.find_symmetries(model, example_inputs=torch.randn(6, 4))
    certified = [e for e in report.certification if e.status == "certified"]
    assert certified, report.certification
    # the copy computes in float64 throughout: an exact site moves the outputs by float64 round-off only
    assert all(math.isfinite(e.error) and e.error < 1e-12 for e in certified), certified
