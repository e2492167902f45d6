"""Under scale-free steps ``sites="auto"`` keeps a norm's rescaling only against scale-invariant weights."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from teleopt.functional import Batch
from teleopt.teleport import Schedule, Teleport
from teleopt.teleport.norm_sites import ScaleInvariance


def _cnn() -> nn.Sequential:
    """conv -> BN -> ReLU -> dropout -> conv -> BN -> ReLU -> pool -> linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Conv2d(4, 5, 3, padding=1, bias=False),
        nn.BatchNorm2d(5),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 3),
    )


def _auto(model: nn.Module, base: torch.optim.Optimizer, x: torch.Tensor) -> tuple[Teleport, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = Teleport(base, model, "auto", example_inputs=x, loss_fn=nn.functional.cross_entropy, objective="balance", schedule=Schedule())
    return opt, [str(w.message) for w in record]


def _moved(opt: Teleport) -> set[str]:
    return {n for s in opt.sites or [] for n in s.tensor_names}


def test_a_batchnormed_convs_rescaling_is_kept_under_adamw_and_the_heads_is_left_out():
    model, x = _cnn(), torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    opt, messages = _auto(model, torch.optim.AdamW(model.parameters()), x)
    # BN 1's gain against conv 4 (renormalised by BN 5): kept; BN 5's gain against the head (nothing after it): left out
    assert {"1.weight", "4.weight"} <= _moved(opt)
    assert "5.weight" not in _moved(opt) and "9.weight" not in _moved(opt)
    left_out = [m for m in messages if "normalisation-affine" in m]
    assert len(left_out) == 1 and "1 normalisation-affine" in left_out[0] and "BatchNorm'd convolutions are kept" in left_out[0]
    # the kept site teleports: balance moves BN 1's gain and conv 4's input columns, and the model's function stays
    before = model.eval()(x)
    report = opt.teleport(batch=(x, torch.zeros(6, dtype=torch.long)))
    assert report.accepted, report.reason
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [torch.optim.Adam, lambda p: torch.optim.AdamW(p, weight_decay=0.0)], ids=["adam", "adamw-no-decay"])
def test_without_decay_on_the_convolution_its_rescaling_is_left_out_too(base):
    # no decay: no equilibrium for the scale-invariant weight's norm to return to, so nothing is kept
    model, x = _cnn(), torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    opt, messages = _auto(model, base(model.parameters()), x)
    assert "1.weight" not in _moved(opt) and "5.weight" not in _moved(opt)
    assert any("2 normalisation-affine" in m for m in messages)


def test_sgd_keeps_every_normalisation_affine_site():
    model, x = _cnn(), torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    opt, messages = _auto(model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    assert {"1.weight", "5.weight", "9.weight"} <= _moved(opt)
    assert not [m for m in messages if "normalisation-affine" in m]


def test_scale_invariance_is_read_in_training_mode_on_a_copy():
    model, x = _cnn().eval(), torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(2))
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    invariant = ScaleInvariance(model, Batch((x,), None))
    # a conv before a BatchNorm is scale-invariant with batch statistics (training mode), not with running ones
    assert invariant("0.weight") and invariant("4.weight")
    assert not invariant("9.weight")
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, buffers[k]), k


@pytest.mark.parametrize(("bias", "expected"), [(False, True), (True, False)])
def test_a_linear_before_a_layernorm_is_scale_invariant_only_without_a_bias(bias: bool, expected: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=bias), nn.LayerNorm(6), nn.Linear(6, 2))
    assert ScaleInvariance(model, Batch((torch.randn(3, 4),), None))("0.weight") is expected


def test_a_model_that_cannot_run_in_training_mode_is_not_shown_invariant():
    model = _cnn()
    # one sample: BatchNorm cannot take batch statistics, so nothing is shown scale-invariant (fail closed)
    invariant = ScaleInvariance(model, Batch((torch.randn(1, 2, 1, 1),), None))
    assert not invariant("4.weight") and not invariant("0.weight")


class _ZeroInitBlock(nn.Module):
    """A pre-norm residual block ``x + fc2(relu(fc1(ln(x))))``, ``fc2`` zero-initialised (ReZero, GPT-style
    output projections): ``fc1`` moves no output yet, so doubling it changes nothing, but it is no
    scale-invariant weight (no norm after it)."""

    def __init__(self, zero: bool) -> None:
        super().__init__()
        self.inp, self.ln, self.fc1, self.fc2, self.head = (
            nn.Linear(4, 8),
            nn.LayerNorm(8),
            nn.Linear(8, 16),
            nn.Linear(16, 8),
            nn.Linear(8, 3),
        )
        if zero:
            nn.init.zeros_(self.fc2.weight)
            nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        return self.head(x + self.fc2(torch.relu(self.fc1(self.ln(x)))))


@pytest.mark.parametrize("zero", [False, True], ids=["random-init", "zero-init-after"])
def test_a_weight_that_moves_no_output_is_not_shown_scale_invariant(zero: bool):
    # doubling fc1 leaves the outputs alone when fc2 is zero: without the perturbation test it would pass as
    # scale-invariant and the LayerNorm's rescaling (the ViT's collapse under AdamW) would be kept
    torch.manual_seed(0)
    model, x = _ZeroInitBlock(zero), torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    assert not ScaleInvariance(model, Batch((x,), None))("fc1.weight")
    opt, messages = _auto(model, torch.optim.AdamW(model.parameters()), x)
    assert "ln.weight" not in _moved(opt)
    assert any("1 normalisation-affine" in m for m in messages)


def test_coupled_l2_decay_under_adam_does_not_count_as_decay():
    # the equilibrium argument is for decoupled decay (AdamW's); Adam's weight_decay is an L2 term in the gradient
    model, x = _cnn(), torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(1))
    opt, messages = _auto(model, torch.optim.Adam(model.parameters(), weight_decay=0.1), x)
    assert "1.weight" not in _moved(opt)
    assert any("2 normalisation-affine" in m for m in messages)


def test_the_construction_warnings_point_at_the_line_that_builds_teleport():
    # a warning attributed to a line inside teleopt tells the user nothing about which of their wrappers it is
    model = _cnn()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Teleport(torch.optim.Adam(model.parameters()), model, "auto", example_inputs=torch.randn(2, 2, 8, 8), objective="balance")
    assert record and {w.filename for w in record} == {__file__}, [(w.filename, w.lineno) for w in record]
