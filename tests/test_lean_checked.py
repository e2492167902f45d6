"""The first balance teleport of a plan runs lean and is checked there, as the engine checks it.

The README configuration (``Teleport(base, model, sites, example_inputs=..., loss_fn=..., batch_fn=...)``)
balances on a schedule.  The lean path (``teleopt.teleport.companion``) moves the weights in closed form with no
pass through the model; the first teleport of each plan is verified by the output check (``teleopt.teleport.check``:
the model's outputs on the first rows of ``batch_fn``'s batch, before and after, under a forked RNG, against the
dtype's tolerance), and a teleport that fails it is undone by its inverse elements and reported rolled back.
Compared here, in float64, with a twin whose companion is off (the engine: same closed form, same check).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, Teleport
from teleopt.teleport.companion import BalanceCompanion
from teleopt.teleport.companion import lean_teleport as companion_lean
from teleopt.teleport.engine import TeleportEngine

pytestmark = pytest.mark.usefixtures("one_thread")

TANH_AS_RELU = get_action("positive_rescaling", activation="relu")  # bound to a tanh layer below: not a symmetry


def _mlp(rows: int = 16, tanh: bool = False) -> tuple[nn.Module, list[Site] | str, Tensor, Tensor]:
    """A float64 ReLU MLP (a chain of scaling sites, found by ``"auto"``), or with ``tanh`` a tanh layer whose
    hidden units carry a positive scaling (not a symmetry), its first layer's rows far from balance."""
    torch.manual_seed(0)
    act = nn.Tanh() if tanh else nn.ReLU()
    model = nn.Sequential(nn.Linear(6, 12), act, nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3)).double()
    with torch.no_grad():
        model[0].weight.mul_(torch.linspace(0.2, 3.0, 12, dtype=torch.float64).unsqueeze(1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=gen, dtype=torch.float64)
    sites: list[Site] | str = [Site(TANH_AS_RELU, ("0.weight", "0.bias", "2.weight"))] if tanh else "auto"
    return model, sites, x, y


def _readme(
    model: nn.Module, sites: list[Site] | str, x: Tensor, y: Tensor, calls: list[int], safety: SafetyConfig | None = None
) -> Teleport:
    def batch_fn() -> tuple[Tensor, Tensor]:
        calls[0] += 1
        return x, y

    base = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Teleport(
            base,
            model,
            sites,
            example_inputs=x[:2],
            loss_fn=nn.functional.mse_loss,
            batch_fn=batch_fn,
            objective="balance",
            schedule=Schedule(every=3, warmup=3),
            safety=safety or SafetyConfig(),
        )


def _train_to_due(model: nn.Module, opt: Teleport, x: Tensor, y: Tensor) -> None:
    """Steps up to (not including) the first due teleport; then the gradient its step reads."""
    while not opt._schedule.due(opt.record.step, opt.record.accepted):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()


def _engine_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs = [0]
    run = TeleportEngine.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        runs[0] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(TeleportEngine, "run", counted)
    return runs


def _train_both(pairs: tuple[tuple[nn.Module, Teleport], ...], x: Tensor, y: Tensor, steps: int) -> None:
    """``steps`` training steps of each (model, wrapper) pair: a lean wrapper and its engine twin."""
    for m, o in pairs:
        for _ in range(steps):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()


def _rows_seen(model: nn.Module) -> list[int]:
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    return seen


def _close(a: Tensor, b: Tensor) -> float:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) / scale


def _same_tensors(model: nn.Module, opt: Teleport, twin: nn.Module, twin_opt: Teleport) -> None:
    """Parameters, gradients and tensor moments of ``model`` equal ``twin``'s to 1e-12 (relative)."""
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert _close(p.detach(), q.detach()) <= 1e-12, name
        assert p.grad is not None and q.grad is not None and _close(p.grad, q.grad) <= 1e-12, name
        for key, value in opt.state[p].items():
            if isinstance(value, Tensor) and value.ndim:
                assert _close(value, twin_opt.state[q][key]) <= 1e-12, (name, key)


def _everything(model: nn.Module, opt: Teleport) -> list[Tensor]:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for p in params for v in opt.state[p].values() if isinstance(v, Tensor) and v.ndim]
    return [t.detach().clone() for t in [*params, *grads, *moments]]


