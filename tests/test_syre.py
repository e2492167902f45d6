"""Syre (Ziyin et al. 2025, eq. 6 / eq. 7): anchors, equivalence to the paper's formulation, state, options, errors."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from teleopt.syre import Syre, fan_in
from teleopt.syre_anchors import decay_list
from teleopt.testing import assert_close
from teleopt.testing.conformance import WrapperConformance
from teleopt.wrapper import OptimizerWrapper

# float64 comparisons of two algebraically identical update rules that round differently
# (e.g. g + gamma (p - a) vs grad at (theta + a) + gamma theta): the per-step rounding is
# ~1e-16 relative and 20 steps of Adam/SGD amplify it by at most a few orders: 1e-10 leaves margin
# while any modelling error (a factor 2 in gamma, a sign, a missing D) is >= 1e-3.
RTOL = 1e-10


def problem(seed: int = 0, dtype=torch.float64):
    """A two-layer tanh regression with 2-D weights only: (6, 4) and (2, 6)."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(6, 4, generator=g, dtype=dtype) * 0.5, torch.randn(2, 6, generator=g, dtype=dtype) * 0.4]
    x = torch.randn(16, 4, generator=g, dtype=dtype)
    y = torch.randn(16, 2, generator=g, dtype=dtype)

    def loss(ws):
        return ((torch.tanh(x @ ws[0].T) @ ws[1].T - y) ** 2).mean()

    return init, loss


def params_from(tensors):
    return [torch.nn.Parameter(t.clone()) for t in tensors]


def train(opt, params, loss, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss(params).backward()
        opt.step()


# -- anchors --------------------------------------------------------------------------------


def test_fan_in_matches_torch_init():
    for shape in [(5, 3), (8, 4, 3, 3), (6, 2, 5), (3, 0)]:
        assert fan_in(shape) == torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))[0]
    assert fan_in((7,)) is None and fan_in(()) is None


def test_anchor_scale_is_sigma0_over_sqrt_fan_in():
    conv = torch.nn.Parameter(torch.zeros(128, 32, 3, 3))
    syre = Syre(torch.optim.SGD([conv], lr=0.1), gamma=0.1, sigma0=0.02)
    anchor = syre.anchor(conv)
    expected = 0.02 / math.sqrt(32 * 9)
    # 36864 Gaussian draws: the sample std has relative standard error 1/sqrt(2N) = 0.4%; 3% is > 7 sigma.
    assert abs(float(anchor.std()) / expected - 1) < 0.03
    assert abs(float(anchor.mean())) < 5 * expected / math.sqrt(anchor.numel())


def test_anchors_depend_on_seed_and_index_only():
    def anchors(seed, shapes, global_seed):
        torch.manual_seed(global_seed)  # the global RNG must not matter
        ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        syre = Syre(torch.optim.SGD(ps, lr=0.1), gamma=0.1, seed=seed)
        return [syre.anchor(p) for p in ps]

    a = anchors(7, [(4, 3), (4, 3)], 0)
    b = anchors(7, [(4, 3), (4, 3)], 1)
    c = anchors(8, [(4, 3), (4, 3)], 0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1]), "two tensors of the same shape must get different anchors"
    assert not torch.equal(a[0], c[0])


def test_anchors_follow_the_parameter_dtype_and_are_the_same_numbers():
    shapes = [(5, 3)]
    p32 = torch.nn.Parameter(torch.zeros(shapes[0]))
    p16 = torch.nn.Parameter(torch.zeros(shapes[0], dtype=torch.bfloat16))
    p64 = torch.nn.Parameter(torch.zeros(shapes[0], dtype=torch.float64))
    a32, a16, a64 = (Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1).anchor(p) for p in (p32, p16, p64))
    assert (a32.dtype, a16.dtype, a64.dtype) == (torch.float32, torch.bfloat16, torch.float64)
    assert torch.equal(a16, a32.to(torch.bfloat16))  # drawn in float32, then rounded
    assert_close(a64.float(), a32, rtol=1e-6, what="float64 anchor vs float32 anchor")


