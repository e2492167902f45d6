"""Teleport as an optimizer wrapper: schedule, reports, hooks, safety (rollback and watch), bad input."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from torch import nn

from teleopt import AxisAction, Member, Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.testing import assert_close, seeds

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def mlp(dtype=torch.float64, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6, bias=bias), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=bias), nn.LeakyReLU(0.1), nn.Linear(7, 3)).to(
        dtype
    )


def sites(bias=True):
    return [
        Site(LEAKY, ("0.weight", "0.bias" if bias else None, "2.weight")),
        Site(LEAKY, ("2.weight", "2.bias" if bias else None, "4.weight")),
    ]


def batch(dtype=torch.float64, n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen, dtype=torch.float64).to(dtype), torch.randn(n, 3, generator=gen, dtype=torch.float64).to(dtype)


def mse(out, y):
    return ((out - y) ** 2).mean()


def train(opt, model, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ---------------------------------------------------------------- schedule
def test_schedule_forms():
    assert [t for t in range(12) if Schedule(every=4, warmup=2).due(t, 0)] == [2, 6, 10]
    assert [t for t in range(12) if Schedule(at=[0, 5, 7]).due(t, 0)] == [0, 5, 7]
    assert [t for t in range(12) if Schedule(when=lambda t: t % 5 == 1).due(t, 0)] == [1, 6, 11]
    assert not any(Schedule().due(t, 0) for t in range(5)) and Schedule().manual
    assert not Schedule(every=1, max_teleports=2).due(3, accepted=2)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(every=2, at=[1]), ValueError),
        (dict(every=0), ValueError),
        (dict(at="5"), TypeError),
        (dict(at=[-1]), ValueError),
        (dict(when=3), TypeError),
        (dict(warmup=-1), ValueError),
        (dict(batches=0), ValueError),
        (dict(max_teleports=0), ValueError),
    ],
)
def test_schedule_rejects_bad_input(kwargs, error):
    with pytest.raises(error):
        Schedule(**kwargs)


def test_teleports_happen_before_the_scheduled_updates():
    model = mlp()
    x, y = batch()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3), model, sites(), schedule=Schedule(every=3, warmup=1), search=SearchConfig(steps=5)
    )
    train(opt, model, x, y, 8)
    assert [r.step for r in opt.reports] == [1, 4, 7]
    assert all(r.accepted and r.path == "fast" for r in opt.reports)


def test_group_flag_disables_teleports():
    model = mlp()
    x, y = batch()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-3), model, sites(), every=1)
    opt.param_groups[0]["teleopt_teleport_enabled"] = False
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    mse(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert not opt.reports
    for (n, p), g in zip(model.named_parameters(), grads):
        assert torch.equal(p.detach(), before[n] - 1e-3 * g)


# ---------------------------------------------------------------- reports and hooks
def test_hooks_receive_reports_and_ema_copies_follow():
    model = mlp()
    ema = copy.deepcopy(model)
    x, y = batch()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-3), model, sites(), schedule=Schedule(at=[0]))
    seen = []

    def follow(wrapper, report):
        seen.append(report)
        report.apply_to(ema)

    handle = opt.register_teleport_hook(follow)
    out_before = ema(x)
    train(opt, model, x, y, 1)
    assert len(seen) == 1 and seen[0].accepted
    assert_close(ema(x), out_before, 1e-10, "EMA output after following the teleport")
    # the EMA copy was moved by the same element as the model before its update
    moved = copy.deepcopy(ema.state_dict())
    assert not torch.equal(moved["0.weight"], model.state_dict()["0.weight"])  # the model also stepped
    handle.remove()

    def closure():
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        return loss

    assert opt.teleport(closure).accepted
    assert len(seen) == 1


def test_report_contents():
    model = mlp()
    x, y = batch()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-3), model, sites(), loss_fn=mse, schedule=Schedule())
    opt.zero_grad()
    mse(model(x), y).backward()
    report = opt.teleport(batch=(x, y), heldout_batch=batch(seed=9))
    assert report.accepted and report.reason == "accepted"
    assert report.loss_drift <= 1e-10
    assert abs(report.heldout_after - report.heldout_before) <= 1e-10 * report.heldout_before
    assert set(report.site_gains) == {s.name for s in opt.sites} and all(g > 1 for g in report.site_gains.values())
    assert report.objective_after == pytest.approx(report.grad_norm_after**2)
    assert report.time_s > 0 and report.summary()["gain"] == report.gain


# ---------------------------------------------------------------- safety
def _wrong_rescaling():
    """Labelled exact, but the reader's power is wrong: not a symmetry of a LeakyReLU net."""
    return AxisAction("bad", "diagonal", (Member("W1", 0), Member("b1", 0, optional=True), Member("W2", 1, -2)))