def test_the_first_scheduled_balance_teleport_runs_lean_and_is_checked_on_batch_fns_batch(monkeypatch) -> None:
    model, sites, x, y = _mlp(rows=20)
    calls = [0]
    opt = _readme(model, sites, x, y, calls)
    _train_to_due(model, opt, x, y)
    twin, twin_opt = copy.deepcopy((model, opt))
    BalanceCompanion.of(twin_opt).enabled = False  # the engine: the same closed form and the same check
    twin_opt.step()
    runs, seen = _engine_runs(monkeypatch), _rows_seen(model)
    before = calls[0]
    opt.step()
    report, engine = opt.reports[-1], twin_opt.reports[-1]
    assert runs[0] == 0 and calls[0] == before + 1  # no engine; one batch_fn() call, for the check
    assert seen == [len(x), len(x)]  # two forwards (before, after), on the whole batch as the engine's
    assert report.accepted and report.check == "batch" and "lean" in report.check_detail, (report.reason, report.check_detail)
    assert engine.accepted and engine.check == "batch"
    assert report.check_error is not None and report.check_error <= report.check_tol == 1e-10
    assert report.loss_before is not None and report.loss_after == pytest.approx(report.loss_before, rel=1e-12)
    assert max(report.coordinate_norms.values()) > 1e-3  # it moved the weights
    assert report.coordinate_norms == pytest.approx(engine.coordinate_norms, rel=1e-9)
    _same_tensors(model, opt, twin, twin_opt)
    assert opt.record.accepted == twin_opt.record.accepted and opt.record.watch is not None
    assert opt.record.lean_check is not None and opt.record.lean_check[2:4] == (opt.record.step - 1, True)
    # the plan is verified: the next scheduled teleport runs lean without a check or a batch_fn call
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.reports[-1].check == "none" and opt.reports[-1].accepted and runs[0] == 0 and calls[0] == before + 1


def test_a_first_lean_teleport_that_fails_the_check_is_undone_and_reported_rolled_back(monkeypatch) -> None:
    model, sites, x, y = _mlp(tanh=True)
    calls = [0]
    opt = _readme(model, sites, x, y, calls)
    _train_to_due(model, opt, x, y)
    twin, twin_opt = copy.deepcopy((model, opt))
    BalanceCompanion.of(twin_opt).enabled = False
    twin_opt.step()
    kept, record = _everything(model, opt), copy.deepcopy(opt.record)
    runs = _engine_runs(monkeypatch)
    BalanceCompanion.of(opt).teleport(opt, _scheduled_request(opt), _drawer(x, y))
    report, engine = opt.reports[-1], twin_opt.reports[-1]
    assert runs[0] == 0
    assert not report.accepted and report.reason.startswith("rolled back: ") and "outputs changed by" in report.reason, report.reason
    assert not engine.accepted and engine.reason.startswith("rolled back: ") and "outputs changed by" in engine.reason
    assert report.check == "batch" and report.check_error is not None and report.check_error > 1e-3
    # everything as it was: the parameters, gradients and moments moved back by the inverse elements (float64
    # round-off of a product by c and one by 1/c: 2 ulp), the counters, the watch and the lean check untouched
    for a, b in zip(_everything(model, opt), kept):
        assert _close(a, b) <= 4e-16
    assert (opt.record.accepted, opt.record.watch, opt.record.lean_check[3]) == (record.accepted, None, False)
    assert BalanceCompanion.of(opt).plan is not None and not BalanceCompanion.of(opt).plan.verified


def _scheduled_request(opt: Teleport):  # type: ignore[no-untyped-def]
    from teleopt.teleport.engine import TeleportRequest

    return TeleportRequest(None, None, None, None, seed=opt._check_seed())


def _drawer(x: Tensor, y: Tensor):  # type: ignore[no-untyped-def]
    from teleopt.functional import as_batch

    return lambda: as_batch((x, y))


def test_a_plan_whose_first_lean_teleport_fails_the_check_never_runs_unchecked() -> None:
    model, sites, x, y = _mlp(tanh=True)
    opt = _readme(model, sites, x, y, [0])
    for _ in range(16):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert len(opt.reports) >= 4 and all(r.check == "batch" and not r.accepted for r in opt.reports), [r.reason for r in opt.reports]


