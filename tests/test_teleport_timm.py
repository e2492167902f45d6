"""Done-when of issue 4 on timm models: ``sites="auto"`` and a forced ``teleport()``.

On resnet18 and vit_tiny (``pretrained=False``, small inputs to keep the test fast),
a teleport of every exact continuous site ``teleopt.find_symmetries`` detects must
leave the outputs on held-out inputs unchanged, in eval mode (running statistics in
use) and in train mode, and raise the gradient norm.  Tolerances (issue 4):
relative error <= 1e-10 in float64, <= 1e-5 in float32 (norm-relative, see
teleopt.testing.assert_close).
"""

from __future__ import annotations

import copy

import pytest
import torch

from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.testing import assert_close

timm = pytest.importorskip("timm")
pytest.importorskip("teleopt.detection")

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {"img_size": 64} if name.startswith("vit") else {}
    model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs).to(dtype)
    # randomise what a fresh model leaves at zero or one (CONVENTIONS.md section 3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.normal_(1, 0.2)
                module.bias.normal_(0, 0.1)
        for name_, p in model.named_parameters():
            if name_.endswith("bias") and p.abs().max() == 0:
                p.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", ["resnet18", "vit_tiny_patch16_224"])
def test_auto_sites_teleport_preserves_outputs_and_raises_the_gradient_norm(name, dtype):
    model = _model(name, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, 64, generator=gen).to(dtype)
    y = torch.randint(0, 10, (4,), generator=gen)
    heldout = torch.randn(8, 3, 64, 64, generator=gen).to(dtype)
    # a fresh model's gradient is large for any learning rate: the stability cap (tested in
    # test_teleport_fast_path.py) would decline; this test forces a teleport
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model,
        "auto",
        example_inputs=x[:2],
        safety=SafetyConfig(max_predicted_decrease=None),
        search=SearchConfig(steps=5),
        schedule=Schedule(),
    )
    assert opt.sites and all(s.action.exactness == "exact" and s.action.continuous for s in opt.sites)
    kinds = {s.action.name for s in opt.sites}
    assert kinds >= ({"positive_rescaling"} if name == "resnet18" else {"positive_rescaling", "attention_qk_gl", "attention_vo_gl"})

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def outputs():
        """Held-out outputs in eval and in train mode (on a copy: train mode moves BatchNorm statistics)."""
        with torch.no_grad():
            train = copy.deepcopy(model).train()(heldout)
            model.eval()
            evaluated = model(heldout)
            model.train()
        return evaluated, train

    closure()  # the gradient at w; BatchNorm statistics move once, as in any training step
    eval_before, train_before = outputs()
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    report = opt.teleport()  # fast path from .grad: no pass of the model at all
    assert report.accepted and report.path == "fast", report.reason
    assert report.gain > 1
    assert max(report.coordinate_norms.values()) > 0.1  # the teleport really moved
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    eval_after, train_after = outputs()
    assert_close(eval_after, eval_before, RTOL[dtype], f"{name} eval outputs on held-out inputs")
    assert_close(train_after, train_before, RTOL[dtype], f"{name} train-mode outputs on held-out inputs")