def test_post_condition_rolls_back_a_non_invariant_teleport():
    model = mlp()
    x, y = batch()
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = Teleport(base, model, [Site(_wrong_rescaling(), ("0.weight", "0.bias", "2.weight"))], loss_fn=mse, schedule=Schedule())
    train(opt, model, x, y, 2)
    opt.zero_grad()
    mse(model(x), y).backward()
    params = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(base.state_dict())
    report = opt.teleport(batch=(x, y))
    assert not report.accepted and report.reason.startswith("rolled back: loss changed")
    for n, t in model.state_dict().items():
        assert torch.equal(t, params[n]), n
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    after = base.state_dict()["state"]
    for i, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), (i, k)


def _rolled_back_without_watch(monkeypatch, **kwargs):
    """A wrong rescaling teleported with the watch off, on the fast path (no closure): which restores the
    rollback ran by kind, and the parameters, gradients and Adam state before and after."""
    from teleopt.teleport.safety import InverseSnapshot, Snapshot

    ran = []
    for cls in (InverseSnapshot, Snapshot):
        original = cls.restore
        monkeypatch.setattr(cls, "restore", lambda self, _o=original, _c=cls: (ran.append(_c.__name__), _o(self))[1])
    model = mlp()
    x, y = batch()
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    site = Site(_wrong_rescaling(), ("0.weight", "0.bias", "2.weight"))
    opt = Teleport(base, model, [site], loss_fn=mse, safety=SafetyConfig(watch_steps=0), **kwargs, objective="grad_norm")
    train(opt, model, x, y, 2)
    opt.zero_grad()
    mse(model(x), y).backward()
    before = (copy.deepcopy(model.state_dict()), [p.grad.clone() for p in model.parameters()], copy.deepcopy(base.state_dict()))
    report = opt.teleport(batch=(x, y))
    assert not report.accepted and report.reason.startswith("rolled back")
    after = (model.state_dict(), [p.grad for p in model.parameters()], base.state_dict())
    return ran, before, after


