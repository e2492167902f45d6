"""``Teleport(opt, model, "auto", example_inputs=...)`` with nothing else teleports on its own, exactly, and safely.

The default is the closed-form balance (least weight norm on the orbit) on its default
schedule; a schedule given without an objective keeps the papers' gradient-norm objective,
and that objective without a schedule is the manual case, which warns.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from teleopt.teleport import Balance, Schedule, Teleport

F64 = torch.float64


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).to(F64)
    with torch.no_grad():  # unbalanced layers: the orbit holds points of smaller weight norm
        model[0].weight.mul_(4.0)
        model[2].weight.mul_(0.5)
    return model


def _data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=F64)
    return x, torch.sin(x[:, :3]) + 0.1 * torch.randn(n, 3, generator=g, dtype=F64)


def _default(model: nn.Module, lr: float, x: torch.Tensor) -> Teleport:
    """Exactly the documented drop-in call, with nothing but the data arguments."""
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return Teleport(base, model, "auto", example_inputs=x[:8], loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, _data()[1]))


def _train(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_default_is_balance_on_its_default_schedule_and_says_so():
    model, (x, _) = _mlp(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never teleports" warning: the default teleports
        opt = _default(model, 0.01, x)
    default = Balance().default_schedule()
    assert opt.objective.name == "balance" and not opt.schedule.manual
    assert (opt.schedule.every, opt.schedule.warmup) == (default.every, default.warmup)
    assert "objective='balance'" in repr(opt) and f"every={default.every}" in repr(opt)
    assert not opt.schedule.due(0, 0)  # never before any training


def test_a_schedule_without_an_objective_keeps_grad_norm_and_grad_norm_alone_is_manual():
    model, (x, _) = _mlp(), _data()
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    assert Teleport(base, model, "auto", example_inputs=x[:8], every=10).objective.name == "grad_norm"
    manual = Teleport(base, model, "auto", example_inputs=x[:8], schedule=Schedule())
    assert manual.objective.name == "grad_norm" and manual.schedule.manual
    with pytest.warns(UserWarning, match="no schedule"):
        chosen = Teleport(base, model, "auto", example_inputs=x[:8], objective="grad_norm")
    assert chosen.schedule.manual


def test_the_default_teleports_on_its_own_and_keeps_the_outputs_in_float64():
    """lr 0: only the teleports move the weights, so the outputs at the end are the outputs at the start."""
    model, (x, y) = _mlp(), _data()
    before = model(x).detach()
    weights = [p.detach().clone() for p in model.parameters()]
    opt = _default(model, 0.0, x)
    steps = 2 * Balance().default_schedule().every + 1
    _train(opt, model, x, y, steps)
    accepted = [r for r in opt.reports if r.accepted]
    assert len(accepted) >= 2 and all(r.objective == "balance" for r in accepted)
    assert all(r.objective_after < r.objective_before for r in accepted)  # the weight norm went down
    assert any(not torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    # float64 rescalings by c and 1/c: the outputs agree to rounding, relative to their scale
    assert (model(x).detach() - before).abs().max() <= 1e-12 * before.abs().max()


def test_the_default_does_not_diverge_and_ends_no_worse_than_the_bare_optimizer():
    model, (x, y) = _mlp(), _data()
    twin = copy.deepcopy(model)
    steps = 3 * Balance().default_schedule().every
    with_default = _train(_default(model, 0.02, x), model, x, y, steps)
    bare = _train(torch.optim.SGD(twin.parameters(), lr=0.02, momentum=0.9), twin, x, y, steps)
    assert all(torch.isfinite(torch.tensor(with_default)))
    assert with_default[-1] <= 1.05 * bare[-1]
