"""An explicit ``teleport(batch=...)`` of a balance plan runs lean, with the output check around the move.

``Teleport.teleport`` with a batch (or with ``batch_fn`` and no argument) is a checked teleport: the lean path
(``teleopt.teleport.companion``) takes it as it takes a plan's first scheduled teleport (``teleopt.teleport.lean_check``:
the outputs and loss on the batch's first rows before and after, the predicted-decrease cap at the lean point), and
hands it to the engine where a cap binds or the model rejects the check's rows.  Compared in float64 with a twin
whose companion is off (the engine: the same closed form, the same check); the moved tensors agree to 1e-12
relative (a few float64 ulps of the same products taken in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import steps_then_backward
from test_lean_checked import _close, _engine_runs, _everything, _mlp, _readme, _same_tensors
from torch import Tensor, nn

from teleopt.teleport import SafetyConfig, Teleport
from teleopt.teleport.companion import BalanceCompanion

pytestmark = pytest.mark.usefixtures("one_thread")


def _trained(tanh: bool = False, safety: SafetyConfig | None = None, rows: int = 16) -> tuple[nn.Module, Teleport, Tensor, Tensor]:
    """Two training steps (before the schedule's first teleport), then a backward: the explicit teleport's point."""
    model, sites, x, y = _mlp(rows=rows, tanh=tanh)
    opt = _readme(model, sites, x, y, [0], safety)
    steps_then_backward(model, opt, x, y, 2)
    return model, opt, x, y


def _twin(model: nn.Module, opt: Teleport) -> tuple[nn.Module, Teleport]:
    twin, twin_opt = copy.deepcopy((model, opt))
    BalanceCompanion.of(twin_opt).enabled = False
    return twin, twin_opt


@pytest.mark.parametrize("argument", [True, False], ids=["batch-argument", "batch-fn"])
def test_an_explicit_checked_balance_teleport_runs_lean_and_lands_at_the_engines_elements(argument, monkeypatch) -> None:
    model, opt, x, y = _trained(rows=20)
    twin, twin_opt = _twin(model, opt)
    engine = twin_opt.teleport(batch=(x, y)) if argument else twin_opt.teleport()
    runs = _engine_runs(monkeypatch)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    report = opt.teleport(batch=(x, y)) if argument else opt.teleport()
    assert runs[0] == 0 and seen == [20, 20]  # no engine; the check's two forwards on the whole batch, as the engine's
    assert report.accepted and engine.accepted, (report.reason, engine.reason)
    assert report.check == engine.check == "batch" and "lean balance, checked" in (report.check_detail or "")
    assert report.check_error is not None and report.check_error <= report.check_tol == 1e-10
    assert report.loss_before is not None and report.loss_after == pytest.approx(report.loss_before, rel=1e-12)
    assert max(report.coordinate_norms.values()) > 1e-3  # it moved the weights
    assert report.elements.keys() == engine.elements.keys()
    for name, g in engine.elements.items():
        assert _close(report.elements[name], g) <= 1e-12, name
    _same_tensors(model, opt, twin, twin_opt)
    assert opt.record.accepted == twin_opt.record.accepted == 1 and opt.record.watch is not None
    assert BalanceCompanion.of(opt).plan is not None and BalanceCompanion.of(opt).plan.verified


def test_an_explicit_teleport_is_checked_even_when_its_plan_was_verified(monkeypatch) -> None:
    model, opt, x, y = _trained()
    opt.teleport(batch=(x, y))  # verifies the plan
    assert BalanceCompanion.of(opt).plan.verified
    for _ in range(2):  # away from balance again
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    runs = _engine_runs(monkeypatch)
    report = opt.teleport(batch=(x, y))
    assert runs[0] == 0 and report.check == "batch" and "lean balance, checked" in (report.check_detail or ""), report.check_detail


def test_an_explicit_lean_teleport_that_fails_the_check_is_undone_as_the_engine_rolls_it_back(monkeypatch) -> None:
    model, opt, x, y = _trained(tanh=True)
    twin, twin_opt = _twin(model, opt)
    engine = twin_opt.teleport(batch=(x, y))
    kept, accepted = _everything(model, opt), opt.record.accepted
    runs = _engine_runs(monkeypatch)
    report = opt.teleport(batch=(x, y))
    assert runs[0] == 0 and "lean balance, checked" in (report.check_detail or "")
    assert not report.accepted and report.reason.startswith("rolled back: ") and "outputs changed by" in report.reason
    assert not engine.accepted and engine.reason.startswith("rolled back: ") and "outputs changed by" in engine.reason
    # moved back by the inverse elements: a product by c and one by 1/c in float64, 2 ulp
    for a, b in zip(_everything(model, opt), kept):
        assert _close(a, b) <= 4e-16
    assert (opt.record.accepted, opt.record.watch) == (accepted, None)
    assert not BalanceCompanion.of(opt).plan.verified


def test_an_explicit_teleport_whose_decrease_cap_binds_goes_to_the_engine(monkeypatch) -> None:
    # the lean path has no bisection: the engine shrinks the move, and the result is the twin's
    model, opt, x, y = _trained(safety=SafetyConfig(max_predicted_decrease=1e-12))
    twin, twin_opt = _twin(model, opt)
    engine = twin_opt.teleport(batch=(x, y))
    runs = _engine_runs(monkeypatch)
    report = opt.teleport(batch=(x, y))
    assert runs[0] == 1 and "lean balance" not in (report.check_detail or "")
    assert (report.accepted, report.reason, report.check, report.shrink) == (engine.accepted, engine.reason, engine.check, engine.shrink)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert _close(p.detach(), q.detach()) <= 1e-12


def test_an_explicit_teleport_whose_check_forward_raises_goes_to_the_engine(monkeypatch) -> None:
    model, opt, x, y = _trained(rows=16)
    forwards = [0]

    def first_fails(m: nn.Module, args: tuple[Tensor, ...]) -> None:  # the lean check's forward, before any write
        forwards[0] += 1
        if forwards[0] == 1:
            raise ValueError("batch")

    model.register_forward_pre_hook(first_fails)
    runs = _engine_runs(monkeypatch)
    report = opt.teleport(batch=(x, y))
    assert runs[0] == 1 and report.accepted and report.check == "batch", (runs, report.reason, report.check)
    assert "lean balance" not in (report.check_detail or "")


def test_a_teleport_with_a_closure_still_runs_on_the_engine(monkeypatch) -> None:
    model, opt, x, y = _trained()

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    runs = _engine_runs(monkeypatch)
    report = opt.teleport(closure)
    assert runs[0] == 1 and "lean balance" not in (report.check_detail or "")
    assert torch.isfinite(torch.tensor(report.loss_before or 0.0))
