"""A teleport is a pipeline of typed values: plan -> search -> apply -> verify, each phase returning a frozen value
or one ``Declined``, and the report written once, from the last value, by one function."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.functional import as_batch
from teleopt.teleport import Schedule, Teleport
from teleopt.teleport import phases as phase_values
from teleopt.teleport.report import TeleportReport

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def _wrapped(seed: int = 0) -> tuple[nn.Module, Teleport, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.1), nn.Linear(6, 3)).double()
    sites = [Site(LEAKY, ("0.weight", "0.bias", "2.weight"))]
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites,
        objective="grad_norm",
        loss_fn=nn.functional.mse_loss,
        schedule=Schedule(),
    )
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return model, opt, (x, y)


@pytest.fixture
def report_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fields written into a ``TeleportReport`` after it was constructed."""
    writes: list[str] = []
    made: set[int] = set()
    init, setattr_ = TeleportReport.__init__, TeleportReport.__setattr__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.add(id(self))

    def __setattr__(self, name, value):
        if id(self) in made:
            writes.append(name)
        setattr_(self, name, value)

    monkeypatch.setattr(TeleportReport, "__init__", __init__)
    monkeypatch.setattr(TeleportReport, "__setattr__", __setattr__)
    return writes


def test_an_accepted_teleport_writes_its_report_once_from_the_phase_values(report_writes: list[str]) -> None:
    _, opt, batch = _wrapped()
    report = opt.teleport(batch=batch)
    assert report.accepted and report.reason == "accepted" and report.check == "batch", report.reason
    assert report.loss_before is not None and report.loss_after is not None and report.grad_norm_after is not None
    assert len(report.elements) == 1 and report.time_s > 0
    assert report_writes == []


def test_a_rolled_back_teleport_is_one_declined_and_its_report_is_written_once(
    report_writes: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from teleopt.teleport import verify_phase

    _, opt, batch = _wrapped()
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    verdict = verify_phase.output_verdict

    def failing(*args, **kwargs):
        failures, measured = verdict(*args, **kwargs)
        return failures + [verify_phase.Failure("outputs changed (simulated)", 1.0, 0.0, torch.float64, True)], measured

    ends: list[object] = []
    run = verify_phase.verify

    def recorded(engine, applied):
        ends.append(run(engine, applied))
        return ends[-1]

    monkeypatch.setattr(verify_phase, "output_verdict", failing)
    monkeypatch.setattr("teleopt.teleport.engine.verify_phase.verify", recorded)
    report = opt.teleport(batch=batch)
    assert not report.accepted and report.reason.startswith("rolled back: ") and "simulated" in report.reason
    assert [type(e).__name__ for e in ends] == ["Declined"] and isinstance(ends[0].after, phase_values.Applied)
    assert all(torch.equal(p, q) for p, q in zip(opt.param_groups[0]["params"], before))
    assert report_writes == []


def test_a_teleport_without_sites_is_declined_by_the_plan_phase_as_a_value(report_writes: list[str]) -> None:
    _, opt, batch = _wrapped()
    engine = opt._engine
    request = phase_values.TeleportRequest(None, None, None, None)
    declined = engine.plan([], request)
    assert isinstance(declined, phase_values.Declined) and declined.reason == "declined: no active continuous sites"
    report, _ = engine.run([], request)
    assert not report.accepted and report.reason == declined.reason and report.check == "none"
    assert report_writes == []


def test_the_phase_values_are_frozen_and_each_holds_the_one_before() -> None:
    _, opt, batch = _wrapped()
    engine = opt._engine
    request = phase_values.TeleportRequest(None, None, as_batch(batch), None)
    planned = engine.plan(list(opt.sites or []), request)
    assert isinstance(planned, phase_values.Planned) and planned.evaluator is not None
    found = engine.search(planned)
    assert isinstance(found, phase_values.Found) and found.planned is planned
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.path = "general"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.elements = []  # type: ignore[misc]
