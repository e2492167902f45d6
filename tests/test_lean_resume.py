"""A run resumed between two lean balance teleports continues bit for bit as the uninterrupted one.

The lean path (:mod:`teleopt.teleport.companion`) starts only after the engine checked a plan's first
teleport.  A resumed wrapper rebuilds its plan; it must remember that the plan was checked, or its next
teleport goes through the engine and the trajectory differs from the uninterrupted run's by round-off.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from teleopt import Teleport


def _build(seed: int = 0, linear: bool = False, **schedule: int) -> tuple[nn.Module, Teleport, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    if linear:  # a factorised linear map: one GL site, balanced on the near-balance step after the first
        model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Linear(4, 5, bias=False))
        with torch.no_grad():
            model[0].weight.mul_(4.0)  # far from balance at the start
    else:  # a chain of ReLU scalings
        model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(32, 6, generator=gen), torch.randn(32, 5 if linear else 3, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = Teleport(
            torch.optim.Adam(model.parameters(), lr=1e-3),
            model,
            "auto",
            example_inputs=x[:2],
            loss_fn=nn.functional.mse_loss,
            batch_fn=lambda: (x, y),
            **({"objective": "balance", **schedule} if schedule else {}),
        )
    return model, opt, x, y


def _train(model: nn.Module, opt: Teleport, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_resume_between_lean_teleports_is_bitwise_identical():
    model, opt, x, y = _build()
    _train(model, opt, x, y, 450)  # teleports at 200 (the engine, checked) and 400 (lean)
    assert [r.check != "none" for r in opt.reports if r.accepted][:2] == [True, False], [r.check for r in opt.reports]

    first, first_opt, x, y = _build()
    _train(first, first_opt, x, y, 300)
    checkpoint = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed, resumed_opt, x, y = _build()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, x, y, 150)
    assert resumed_opt.reports[-1].step == 400 and resumed_opt.reports[-1].check == "none"  # lean, as uninterrupted
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("linear", [False, True], ids=["relu-chain", "gl"])
def test_resume_inside_a_balance_every_step_run_is_bitwise_identical(linear):
    """Every step lean (GL: each after the first a near-balance step): the resumed run takes the same ones."""
    model, opt, x, y = _build(linear=linear, every=1)
    _train(model, opt, x, y, 40)
    assert sum(r.check == "none" for r in opt.reports) >= 35

    first, first_opt, x, y = _build(linear=linear, every=1)
    _train(first, first_opt, x, y, 25)
    checkpoint = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed, resumed_opt, x, y = _build(linear=linear, every=1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    _train(resumed, resumed_opt, x, y, 15)
    assert all(r.check == "none" for r in resumed_opt.reports)
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_damaged_lean_check_is_refused_by_name():
    model, opt, x, y = _build()
    _train(model, opt, x, y, 201)
    state = opt.state_dict()
    state["teleopt_teleport"]["lean_check"]["verified"] = "yes"
    fresh, fresh_opt, _, _ = _build()
    with pytest.raises(ValueError, match="lean_check"):
        fresh_opt.load_state_dict(state)
    # the watch opened at step 200 is saved; a damaged loss of its first strike is refused before anything loads
    state = opt.state_dict()
    assert "watch" in state["teleopt_teleport"]
    state["teleopt_teleport"]["watch"]["strike_loss"] = float("nan")
    before = fresh_opt.state_dict()
    with pytest.raises(ValueError, match="strike_loss"):
        fresh_opt.load_state_dict(state)
    assert fresh_opt.record.step == before["teleopt_teleport"]["step"]