def test_regenerated_anchors_equal_stored_ones():
    init, loss = problem()
    runs = []
    for store in (True, False):
        ps = params_from(init)
        syre = Syre(torch.optim.Adam(ps, lr=0.01), gamma=0.3, sigma0=0.5, diagonal_eps=0.2, store_anchors=store)
        train(syre, ps, loss, 5)
        runs.append((ps, syre))
    (ps_a, syre_a), (ps_b, syre_b) = runs
    for p, q in zip(ps_a, ps_b):
        assert torch.equal(p, q)
        assert torch.equal(syre_a.anchor(p), syre_b.anchor(q)) and torch.equal(syre_a.diagonal(p), syre_b.diagonal(q))
    assert len(syre_b._anchors) == 0, "regenerated anchors must not be kept"
    assert all(Syre.prefix + "anchor" not in entry for entry in syre_b.state_dict()["state"].values())


def test_diagonal_is_uniform_in_one_plus_minus_eps():
    p = torch.nn.Parameter(torch.zeros(200, 50))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1, diagonal_eps=0.25)
    d = syre.diagonal(p)
    assert float(d.min()) >= 0.75 and float(d.max()) <= 1.25
    # 10^4 uniform draws: the mean has standard error 0.25/sqrt(3 * 10^4) = 1.4e-3.
    assert abs(float(d.mean()) - 1) < 0.01 and abs(float(d.std()) - 0.25 / math.sqrt(3)) < 0.01
    assert Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1).diagonal(p) is None


# -- what the update is equivalent to ----------------------------------------------------------


@pytest.mark.parametrize(
    ("make_base", "decoupled"),
    [
        (lambda ps, wd: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=wd), False),
        (lambda ps, wd: torch.optim.Adam(ps, lr=0.01, weight_decay=wd), False),
        (lambda ps, wd: torch.optim.AdamW(ps, lr=0.01, weight_decay=wd), True),
    ],
    ids=["sgd_momentum_coupled", "adam_coupled", "adamw_decoupled"],
)
def test_syre_is_the_papers_biased_model_with_standard_weight_decay(make_base, decoupled):
    """Ziyin et al. 2025, Sec. 5.4: train theta on l(theta + theta_0) with the optimizer's own weight decay gamma."""
    init, loss = problem(1)
    gamma = 0.2
    ps = params_from(init)
    syre = Syre(make_base(ps, 0.0), gamma=gamma, sigma0=2.0, decoupled=decoupled)
    anchors = [syre.anchor(p).clone() for p in ps]
    train(syre, ps, loss, 20)

    thetas = params_from([t - a for t, a in zip(init, anchors)])
    paper = make_base(thetas, gamma)
    train(paper, thetas, lambda th: loss([t + a for t, a in zip(th, anchors)]), 20)
    for p, t, a in zip(ps, thetas, anchors):
        assert_close(p.detach(), (t + a).detach(), RTOL, what="syre weights vs theta + theta_0")
    assert float((ps[0].detach() - init[0]).norm()) > 0.1, "the run must move"


def test_coupled_eq7_trains_on_loss_plus_penalty():
    init, loss = problem(2)
    ps = params_from(init)
    syre = Syre(torch.optim.SGD(ps, lr=0.05, momentum=0.9), gamma=0.3, sigma0=2.0, diagonal_eps=0.4)
    reference = params_from(init)
    anchors = [syre.anchor(p).clone() for p in ps]
    ds = [syre.diagonal(p).clone() for p in ps]
    sgd = torch.optim.SGD(reference, lr=0.05, momentum=0.9)

    def regularised(ws):
        return loss(ws) + sum(0.15 * ((w - a) ** 2 * d).sum() for w, a, d in zip(ws, anchors, ds))

    train(syre, ps, loss, 20)
    train(sgd, reference, regularised, 20)
    for p, r in zip(ps, reference):
        assert_close(p.detach(), r.detach(), RTOL, what="coupled eq. 7 vs SGD on loss + (gamma/2)|w - a|_D^2")


