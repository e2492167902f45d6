"""The round-off control arm of the realistic suite (``baseline_roundoff``): an exact no-op in float32.

It multiplies every parameter by 1.5 and divides it by 1.5 once, before the base update of the step where the
default ``Teleport`` first teleports; every element ends where it was or on a float32 neighbour.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.realistic import arms
from benchmarks.realistic.arms import ARMS, ArmContext, RoundOffOnce, first_default_teleport, roundoff_noop


def _context(seed: int = 0) -> ArmContext:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 6, generator=gen), torch.randint(3, (64,), generator=gen)
    return ArmContext(model, "adamw", 1e-2, 0.0, 0.1, 5, x[:8], F.cross_entropy, lambda: (x, y))


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many float32 steps separate a and b (same sign and nonzero here)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_roundoff_noop_moves_some_elements_by_one_ulp_and_none_further():
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(300, 40, generator=gen) * 0.05, torch.randn(500, generator=gen) + 3.0]
    before = [p.clone() for p in params]
    changed, largest = roundoff_noop(params)
    steps = torch.cat([_ulps_apart(p, b).flatten() for p, b in zip(params, before)])
    assert int(steps.max()) == 1  # at least one element moved, none by more than one ulp
    assert changed == int((steps > 0).sum()) > 0
    assert 0 < largest <= 2.0**-23  # one ulp is at most 2^-23 of the element


def test_roundoff_noop_rejects_a_bad_exponent():
    with pytest.raises(ValueError, match="exponent"):
        roundoff_noop([torch.ones(3)], exponent=0)


def test_control_arm_perturbs_once_at_the_default_teleports_first_step(monkeypatch):
    calls: list[int] = []

    def counted(params, exponent=1):
        calls.append(len(params))
        return roundoff_noop(params, exponent)

    monkeypatch.setattr(arms, "roundoff_noop", counted)
    c = _context()
    first = first_default_teleport(c)
    schedule = ARMS["teleport_default"](_context()).schedule  # type: ignore[attr-defined]
    assert first == next(t for t in range(10_000) if schedule.due(t, 0)) and first > 0
    twin = _context()
    opt, ref = ARMS["baseline_roundoff"](c), ARMS["baseline"](twin)
    assert isinstance(opt, RoundOffOnce) and opt.at == first
    assert not any(h for m in c.model.modules() for h in m._forward_pre_hooks.values())  # the default's twin is not c's
    x, y = c.batch_fn()
    for step in range(first + 2):
        for o, model in ((opt, c.model), (ref, twin.model)):
            o.zero_grad()
            F.cross_entropy(model(x), y).backward()
        opt.step()
        ref.step()
        same = all(torch.equal(p, q) for p, q in zip(c.model.parameters(), twin.model.parameters()))
        assert same == (step < first), step  # identical to the baseline until the perturbation, different from it on
        if step == first:
            assert opt.perturbation is not None and opt.perturbation[0] == first and opt.perturbation[1] > 0
        else:
            assert (opt.perturbation is None) == (step < first)
    assert calls == [len(list(c.model.parameters()))]  # once, on every parameter
    assert opt.perturbation is not None and 0 < opt.perturbation[2] <= 2.0**-23
