"""The checked lean balance path against the engine on what a review found it skipped: the whole batch's loss
(the predicted-decrease cap, the report and the watch), ``watch_restore="snapshot"``, one lean attempt per
scheduled teleport, no near-balance step under check, a declined teleport's plan and 0-d chain gradients."""

from __future__ import annotations

import pytest
import torch
from test_lean_checked import _mlp, _readme, _train_to_due
from test_lean_explicit import _trained, _twin
from torch import nn

import teleopt.teleport.companion as companion
from teleopt.teleport import SafetyConfig
from teleopt.teleport.companion import BalanceCompanion
from teleopt.teleport.lean_moves import Writes, _chain_squares
from teleopt.teleport.watch import InverseMove


def _hard_rows_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_mlp``'s 20 rows ordered by loss, highest first: the first 8 rows' loss is well above the batch's."""
    import test_lean_explicit

    model, _, x, y = _mlp(rows=20)
    with torch.no_grad():
        order = ((model(x) - y) ** 2).mean(1).argsort(descending=True)

    def ordered(rows: int = 16, tanh: bool = False):  # type: ignore[no-untyped-def]
        m, sites, xs, ys = _mlp(rows=rows, tanh=tanh)
        return m, sites, xs[order], ys[order]

    monkeypatch.setattr(test_lean_explicit, "_mlp", ordered)


def test_the_checked_lean_cap_and_report_read_the_whole_batch_loss(monkeypatch) -> None:
    # the cap binds on the whole batch's loss and not on the first 8 rows' (four times the loss there)
    _hard_rows_first(monkeypatch)
    model, opt, x, y = _trained(rows=20, safety=SafetyConfig(max_predicted_decrease=0.0316))
    twin, twin_opt = _twin(model, opt)
    engine = twin_opt.teleport(batch=(x, y))
    report = opt.teleport(batch=(x, y))
    assert engine.accepted and engine.shrink < 0.9, (engine.reason, engine.shrink)
    assert report.accepted and report.shrink == engine.shrink, (report.shrink, engine.shrink)
    with torch.no_grad():
        whole = float(nn.functional.mse_loss(twin(x), y))  # float64 model: the same forward, to round-off
    assert report.loss_before == pytest.approx(whole, rel=1e-12)
    assert report.loss_before == pytest.approx(engine.loss_before, rel=1e-12)


def test_an_uncapped_checked_lean_teleport_reports_and_watches_the_whole_batch_loss(monkeypatch) -> None:
    _hard_rows_first(monkeypatch)
    model, opt, x, y = _trained(rows=20)
    twin, twin_opt = _twin(model, opt)
    engine = twin_opt.teleport(batch=(x, y))
    with torch.no_grad():
        before = float(nn.functional.mse_loss(model(x), y))
    report = opt.teleport(batch=(x, y))
    assert report.accepted and "lean balance" in (report.check_detail or ""), report.check_detail
    # balance changes no output (ENorm): the float64 losses agree to round-off (1e-12 relative)
    assert report.loss_before == pytest.approx(before, rel=1e-12)
    assert report.loss_after == pytest.approx(engine.loss_after, rel=1e-12)
    watch, twin_watch = opt.record.watch, twin_opt.record.watch
    assert watch is not None and twin_watch is not None
    assert watch.loss_ref == pytest.approx(twin_watch.loss_ref, rel=1e-12) and watch.loss_ref == report.loss_before


def test_a_snapshot_watch_is_left_to_the_engine() -> None:
    model, opt, x, y = _trained(safety=SafetyConfig(watch_restore="snapshot"))
    twin, twin_opt = _twin(model, opt)
    report, engine = opt.teleport(batch=(x, y)), twin_opt.teleport(batch=(x, y))
    assert report.accepted and engine.accepted
    assert "lean balance" not in (report.check_detail or ""), report.check_detail
    watch = opt.record.watch
    assert watch is not None and not isinstance(watch.snapshot, InverseMove)
    assert type(watch.snapshot) is type(twin_opt.record.watch.snapshot)


def test_a_scheduled_teleport_the_engine_takes_tries_the_lean_path_once(monkeypatch) -> None:
    attempts: list[bool] = []
    lean = companion.lean_teleport

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(True)
        return lean(*args, **kwargs)

    monkeypatch.setattr(companion, "lean_teleport", counted)
    model, sites, x, y = _mlp(rows=16)
    calls = [0]
    opt = _readme(model, sites, x, y, calls, SafetyConfig(max_predicted_decrease=1e-12))  # the cap always binds
    for _ in range(12):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert len(opt.reports) == 3 and all(r.shrink < 1.0 for r in opt.reports if r.accepted)
    assert len(attempts) == 3 and calls[0] == 3  # one lean attempt and one batch per scheduled teleport