def test_penalty_gradient_is_the_coupled_decay():
    init, _ = problem(3)
    ps = params_from(init)
    syre = Syre(torch.optim.SGD(ps, lr=0.1), gamma=0.7, sigma0=1.0, diagonal_eps=0.3)
    syre.penalty().backward()
    for p in ps:
        expected = 0.7 * syre.diagonal(p) * (p - syre.anchor(p))
        assert_close(p.grad, expected.detach(), 1e-14, what="d penalty / dw")


def test_coupled_and_decoupled_agree_for_plain_sgd_and_differ_for_adam():
    init, loss = problem(4)
    finals = {}
    for name, make in {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}.items():
        for decoupled in (False, True):
            ps = params_from(init)
            train(Syre(make(ps), gamma=0.5, sigma0=2.0, decoupled=decoupled), ps, loss, 20)
            finals[name, decoupled] = ps
    for p, q in zip(finals["sgd", False], finals["sgd", True]):
        assert_close(p.detach(), q.detach(), RTOL, what="SGD coupled vs decoupled")
    gap = max(float((p - q).detach().abs().max()) for p, q in zip(finals["adam", False], finals["adam", True]))
    assert gap > 1e-4, f"coupled and decoupled Adam should differ, max gap {gap:.2e}"


def test_data_gradient_is_left_for_the_caller():
    init, loss = problem(5)
    ps = params_from(init)
    syre = Syre(torch.optim.Adam(ps, lr=0.01), gamma=0.5)
    loss(ps).backward()
    grads = [p.grad.clone() for p in ps]
    objects = [p.grad for p in ps]
    syre.step()
    assert all(p.grad is g for p, g in zip(ps, objects))
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads))


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("diagonal_eps", [0.0, 0.3])
def test_foreach_and_for_loop_give_the_same_bits(decoupled, diagonal_eps):
    init, loss = problem(6, dtype=torch.float32)
    runs = []
    for foreach in (True, False):
        ps = params_from(init)
        syre = Syre(
            torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=foreach),
            gamma=0.3,
            sigma0=1.0,
            decoupled=decoupled,
            diagonal_eps=diagonal_eps,
        )
        train(syre, ps, loss, 5)
        runs.append(ps)
    assert all(torch.equal(p, q) for p, q in zip(*runs))


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("foreach", [False, True])
def test_reused_and_fresh_buffers_give_the_same_bits(decoupled, foreach):
    """CPU steps reuse a w - theta_0 buffer; accelerators allocate it per step: same arithmetic either way."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5, 2, 3)]

    def draw():
        return [torch.randn(s, generator=g) for s in shapes]

    params, grads, anchors, diagonals = draw(), draw(), draw(), [1 + 0.2 * torch.rand(s, generator=g) for s in shapes]
    outcomes = []
    for scratch in (None, [torch.empty(s) for s in shapes]):
        ps = [p.clone() for p in params]
        new = decay_list(ps, grads, anchors, diagonals, 0.3, decoupled, foreach, scratch)
        outcomes.append(ps + list(new))
    assert all(torch.equal(a, b) for a, b in zip(*outcomes))
    assert decoupled or all(not torch.equal(n, gr) for n, gr in zip(outcomes[0][2:], grads))


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("store_anchors", [True, False])
@pytest.mark.parametrize("diagonal_eps", [0.0, 0.3])
def test_gamma_zero_is_bitwise_the_base(decoupled, store_anchors, diagonal_eps):
    init, loss = problem(7, dtype=torch.float32)
    bare_ps, syre_ps = params_from(init), params_from(init)
    bare = torch.optim.AdamW(bare_ps, lr=0.01, weight_decay=0.05)
    syre = Syre(
        torch.optim.AdamW(syre_ps, lr=0.01, weight_decay=0.05),
        gamma=0.0,
        decoupled=decoupled,
        diagonal_eps=diagonal_eps,
        store_anchors=store_anchors,
    )
    train(bare, bare_ps, loss, 6)
    train(syre, syre_ps, loss, 6)
    assert all(torch.equal(p, q) for p, q in zip(bare_ps, syre_ps))


def test_maximize_still_decays_towards_the_anchor():
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    syre = Syre(torch.optim.SGD([p], lr=0.1, maximize=True), gamma=0.5, sigma0=1.0)
    a = syre.anchor(p).clone()
    start = (p - a).detach().clone()
    p.grad = torch.zeros_like(p)
    syre.step()
    assert_close((p - a).detach(), 0.95 * start, 1e-14, what="p - a after one maximize step")


def test_bfloat16_parameters():
    p = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.5, sigma0=1.0, decoupled=True)
    p.grad = torch.zeros_like(p)
    start = float((p.detach().float() - syre.anchor(p).float()).norm())
    syre.step()
    assert syre.anchor(p).dtype == torch.bfloat16
    assert float((p.detach().float() - syre.anchor(p).float()).norm()) < start


# -- groups and options ---------------------------------------------------------------------


def test_per_group_options_opt_out_and_exclusion():
    w1, w2 = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 4))
    bias = torch.nn.Parameter(torch.randn(4))
    base = torch.optim.SGD([{"params": [w1, bias]}, Syre.param_group([w2], enabled=False)], lr=0.1)
    syre = Syre(base, gamma=0.5, exclude_1d=True)
    grads = {w1: torch.randn(4, 3), w2: torch.randn(5, 4), bias: torch.randn(4)}
    before = {p: p.detach().clone() for p in grads}
    for p, g in grads.items():
        p.grad = g.clone()
    syre.step()
    # Opted-out and excluded tensors take exactly the bare SGD step; w1 is also decayed.
    assert torch.equal(w2, before[w2].add(grads[w2], alpha=-0.1))
    assert torch.equal(bias, before[bias].add(grads[bias], alpha=-0.1))
    assert not torch.equal(w1, before[w1].add(grads[w1], alpha=-0.1))
    for p in (w2, bias):
        with pytest.raises(ValueError, match="not a parameter syre acts on"):
            syre.anchor(p)
    assert set(syre.state_dict()["state"]) == {0}


def test_group_fan_in_override_decays_biases():
    bias = torch.nn.Parameter(torch.zeros(10000))
    syre = Syre(torch.optim.SGD([Syre.param_group(bias, fan_in=100)], lr=0.1), gamma=0.5, sigma0=0.1)
    # 10^4 draws: relative standard error of the std 0.7%.
    assert abs(float(syre.anchor(bias).std()) / (0.1 / 10) - 1) < 0.05


def test_scheduled_gamma_is_read_every_step():
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.5, sigma0=1.0)
    a = syre.anchor(p).clone()
    p.grad = torch.zeros_like(p)
    start = (p - a).detach().clone()
    syre.param_groups[0][Syre.prefix + "gamma"] = 1.0
    syre.step()
    assert_close((p - a).detach(), 0.9 * start, 1e-14, what="decay with the new gamma")


def test_base_weight_decay_warns():
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.warns(UserWarning, match="weight_decay > 0 in param group"):
        Syre(torch.optim.AdamW([p], lr=0.01), gamma=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Syre(torch.optim.AdamW([p], lr=0.01, weight_decay=0.0), gamma=0.1)
        Syre(torch.optim.AdamW([p], lr=0.01), gamma=0.0)
    syre = Syre(torch.optim.SGD([p], lr=0.01), gamma=0.1)
    with pytest.warns(UserWarning, match=r"weight_decay > 0 in param group\(s\) \[1\]"):
        syre.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))], "weight_decay": 0.1})


def test_add_param_group_gets_anchors_and_validation():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1, seed=9)
    q = torch.nn.Parameter(torch.randn(5, 2))
    syre.add_param_group({"params": iter([q])})
    assert syre.param_groups[-1][Syre.prefix + "seed"] == 9
    other = Syre(torch.optim.SGD([torch.nn.Parameter(torch.randn(4, 3)), q], lr=0.1), gamma=0.1, seed=9)
    assert torch.equal(syre.anchor(q), other.anchor(q)), "index 1 draws the same anchor whichever way it was added"
    with pytest.raises(ValueError, match="overflow"):
        syre.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], Syre.prefix + "sigma0": 1e40})
    assert len(syre.param_groups) == 2, "a rejected group must not stay in the base"


# -- state ------------------------------------------------------------------------------------


def test_loaded_anchors_win_over_the_seed():
    init, loss = problem(8)
    ps = params_from(init)
    syre = Syre(torch.optim.Adam(ps, lr=0.01), gamma=0.5, sigma0=2.0, diagonal_eps=0.2, seed=1)
    train(syre, ps, loss, 3)
    buffer = io.BytesIO()
    torch.save(syre.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    # Different seed and regenerated anchors: the checkpoint's anchors (and D) must still be used.
    other_ps = params_from([p.detach() for p in ps])
    other = Syre(torch.optim.Adam(other_ps, lr=0.01), gamma=0.5, sigma0=2.0, diagonal_eps=0.2, seed=2, store_anchors=False)
    other.load_state_dict(state)
    train(syre, ps, loss, 3)
    train(other, other_ps, loss, 3)
    assert all(torch.equal(p, q) for p, q in zip(ps, other_ps))


def test_regenerated_state_dict_restores_the_seed():
    init, loss = problem(9)
    ps = params_from(init)
    syre = Syre(torch.optim.SGD(ps, lr=0.05), gamma=0.5, sigma0=2.0, seed=11, store_anchors=False)
    train(syre, ps, loss, 2)
    state = syre.state_dict()
    assert state["param_groups"][0][Syre.prefix + "seed"] == 11
    other_ps = params_from([p.detach() for p in ps])
    other = Syre(torch.optim.SGD(other_ps, lr=0.05), gamma=0.5, sigma0=2.0, seed=12)
    other.anchor(other_ps[0])  # materialised with seed 12 ...
    other.load_state_dict(state)  # ... and dropped: seed 11 now
    assert torch.equal(other.anchor(other_ps[0]), syre.anchor(ps[0]))


def test_anchors_are_created_on_the_parameters_device_and_dtype_at_first_use():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1)
    p.data = p.data.double()  # what model.to(float64) does after the optimizer was made
    assert syre.anchor(p).dtype == torch.float64


# -- composition ----------------------------------------------------------------------------


class Counting(OptimizerWrapper):
    """A minimal wrapper with a state counter (stands in for Teleport's schedule counter)."""

    prefix = "teleopt_counting_"

    def __init__(self, optimizer):
        super().__init__(optimizer, {"every": 2})
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._run_closure(closure)
        self.count += 1
        self._base.step()
        return loss

    def _wrapper_state(self):
        return {}, {"count": self.count}

    def _load_wrapper_state(self, per_param, top):
        self.count = int(top["count"])


@pytest.mark.parametrize("order", ["syre_outside", "syre_inside"])
@pytest.mark.parametrize("check", ["resume", "deepcopy", "hooks", "add_param_group", "shares_param_groups"])
def test_composition_with_another_wrapper(order, check):
    def outside(base):
        return Syre(Counting(base), gamma=0.05, sigma0=0.5, exclude_1d=True)

    def inside(base):
        return Counting(Syre(base, gamma=0.05, sigma0=0.5, exclude_1d=True))

    WrapperConformance(outside if order == "syre_outside" else inside, base="adam", n_groups=2).run(check)


def test_composed_state_dict_nests():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(Counting(torch.optim.SGD([p], lr=0.1)), gamma=0.1)
    p.grad = torch.randn(4, 3)
    syre.step()
    state = syre.state_dict()
    assert state["teleopt_counting"] == {"count": 1}
    assert Syre.prefix + "anchor" in state["state"][0]
    fresh_p = torch.nn.Parameter(p.detach().clone())
    fresh = Syre(Counting(torch.optim.SGD([fresh_p], lr=0.1)), gamma=0.1, seed=5)
    fresh.load_state_dict(state)
    assert fresh.base.count == 1 and torch.equal(fresh.anchor(fresh_p), syre.anchor(p))


def test_syre_inside_syre_is_rejected():
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="already wrapped by Syre"):
        Syre(Counting(Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1)), gamma=0.1)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gamma": -0.1}, ValueError, "gamma must be >= 0"),
        ({"gamma": float("nan")}, ValueError, "gamma must be a finite real number"),
        ({"gamma": True}, TypeError, "gamma"),
        ({"gamma": 0.1, "sigma0": -1.0}, ValueError, "sigma0 must be >= 0"),
        ({"gamma": 0.1, "diagonal_eps": 1.0}, ValueError, "diagonal_eps must lie in"),
        ({"gamma": 0.1, "diagonal_eps": -0.1}, ValueError, "diagonal_eps"),
        ({"gamma": 0.1, "decoupled": 1}, TypeError, "decoupled must be a bool"),
        ({"gamma": 0.1, "exclude_1d": "yes"}, TypeError, "exclude_1d must be a bool"),
        ({"gamma": 0.1, "seed": 1.5}, TypeError, "seed must be an int"),
        ({"gamma": 0.1, "store_anchors": None}, TypeError, "store_anchors must be a bool"),
    ],
)
def test_bad_options(kwargs, error, match):
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(error, match=match):
        Syre(torch.optim.SGD([p], lr=0.1), **kwargs)


