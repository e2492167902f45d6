"""Fast path: closed-form transport over group coordinates (Zhao 2026, Prop. 4.5.1), tested in float64.

Tolerances: exact symmetries in float64 reach ~1e-15 relative error; with scales in
[1/4, 4] and GL elements of condition number < 10 the error stays below 1e-12, so
1e-10 (teleopt.testing.default_rtol) leaves margin while catching any real error
(a wrong exponent or a first-order inverse gives 1e-3 or more).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from torch import nn

from teleopt import AxisAction, Member, Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.gradient_norm import GradientNormModel
from teleopt.teleport.transport import transport
from teleopt.testing import assert_close, seeds

RTOL = 1e-10
LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def mlp(seed: int = 0, bias: bool = True) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 6, bias=bias), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=bias), nn.LeakyReLU(0.1), nn.Linear(7, 3)
    ).double()


def rescaling_sites(bias: bool = True) -> list[Site]:
    return [
        Site(LEAKY, ("0.weight", "0.bias" if bias else None, "2.weight")),
        Site(LEAKY, ("2.weight", "2.bias" if bias else None, "4.weight")),
    ]


def data(seed: int = 1, n: int = 16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen, dtype=torch.float64), torch.randn(n, 3, generator=gen, dtype=torch.float64)


def mse(out, y):
    return ((out - y) ** 2).mean()


def true_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = mse(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def linear_mlp(seed: int) -> nn.Sequential:
    """A linear hidden layer (identity activation): GL_6 between layers 0 and 2 is exact."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Identity(), nn.Linear(6, 7), nn.LeakyReLU(0.1), nn.Linear(7, 3)).double()


FAMILIES = {
    "rescalings": (lambda seed: mlp(seed), lambda: rescaling_sites()),
    "GL and rescaling": (
        linear_mlp,
        lambda: [Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight")), Site(LEAKY, ("2.weight", "2.bias", "4.weight"))],
    ),
}


@settings(deadline=None, max_examples=4)
@given(seed=seeds())
@example(seed=0)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_teleport_is_exact_and_moves_grad_to_the_new_gradient(family, seed):
    """Loss unchanged, .grad equal to autograd at g . w (Prop. 4.5.1), gradient norm raised."""
    make_model, make_sites = FAMILIES[family]
    model = make_model(seed % 1000)
    x, y = data(seed % 997 + 1)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, make_sites(), search=SearchConfig(steps=10), schedule=Schedule())
    loss, _ = true_gradients(model, x, y)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = opt.teleport()
    assert report.accepted and report.path == "fast"
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    moved = {n: p.grad.clone() for n, p in model.named_parameters()}
    new_loss, fresh = true_gradients(model, x, y)
    assert abs(new_loss - loss) <= RTOL * loss
    for n in fresh:
        assert_close(moved[n], fresh[n], RTOL, f"transported .grad of {n}")
    assert report.gain > 1 and report.grad_norm_after == pytest.approx(
        math.sqrt(sum(float(g.square().sum()) for g in fresh.values())), rel=1e-10
    )


def test_teleport_with_closure_verifies_the_loss():
    model = mlp()
    x, y = data()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, rescaling_sites(), schedule=Schedule())

    def closure():
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        return loss

    report = opt.teleport(closure)
    assert report.accepted
    assert report.loss_drift is not None and report.loss_drift <= RTOL


def _gl(name: str, members: tuple[Member, ...], **kw) -> AxisAction:
    return AxisAction(name, "general", members, **kw)