def test_a_rollback_without_watch_undoes_gradients_and_state_by_the_inverse(monkeypatch):
    """With the watch off, the rollback copies only the site's parameters: they come back bit for bit
    (the model computes exactly what it did), and .grad and Adam's moments are moved back by the
    inverse element, exact up to round-off: one multiplication by c and one by 1/c (c^2 and c^-2 for
    the second moment) in float64, a few units in the last place."""
    ran, (params, grads, state), (params_after, grads_after, state_after) = _rolled_back_without_watch(monkeypatch)
    assert ran == ["InverseSnapshot"]
    for n, t in params_after.items():
        assert torch.equal(t, params[n]), n
    for g_after, g in zip(grads_after, grads):
        torch.testing.assert_close(g_after, g, rtol=1e-14, atol=0)
    for i, st in state["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(state_after["state"][i][k], v, rtol=1e-14, atol=0)


def _rollback_copies(monkeypatch, **kwargs):
    """Like :func:`_rolled_back_without_watch`, recording whether each InverseSnapshot held copies and the report."""
    from teleopt.teleport.safety import InverseSnapshot

    copies = []
    original = InverseSnapshot.__init__

    def init(self, *a, **k):
        original(self, *a, **k)
        copies.append(self.copies)

    monkeypatch.setattr(InverseSnapshot, "__init__", init)
    ran, before, after = _rolled_back_without_watch(monkeypatch, **kwargs)
    return copies, ran, before, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_exactly_invertible_rollback_copies_nothing(monkeypatch, dtype):
    """Under the default trust region (log 4) the boundary step scales by 4, 1/4 or 1: powers of two, so
    the parameters come back bit for bit by the inverse element and the rollback copies nothing."""
    monkeypatch.setattr("tests.test_teleport_wrapper.mlp", lambda **k: mlp(dtype=dtype, **k))
    monkeypatch.setattr("tests.test_teleport_wrapper.batch", lambda **k: batch(dtype=dtype, **k))
    copies, ran, (params, _, _), (params_after, _, _) = _rollback_copies(monkeypatch)
    assert copies == [False] and ran == ["InverseSnapshot"]
    for n, t in params_after.items():
        assert torch.equal(t, params[n]), n


def test_a_rollback_by_other_scales_copies_the_site_members(monkeypatch):
    """A trust region of 0.3 gives scales e^0.3, not powers of two: the site members are copied (and come back bit for bit)."""
    copies, ran, (params, _, _), (params_after, _, _) = _rollback_copies(monkeypatch, search=SearchConfig(trust_region=0.3))
    assert copies == [True] and ran == ["InverseSnapshot"]
    for n, t in params_after.items():
        assert torch.equal(t, params[n]), n


def test_a_rollback_without_copies_rechecks_the_outputs(monkeypatch):
    """After a rollback by the inverse elements the model's outputs are compared with those before, bit for
    bit; a difference (here made by a perturbed undo) is reported and warned about, never silent."""
    from teleopt.teleport.fast_path import FastEvaluator

    undo = FastEvaluator.undo

    def perturbed(self, elements, params=False):
        undo(self, elements, params)
        if params:
            self.live["0.weight"].data[0, 0] += 1e-3

    monkeypatch.setattr(FastEvaluator, "undo", perturbed)
    model = mlp()
    x, y = batch()
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model,
        [Site(_wrong_rescaling(), ("0.weight", "0.bias", "2.weight"))],
        loss_fn=mse,
        safety=SafetyConfig(watch_steps=0),
        schedule=Schedule(),
    )
    train(opt, model, x, y, 2)
    opt.zero_grad()
    mse(model(x), y).backward()
    with pytest.warns(UserWarning, match="after the rollback the outputs differ from before"):
        report = opt.teleport(batch=(x, y))
    assert not report.accepted and "after the rollback the outputs differ from before by" in report.reason


def test_exactly_invertible_needs_powers_of_two_in_the_parameter_dtype():
    """The decision itself: powers of two in float32, float64 and bfloat16; never in float16 (its subnormals
    start at 6e-5, where a weight scaled by 1/4 loses bits), nor for other scales."""
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.fast_path import FastEvaluator
    from teleopt.teleport.state_policy import StatePolicy

    for dtype, scale, expected in [
        (torch.float32, 4.0, True),
        (torch.float64, 0.25, True),
        (torch.bfloat16, 4.0, True),
        (torch.float16, 4.0, False),
        (torch.float32, 3.0, False),
        (torch.float32, math.exp(0.3), False),
    ]:
        model = mlp(dtype=dtype)
        x, y = batch(dtype=dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        mse(model(x), y).backward()
        opt.step()
        site = sites()[0]
        evaluator = FastEvaluator([site], TeleportContext.build(model, opt, StatePolicy()))
        element = torch.full((model[0].weight.shape[0],), scale, dtype=torch.float64)
        element[0] = 1.0
        assert evaluator.exactly_invertible([element]) is expected, (dtype, scale)


def test_a_state_policy_that_resets_keeps_a_full_snapshot(monkeypatch):
    """A reset cannot be undone by an inverse element: the rollback restores copies, bit for bit."""
    ran, (params, grads, state), (params_after, grads_after, state_after) = _rolled_back_without_watch(
        monkeypatch, state_policy={"first_moment": "reset"}
    )
    assert ran == ["Snapshot"]
    for n, t in params_after.items():
        assert torch.equal(t, params[n]), n
    for g_after, g in zip(grads_after, grads):
        assert torch.equal(g_after, g)
    for i, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(state_after["state"][i][k], v), (i, k)


def _paper_mlp(seed):
    torch.manual_seed(seed)
    W = [torch.rand(6, 5), torch.rand(7, 6), torch.rand(8, 7)]
    X, Y = torch.rand(5, 4), torch.rand(8, 4)
    model = nn.Sequential(
        nn.Linear(5, 6, bias=False), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=False), nn.LeakyReLU(0.1), nn.Linear(7, 8, bias=False)
    )
    with torch.no_grad():
        for layer, w in zip(model[::2], W):
            layer.weight.copy_(w)
    return model, X.T.contiguous(), Y.T.contiguous()