def test_bad_parameters_and_groups():
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        Syre([torch.nn.Parameter(torch.randn(2, 2))], gamma=0.1)
    with pytest.raises(ValueError, match=r"parameter 1 \(param group 0, shape \(2, 2\)\): sigma0 .* overflow"):
        Syre(torch.optim.SGD([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))], lr=0.1), gamma=0.1, sigma0=1e39)
    with pytest.raises(ValueError, match="fan_in must be a positive int"):
        Syre(torch.optim.SGD([Syre.param_group([torch.nn.Parameter(torch.randn(3))], fan_in=0)], lr=0.1), gamma=0.1)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        Syre(torch.optim.SGD([Syre.param_group([torch.nn.Parameter(torch.randn(3, 3))], gamma=-1.0)], lr=0.1), gamma=0.1)
    with pytest.raises(TypeError, match="unknown syre option"):
        Syre.param_group([torch.nn.Parameter(torch.randn(3, 3))], gama=0.1)
    integer = torch.zeros(3, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="floating-point parameters"):
        Syre(torch.optim.SGD([integer], lr=0.1), gamma=0.1)


def test_negative_gamma_set_later_fails_at_step():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1)
    syre.param_groups[0][Syre.prefix + "gamma"] = -0.5
    p.grad = torch.zeros_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        syre.step()
    assert torch.equal(p, before)