def test_an_interrupt_in_the_checks_second_forward_leaves_everything_as_it_was() -> None:
    model, sites, x, y = _mlp()
    opt = _readme(model, sites, x, y, [0])
    _train_to_due(model, opt, x, y)
    kept, record = _everything(model, opt), copy.deepcopy(opt.record)
    forwards = [0]

    def interrupt(module: nn.Module, args: object) -> None:
        forwards[0] += 1
        if forwards[0] == 2:  # the check's forward after the move
            raise KeyboardInterrupt

    handle = model.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    handle.remove()
    assert forwards[0] == 2
    for a, b in zip(_everything(model, opt), kept):
        assert _close(a, b) <= 4e-16
    assert (opt.record.accepted, opt.record.watch, opt.record.lean_check) == (record.accepted, record.watch, record.lean_check)
    assert opt.reports == [] or not opt.reports[-1].accepted


def test_an_inconclusive_float32_lean_check_is_decided_by_the_float64_re_run(monkeypatch) -> None:
    # a tolerance float32 cannot meet (loss_tol 1e-8): the check's error lies within 100x of it, so a float64
    # copy of the model at the pre-teleport weights (computed back by the inverse elements) decides, as the engine's
    model, sites, x, y = _mlp(rows=8)
    model.float()
    x, y = x.float(), y.float()
    base = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = Teleport(
            base, model, sites, example_inputs=x[:2], loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, y),
            objective="balance", schedule=Schedule(every=3, warmup=3), safety=SafetyConfig(loss_tol=1e-8),
        )  # fmt: skip
    _train_to_due(model, opt, x, y)
    runs = _engine_runs(monkeypatch)
    opt.step()
    report = opt.reports[-1]
    assert runs[0] == 0 and report.check == "batch" and "lean balance, checked" in report.check_detail
    assert report.accepted and "float64 copy" in report.check_detail, (report.reason, report.check_detail)
    assert 1e-8 < report.check_error <= 1e-6 and report.check_error_float64 <= 1e-10


def test_a_first_teleport_on_the_trust_regions_edge_runs_lean_with_the_checks_two_forwards(monkeypatch) -> None:
    # GL balanced points on the trust region's edge (a small radius): the lean path bounds them for round-off as
    # the engine does and checks the move; the check's forward before it runs once the move is decided, so the
    # teleport costs the check's two forwards and no engine run
    from test_balance_companion import lora_like, wrapped

    import teleopt.teleport.companion as companion
    from teleopt.teleport import SearchConfig

    model, opt, step = wrapped(lora_like, lean=True, search=SearchConfig(trust_region=0.05))
    step()  # the base's state is made: the plan is built at the next teleport
    runs, forwards, lean = _engine_runs(monkeypatch), [0], []
    model.register_forward_pre_hook(lambda m, args: forwards.__setitem__(0, forwards[0] + 1))
    monkeypatch.setattr(companion, "lean_teleport", lambda *a, **k: lean.append(companion_lean(*a, **k)) or lean[-1])
    step()
    report = opt.reports[-1]
    assert len(lean) == 1 and lean[0] is report and runs[0] == 0, (lean, runs)
    assert report.accepted and report.check == "probe" and "lean balance, checked" in report.check_detail, report.check_detail
    assert max(report.coordinate_norms.values()) <= 0.05 * (1 + 1e-9)  # clipped to the radius
    assert forwards[0] == 1 + 2  # the training forward, then the check: before and after


@pytest.mark.parametrize(
    "safety",
    [SafetyConfig(max_predicted_decrease=1e-12), SafetyConfig(stability_margin=1.0)],
    ids=["decrease-cap-binds", "stability-cap"],
)
def test_a_cap_that_binds_or_the_sharpness_cap_sends_the_first_teleport_to_the_engine(safety, monkeypatch) -> None:
    # the lean path has no bisection: where the predicted-decrease cap binds at the lean point (here: any decrease
    # exceeds 1e-12 of the loss), or the opt-in sharpness cap is on, the engine takes the teleport and shrinks it
    # as it did before the lean check; the result is the twin's whose companion is off
    model, sites, x, y = _mlp()
    twin = copy.deepcopy(model)
    opt, off = _readme(model, sites, x, y, [0], safety), _readme(twin, sites, x, y, [0], safety)
    BalanceCompanion.of(off).enabled = False
    runs = _engine_runs(monkeypatch)
    _train_both(((model, opt), (twin, off)), x, y, 12)
    assert runs[0] >= 2 * len(off.reports) - 1 and opt.reports and len(opt.reports) == len(off.reports)
    for r, e in zip(opt.reports, off.reports):
        assert (r.step, r.accepted, r.reason, r.check, r.shrink) == (e.step, e.accepted, e.reason, e.check, e.shrink)
        assert r.check_detail is None or "lean balance" not in r.check_detail
    for p, q in zip(model.parameters(), twin.parameters()):
        assert _close(p.detach(), q.detach()) <= 1e-12