def _sse(out, y):
    return 0.5 * ((out - y) ** 2).sum()


def _diverging_teleport(watch_restore="snapshot"):
    """The papers' MLP under GD at lr 1e-4 with a teleport at step 5 to a 1000x gradient norm (trust region
    log 16, no decrease cap) and a 10-step watch: model, inputs, targets, wrapper."""
    model, X, Y = _paper_mlp(12345)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        model,
        sites(bias=False)[:1] + [Site(LEAKY, ("2.weight", None, "4.weight"))],
        example_inputs=X,
        safety=SafetyConfig(max_predicted_decrease=None, watch_steps=10, watch_restore=watch_restore),
        schedule=Schedule(at=[5]),
        search=SearchConfig(trust_region=math.log(16)),
    )
    return model, X, Y, opt


def test_watch_rolls_back_a_teleport_that_diverges_later():
    """GD at lr 1e-4 on the papers' MLP is stable; a teleport to a 1000x gradient norm is not.

    Without caps the teleport is accepted (the loss is preserved exactly), the next
    steps blow up, and the watch (default ``watch_restore="snapshot"``) restores the
    pre-teleport point bit for bit.
    """
    model, X, Y, opt = _diverging_teleport()
    snapshots = {}

    def record(wrapper, report):
        snapshots.setdefault(report.path, report)

    opt.register_teleport_hook(record)
    before_teleport = None
    for t in range(20):
        if t == 5:
            before_teleport = copy.deepcopy(model.state_dict())
        opt.zero_grad()
        _sse(model(X), Y).backward()
        opt.step()
        if "watch" in snapshots and t < 19:
            rolled_back_at = t
            break
    assert snapshots["fast"].accepted and snapshots["fast"].gain > 100
    assert "watch" in snapshots and "rolled back after" in snapshots["watch"].reason
    for n, v in model.state_dict().items():
        assert torch.equal(v, before_teleport[n]), n
    assert all(p.grad is None for p in model.parameters())
    assert rolled_back_at < 5 + 10
    assert opt.record.backoff == 0.5


def test_an_inverse_watch_moves_a_diverging_teleport_back_but_keeps_the_damage():
    """The same diverging teleport with ``watch_restore="inverse"``: no snapshot is kept; the rollback skips
    the blown-up step's update and moves the current point back by the inverse elements (16 and 1/16 in
    float32 here: bit for bit), so the model computes exactly what it did before the rollback and the steps
    since are kept, with them the damage they did: the gradient right after is still far above its
    pre-teleport scale (this run diverges on, which is why the snapshot is the default)."""
    model, X, Y, opt = _diverging_teleport(watch_restore="inverse")
    reports = []
    opt.register_teleport_hook(lambda wrapper, report: reports.append(report))
    grad_norms, rolled_back = [], None
    for t in range(12):
        opt.zero_grad()
        _sse(model(X), Y).backward()
        grad_norms.append(math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters())))
        outputs = model(X).detach()
        opt.step()
        if t == 5:
            assert "inverse" in opt.state_dict()["teleopt_teleport"]["watch"]  # the elements, no snapshot
        if any(r.path == "watch" for r in reports):
            rolled_back = t
            assert torch.equal(model(X).detach(), outputs)  # the inverse move is a symmetry, bit for bit
            assert all(p.grad is None for p in model.parameters())
            break
    teleport, watch = reports[0], reports[-1]
    assert teleport.accepted and teleport.gain > 100 and opt.record.watch is None
    assert all(bool(((e == 16) | (e == 1 / 16) | (e == 1)).all()) for e in (e.float() for e in teleport.elements.values()))
    assert watch.path == "watch" and "moved back by the inverse elements of the teleport at step 5 (the steps since kept" in watch.reason
    assert "outputs on the probe inputs changed by 0.0e+00" in watch.reason
    assert rolled_back is not None and 5 < rolled_back < 5 + 10 and opt.record.backoff == 0.5
    opt.zero_grad()
    _sse(model(X), Y).backward()
    after = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()))
    assert after > 100 * max(grad_norms[:5])  # the function the steps since damaged is kept


