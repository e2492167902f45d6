"""Issue 13 (Teleport side): every teleport is checked; none is accepted unchecked.

A teleport compares the model's outputs before and after it (``teleopt.teleport.check``)
on its batch, on the closure's forwards, or on probe inputs (``example_inputs`` or the
last forward's inputs), and is declined when there is none of them.  Tolerances:
``default_rtol`` of the output dtype (1e-10 float64, 1e-5 float32); the outputs
measured by these tests on held-out inputs must stay within 1e-9 (float64) and 1e-5
(float32).  Models are seeded and small; the whole file runs in a few seconds.
"""

from __future__ import annotations

import copy
import functools
import gc
import math

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.functional import Batch
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.check import PROBE_ROWS, OutputCheck, float64_rerun
from teleopt.testing import relative_error

F64 = torch.float64
HELDOUT_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5}
LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)
RELU = get_action("positive_rescaling", activation="relu")
GL = get_action("gl_linear")


def mse(out, y):
    return ((out - y) ** 2).mean()


def mlp(dtype=F64, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.LeakyReLU(0.1),
        nn.Dropout(dropout),
        nn.Linear(6, 7),
        nn.LeakyReLU(0.1),
        nn.Linear(7, 3),
    ).to(dtype)


def mlp_sites():
    return [Site(LEAKY, ("0.weight", "0.bias", "3.weight")), Site(LEAKY, ("3.weight", "3.bias", "5.weight"))]


def data(n=16, dtype=F64, seed=1, features=5, outputs=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=gen).to(dtype), torch.randn(n, outputs, generator=gen).to(dtype)


def backward(model, x, y):
    model.zero_grad()
    loss = mse(model(x), y)
    loss.backward()
    return loss