def _site_configs():
    """(sites, tensors) exercising each reduction and the explicit fallback."""
    gen = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    scaling = get_action("positive_rescaling", activation="relu")
    relu_sq = get_action("positive_rescaling", activation="relu_power", alpha=2.0)
    gl = get_action("gl_linear")
    tensors = {"w1": r(6, 5), "b1": r(6), "w2": r(7, 6), "b2": r(7), "w3": r(3, 7), "conv": r(6, 4, 3, 3)}
    qkv = AxisAction(
        "fused_qk",
        "general",
        (Member("Q", 0, 1, start=0, stop=4), Member("K", 0, -1, start=4, stop=8)),
        blocks=2,
    )
    tensors["qkv"] = r(12, 5)
    vo = AxisAction("fused_vo", "general", (Member("V", 0, 1, start=8, stop=12), Member("O", 1, -1)), blocks=2)
    tensors["o"] = r(3, 4)
    tensors["qkv_bias"] = r(12)
    qk_bias = AxisAction("fused_qk_bias", "general", (Member("Q", 0, 1, start=0, stop=4), Member("Qb", 0, 1, start=0, stop=4)), blocks=2)
    return [
        ("overlapping scalings", [Site(scaling, ("w1", "b1", "w2")), Site(relu_sq, ("w2", "b2", "w3"))]),
        ("scaling on conv", [Site(AxisAction("c", "diagonal", (Member("W", 0), Member("V", 1, -1))), ("conv", "w2"))]),
        ("single GL", [Site(gl, ("w1", "b1", "w2"))]),
        ("two GL on one tensor", [Site(gl, ("w1", "b1", "w2")), Site(gl, ("w2", "b2", "w3"))]),
        ("fused qkv slices", [Site(qkv, ("qkv", "qkv"))]),
        ("fused qkv with vo", [Site(qkv, ("qkv", "qkv")), Site(vo, ("qkv", "o"))]),
        ("sliced bias, k rows unmoved", [Site(qk_bias, ("qkv", "qkv_bias"))]),
        ("GL beside scaling", [Site(gl, ("w1", "b1", "w2")), Site(scaling, ("w2", "b2", "w3"))]),
    ], tensors


CONFIGS, TENSORS = _site_configs()