def test_caps_decline_when_no_move_is_allowed():
    model = mlp()
    x, y = batch()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-3), model, sites(), safety=SafetyConfig(max_gain=1.0), schedule=Schedule())
    opt.zero_grad()
    mse(model(x), y).backward()
    before = copy.deepcopy(model.state_dict())
    report = opt.teleport()
    assert not report.accepted and report.reason.startswith("declined")
    for n, v in model.state_dict().items():
        assert torch.equal(v, before[n])


# ---------------------------------------------------------------- state_dict
def test_state_dict_keeps_counters_and_loads_weights_only():
    model = mlp()
    x, y = batch()
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-3), model, sites(), every=2, objective="curvature", search=SearchConfig(steps=3)
    )
    train(opt, model, x, y, 3)
    sd = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    top = loaded["teleopt_teleport"]
    assert top["step"] == 3 and top["accepted"] == 2 and "watch" in top
    other = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-3), model, sites(), every=2, objective="curvature", search=SearchConfig(steps=3)
    )
    other.load_state_dict(loaded)
    assert other.record.step == 3 and torch.equal(other._generator.get_state(), opt._generator.get_state())


# ---------------------------------------------------------------- bad input
def test_rejects_a_model_the_optimizer_does_not_update():
    model, other = mlp(), mlp()
    with pytest.raises(ValueError, match="does not update any parameter"):
        Teleport(torch.optim.SGD(other.parameters(), lr=0.1), model, sites(), schedule=Schedule())


def test_rejects_sites_on_frozen_or_unoptimized_parameters():
    model = mlp()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen parameter '0.weight'"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), schedule=Schedule())
    model = mlp()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "4.weight"], lr=0.1)
    with pytest.raises(ValueError, match="'4.weight' is not updated by the optimizer"):
        Teleport(opt, model, sites(), schedule=Schedule())


def test_rejects_unknown_members_discrete_sites_and_bad_types():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'9.weight' is not a parameter or buffer"):
        Teleport(opt, model, [Site(LEAKY, ("9.weight", None, "2.weight"))], schedule=Schedule())
    perm = get_action("hidden_permutation")
    with pytest.raises(ValueError, match="discrete group"):
        Teleport(opt, model, [Site(perm, ("0.weight", "0.bias", "2.weight"))], schedule=Schedule())
    with pytest.raises(TypeError, match="list of Site"):
        Teleport(opt, model, Site(LEAKY, ("0.weight", None, "2.weight")), schedule=Schedule())
    with pytest.raises(ValueError, match="unknown teleport objective"):
        Teleport(opt, model, sites(), objective="speed")
    with pytest.raises(ValueError, match="state_policy"):
        Teleport(opt, model, sites(), state_policy="teleport", schedule=Schedule())
    with pytest.raises(ValueError, match="trust_region"):
        Teleport(opt, model, sites(), search=SearchConfig(trust_region=-1.0), schedule=Schedule())
    with pytest.raises(ValueError, match="batches=2 needs batch_fn"):
        Teleport(opt, model, sites(), schedule=Schedule(every=1, batches=2))
    with pytest.raises(TypeError, match="nn.Module"):
        Teleport(opt, "model", sites(), schedule=Schedule())
    with pytest.raises(ValueError, match="max_gain"):
        SafetyConfig(max_gain=0.5)
    with pytest.raises(ValueError, match="watch_restore must be 'snapshot' or 'inverse', got 'auto'"):
        SafetyConfig(watch_restore="auto")


def test_rejects_dtype_and_device_mixes():
    model = mlp()
    model[0].bias.data = model[0].bias.data.float()
    with pytest.raises(ValueError, match="mixes dtypes"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), schedule=Schedule())
    model = mlp()
    model[2].weight = nn.Parameter(torch.empty(7, 6, dtype=torch.float64, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), schedule=Schedule())