def outputs(model, x, train):
    """Outputs on held-out inputs in train or eval mode (modes restored)."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        with torch.no_grad():
            return model(x)
    finally:
        for m, f in flags:
            m.training = f


def params_of(model):
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_bitwise(model, saved):
    for n, t in model.state_dict().items():
        assert torch.equal(t, saved[n]), n


def assert_checked(report):
    assert report.check != "none", report
    if report.accepted:
        assert report.check_error is not None and report.check_tol is not None
        assert report.check_passed, report.check_detail  # within check_tol, or an inconclusive check passed in float64


# ---------------------------------------------------------------- probe inputs, MLP and timm
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("probe", ["last_forward", "example_inputs"])
def test_mlp_teleport_without_batch_is_checked_on_probe_inputs(probe, dtype, train):
    model = mlp(dtype).train(train)
    x, y = data(32, dtype)
    heldout, _ = data(8, dtype, seed=5)
    example = {"example_inputs": data(4, dtype, seed=9)[0]} if probe == "example_inputs" else {}
    # trust region 1: scales e^+-1, not the powers of two (exact in binary) log 4 would give
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2),
        model,
        mlp_sites(),
        **example,
        search=SearchConfig(steps=10, trust_region=1.0),
        schedule=Schedule(),
    )
    backward(model, x, y)  # the last forward: its first 8 rows are the probe when no example_inputs
    before = {t: outputs(model, heldout, t) for t in (False, True)}
    report = opt.teleport()
    assert report.accepted and report.path == "fast", report.reason
    assert report.check == "probe" and report.check_error <= report.check_tol == (1e-10 if dtype == F64 else 1e-5)
    assert ("example_inputs" if probe == "example_inputs" else "last forward") in report.check_detail
    assert max(report.coordinate_norms.values()) > 0.05  # it really moved
    for t in (False, True):
        assert relative_error(outputs(model, heldout, t), before[t]) <= HELDOUT_RTOL[dtype]
    assert [m.training for m in model.modules()] == [train] * len(list(model.modules()))  # modes restored


def _vit(dtype, **kwargs):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, **kwargs
    ).to(dtype)
    with torch.no_grad():  # timm leaves biases at zero: randomise them (CONVENTIONS.md section 3)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


@functools.cache
def _vit_sites():
    """The certified exact continuous sites of the small ViT (detected once: names are shared by every
    instance; dropout and DropPath do not change them): LayerNorm rescalings, attention GL(Q, K), GL(V, O)."""
    from teleopt import find_symmetries

    found = find_symmetries(_vit(F64), (_images(2, F64)[0],), include_discrete=False)
    return tuple(s for s in found.sites if s.action.exactness == "exact")


def _images(n, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=gen).to(dtype), torch.randint(0, 5, (n,), generator=gen)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
def test_timm_vit_teleport_without_batch_is_checked_on_probe_inputs(dtype, train):
    model = _vit(dtype).train(train)
    x, y = _images(4, dtype)
    heldout, _ = _images(6, dtype, seed=2)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model,
        list(_vit_sites()),
        safety=SafetyConfig(max_predicted_decrease=None),
        search=SearchConfig(steps=2, lr=0.5),
        schedule=Schedule(),
    )
    assert {s.action.name for s in opt.sites} == {"attention_qk_gl", "attention_vo_gl", "positive_rescaling"}
    with torch.no_grad():
        before = {t: outputs(model, heldout, t) for t in (False, True)}
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # the last forward: the probe inputs
    report = opt.teleport()
    assert report.accepted and report.check == "probe" and "last forward" in report.check_detail, report.reason
    assert report.check_error <= report.check_tol
    assert max(report.coordinate_norms.values()) > 0.05
    for t in (False, True):
        assert relative_error(outputs(model, heldout, t), before[t]) <= HELDOUT_RTOL[dtype]


# ---------------------------------------------------------------- dropout and DropPath in train mode
def test_dropout_and_droppath_in_train_mode_accept_true_symmetries():
    """Train-mode checks fork the RNG: both forwards draw the same Dropout and DropPath masks."""
    model = _vit(F64, drop_rate=0.2, proj_drop_rate=0.2, attn_drop_rate=0.2, drop_path_rate=0.3).train()
    x, y = _images(4, F64)
    with torch.no_grad():  # the model really is random in train mode
        assert relative_error(model(x), model(x)) > 1e-3

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model,
        list(_vit_sites()),
        loss_fn=nn.functional.cross_entropy,
        batch_fn=lambda: (x, y),
        every=1,
        safety=SafetyConfig(max_predicted_decrease=None, watch_steps=0),
        search=SearchConfig(steps=2, lr=0.5),
    )
    state = torch.random.get_rng_state()
    closure()
    opt.step()  # a scheduled teleport, checked on the batch_fn batch in train mode
    assert not torch.equal(state, torch.random.get_rng_state())  # training's own dropout advanced the RNG
    report = opt.teleport(closure)  # checked on the closure's forwards, same seed before and after
    reports = opt.reports[:1] + [report]
    assert [r.check for r in reports] == ["batch", "closure"]
    for r in reports:
        assert r.accepted, r.reason
        assert r.check_error <= r.check_tol == 1e-10 and r.loss_drift <= 1e-10
        assert max(r.coordinate_norms.values()) > 0.05


# ---------------------------------------------------------------- a wrong site is declined
def _gelu_net(dtype=F64):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.Linear(6, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
def test_a_rescaling_across_gelu_is_declined_by_the_probe_check(dtype):
    """Positive rescaling does not commute with GELU: labelled exact, built by hand, rolled back."""
    model = _gelu_net(dtype)
    x, y = data(16, dtype)
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = Teleport(base, model, [Site(RELU, ("0.weight", "0.bias", "2.weight"))], search=SearchConfig(steps=10), schedule=Schedule())
    for _ in range(2):
        backward(model, x, y)
        opt.step()
    backward(model, x, y)
    saved, grads = params_of(model), [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(base.state_dict())
    report = opt.teleport()
    assert not report.accepted and report.check == "probe"
    assert report.reason.startswith("rolled back: outputs changed by") and "probe inputs" in report.reason
    assert report.check_error > 1e-3 > report.check_tol
    assert_bitwise(model, saved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    for i, st in base.state_dict()["state"].items():
        assert all(torch.equal(v, state["state"][i][k]) for k, v in st.items())


def test_without_anything_to_check_on_the_teleport_is_declined():
    model = mlp()
    x, y = data()
    backward(model, x, y)  # before the wrapper exists: not recorded
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), schedule=Schedule())
    saved = params_of(model)
    report = opt.teleport()
    assert not report.accepted and report.check == "none" and "nothing to check" in report.reason
    assert_bitwise(model, saved)


# ---------------------------------------------------------------- every path is checked
def _dd_setup():
    torch.manual_seed(12345)
    model = nn.Sequential(nn.Linear(5, 6, bias=False), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=False)).double()
    x, y = torch.rand(4, 5, dtype=F64), torch.rand(4, 7, dtype=F64)
    dd = get_action("data_dependent_gl", activation="leaky_relu", negative_slope=0.1)
    return model, x, y, [Site(dd, ("0.weight", None, "2.weight"), data_input="0")]


PATHS = ["batch_fn", "example_inputs", "last_forward", "closure", "general", "data_dependent", "paper_compat"]


@pytest.mark.parametrize("how", PATHS)
def test_every_path_checks_the_outputs(how):
    model, (x, y) = mlp(), data()
    sites, kwargs, search = mlp_sites(), {}, {"steps": 5}
    if how == "batch_fn":
        kwargs = {"batch_fn": lambda: (x, y), "loss_fn": mse, "schedule": Schedule(at=[0])}
    elif how == "example_inputs":
        kwargs = {"example_inputs": x[:3], "schedule": Schedule(at=[0])}
    elif how == "last_forward":
        kwargs = {"schedule": Schedule(at=[0])}
    elif how == "general":
        kwargs, search["path"] = {"loss_fn": mse}, "general"
    elif how == "data_dependent":
        model, x, y, sites = _dd_setup()
        kwargs, search["trust_region"] = {"loss_fn": mse}, 0.5
    elif how == "paper_compat":
        model, x, y = _dd_setup()[:3]
        sites = [Site(GL, ("0.weight", None, "2.weight"))]
        kwargs = {"loss_fn": mse}
        search.update(paper_compat=True, lr=0.5)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2), model, sites, **kwargs, search=SearchConfig(**search), objective="grad_norm"
    )
    backward(model, x, y)
    if how in ("batch_fn", "example_inputs", "last_forward"):
        opt.step()  # scheduled at step 0
        report = opt.reports[0]
    elif how == "closure":
        report = opt.teleport(lambda: backward(model, x, y))
    else:
        report = opt.teleport(batch=(x, y))
    expected = {"example_inputs": "probe", "last_forward": "probe", "closure": "closure"}.get(how, "batch")
    assert report.accepted and report.check == expected, report.reason
    assert report.check_error is not None and report.check_tol == 1e-10
    if how == "paper_compat":  # measured, never decides (the papers' first-order teleport is not invariant)
        assert report.check_error > 1e-6 and "not loss-preserving" in report.reason
    else:
        assert_checked(report)
        assert report.summary()["check"] == expected and report.summary()["check_error"] == report.check_error


def test_a_closure_that_does_not_call_the_model_is_checked_by_its_loss():
    model, (x, y) = mlp(), data()
    params = list(model.parameters())
    opt = Teleport(torch.optim.SGD(params, lr=1e-2), model, mlp_sites(), search=SearchConfig(steps=5), schedule=Schedule())

    def closure():  # computes the model's function from its tensors: the module is never called
        opt.zero_grad()
        w0, b0, w3, b3, w5, b5 = params
        leaky = nn.functional.leaky_relu
        loss = mse(leaky(leaky(x @ w0.T + b0, 0.1) @ w3.T + b3, 0.1) @ w5.T + b5, y)
        loss.backward()
        return loss

    report = opt.teleport(closure)
    assert report.accepted and report.check == "closure" and "did not call the model" in report.check_detail
    assert report.check_error == report.loss_drift <= 1e-10


# ---------------------------------------------------------------- float32 rounding is re-run in float64
def test_an_inconclusive_float32_check_is_re_run_in_float64():
    """A tolerance float32 cannot meet: the error is within 100x of it, so a float64 copy decides."""
    model = mlp(torch.float32)
    x, y = data(16, torch.float32)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2),
        model,
        mlp_sites(),
        safety=SafetyConfig(loss_tol=1e-8),
        search=SearchConfig(steps=10, trust_region=0.9),  # scales of e^0.9 (a power of two would be exact in binary)
        schedule=Schedule(),
    )
    backward(model, x, y)
    report = opt.teleport()
    assert report.accepted, report.reason
    assert "float64 copy" in report.check_detail and "inconclusive" in report.check_detail
    # check_error is the change in the precision the model runs in; the float64 re-run has fields of its own
    assert report.check_tol == 1e-8 < report.check_error <= 100 * report.check_tol
    assert f"{report.check_error:.2e}" in report.check_detail
    assert report.check_tol_float64 == 1e-10 and report.check_error_float64 <= 1e-10
    assert report.check_passed
    summary = report.summary()
    assert (summary["check_error"], summary["check_error_float64"]) == (report.check_error, report.check_error_float64)


def test_float64_rerun_measures_a_wrong_site_even_for_a_small_element():
    model = _gelu_net(torch.float32)
    x, _ = data(8, torch.float32)
    site = Site(RELU, ("0.weight", "0.bias", "2.weight"))
    saved = {n: t.detach().clone() for n, t in model.state_dict().items()}
    check = OutputCheck.of_sites("probe", Batch((x,), None, None), False, 0, [site], "test")
    element = torch.full((6,), math.exp(1e-4), dtype=F64)
    assert float64_rerun(model, saved, [site], [element], check) > 1e-9
    assert float64_rerun(model, saved, [site], [torch.ones(6, dtype=F64)], check) == 0.0


# ---------------------------------------------------------------- keyword arguments
class Masked(nn.Module):
    """An MLP whose forward needs a keyword argument, as transformers models need attention masks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = nn.Linear(5, 6).double(), nn.Linear(6, 3).double()

    def forward(self, x, *, mask):
        return self.b(nn.functional.leaky_relu(self.a(x), 0.1)) * mask[:, None]