def test_a_checked_teleport_right_after_a_lean_one_solves_in_closed_form(monkeypatch) -> None:
    nears: list[bool] = []
    solve = companion.solve

    def spied(plan, rcond, near=False, edge=None):  # type: ignore[no-untyped-def]
        nears.append(near)
        return solve(plan, rcond, near, edge)

    model, opt, x, y = _trained(tanh=True)  # one site, no chain: the closed form per bucket (solve)
    opt.teleport(batch=(x, y))
    BalanceCompanion.of(opt).plan.lean_step = opt.record.step - 1  # as after a lean teleport at the step before
    monkeypatch.setattr(companion, "solve", spied)
    opt.teleport(batch=(x, y))
    assert nears == [False]


def test_a_declined_explicit_teleport_keeps_the_step_its_plan_was_checked_at(monkeypatch) -> None:
    model, opt, x, y = _trained()
    first = opt.teleport(batch=(x, y))
    plan = BalanceCompanion.of(opt).plan
    assert first.accepted and plan is not None and plan.checked_at == opt.record.step
    checked = plan.checked_at
    solve_chain = companion.solve_chain

    def still(plan, objective):  # type: ignore[no-untyped-def]  # every site within its floor: nothing moves
        coords, norms, before, _ = solve_chain(plan, objective)
        return [torch.zeros_like(c) for c in coords], [0.0] * len(norms), before, before

    monkeypatch.setattr(companion, "solve_chain", still)
    opt.record.step += 1  # a later step
    again = opt.teleport(batch=(x, y))
    assert not again.accepted and "no improvement" in again.reason, again.reason
    assert plan.checked_at == checked


def test_a_chain_gradient_without_dimensions_gets_its_squared_norm() -> None:
    writes = Writes(chain=[(torch.tensor(2.0, dtype=torch.float64), [torch.tensor(3.0, dtype=torch.float64)])])
    _chain_squares(writes)
    assert len(writes.grad_squares) == 1 and float(writes.grad_squares[0]) == 36.0


def test_the_lean_watch_keeps_each_element_in_its_sites_dtype_as_the_engine() -> None:
    # a float32 Llama: the gained residual rotation has no lean slot (the closed form leaves it at the identity);
    # the engine's watch_elements keeps every element in its site's first tensor's dtype (float32 here)
    pytest.importorskip("transformers")
    from test_balance_companion import TinyLlama, wrapped

    def float32_llama():  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        return TinyLlama(), "auto", torch.randint(0, 32, (3, 6), generator=gen), torch.randn(3, 6, 32, generator=gen)

    model, opt, step = wrapped(float32_llama, lean=True)
    for _ in range(3):
        step()
    plan = BalanceCompanion.of(opt).plan
    assert plan is not None
    params = dict(model.named_parameters())
    assert {s.site for s in plan.slots} != set(range(len(plan.sites)))  # some site has no lean slot
    assert plan.watch_dtypes == [params[s.tensor_names[0]].dtype for s in plan.sites] == [torch.float32] * len(plan.sites)


def test_after_new_storage_the_scheduled_teleports_engine_turn_takes_it_lean_with_a_check() -> None:
    # new storage (p.data = ...) drops the plan: the scheduled call finds none and makes no lean attempt, so the
    # engine's turn may plan again and take the teleport lean with its check (not the engine, then a second check)
    model, sites, x, y = _mlp()
    opt = _readme(model, sites, x, y, [0])
    for _ in range(5):  # the first scheduled teleport (step 3) verifies the plan
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for p in model.parameters():
        p.data = p.data.clone()
    _train_to_due(model, opt, x, y)
    before = len(opt.reports)
    attempts: list[bool] = []
    real = BalanceCompanion.teleport

    def spy(self, owner, request, draw=None):  # type: ignore[no-untyped-def]
        report = real(self, owner, request, draw)
        attempts.append(self.tried)
        return report

    BalanceCompanion.teleport = spy  # type: ignore[method-assign]
    try:
        opt.step()  # the due step
    finally:
        BalanceCompanion.teleport = real  # type: ignore[method-assign]
    report = opt.reports[-1]
    assert len(opt.reports) == before + 1
    assert attempts == [False, True], attempts  # no plan on the scheduled call; planned again on the engine's turn
    assert report.accepted and report.check == "batch" and "lean" in report.check_detail, (report.check, report.reason)