@settings(deadline=None, max_examples=10)
@given(seed=seeds())
@example(seed=0)
@pytest.mark.parametrize("label,sites", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_reduced_gradient_norm_equals_explicit_transport(label, sites, seed):
    gen = torch.Generator().manual_seed(seed)
    names = {n for s in sites for n in s.tensor_names}
    like = {n: TENSORS[n] for n in names}
    grads = {n: torch.randn(TENSORS[n].shape, generator=gen, dtype=torch.float64) for n in names}
    model = GradientNormModel(sites, grads, like)
    elements = []
    for s in sites:
        group = s.action.group(tuple(None if n is None else like[n] for n in s.members))
        coords = torch.randn(group.coord_shape, generator=gen, dtype=torch.float64) * 0.3
        elements.append(s.action.exp(coords, tuple(None if n is None else like[n] for n in s.members)))
    moved, _ = transport(sites, elements, grads, like, "covector")
    explicit = sum(float(t.square().sum()) for t in moved.values())
    assert float(model.value(elements)) == pytest.approx(explicit, rel=1e-12)


def test_reductions_are_used_where_they_apply():
    sites = dict(CONFIGS)
    like = TENSORS

    def model_for(label):
        s = sites[label]
        names = {n for site in s for n in site.tensor_names}
        return GradientNormModel(s, {n: like[n] for n in names}, like)

    assert not model_for("overlapping scalings").explicit
    assert not model_for("single GL").explicit
    assert model_for("two GL on one tensor").explicit
    assert not model_for("fused qkv slices").explicit  # each slice reduces on its own (Gram matrix per slice)
    assert not model_for("fused qkv with vo").explicit
    assert model_for("fused qkv slices").remainders == [("qkv", pytest.approx(float(like["qkv"][8:].square().sum())))]


def test_a_tensor_between_two_sites_is_read_in_row_chunks_without_its_square():
    """The tensor two chained scalings act on is kept as its gradient (no squared copy): its value away from
    the identity is summed a chunk of rows at a time (600 rows of 2048: 3 chunks), the identity's value and
    gradient come from its margins, and autograd elsewhere squares it once; all agree with the explicit
    transport to float64 round-off.  A gradient changed after the reduction is refused, not read stale."""
    gen = torch.Generator().manual_seed(3)
    like = {
        n: torch.randn(*shape, generator=gen, dtype=torch.float64)
        for n, shape in [("w1", (600, 8)), ("w2", (2048, 600)), ("w3", (5, 2048))]
    }
    grads = {n: torch.randn(t.shape, generator=gen, dtype=torch.float64) for n, t in like.items()}
    scaling = get_action("positive_rescaling", activation="relu")
    sites = [Site(scaling, ("w1", None, "w2")), Site(scaling, ("w2", None, "w3"))]
    model = GradientNormModel(sites, grads, like)
    middle = next(r for r in model.reduced if r.name == "w2")
    assert middle._S is None and len(middle._rows()) == 3
    elements = [torch.exp(0.3 * torch.randn(n, generator=gen, dtype=torch.float64)) for n in (600, 2048)]
    moved, _ = transport(sites, elements, grads, like, "covector")
    explicit = sum(float(t.square().sum()) for t in moved.values())
    assert float(model.value(elements)) == pytest.approx(explicit, rel=1e-12)
    assert middle._S is None  # no autograd: still no square
    identity = [torch.ones(n, dtype=torch.float64, requires_grad=True) for n in (600, 2048)]
    value = model.value(identity)
    assert float(value.detach()) == pytest.approx(sum(float(g.square().sum()) for g in grads.values()), rel=1e-12)
    (d_first,) = torch.autograd.grad(value, identity[0])  # d/dc_i at the identity: -2 (row sums of w1 - column sums of w2)
    expected = -2 * (grads["w1"].square().sum(1) - grads["w2"].square().sum(0))
    torch.testing.assert_close(d_first, expected, rtol=1e-12, atol=1e-9)
    tracked = [e.clone().requires_grad_(True) for e in elements]
    assert float(model.value(tracked).detach()) == pytest.approx(explicit, rel=1e-12)
    assert middle._S is not None  # autograd away from the identity squares it once
    fresh = GradientNormModel(sites, grads, like)
    grads["w2"].mul_(2.0)
    with pytest.raises(RuntimeError, match="changed after its reduction"):
        fresh.value(elements)


@pytest.mark.parametrize("label", ["single GL", "fused qkv with vo", "GL beside scaling", "overlapping scalings", "orthogonal"])
def test_the_value_and_gradient_at_the_identity_match_the_explicit_transport(label):
    """At the identity the reduced terms return their sum (tr K, sum S) and, for autograd, their linearisation
    there, with no solve or contraction: value and gradient in the elements must equal autograd through the
    explicit transport of the gradients, to float64 round-off."""
    orthogonal = AxisAction("o", "orthogonal", (Member("W", 0), Member("b", 0, optional=True), Member("V", 1, -1)))
    sites = dict(CONFIGS, orthogonal=[Site(orthogonal, ("w1", "b1", "w2"))])[label]
    gen = torch.Generator().manual_seed(5)
    names = {n for s in sites for n in s.tensor_names}
    like = {n: TENSORS[n] for n in names}
    grads = {n: torch.randn(TENSORS[n].shape, generator=gen, dtype=torch.float64) for n in names}
    model = GradientNormModel(sites, grads, like)

    def identity():
        return [g.identity(dtype=torch.float64).requires_grad_(True) for g in model.groups]

    fast, explicit = identity(), identity()
    value = model.value(fast)
    moved, _ = transport(sites, explicit, grads, like, "covector")
    reference = sum(t.square().sum() for t in moved.values())
    assert float(value.detach()) == pytest.approx(float(reference.detach()), rel=1e-12)
    for got, want in zip(torch.autograd.grad(value, fast), torch.autograd.grad(reference, explicit)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_fused_slices_transport_like_separate_tensors():
    """Members sharing a tensor on disjoint slices compose like the same action on split tensors."""
    gen = torch.Generator().manual_seed(3)
    qkv = TENSORS["qkv"]
    fused = dict(CONFIGS)["fused qkv slices"][0]
    split = AxisAction("split_qk", "general", (Member("Q", 0, 1), Member("K", 0, -1)), blocks=2)
    g = fused.action.exp(torch.randn(2, 2, 2, generator=gen, dtype=torch.float64) * 0.5, (qkv, qkv))
    moved, _ = transport([fused], [g], {"qkv": qkv}, {"qkv": qkv}, "params")
    q, k = split.act(g, (qkv[:4], qkv[4:8]))
    assert_close(moved["qkv"], torch.cat([q, k, qkv[8:]]), RTOL, "fused qkv")


def test_overlapping_sites_compose_in_list_order():
    """Sites act in list order on the result of the sites before; scalings on different axes commute."""
    gl = get_action("gl_linear")
    w = {"w1": TENSORS["w1"], "b1": TENSORS["b1"], "w2": TENSORS["w2"]}
    gen = torch.Generator().manual_seed(5)
    params = (w["w1"], w["b1"], w["w2"])
    g1 = gl.exp(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3, params)
    g2 = gl.exp(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.3, params)
    site = Site(gl, ("w1", "b1", "w2"))
    moved, _ = transport([site, site], [g1, g2], w, w, "params")
    expected = gl.act(gl.compose(g2, g1), params)
    for n, e in zip(("w1", "b1", "w2"), expected):
        assert_close(moved[n], e, RTOL, f"{n} after g1 then g2")
    swapped, _ = transport([site, site], [g2, g1], w, w, "params")
    assert (swapped["w1"] - moved["w1"]).abs().max() > 1e-3  # GL on one axis: the order matters

    sites = rescaling_sites(bias=False)
    model = mlp(bias=False)
    live = {n: p.detach() for n, p in model.named_parameters()}
    c1 = torch.exp(torch.randn(6, generator=gen, dtype=torch.float64))
    c2 = torch.exp(torch.randn(7, generator=gen, dtype=torch.float64))
    a, _ = transport(sites, [c1, c2], live, live, "params")
    b, _ = transport(sites[::-1], [c2, c1], live, live, "params")
    for n in a:
        assert_close(a[n], b[n], RTOL, f"{n}: scalings of rows and columns commute")


@pytest.mark.parametrize("kind", ["params", "covector", "second_moment"])
def test_in_place_transport_is_bitwise_the_out_of_place_one(kind):
    """transport_ (the apply phase: no copies of whole tensors) multiplies each tensor in place by exactly the
    factors transport() uses, in the same order, and writes a GL site's moved part over the part; it touches
    nothing where a site has no in-place rule (GL second moments, outer/inner layouts)."""
    from teleopt.teleport.transport import transport_

    gen = torch.Generator().manual_seed(11)
    sites = rescaling_sites()  # two chained rescalings with biases: w2 is scaled on both axes
    live = {n: p.detach() for n, p in mlp().named_parameters()}
    elements = [torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)) for n in (6, 7)]
    values = {n: t.clone().float() for n, t in live.items()}  # float32: the factors are cast as act_on_axis casts them
    expected, missing = transport(sites, elements, values, live, kind)
    assert not missing
    ids = {n: id(t) for n, t in values.items()}
    assert transport_(sites, elements, values, live, kind)
    for n, t in values.items():
        assert id(t) == ids[n] and torch.equal(t, expected[n]), n  # the same tensor, bitwise the same values
    gl = Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight"))
    g = get_action("gl_linear").exp(0.1 * torch.randn(6, 6, generator=gen, dtype=torch.float64), (live["0.weight"], None, live["2.weight"]))
    before = {n: t.clone() for n, t in values.items()}
    expected, missing = transport([gl, *sites], [g, *elements], values, live, kind)
    if kind == "second_moment":  # GL has no elementwise rule for second moments: transport() keeps them
        assert not transport_([gl], [g], values, live, kind)
        assert all(torch.equal(values[n], before[n]) for n in values)  # untouched
        return
    assert transport_([gl, *sites], [g, *elements], values, live, kind)  # GL, then scalings on the same tensors
    for n, t in values.items():
        assert id(t) == ids[n] and torch.equal(t, expected[n]), n
    interleaved = AxisAction("interleaved", "general", [Member("w", 1, -1, inner=2)])  # 2.weight's 6 columns as 3 x 2
    before = {n: t.clone() for n, t in values.items()}
    site = Site(interleaved, ("2.weight",))
    assert not transport_([site], [torch.eye(3, dtype=torch.float64)], values, live, kind)  # an inner layout
    assert all(torch.equal(values[n], before[n]) for n in values)