@pytest.mark.parametrize("form", ["triple", "mapping", "probe"])
def test_keyword_arguments_reach_the_model(form):
    model = Masked()
    x, y = data(12)
    mask = (torch.arange(12) % 3 != 0).to(F64)
    site = Site(LEAKY, ("a.weight", "a.bias", "b.weight"))
    if form == "mapping":

        def loss_fn(out, target):
            assert target is None
            return mse(out, y)

        batch = {"x": x, "mask": mask}
    else:
        loss_fn, batch = mse, (x, y, {"mask": mask})
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2), model, [site], loss_fn=loss_fn, search=SearchConfig(steps=5), schedule=Schedule()
    )
    model.zero_grad()
    mse(model(x, mask=mask), y).backward()
    if form == "probe":
        recorded = opt._probe.batch
        assert recorded.kwargs is not None and torch.equal(recorded.kwargs["mask"], mask[:PROBE_ROWS])
        report = opt.teleport()
    else:
        report = opt.teleport(batch=batch)
    assert report.accepted and report.check == ("probe" if form == "probe" else "batch"), report.reason
    assert_checked(report)


def test_the_probe_keeps_a_bounded_copy_of_the_last_forward():
    model = mlp()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), schedule=Schedule())
    x, _ = data(64)
    model(x)
    probe = opt._probe.batch
    assert probe.inputs[0].shape == (PROBE_ROWS, 5) and torch.equal(probe.inputs[0], x[:PROBE_ROWS])
    assert probe.inputs[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a copy, not a view
    copy.deepcopy(model)(data(3, seed=7)[0])  # a copy of the model does not feed this wrapper
    assert opt._probe.batch is probe


def test_with_example_inputs_only_the_precision_hook_runs_on_every_forward():
    # the probe recorder copies inputs (34 us a forward on a small MLP); with example_inputs only the precision
    # recorder stays, which reads autocast's flags (the training precision) and copies nothing
    model = mlp()
    x, y = data(64)
    plain = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), schedule=Schedule())
    assert {type(h).__name__ for h in model._forward_pre_hooks.values()} == {"ProbeRecorder", "PrecisionRecorder"}
    del plain
    gc.collect()
    assert not model._forward_pre_hooks
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2),
        model,
        mlp_sites(),
        example_inputs=x[:8],
        search=SearchConfig(steps=3),
        schedule=Schedule(),
    )
    # the autocast recorder, and one pre-hook for one forward: the keyword names of the training forward
    assert len(model._forward_pre_hooks) == 2 and not model._forward_hooks
    model.zero_grad()
    mse(model(x), y).backward()
    # the forwards until the next teleport keep only the autocast recorder
    assert [type(h).__name__ for h in model._forward_pre_hooks.values()] == ["PrecisionRecorder"]
    report = opt.teleport()
    assert report.accepted and report.check == "probe", report.reason
    assert_checked(report)


