"""A quiet step (no teleport due, none soon, none watched) takes a short path that changes nothing.

``Schedule.quiet`` answers ``not due and not soon`` from a window of quiet steps it found last; it must give
the same answer as asking ``due`` and ``soon`` for every schedule, step order (a counter set back or ahead, as a
resumed run or a benchmark does), teleport count and change of the schedule's fields.  ``Teleport.step`` with
the short path trains bitwise as without it (teleports, watch, rollbacks and all), and a ``when`` callable is
still asked once per step, and not while teleports are disabled.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, Teleport

pytestmark = pytest.mark.usefixtures("one_thread")

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def test_quiet_is_not_due_and_not_soon_for_every_schedule_and_step_order():
    rng = random.Random(0)
    forms = [{}, {"every": 1}, {"every": 3}, {"every": 7}, {"at": [0, 4, 5, 13]}, {"when": lambda t: t % 4 == 1}]
    for form, warmup, most in itertools.product(forms, [0, 1, 6], [None, 1, 2]):
        schedule = Schedule(**form, warmup=warmup, max_teleports=most)
        for within in (0, 1, 5):
            for step in [*range(40), *(rng.randrange(40) for _ in range(40))]:
                accepted = rng.choice([0, 0, 0, 1, 2])
                want = not schedule.due(step, accepted) and not schedule.soon(step, accepted, within)
                got = schedule.quiet(step, accepted, within)
                assert got == want or (not got and ("at" in form or "when" in form)), (schedule, step, accepted, within)
                if "at" not in form and "when" not in form:
                    assert got == want


def test_a_changed_schedule_forgets_its_quiet_steps():
    schedule = Schedule(every=10)
    assert schedule.quiet(3, 0, 5)  # quiet up to step 5 (the next teleport at 10)
    schedule.every = 4  # now due at 4: soon at 3
    assert not schedule.quiet(3, 0, 5)
    schedule.every, schedule.warmup = 50, 20
    assert schedule.quiet(3, 0, 5) and not schedule.quiet(15, 0, 5)


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.LeakyReLU(0.1), nn.Linear(8, 6), nn.LeakyReLU(0.1), nn.Linear(6, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 5, generator=gen), torch.randn(16, 3, generator=gen)
    return x, y * 100 if step == 9 else y  # a blow-up inside the watch of the teleport at 7: rolled back


def _run(short_path: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[str], tuple[int, ...]]:
    """Train 30 steps (teleports every 7 from 7, a 4-step watch, Adam); the parameters, reports and counters."""
    model = _mlp()
    sites = [Site(LEAKY, ("0.weight", "0.bias", "2.weight")), Site(LEAKY, ("2.weight", "2.bias", "4.weight"))]
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        model,
        sites,
        schedule=Schedule(every=7, warmup=7),
        objective="grad_norm",
        safety=SafetyConfig(watch_steps=4),
    )
    with monkeypatch.context() as patch:
        if not short_path:
            patch.setattr(Schedule, "quiet", lambda self, step, accepted, within: False)
        for step in range(30):
            x, y = _batch(step)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    r = opt.record
    return (
        [p.detach().clone() for p in model.parameters()],
        [f"{x.step} {x.path} {x.reason}" for x in opt.reports],
        (
            r.step,
            r.accepted,
            r.rollbacks,
        ),
    )


@pytest.mark.filterwarnings("ignore:Teleport\\(objective='grad_norm'\\)")
def test_training_with_the_quiet_path_is_bitwise_training_without_it(monkeypatch):
    params, reports, counters = _run(True, monkeypatch)
    assert counters[1] >= 3 and counters[2] == 1, (counters, reports)  # teleports accepted, one rolled back
    other = _run(False, monkeypatch)
    assert (reports, counters) == other[1:]
    assert all(torch.equal(a, b) for a, b in zip(params, other[0]))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_when_schedule_is_asked_once_per_step_and_not_while_disabled(enabled):
    asked: list[int] = []
    model = _mlp()
    site = Site(LEAKY, ("0.weight", "0.bias", "2.weight"))
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9),
        model,
        [site],
        schedule=Schedule(when=lambda t: asked.append(t) or False),
    )
    opt.param_groups[0]["teleopt_teleport_enabled"] = enabled
    for step in range(6):
        x, y = _batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    assert asked == (list(range(6)) if enabled else [])
