"""Teleports closer together than the watch window: a later teleport joins the open watch, it does not reset it.

A slow blow-up (the squared gradient norm 50x its reference: above the watch factor 10, below its square)
that persists over a second teleport must be rolled back after ``watch_patience`` steps, the strikes counted
across the teleport, and the rollback undoes both teleports, the last first.  The joined watch travels in
``state_dict`` (a resume is bitwise) and is validated before anything loads.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_resume import PATHS, differences
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.watch import Watch

pytestmark = pytest.mark.usefixtures("one_thread")

RELU = get_action("positive_rescaling", activation="relu")
#: on the blow-up steps ||g||^2 is this multiple of the first teleport's reference: one strike each (above the
#: watch factor 10, below its square), also against that reference times the second teleport's gain (below 2)
BLOW_UP = 50.0


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).double()


def _wrapper(model: nn.Module, **safety) -> Teleport:
    sites = [Site(RELU, ("0.weight", "0.bias", "2.weight")), Site(RELU, ("2.weight", "2.bias", "4.weight"))]
    return Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model,
        sites,
        schedule=Schedule(when=lambda step: step in (2, 4)),
        search=SearchConfig(steps=5, trust_region=0.1),
        safety=SafetyConfig(**safety),
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 4, generator=gen, dtype=torch.float64), torch.randn(16, 2, generator=gen, dtype=torch.float64)


def _step(model: nn.Module, opt: Teleport, step: int, reference: list[float]) -> None:
    """One training step; on steps 3 to 6 ||g||^2 is ``BLOW_UP`` times the first teleport's reference (taken
    into ``reference`` after step 2: a slow blow-up)."""
    x, y = _data(step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if 3 <= step <= 6:
        grads = [p.grad for p in model.parameters()]
        scale = math.sqrt(BLOW_UP * reference[0] / float(sum(g.square().sum() for g in grads)))
        torch._foreach_mul_(grads, scale)
    opt.step()
    if step == 2:
        assert opt.record.watch is not None
        reference[:] = [opt.record.watch.grad_ref]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("restore", ["inverse", "snapshot"])
def test_a_blow_up_across_a_second_teleport_is_rolled_back_with_both_teleports(restore: str) -> None:
    model = _mlp()
    opt, reference = _wrapper(model, watch_restore=restore), [0.0]
    for step in range(2):
        _step(model, opt, step, reference)
    before_first = _params(model)
    for step in range(2, 6):
        _step(model, opt, step, reference)
    accepted = [r.step for r in opt.reports if r.accepted]
    assert accepted == [2, 4], [(r.step, r.reason) for r in opt.reports]
    rollbacks = [r for r in opt.reports if r.path == "watch"]
    # strikes on steps 3, 4 and 5 (the teleport at step 4 joins the watch and keeps them): rolled back at step 5
    assert [r.step for r in rollbacks] == [5], [(r.step, r.reason) for r in opt.reports]
    reason = rollbacks[0].reason
    assert "for 3 step(s)" in reason and reason.index("teleport at step 4") < reason.index("teleport at step 2"), reason
    assert opt.record.watch is None and opt.record.rollbacks == 1
    if restore == "snapshot":  # back to before the first teleport, the steps since discarded (step 5's update skipped)
        assert all(torch.equal(a, b) for a, b in zip(before_first, _params(model)))


def test_the_joined_watch_keeps_the_smallest_reference_and_the_strikes() -> None:
    first = Watch(snapshot=None, until=12, teleport_step=2, grad_ref=1.0, loss_ref=2.0, strikes=2)  # type: ignore[arg-type]
    second = Watch(snapshot=None, until=14, teleport_step=4, grad_ref=30.0, loss_ref=3.0)  # type: ignore[arg-type]
    joined = second.stack(first, gain=4.0)
    assert joined.strikes == 2 and [w.teleport_step for w in joined.chain] == [2, 4]
    assert joined.earlier[0].grad_ref == 4.0 and first.grad_ref == 1.0  # scaled by the new gain; the open watch unchanged
    for no_gain in (0.5, float("nan"), float("inf")):  # a teleport that shrank the gradient, or no gain known
        assert second.stack(first, gain=no_gain).earlier[0].grad_ref == 1.0
    # 30x the squared reference (4.0: the first teleport's, scaled by the second's gain) is the third strike
    grads = [torch.tensor([math.sqrt(120.0)], dtype=torch.float64)]
    assert "for 3 step(s)" in (joined.alarm(grads, 2.5, 10.0, 3) or "")
    # a teleport leaves the watch when its own window ends; the watch ends with the last one
    settled, passed = joined.settle(13)
    assert passed == 1 and settled is not None and settled.chain == [settled] and settled.teleport_step == 4
    assert joined.settle(15) == (None, 2)


def test_a_watch_never_holds_more_teleports_than_its_window() -> None:
    model = _mlp()
    opt = _wrapper(model, watch_steps=5, watch_factor=1e6)
    opt._schedule = Schedule(every=2)  # teleports at steps 0, 2, 4, ...
    longest = 0
    for step in range(16):
        x, y = _data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        longest = max(longest, len(opt.record.watch.chain) if opt.record.watch is not None else 0)
    assert opt.record.accepted >= 6 and longest == 3  # teleports at t-4, t-2 and t: the window is 5 steps


def _save(opt: Teleport) -> dict:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


RESUMES = [("inverse", path) for path in PATHS] + [("snapshot", "torch_save")]  # torch's DCP drops a snapshot (docs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize(("restore", "path"), RESUMES, ids=[f"{r}-{p}" for r, p in RESUMES])
def test_a_run_resumed_inside_a_joined_watch_continues_bitwise(tmp_path, restore: str, path: str) -> None:
    save, load = PATHS[path]
    model = _mlp()
    opt, reference = _wrapper(model, watch_restore=restore), [0.0]
    for step in range(5):
        _step(model, opt, step, reference)
    watch = opt.record.watch
    assert watch is not None and len(watch.chain) == 2 and watch.strikes == 2
    save(model, opt, str(tmp_path / "saved"))
    for step in range(5, 8):
        _step(model, opt, step, reference)
    fresh = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(-1.0)  # not the saved weights: the checkpoint must bring them
    resumed = _wrapper(fresh, watch_restore=restore)
    load(fresh, resumed, str(tmp_path / "saved"))
    joined = resumed.record.watch
    assert joined is not None and [w.teleport_step for w in joined.chain] == [2, 4] and joined.strikes == 2
    for step in range(5, 8):
        _step(fresh, resumed, step, reference)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(fresh)))
    assert not differences(model, opt, fresh, resumed)
    assert [r.reason for r in opt.reports[-1:]] == [r.reason for r in resumed.reports]
    assert opt.record.rollbacks == resumed.record.rollbacks == 1


def test_a_damaged_earlier_teleport_of_the_watch_is_refused_before_anything_loads() -> None:
    model = _mlp()
    opt, reference = _wrapper(model), [0.0]
    for step in range(5):
        _step(model, opt, step, reference)
    saved = _save(opt)
    fresh = _mlp()
    resumed = _wrapper(fresh)
    before = resumed.state_dict()
    top = saved["teleopt_teleport"] if "teleopt_teleport" in saved else None
    assert top is not None and "earlier" in top["watch"], sorted(saved)
    top["watch"]["earlier"][0]["inverse"]["elements"][0] = torch.zeros_like(top["watch"]["earlier"][0]["inverse"]["elements"][0])
    with pytest.raises(ValueError, match=r"\['watch'\]\['earlier'\]\[0\]\['inverse'\]\['elements'\]\[0\]"):
        resumed.load_state_dict(saved)
    assert resumed.state_dict()["state"] == before["state"] and resumed.record.watch is None