# ---------------------------------------------------------------- contract points
def test_torch_compile_is_unwrapped_and_its_forwards_are_recorded():
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    x, y = data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), compiled, mlp_sites(), search=SearchConfig(steps=5), schedule=Schedule())
    assert opt.module is model
    compiled.zero_grad()
    mse(compiled(x), y).backward()
    report = opt.teleport()
    assert report.accepted and report.check == "probe", report.reason
    assert_checked(report)


def test_auto_sites_keep_the_optimized_ones_and_list_the_others():
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    x, y = data()
    head = list(model[4].parameters())
    with pytest.warns(UserWarning, match="left out"):
        opt = Teleport(
            torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-2),
            model,
            "auto",
            example_inputs=x,
            schedule=Schedule(),
        )
    assert opt.sites and all("4.weight" not in s.tensor_names for s in opt.sites)
    backward(model, x, y)
    saved = [p.detach().clone() for p in head]
    report = opt.teleport()
    assert report.accepted and any("not updated by the optimizer" in why for why in report.skipped.values()), report.skipped
    assert all(torch.equal(p, s) for p, s in zip(head, saved))


def test_parameters_frozen_after_the_wrapper_is_built_are_never_moved():
    model, (x, y) = mlp(), data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), search=SearchConfig(steps=5), schedule=Schedule())
    backward(model, x, y)
    model[5].weight.requires_grad_(False)
    frozen = model[5].weight.detach().clone()
    report = opt.teleport()
    assert report.accepted and [s.name for s in report.sites] == [mlp_sites()[0].name]
    assert "frozen" in report.skipped[mlp_sites()[1].name]
    assert torch.equal(model[5].weight, frozen)
    assert_checked(report)


