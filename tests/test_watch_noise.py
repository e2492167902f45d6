"""The watch after a teleport: robust to minibatch noise, still quick on a real blow-up.

Late in training one minibatch's squared gradient norm varies by large factors from
step to step; a teleport taken at a step whose gradient happened to be small must
not be rolled back when the next steps show ordinary sizes or one spike.  A blow-up
that persists, or one far beyond the factor, must still be rolled back within a few
steps.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from teleopt import find_symmetries
from teleopt.teleport import SafetyConfig, Teleport
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.watch import REFERENCE_STEPS, Watch, reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _watch(grad_ref: float = 1.0) -> Watch:
    return Watch(snapshot=None, until=10, teleport_step=0, grad_ref=grad_ref, loss_ref=None)  # type: ignore[arg-type]


def _grads(sq: float) -> list[torch.Tensor]:
    return [torch.tensor([math.sqrt(sq)], dtype=torch.float64)]


def test_one_spike_between_the_factor_and_its_square_does_not_alarm():
    watch = _watch()
    assert [watch.alarm(_grads(sq), None, 10.0, 3) for sq in (1.0, 50.0, 2.0, 60.0, 0.5)] == [None] * 5


def test_a_blow_up_that_persists_for_patience_steps_alarms_on_the_last():
    watch = _watch()
    results = [watch.alarm(_grads(sq), None, 10.0, 3) for sq in (20.0, 30.0, 40.0)]
    assert results[:2] == [None, None]
    assert results[2] is not None and "for 3 step(s)" in results[2]


def test_a_blow_up_beyond_the_square_of_the_factor_or_non_finite_alarms_at_once():
    assert "grew to 101.0x" in (_watch().alarm(_grads(101.0), None, 10.0, 3) or "")
    assert _watch().alarm(_grads(float("inf")), None, 10.0, 3) == "non-finite gradient"
    assert _watch().alarm([], float("nan"), 10.0, 3) is None  # no loss reference: the loss is not watched
    assert _watch(0.0).alarm([], float("nan"), 10.0, 3) is None


def test_the_reference_is_the_median_of_recent_steps_where_the_teleport_step_was_a_low_outlier():
    # the teleport step's gradient was 20x smaller than the typical step; the teleport doubled ||g||^2
    assert reference(0.05, 0.05 * math.sqrt(2), [1.0, 0.9, 1.1, 40.0, 0.8]) == pytest.approx(2.0 * 1.0)
    assert reference(2.0, 1.0, [1.0, 1.0]) == 4.0  # never below the teleport step's own norm
    assert reference(2.0, 1.0) == 4.0  # no samples (a teleport() call): the old reference


@pytest.mark.parametrize(
    "schedule",
    [Schedule(every=7), Schedule(every=5, warmup=12), Schedule(at=[0, 3, 9, 30]), Schedule(every=4, max_teleports=2)],
    ids=repr,
)
def test_soon_agrees_with_due_over_the_next_steps(schedule):
    for step, accepted in itertools.product(range(40), (0, 2)):
        expected = any(schedule.due(step + j, accepted) for j in range(1, REFERENCE_STEPS + 1))
        assert schedule.soon(step, accepted, REFERENCE_STEPS) == expected, (step, accepted)
    assert not Schedule(when=lambda t: True).soon(0, 0, 5)


def _run(multipliers: dict[int, float], steps: int = 24, **safety):
    """An MLP under SGD(lr 1e-3) with balance teleports at steps 10 and 20; the gradient of step t is scaled by
    ``multipliers.get(t, 1)`` (planted noise or blow-ups): returns the wrapper."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    with torch.no_grad():
        model[0].weight.mul_(3.0)  # unbalanced: the balance teleport moves
    sites = find_symmetries(model, x).continuous_sites
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-3), model, sites, objective="balance", safety=SafetyConfig(**safety), schedule=Schedule(every=10, warmup=10))  # fmt: skip
    for t in range(steps):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        for p in model.parameters():
            p.grad.mul_(multipliers.get(t, 1.0))
        opt.step()
    return opt


def test_a_healthy_run_with_a_small_gradient_at_the_teleport_and_a_spike_after_is_not_rolled_back():
    # step 10 (the teleport) is a 20x low outlier; step 13 a 5x spike (25x in ||g||^2)
    opt = _run({10: 0.05, 13: 5.0})
    assert [r.accepted for r in opt.reports] == [True, True]
    assert opt.record.rollbacks == 0


def test_a_planted_blow_up_that_persists_is_rolled_back_after_patience_steps():
    opt = _run({t: 5.0 for t in range(12, 20)})
    rollbacks = [r for r in opt.reports if r.path == "watch"]
    assert len(rollbacks) == 1 and rollbacks[0].step == 14  # steps 12, 13, 14 above 10x
    assert "for 3 step(s)" in rollbacks[0].reason


def test_a_planted_blow_up_beyond_the_square_of_the_factor_is_rolled_back_at_once():
    opt = _run({12: 1e3})
    rollbacks = [r for r in opt.reports if r.path == "watch"]
    assert len(rollbacks) == 1 and rollbacks[0].step == 12


def test_the_samples_and_the_strike_count_survive_a_state_dict_round_trip():
    opt = _run({}, steps=8)  # steps 5, 6, 7 sampled for the teleport at step 10
    state = opt.state_dict()
    assert [t for t, _ in opt.record.recent] == [5, 6, 7]
    opt.record.recent = []
    opt.load_state_dict(state)
    assert [t for t, _ in opt.record.recent] == [5, 6, 7]
    opt = _run({12: 5.0}, steps=13)  # teleport at 10; step 12 (25x in ||g||^2) is one strike
    assert opt.record.watch is not None and opt.record.watch.strikes == 1
    state = opt.state_dict()
    opt.record.watch.strikes = 0
    opt.load_state_dict(state)
    assert opt.record.watch.strikes == 1


def test_bad_watch_patience_is_rejected():
    with pytest.raises(ValueError, match="watch_patience"):
        SafetyConfig(watch_patience=0)