@pytest.mark.parametrize("kind", ["params", "covector"])
def test_in_place_transport_of_fused_qkv_slices_is_bitwise(kind):
    """Two GL sites on slices of one fused qkv weight (q and k rows by one, v rows and the output projection's
    columns by the other, as find_symmetries builds them for timm attention): transport_ moves each slice
    where it lies, bitwise what transport() returns by copying and concatenating whole tensors."""
    from teleopt.teleport.transport import transport_

    gen = torch.Generator().manual_seed(5)
    heads, d = 2, 3
    qk = AxisAction(
        "qk",
        "general",
        [
            Member("qkv[q]", 0, 1, start=0, stop=heads * d, tensor="qkv"),
            Member("bias_q", 0, 1, start=0, stop=heads * d),
            Member("qkv[k]", 0, -1, start=heads * d, stop=2 * heads * d, tensor="qkv"),
        ],
        blocks=heads,
    )
    vo = AxisAction("vo", "general", [Member("qkv", 0, 1, start=2 * heads * d, stop=3 * heads * d), Member("proj", 1, -1)], blocks=heads)
    live = {
        "qkv": torch.randn(3 * heads * d, 4, generator=gen),
        "bias": torch.randn(3 * heads * d, generator=gen),
        "proj": torch.randn(4, heads * d, generator=gen),
    }
    sites = [Site(qk, ("qkv", "bias", "qkv")), Site(vo, ("qkv", "proj"))]
    elements = [torch.linalg.matrix_exp(0.3 * torch.randn(heads, d, d, generator=gen, dtype=torch.float64)) for _ in sites]
    values = {n: t.clone() for n, t in live.items()}
    expected, _ = transport(sites, elements, values, live, kind)
    assert not torch.equal(expected["qkv"], live["qkv"])
    ids = {n: id(t) for n, t in values.items()}
    assert transport_(sites, elements, values, live, kind)
    for n, t in values.items():
        assert id(t) == ids[n] and torch.equal(t, expected[n]), n