def test_a_non_finite_gradient_declines_the_teleport():
    model, (x, y) = mlp(), data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), schedule=Schedule())
    backward(model, x, y)
    model[3].weight.grad[0, 0] = math.nan
    saved = params_of(model)
    report = opt.teleport()
    assert not report.accepted and report.reason == "declined: non-finite gradient (3.weight)"
    assert_bitwise(model, saved)


def test_a_search_that_returns_non_finite_coordinates_declines_and_moves_nothing():
    """A strategy (a learned policy, say) whose coordinates overflow: the teleport is declined in the
    search phase, before anything moves (parameters, gradients and optimizer state bit for bit)."""
    from teleopt.teleport import SearchResult

    class Overflowing:
        def search(self, problem):
            return SearchResult([torch.full_like(c, math.nan) for c in problem.start], None, 0)

    model, (x, y) = mlp(), data()
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = Teleport(base, model, mlp_sites(), search=SearchConfig(strategy=Overflowing()), schedule=Schedule())
    for _ in range(2):
        opt.zero_grad()
        backward(model, x, y)
        opt.base.step()
    saved, grads = params_of(model), [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(base.state_dict())
    report = opt.teleport()
    assert not report.accepted and report.reason == "declined: the search returned non-finite coordinates"
    assert_bitwise(model, saved)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    for i, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(base.state_dict()["state"][i][k], v), (i, k)


def test_the_non_finite_gradient_test_reads_each_gradient_once_and_is_exact():
    """The test sums each gradient (NaN and inf propagate) and only tests elementwise when the sum is
    not finite: a finite gradient whose float32 sum overflows is finite, an inf anywhere is not."""
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.state_policy import StatePolicy
    from teleopt.teleport.verdict import non_finite_gradient

    model = mlp()
    backward(model, *data())
    ctx = TeleportContext.build(model, torch.optim.SGD(model.parameters(), lr=1e-2), StatePolicy())
    assert non_finite_gradient(ctx) is None
    big = torch.finfo(model[3].weight.dtype).max / 2
    model[3].weight.grad.fill_(big)  # every entry finite, the sum overflows to inf
    assert not math.isfinite(float(model[3].weight.grad.sum()))
    assert non_finite_gradient(ctx) is None
    model[3].weight.grad[1, 2] = -math.inf
    assert non_finite_gradient(ctx) == "3.weight"


def test_a_gradient_norm_that_overflows_declines_the_fast_path_before_anything_moves():
    """The fast path reads no gradient for finiteness in its plan phase: its search declines on a non-finite
    gradient norm (a NaN anywhere, or squares that overflow), naming the gradient when an entry is not finite."""
    model, (x, y) = mlp(), data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), schedule=Schedule())
    backward(model, x, y)
    model[5].weight.grad.fill_(torch.finfo(F64).max / 2)  # every entry finite, their squares overflow
    saved, grads = params_of(model), [p.grad.clone() for p in model.parameters()]
    report = opt.teleport()
    assert not report.accepted and report.path == "fast"
    assert report.reason == "declined: non-finite gradient (its norm is not finite)"
    assert_bitwise(model, saved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_moved_gradients_are_proven_finite_only_for_scalings_well_inside_their_dtype():
    """The verify phase skips its pass over the moved gradients when the predicted norm after the teleport bounds
    every entry: positive scalings (entrywise products) with a finite norm below half the dtype's largest value."""
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.fast_path import FastEvaluator
    from teleopt.teleport.state_policy import StatePolicy

    def evaluator(model, sites):
        backward(model, *data(dtype=next(model.parameters()).dtype))
        return FastEvaluator(sites, TeleportContext.build(model, torch.optim.SGD(model.parameters(), lr=1e-2), StatePolicy()))

    scalings = evaluator(mlp(), mlp_sites())
    assert scalings.gradients_finite_after(1.0) and scalings.gradients_finite_after(1e300)
    assert not scalings.gradients_finite_after(torch.finfo(F64).max / 2)
    assert not scalings.gradients_finite_after(math.inf) and not scalings.gradients_finite_after(math.nan)
    half = evaluator(mlp(dtype=torch.float16), mlp_sites())
    assert half.gradients_finite_after(1e4) and not half.gradients_finite_after(4e4)  # float16's largest: 65504
    gl = evaluator(mlp(), [Site(GL, ("0.weight", "0.bias", "3.weight"))])  # matrix products: no entrywise bound
    assert not gl.gradients_finite_after(1.0)


@pytest.mark.parametrize("gl", [False, True])
def test_the_verify_phase_reads_the_moved_gradients_only_when_not_proven_finite(gl):
    """A scaling teleport's verify phase sums no gradient (gradients_finite_after); a GL site's moves them by
    matrix products, which the norm does not bound entrywise, so they are summed after the apply."""
    from torch.overrides import TorchFunctionMode

    model, (x, y) = mlp(), data()
    sites = mlp_sites()
    if gl:  # GL(6) acts exactly on the hidden layer of a linear net
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3)).to(F64)
        sites = [Site(GL, ("0.weight", "0.bias", "1.weight"))]
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, sites, schedule=Schedule())
    backward(model, x, y)
    grads = {p.grad.data_ptr(): name for name, p in model.named_parameters()}
    summed = set()

    class Sums(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "sum" and args and isinstance(args[0], torch.Tensor):
                t = args[0]
                if t.data_ptr() in grads and t.numel() == model.get_parameter(grads[t.data_ptr()]).numel():
                    summed.add(grads[t.data_ptr()])
            return func(*args, **(kwargs or {}))

    with Sums():
        report = opt.teleport()
    assert report.accepted and report.path == "fast"
    assert summed == ({"0.weight", "0.bias", "1.weight"} if gl else set())


def test_probe_inputs_the_model_does_not_take_decline_the_teleport():
    model, (x, y) = mlp(), data()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2), model, mlp_sites(), example_inputs=torch.zeros(2, 4, dtype=F64), schedule=Schedule()
    )
    backward(model, x, y)
    saved = params_of(model)
    report = opt.teleport()
    assert not report.accepted and report.check == "none"
    assert report.reason.startswith("declined: the probe inputs (example_inputs) do not run through the model (RuntimeError")
    assert_bitwise(model, saved)


def test_the_check_keeps_the_output_leaves_and_not_the_whole_output() -> None:
    # a model output can carry more than its tensor leaves (a transformers KV cache object): the check compares
    # leaves only, so it keeps nothing else alive between its two forwards (the whole batch's, since the lean
    # check reads it)
    import gc
    import weakref

    from teleopt.functional import as_batch
    from teleopt.teleport.check import OutputCheck

    class Cache:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class WithCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.last: weakref.ref[Cache] | None = None

        def forward(self, x: torch.Tensor) -> dict[str, object]:
            cache = Cache(x.repeat(4, 1))
            self.last = weakref.ref(cache)
            return {"logits": self.lin(x), "cache": cache}

    model = WithCache()
    check = OutputCheck("batch", as_batch((torch.randn(5, 3), None)), False, 0)
    out = check.reference(model)
    assert len(check.before) == 1 and model.last is not None and model.last() is not None
    del out
    gc.collect()
    assert model.last() is None
