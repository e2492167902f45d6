"""The checked balance teleport (the README configuration's first) does only what a closed form needs.

``"balance"`` reads no gradient, so the checked teleport on the engine reads ||grad|| for its report and
watch off ``.grad`` before and after, as the lean path does, and never builds the gradient norm's reduced
model (GL Gram matrices, per-entry squared gradients between two sites); under Adam the predicted-decrease
cap's bound does not read that model either.  Float64, so the norms agree to round-off.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import steps_then_backward
from torch import nn

from teleopt.teleport import Teleport, fast_path

F64 = torch.float64


def _setup(base: str) -> tuple[nn.Module, Teleport, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(F64)
    with torch.no_grad():  # unbalanced layers: the balanced point is a real move
        model[0].weight.mul_(4.0)
        model[2].weight.mul_(0.5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g, dtype=F64), torch.randn(32, 3, generator=g, dtype=F64)
    opt_cls = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3), "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)}[base]
    opt = Teleport(
        opt_cls(model.parameters()), model, "auto", example_inputs=x[:4], loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, y)
    )
    steps_then_backward(model, opt, x, y, 3)  # optimizer state exists, then the gradient the teleport reads
    return model, opt, x, y


def _grad_norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.to(F64).square().sum()) for p in model.parameters() if p.grad is not None))


def test_a_checked_balance_teleport_under_adam_never_builds_the_gradient_norm_model(monkeypatch):
    model, opt, x, y = _setup("adam")
    assert opt.objective.name == "balance"
    before = _grad_norm(model)

    def refuse(*args, **kwargs):
        raise AssertionError("the gradient norm's model was built for a balance teleport")

    monkeypatch.setattr(fast_path.GradientNormModel, "__init__", refuse)
    report = opt.teleport(batch=(x, y))
    assert report.accepted and report.check == "batch" and report.path == "fast", report.reason
    assert report.objective_after < report.objective_before  # it moved to a smaller weight norm
    # the report's norms are the gradients' own, before and after (transported in place by the apply)
    assert report.grad_norm_before == pytest.approx(before, rel=1e-12)
    assert report.grad_norm_after == pytest.approx(_grad_norm(model), rel=1e-12)
    assert report.grad_norm_after != pytest.approx(before, rel=1e-6)  # the move changed the gradient


def test_the_grad_norm_objective_still_reads_the_model_and_agrees_with_the_gradients():
    """The gradient-norm objective keeps its model (it searches on it); its predicted norm after the move
    is the transported gradients' norm, the same quantity the balance teleport measures directly."""
    model, opt, x, y = _setup("sgd")
    opt_grad = Teleport(opt.base, model, opt.sites, objective="grad_norm", loss_fn=nn.functional.mse_loss, every=10**9)
    before = _grad_norm(model)
    report = opt_grad.teleport(batch=(x, y))
    assert report.accepted, report.reason
    assert report.grad_norm_before == pytest.approx(before, rel=1e-10)
    assert report.grad_norm_after == pytest.approx(_grad_norm(model), rel=1e-10)


def test_the_decrease_caps_weights_are_freed_before_the_apply():
    """Peak extra memory of one checked balance teleport of a wide ReLU MLP under Adam, in multiples of the
    parameters' bytes: the transaction's copies of every member, its gradient and both moments (4x) at the
    apply, and nothing from the search.  The decrease cap's per-entry weights of the weights between two
    sites (float32, 0.78x the parameters here) used to stay alive through the apply: 4.83x then, 4.05x now."""
    from conftest import load_benchmark

    bench = load_benchmark("teleport_cost")
    model, _, (x, y) = bench.mlp_10m(4, widths=[64, 128, 128, 96, 10])
    y = y.argmax(1)
    base = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = nn.functional.cross_entropy
    opt = Teleport(base, model, "auto", example_inputs=(x[:2],), loss_fn=loss_fn, batch_fn=lambda: (x, y))
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if _ < 2:
            opt.step()
    counter = bench.LiveBytes()
    with counter:
        report = opt.teleport(batch=(x, y))
    assert report.accepted and report.shrink == 1.0, report.reason
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert counter.peak / param_bytes <= 4.3, counter.peak / param_bytes


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_simulated_decrease_transports_the_parameters_only_for_weight_decay(monkeypatch, weight_decay):
    """GL sites under Adam have no decrease bound: the cap simulates the next update at the balanced point.
    Adam's update reads the parameters only through weight decay, so without it their transport (most of
    the simulation's time on a ViT's attention sites) is skipped; with it they are transported."""
    from teleopt import Site, get_action

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 5)).to(F64)
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 6, generator=g, dtype=F64), torch.randn(16, 5, generator=g, dtype=F64)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=weight_decay)
    site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    opt = Teleport(base, model, [site], objective="balance", loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, y))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if _ < 2:
            opt.step()
    calls = {"decrease": 0, "params": 0}
    decrease, params = fast_path.FastEvaluator.first_order_decrease, fast_path.FastEvaluator.site_params

    def counted(name, fn):
        def run(self, *args):
            calls[name] += 1
            return fn(self, *args)

        return run

    monkeypatch.setattr(fast_path.FastEvaluator, "first_order_decrease", counted("decrease", decrease))
    monkeypatch.setattr(fast_path.FastEvaluator, "site_params", counted("params", params))
    report = opt.teleport(batch=(x, y))
    assert report.accepted, report.reason
    assert calls["decrease"] >= 1  # the cap ran on the simulated decrease
    assert (calls["params"] > 0) == (weight_decay > 0), calls