def test_a_diagonal_teleport_moves_the_live_tensors_in_place():
    """After a fast-path teleport of rescaling sites under Adam the parameters, .grad and moments are the same
    tensor objects as before (moved in place), with the values the out-of-place transport gives."""
    sites = rescaling_sites()
    model, base, opt = _adam_setup(sites)
    params = dict(model.named_parameters())
    ids = {n: (id(p.grad), id(base.state[p]["exp_avg"]), id(base.state[p]["exp_avg_sq"])) for n, p in params.items()}
    like = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: p.grad.clone() for n, p in params.items()}
    report = opt.teleport()
    assert report.accepted
    elements = [report.elements[s.name] for s in sites]
    moved_params, _ = transport(sites, elements, like, like, "params")
    moved_grads, _ = transport(sites, elements, grads, like, "covector")
    for n, p in params.items():
        assert (id(p.grad), id(base.state[p]["exp_avg"]), id(base.state[p]["exp_avg_sq"])) == ids[n]
        assert torch.equal(p.detach(), moved_params[n].to(p.dtype)) and torch.equal(p.grad, moved_grads[n].to(p.dtype)), n


def _adam_setup(action_sites, state_policy=None):
    model = mlp()
    x, y = data()
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = Teleport(base, model, action_sites, state_policy=state_policy, search=SearchConfig(steps=20), schedule=Schedule())
    for _ in range(3):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    mse(model(x), y).backward()
    return model, base, opt


def test_adam_state_is_transported_exactly_for_scalings():
    sites = rescaling_sites()
    model, base, opt = _adam_setup(sites)
    params = dict(model.named_parameters())
    old = {n: {k: v.clone() for k, v in base.state[p].items()} for n, p in params.items()}
    report = opt.teleport()
    assert report.accepted
    elements = [report.elements[s.name] for s in sites]
    like = {n: p.detach() for n, p in params.items()}
    m, _ = transport(sites, elements, {n: old[n]["exp_avg"] for n in params}, like, "covector")
    v, _ = transport(sites, elements, {n: old[n]["exp_avg_sq"] for n in params}, like, "second_moment")
    for n, p in params.items():
        assert_close(base.state[p]["exp_avg"], m[n], RTOL, f"exp_avg of {n}")
        assert_close(base.state[p]["exp_avg_sq"], v[n], RTOL, f"exp_avg_sq of {n}")
        assert torch.equal(base.state[p]["step"], old[n]["step"])
    assert report.state_decisions["transport"] > 0