def test_the_decrease_cap_is_evaluated_at_the_lean_point_when_it_does_not_bind(monkeypatch) -> None:
    # the default cap (8 x the loss) holds at the balanced point: the first teleport stays lean and checked, and
    # the cap was asked once, at the lean coordinates
    from teleopt.teleport.lean_check import LeanCheck

    model, sites, x, y = _mlp()
    opt = _readme(model, sites, x, y, [0])
    asked: list[bool] = []
    real = LeanCheck.caps_hold

    def recorded(self, coords, report):  # type: ignore[no-untyped-def]
        asked.append(real(self, coords, report))
        return asked[-1]

    monkeypatch.setattr(LeanCheck, "caps_hold", recorded)
    runs = _engine_runs(monkeypatch)
    _train_to_due(model, opt, x, y)
    opt.step()
    assert asked == [True] and runs[0] == 0
    assert opt.reports[-1].accepted and "lean balance, checked" in (opt.reports[-1].check_detail or "")


def test_a_model_that_takes_only_the_whole_batch_is_checked_lean_on_it(monkeypatch) -> None:
    # a forward that takes only the whole batch (a hard-coded batch size): the lean check runs on the whole
    # teleport batch, as the engine's, so it neither raises nor needs the engine
    model, sites, x, y = _mlp(rows=16)
    model.register_forward_pre_hook(lambda m, args: None if args[0].shape[0] in (2, 16) else (_ for _ in ()).throw(ValueError("batch")))
    opt = _readme(model, sites, x, y, [0])
    runs = _engine_runs(monkeypatch)
    _train_to_due(model, opt, x, y)
    opt.step()
    report = opt.reports[-1]
    assert runs[0] == 0 and report.accepted and report.check == "batch", (runs, report.reason, report.check)
    assert "lean balance, checked" in (report.check_detail or "")


def test_a_first_balanced_point_on_the_trust_regions_edge_is_bounded_lean_as_the_engine_bounds_it(monkeypatch) -> None:
    # GL sites (attention Q/K and V/O) with a trust region their balanced points lie beyond: the clipped point and
    # its round-off bound (teleopt.teleport.coordinates.within_roundoff) are computed lean, checked, and equal to
    # the engine's (companion off) in float64; before, such a teleport went to the engine after a lean solve
    from test_balance_companion import attention

    model, sites, x, y = attention()
    twin = copy.deepcopy(model)

    def wrap(m: nn.Module) -> Teleport:
        base = torch.optim.AdamW([{"params": list(m.parameters()), "teleopt_teleport_trust_region": 0.05}], lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Teleport(
                base, m, sites, example_inputs=x[:2], loss_fn=nn.functional.mse_loss, batch_fn=lambda: (x, y),
                objective="balance", schedule=Schedule(every=3, warmup=3),
            )  # fmt: skip

    opt, off = wrap(model), wrap(twin)
    BalanceCompanion.of(off).enabled = False
    runs = _engine_runs(monkeypatch)
    _train_both(((model, opt), (twin, off)), x, y, 4)
    lean, engine = opt.reports[0], off.reports[0]
    assert runs[0] == 1 and lean.accepted and engine.accepted, (runs, lean.reason, engine.reason)
    assert "lean balance, checked" in (lean.check_detail or "")
    assert max(float(v) for v in engine.coordinate_norms.values()) <= 0.05 * (1 + 1e-9)  # the edge: clipped
    for name, g in engine.elements.items():
        assert _close(lean.elements[name], g) <= 1e-12, name
    for p, q in zip(model.parameters(), twin.parameters()):
        assert _close(p.detach(), q.detach()) <= 1e-12
