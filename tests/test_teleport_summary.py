"""``Teleport.summary()`` counts each teleport once, by what it came to, and a run that keeps not keeping
its teleports says so in a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from teleopt import find_symmetries
from teleopt.teleport import SafetyConfig, Schedule, Teleport
from teleopt.teleport.report import Tally, TeleportReport

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(lr=1e-3, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=lr), model, find_symmetries(model, x).continuous_sites, **kwargs)
    return model, x, y, opt


def _backward(model, x, y, scale=1.0):
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    for p in model.parameters():
        p.grad.mul_(scale)


def test_summary_counts_a_teleport_rolled_back_by_the_watch_once():
    model, x, y, opt = _setup(0.0, objective="balance", schedule=Schedule(every=5, warmup=5))  # lr 0: the weights move by teleports only
    for t in range(14):
        _backward(model, x, y, 1e3 if t == 6 else 1.0)  # the teleport at step 5 blows up at step 6
        opt.step()
    paths = [(r.path, r.accepted) for r in opt.reports]
    assert paths == [("fast", True), ("watch", False), ("fast", True)]  # 3 reports, 2 teleports
    assert opt.summary() == "2 teleports: 2 accepted, 1 kept, 1 rolled back, 0 undone by the check, 0 declined"


def test_a_run_that_keeps_declining_warns_once_when_the_streak_reaches_three():
    model, x, y, opt = _setup(objective="balance")
    _backward(model, x, y)
    assert opt.teleport().accepted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            opt.teleport()  # already balanced: "declined: no improvement found"
    mine = [w for w in caught if "were not kept" in str(w.message)]
    assert len(mine) == 1 and "the last 3 teleports were not kept" in str(mine[0].message)
    assert mine[0].filename == __file__  # it points at the user's line, not into teleopt or torch
    assert "6 teleports: 1 accepted, 1 kept, 0 rolled back, 0 undone by the check, 5 declined" in opt.summary()


def test_an_accepted_teleport_rolled_back_by_the_watch_counts_as_not_kept():
    tally = Tally()
    for _ in range(3):
        tally.count(TeleportReport(step=0, path="fast", objective="x", accepted=True, reason="accepted"))
        if _ == 2:
            with pytest.warns(UserWarning, match="the last 3 teleports were not kept"):
                tally.count(TeleportReport(step=1, path="watch", objective="x", reason="rolled back after 1 step(s)"))
        else:
            tally.count(TeleportReport(step=1, path="watch", objective="x", reason="rolled back after 1 step(s)"))
    assert tally.summary() == "3 teleports: 3 accepted, 0 kept, 3 rolled back, 0 undone by the check, 0 declined"
    tally.count(TeleportReport(step=2, path="fast", objective="x", accepted=True, reason="accepted"))
    tally.count(TeleportReport(step=3, path="fast", objective="x", reason="declined: no improvement found"))
    assert tally.streak == 1  # the accepted teleport before it was kept


def test_the_tally_survives_a_state_dict_round_trip():
    model, x, y, opt = _setup(objective="balance", safety=SafetyConfig(watch_steps=0))
    _backward(model, x, y)
    opt.teleport()
    opt.teleport()
    state = opt.state_dict()
    _, _, _, fresh = _setup(objective="balance", safety=SafetyConfig(watch_steps=0))
    fresh.load_state_dict(state)
    assert fresh.summary() == opt.summary() == "2 teleports: 1 accepted, 1 kept, 0 rolled back, 0 undone by the check, 1 declined"