def test_objectives_that_need_a_batch_say_so():
    model = mlp()
    x, y = batch()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), objective="lookahead", loss_fn=mse)
    opt.zero_grad()
    mse(model(x), y).backward()
    with pytest.raises(ValueError, match="objective 'lookahead' need.*teleport batch"):
        opt.teleport()
    dd = get_action("data_dependent_gl", activation="leaky_relu", negative_slope=0.1)
    site = Site(dd, ("0.weight", None, "2.weight"), data_input="0")
    model2 = mlp(bias=False)
    opt2 = Teleport(torch.optim.SGD(model2.parameters(), lr=0.1), model2, [site], loss_fn=mse, schedule=Schedule())
    with pytest.raises(ValueError, match="need.*teleport batch"):
        opt2.teleport()
    with pytest.raises(ValueError, match="names no data_input"):
        Teleport(torch.optim.SGD(model2.parameters(), lr=0.1), model2, [Site(dd, ("0.weight", None, "2.weight"))], schedule=Schedule())
    with pytest.raises(ValueError, match="path='fast' is not possible"):
        Teleport(
            torch.optim.SGD(model2.parameters(), lr=0.1), model2, [site], search=SearchConfig(path="fast"), schedule=Schedule()
        ).teleport(batch=(x, y))


def test_unmodelled_optimizers_reject_objectives_that_need_their_update():
    torch_optimizer = pytest.importorskip("torch_optimizer")
    model = mlp()
    with pytest.raises(TypeError, match="Lamb"):
        Teleport(torch_optimizer.Lamb(model.parameters()), model, sites(), objective="preconditioned_norm")


def test_paper_compat_needs_gl_sites():
    model = mlp()
    with pytest.raises(ValueError, match="not a GL site"):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), search=SearchConfig(paper_compat=True), schedule=Schedule())


def test_fused_base_under_grad_scaler_teleports_unscaled_gradients():
    """GradScaler unscales before Teleport.step (the wrapper never claims _step_supports_amp_scaling),
    so teleports and the fused base see the true gradients: bitwise the unscaled trajectory."""
    x, y = batch(torch.float32)

    def run(scaled: bool):
        model = mlp(torch.float32)
        opt = Teleport(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True), model, sites(), every=2, search=SearchConfig(steps=10))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=scaled)
        for _ in range(5):
            opt.zero_grad()
            scaler.scale(mse(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        assert sum(r.accepted for r in opt.reports) == 3
        return [p.detach().clone() for p in model.parameters()]

    assert not getattr(Teleport, "_step_supports_amp_scaling", False)
    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@settings(deadline=None, max_examples=25)
@given(
    widths=hst.lists(hst.integers(1, 9), min_size=4, max_size=4),
    exponents=hst.lists(hst.integers(-3, 3), min_size=18, max_size=18),
    dtype=hst.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=seeds(),
)
def test_powers_of_two_undo_the_parameters_bit_for_bit(widths, exponents, dtype, seed):
    """Any two chained ReLU rescalings, any elements whose scales are powers of two (2^-3 .. 2^3), float32,
    bfloat16 or float64: ``exactly_invertible`` holds, and the apply followed by the undo with ``params``
    gives every parameter back bit for bit, as do the ``originals`` computed at g . w (weights drawn at their
    usual scale, far from the subnormals); one scale of 3 makes it false."""
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.fast_path import FastEvaluator
    from teleopt.teleport.state_policy import StatePolicy

    torch.manual_seed(seed)
    a, b, c, d = widths
    model = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d)).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, a, dtype=dtype)).square().sum().backward()
    opt.step()
    relu = get_action("positive_rescaling", activation="relu")
    sites = [Site(relu, ("0.weight", "0.bias", "2.weight")), Site(relu, ("2.weight", "2.bias", "4.weight"))]
    elements = [2.0 ** torch.tensor(exponents[:b], dtype=torch.float64), 2.0 ** torch.tensor(exponents[9 : 9 + c], dtype=torch.float64)]
    evaluator = FastEvaluator(sites, TeleportContext.build(model, opt, StatePolicy()))
    assert evaluator.exactly_invertible(elements)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    evaluator.apply(elements)
    originals = evaluator.originals(elements)  # what a rollback without copies hands the float64 re-run
    assert all(torch.equal(originals[n], before[n]) for n in originals)
    evaluator.undo(elements, params=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    elements[0][0] = 3.0
    assert not evaluator.exactly_invertible(elements)
