"""``keep_float64``: the float64 copy that certification runs keeps the model's float32 casts in float64.

A model written for half precision computes some steps in float32 whatever its dtype,
and not only from float64 tensors: transformers' rotary table casts the integer
``position_ids`` with ``.float()`` and multiplies them with the (float64, in the copy)
inverse frequencies (transformers 5.17 does exactly this; a mixed float64 @ float32
matmul raises).  Inside ``keep_float64`` a cast to float32 of a float64 or a
non-floating tensor gives float64; casts of other tensors and to other dtypes are
untouched.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import teleopt
from teleopt.detection.float64 import keep_float64


@pytest.mark.parametrize("cast", ["float", "to_dtype", "to_kw", "type"])
@pytest.mark.parametrize("source", [torch.float64, torch.int64, torch.int32, torch.bool])
def test_a_cast_to_float32_of_a_float64_or_integer_tensor_keeps_float64(cast, source):
    t = torch.arange(4).to(source)
    with keep_float64():
        out = {
            "float": lambda: t.float(),
            "to_dtype": lambda: t.to(torch.float32),
            "to_kw": lambda: t.to(dtype=torch.float32),
            "type": lambda: t.type(torch.float32),
        }[cast]()
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.arange(4).to(source).double())


@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16])
def test_other_floating_casts_are_untouched(source):
    t = torch.ones(3, dtype=source)
    with keep_float64():
        assert t.float().dtype == torch.float32
        assert t.to(torch.float32).dtype == torch.float32
        assert torch.ones(3, dtype=torch.float64).to(torch.float16).dtype == torch.float16
        assert torch.arange(3).to(torch.bfloat16).dtype == torch.bfloat16


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