def test_gl_second_moments_fall_back_and_are_reported():
    model = mlp()
    gl = get_action("gl_linear")
    model[1] = nn.Identity()  # linear between layer 0 and 2: GL_6 is exact
    x, y = data()
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = Teleport(base, model, [Site(gl, ("0.weight", "0.bias", "2.weight"))], search=SearchConfig(steps=10), schedule=Schedule())
    for _ in range(2):
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    mse(model(x), y).backward()
    w2 = model[2].weight
    v_before = base.state[w2]["exp_avg_sq"].clone()
    report = opt.teleport()
    assert report.accepted
    assert report.state_decisions.get("fallback:keep", 0) >= 3  # exp_avg_sq of 0.weight, 0.bias, 2.weight
    assert torch.equal(base.state[w2]["exp_avg_sq"], v_before)


def test_reset_policy_gives_a_fresh_adam_state():
    model, base, opt = _adam_setup(rescaling_sites(), state_policy={"exp_avg_sq": "reset"})
    report = opt.teleport()
    assert report.accepted
    w = model[0].weight
    assert float(base.state[w]["exp_avg_sq"].abs().max()) == 0.0
    assert float(base.state[w]["exp_avg"].abs().max()) == 0.0  # reset with it: bias correction restarts
    assert float(base.state[w]["step"]) == 0.0
    assert report.state_decisions["reset:bias-correction"] > 0


def test_adagrad_sum_is_kept_by_default_and_transported_on_request():
    for policy, expect_same in ((None, True), ({"sum": "transport"}, False)):
        model = mlp()
        x, y = data()
        base = torch.optim.Adagrad(model.parameters(), lr=0.01)
        opt = Teleport(base, model, rescaling_sites(), state_policy=policy, schedule=Schedule())
        opt.zero_grad()
        mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        mse(model(x), y).backward()
        w = model[2].weight
        before = base.state[w]["sum"].clone()
        assert opt.teleport().accepted
        assert torch.equal(base.state[w]["sum"], before) is expect_same


def test_trust_region_bounds_the_log_scales():
    model = mlp()
    x, y = data()
    r = 0.3
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01), model, rescaling_sites(), search=SearchConfig(trust_region=r), schedule=Schedule()
    )
    true_gradients(model, x, y)
    report = opt.teleport()
    assert report.accepted
    for s in opt.sites:
        assert float(report.elements[s.name].log().abs().max()) <= r + 1e-12
    assert max(report.coordinate_norms.values()) == pytest.approx(r)  # the gradient norm pins the boundary


def test_gain_cap_holds():
    model = mlp()
    x, y = data()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model,
        rescaling_sites(),
        safety=SafetyConfig(max_gain=2.0, max_predicted_decrease=None),
        search=SearchConfig(trust_region=3.0),
        schedule=Schedule(),
    )
    true_gradients(model, x, y)
    report = opt.teleport()
    assert report.accepted and report.shrink < 1
    assert 1.0 < report.gain <= 2.0


def test_predicted_decrease_cap_ties_the_gain_to_the_learning_rate():
    """With the loss known, lr * ||grad'||^2 <= ratio * (L - floor) for SGD."""
    model = mlp()
    x, y = data()
    lr, ratio = 0.5, 0.5
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=lr),
        model,
        rescaling_sites(),
        loss_fn=mse,
        safety=SafetyConfig(max_predicted_decrease=ratio),
        search=SearchConfig(trust_region=3.0),
        schedule=Schedule(),
    )
    true_gradients(model, x, y)
    report = opt.teleport(batch=(x, y))
    assert report.accepted
    assert lr * report.grad_norm_after**2 <= ratio * report.loss_before * (1 + 1e-9)
    assert report.shrink < 1