def test_parameters_moved_after_their_anchors_were_made_fail_before_any_change():
    # On a CPU-only machine a dtype cast stands in for a device move: both go through the same check.
    p = torch.nn.Parameter(torch.randn(4, 3))
    q = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([q, p], lr=0.1), gamma=0.1)
    syre.anchor(p)  # stored as float32
    p.data = p.data.double()
    p.grad = torch.zeros(4, 3, dtype=torch.float64)
    q.grad = torch.ones(4, 3)
    before = q.detach().clone()
    with pytest.raises(ValueError, match=r"parameter 1 is a torch.float64 tensor on cpu but its anchor is a torch.float32"):
        syre.step()
    assert torch.equal(q, before), "nothing may change when an anchor does not match"


def test_bad_state_dicts():
    p = torch.nn.Parameter(torch.randn(4, 3))
    syre = Syre(torch.optim.SGD([p], lr=0.1), gamma=0.1)
    state = syre.state_dict()
    state["state"][0][Syre.prefix + "anchor"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"anchor of parameter 0 has shape \(3, 4\)"):
        syre.load_state_dict(state)
    state = syre.state_dict()
    state["state"][0][Syre.prefix + "bogus"] = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="unexpected entry 'teleopt_syre_bogus'"):
        syre.load_state_dict(state)


def test_sparse_gradients_need_decoupled_mode():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    syre = Syre(torch.optim.SGD(embedding.parameters(), lr=0.1), gamma=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        syre.step()