def test_preconditioned_sharpness_is_the_top_eigenvalue():
    from teleopt.teleport.safety import preconditioned_sharpness

    gen = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64)).Q
    A = Q @ torch.diag(torch.tensor([5.0, 3.0, 2.0, 1.0, 0.5, 0.1], dtype=torch.float64)) @ Q.T
    w = {"w": torch.randn(6, generator=gen, dtype=torch.float64)}
    lam, _ = preconditioned_sharpness(lambda t: 0.5 * t["w"] @ A @ t["w"], w, {"w": torch.full((6,), 0.1, dtype=torch.float64)}, 200, gen)
    assert lam == pytest.approx(0.5, rel=1e-8)  # lambda_max(lr A) = 0.1 * 5


def test_stability_margin_keeps_the_teleported_point_stable():
    """lambda_max(P H) at g . w stays below margin x 2 (GD) although the gradient norm still grows."""
    from teleopt.teleport.safety import preconditioned_sharpness

    model = mlp()
    x, y = data()
    lr, margin = 0.05, 0.5
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=lr),
        model,
        rescaling_sites(),
        loss_fn=mse,
        safety=SafetyConfig(max_predicted_decrease=None, stability_margin=margin, stability_iterations=50),
        search=SearchConfig(trust_region=3.0),
        schedule=Schedule(),
    )
    true_gradients(model, x, y)
    report = opt.teleport(batch=(x, y))
    assert report.accepted and report.gain > 1 and report.shrink < 1
    assert report.sharpness_before < margin * 2
    params = {n: p.detach() for n, p in model.named_parameters()}
    P = {n: torch.full_like(p, lr) for n, p in params.items()}
    lam, _ = preconditioned_sharpness(
        lambda t: mse(torch.func.functional_call(model, t, (x,)), y), params, P, 300, torch.Generator().manual_seed(1)
    )
    assert lam <= margin * 2 * 1.02  # power iteration inside the cap: 50 rounds, 2% slack


def test_end_search_frees_the_gradient_norm_terms_and_later_values_raise():
    """After the search the evaluator drops the gradient norm's reduced terms (a GL site's float64 Gram
    matrices, which were alive at the apply's peak): a value asked for afterwards raises instead of being
    answered from nothing, and the apply still moves the gradients to the norm the search predicted."""
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.fast_path import FastEvaluator

    gl = Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight"))
    model, base, opt = _adam_setup([gl])
    evaluator = FastEvaluator([gl], TeleportContext.build(model, base, opt._engine.config.policy))
    gen = torch.Generator().manual_seed(4)
    elements = evaluator.elements([0.2 * torch.randn(6, 6, generator=gen, dtype=torch.float64)])
    predicted = float(evaluator.grad_norm_sq(elements))
    assert evaluator.norm_model.reduced
    evaluator.end_search()
    assert not evaluator.norm_model.reduced and "_norm_memo" not in evaluator.__dict__
    with pytest.raises(RuntimeError, match="released after the search"):
        evaluator.grad_norm_sq(elements)
    with pytest.raises(RuntimeError, match="released after the search"):
        evaluator.site_gain(0, elements[0], 1.0)
    evaluator.apply(elements)
    moved = sum(float(p.grad.square().sum()) for p in model.parameters())
    assert moved == pytest.approx(predicted, rel=1e-12)


def test_a_shared_identity_is_the_identity_without_memory_per_block():
    """shared_identity equals identity; a block-diagonal matrix group's blocks share one n x n identity
    (a broadcast view), which refuses writes; other groups return their identity."""
    from teleopt.groups import GeneralLinear, Orthogonal, PositiveScaling

    for group in (GeneralLinear(5, blocks=4), Orthogonal(3, blocks=2), GeneralLinear(4), PositiveScaling(6)):
        shared = group.shared_identity()
        assert torch.equal(shared, group.identity())
    shared = GeneralLinear(5, blocks=4).shared_identity()
    assert shared.untyped_storage().nbytes() == 5 * 5 * 8  # one block's worth of float64
    with pytest.raises(RuntimeError):
        shared.add_(1.0)
