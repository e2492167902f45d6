"""The balance objective: the least weight norm on the orbit, in closed form, exact and cheap.

For a GL site the minimiser is the balanced point g A g^T = g^-T B g^-1 (a LoRA pair B A:
A A^T = B^T B), M P M = Q for M = g^T g solved by the matrix geometric mean
M = P^{-1/2} (P^{1/2} Q P^{1/2})^{1/2} P^{-1/2}, g = M^{1/2}; for positive scalings
|w_in,i| = |w_out,i| per unit.  Checked in float64: the function is unchanged, the Gram
matrices agree afterwards, a balanced site does not move again, and units or blocks
without a balanced point (B = 0, a rank-deficient Gram matrix) stay where they are.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.actions.axis import AxisAction, Member
from teleopt.groups import GeneralLinear, PositiveScaling
from teleopt.teleport import Balance, ClosedForm, GradientAscent, SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.balance import balance_coordinates

pytestmark = pytest.mark.usefixtures("one_thread")

RELU = get_action("positive_rescaling", activation="relu")


def chain(widths, seed=0, scales=None):
    """A float64 ReLU MLP with the given widths; ``scales`` multiply the layers' weights (an imbalanced start)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers).double()
    if scales is not None:
        with torch.no_grad():
            for layer, s in zip(model[::2], scales):
                layer.weight.mul_(s)
                layer.bias.mul_(s)
    return model


def relu_sites(n_hidden):
    return [Site(RELU, (f"{2 * i}.weight", f"{2 * i}.bias", f"{2 * i + 2}.weight")) for i in range(n_hidden)]


def norm_after(sites, model, coords):
    """sum of squared norms of the trainable site members after exp(coords) (autograd through ``act``)."""
    moved = dict(model.named_parameters())
    for site, xi in zip(sites, coords):
        params = tuple(moved[n] for n in site.members)
        g = site.action.group(params).exp(xi)
        for n, t in zip(site.members, site.action.act(g, params)):
            moved[n] = t
    names = {n for s in sites for n in s.tensor_names}
    return sum(moved[n].square().sum() for n in names)


def solve(model, sites, radius=None, **kw):
    tensors = dict(model.named_parameters())
    groups = [s.action.group(s.tensors(model)) for s in sites]
    start = [torch.zeros(g.coord_shape, dtype=torch.float64) for g in groups]
    return balance_coordinates(sites, groups, tensors, set(tensors), [radius] * len(sites), start, **kw)


def test_closed_form_is_the_exact_minimum_for_one_site():
    model = chain([5, 7, 3], scales=[3.0, 0.2])
    sites = relu_sites(1)
    W1, b1, W2 = (t.detach() for t in (model[0].weight, model[0].bias, model[2].weight))
    a = W1.square().sum(1) + b1.square()
    b = W2.square().sum(0)
    found = solve(model, sites)
    # c_i = (b_i / a_i)^(1/4), the ENorm scale
    assert torch.allclose(found.coords[0].exp(), (b / a) ** 0.25, rtol=1e-12, atol=0)
    # brute force: damped Newton steps on the log-scales from the identity (autograd gradient and Hessian) land on
    # the same point.  (Not torch.optim.LBFGS: an LBFGS created before torch.compile first runs gets its step
    # wrapped twice by torch, which doubles the step hooks of every later LBFGS in the session.)
    x = torch.zeros(7, dtype=torch.float64)
    for _ in range(100):
        grad = torch.autograd.functional.jacobian(lambda v: norm_after(sites, model, [v]), x)
        hess = torch.autograd.functional.hessian(lambda v: norm_after(sites, model, [v]), x)
        step = torch.linalg.solve(hess, grad).clamp(-1.0, 1.0)
        x = x - step
        if float(step.abs().max()) < 1e-13:
            break
    assert torch.allclose(x.detach(), found.coords[0], atol=1e-7)
    best = float(norm_after(sites, model, found.coords).detach())
    assert best <= float(norm_after(sites, model, [x.detach()]).detach()) + 1e-12
    # and the closed form is a stationary point to rounding
    xi = found.coords[0].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(norm_after(sites, model, [xi]), xi)
    assert float(grad.abs().max()) < 1e-12 * best


def test_general_powers_take_newton_steps_to_the_same_minimum():
    # relu(z)^2 between the layers: the reader scales by c^-2, so the minimum is c^6 = 2 b / a per unit
    action = get_action("positive_rescaling", activation="relu_power", alpha=2.0)
    gen = torch.Generator().manual_seed(3)
    W1, b1, W2 = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((6, 4), (6,), (3, 6)))
    a = W1.square().sum(1) + b1.square()
    b = W2.square().sum(0)
    group = PositiveScaling(6)
    x = group.balance({1.0: a, -2.0: b}, None)
    assert torch.allclose(x.exp() ** 6, 2 * b / a, rtol=1e-12)
    # three powers: no closed form, Newton; check stationarity of sum_p m_p e^(2 p x)
    m = {1.0: a, -2.0: b, -1.0: b.flip(0)}
    x = group.balance(m, None)
    grad = sum(2 * p * v * torch.exp(2 * p * x) for p, v in m.items())
    assert float(grad.abs().max()) < 1e-9 * float(a.sum())
    assert action.group((W1, b1, W2)).dim == 6


def test_gl_balance_equalises_the_gram_matrices_and_is_stationary():
    gen = torch.Generator().manual_seed(1)
    W1 = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 3.0
    b1 = torch.randn(4, generator=gen, dtype=torch.float64)
    W2 = torch.randn(6, 4, generator=gen, dtype=torch.float64) * 0.1
    site = Site(get_action("gl_linear"), ("W1", "b1", "W2"))
    model = nn.Module()
    for name, t in (("W1", W1), ("b1", b1), ("W2", W2)):
        model.register_parameter(name, nn.Parameter(t.clone()))
    found = solve(model, [site])
    g = GeneralLinear(4).exp(found.coords[0])
    A = W1 @ W1.T + torch.outer(b1, b1)
    B = W2.T @ W2
    left, right = g @ A @ g.T, torch.linalg.solve(g.T, torch.linalg.solve(g.T, B).T)  # g A g^T and g^-T B g^-1
    assert torch.allclose(left, right, rtol=1e-9, atol=1e-9 * float(left.abs().max()))
    # the Lie-algebra gradient of the norm vanishes there (any direction, not only symmetric ones)
    xi = found.coords[0].clone().requires_grad_(True)
    value = norm_after([site], model, [xi])
    (grad,) = torch.autograd.grad(value, xi)
    assert float(grad.abs().max()) < 1e-9 * float(value.detach())
    # and no random nearby element does better
    for _ in range(20):
        step = 0.05 * torch.randn(4, 4, generator=gen, dtype=torch.float64)
        assert float(norm_after([site], model, [found.coords[0] + step]).detach()) >= float(value.detach()) - 1e-12


def test_attention_sites_with_fused_qkv_slices_balance_head_by_head():
    vit = pytest.importorskip("timm.models.vision_transformer")
    from teleopt import find_symmetries

    torch.manual_seed(0)
    attn = vit.Attention(8, num_heads=2, qkv_bias=True).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        attn.qkv.weight[:8].mul_(4.0)  # queries far larger than keys
        attn.qkv.weight[16:].mul_(0.1)  # values far smaller than the output projection
    found = [s for s in find_symmetries(attn, (x,)).sites if s.action.exactness == "exact" and s.action.continuous]
    assert {s.action.name for s in found} == {"attention_qk_gl", "attention_vo_gl"}
    before = attn(x)
    opt = Teleport(
        torch.optim.SGD(attn.parameters(), lr=0.1),
        attn,
        found,
        objective="balance",
        example_inputs=x,
        search=SearchConfig(trust_region=None),
    )
    before.sum().backward()
    report = opt.teleport()
    assert report.accepted, report.reason
    assert report.objective_after < 0.5 * report.objective_before
    after = attn(x)
    assert float(((after - before).abs().max() / before.abs().max()).detach()) < 1e-10
    # both sides of each head now have equal Gram matrices: q rows against k rows, v rows against proj columns
    W = attn.qkv.weight.detach()
    b = attn.qkv.bias.detach()
    for h in range(2):
        rows = slice(4 * h, 4 * h + 4)
        q, k = W[0:8][rows], W[8:16][rows]
        qb = torch.cat([q, b[0:8][rows, None]], 1)
        assert torch.allclose(qb @ qb.T, k @ k.T, rtol=1e-8, atol=1e-8 * float((k @ k.T).abs().max()))
        v = torch.cat([W[16:24][rows], b[16:24][rows, None]], 1)
        o = attn.proj.weight.detach()[:, rows]
        assert torch.allclose(v @ v.T, o.T @ o, rtol=1e-8, atol=1e-8 * float((o.T @ o).abs().max()))


def test_balance_teleport_is_exact_and_lowers_the_weight_norm():
    model = chain([6, 16, 16, 4], scales=[4.0, 0.3, 2.0])
    sites = relu_sites(2)
    x = torch.randn(32, 6, dtype=torch.float64)
    y = torch.randn(32, 4, dtype=torch.float64)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, sites, objective="balance", loss_fn=nn.functional.mse_loss)
    out = model(x).detach()
    nn.functional.mse_loss(model(x), y).backward()
    norm0 = sum(float(p.detach().square().sum()) for p in model.parameters())
    report = opt.teleport(batch=(x, y))
    assert report.accepted and report.path == "fast", report.reason
    assert float((model(x).detach() - out).abs().max() / out.abs().max()) < 1e-10
    norm1 = sum(float(p.detach().square().sum()) for p in model.parameters())
    assert norm1 < 0.5 * norm0
    members = {n for site in sites for n in site.tensor_names}
    counted = sum(float(p.detach().square().sum()) for n, p in model.named_parameters() if n in members)
    assert report.objective_after == pytest.approx(counted, rel=1e-12)  # every parameter but the last bias
    # the gradient moved with the parameters: it equals the gradient at the new point
    moved = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    for g, p in zip(moved, model.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-9, atol=1e-12)


def test_a_chain_of_three_sites_decreases_monotonically_to_a_stationary_point():
    model = chain([5, 12, 10, 8, 3], scales=[5.0, 0.1, 3.0, 0.5], seed=2)
    sites = relu_sites(3)
    found = solve(model, sites, max_sweeps=500, tol=1e-10, trace=True)
    norms = found.norms
    assert len(norms) > 3
    assert all(b <= a * (1 + 1e-14) for a, b in zip(norms, norms[1:]))
    assert norms[-1] < 0.1 * norms[0]
    coords = [c.clone().requires_grad_(True) for c in found.coords]
    value = norm_after(sites, model, coords)
    assert float(value.detach()) == pytest.approx(norms[-1], rel=1e-12)
    grads = torch.autograd.grad(value, coords)
    assert max(float(g.abs().max()) for g in grads) < 1e-8 * float(value.detach())
    # a few sweeps already get most of the way (the default tolerance stops far sooner)
    quick = solve(model, sites, tol=1e-3)
    assert quick.sweeps < found.sweeps
    assert quick.norm_start == pytest.approx(norms[0])


@pytest.mark.parametrize("radius", [None, math.log(4)], ids=["unbounded", "trust-region"])
def test_over_relaxed_sweeps_reach_the_plain_sweeps_minimum_in_fewer_passes(radius, monkeypatch):
    # successive over-relaxation of the scaling sites' block steps (teleopt.teleport.balance.RELAXATION): the same
    # minimum of N as plain block-coordinate descent, within the default tolerance (1e-3) of the converged point,
    # in fewer site solves, and N still decreases at every sweep
    import teleopt.teleport.balance as balance

    model = chain([16, 64, 64, 48, 3], seed=2)  # as initialised: the narrow head's units are the least balanced
    sites = relu_sites(3)
    solves = [0]
    move = balance.WeightNormModel._move

    def counted(self, *args):  # type: ignore[no-untyped-def]
        solves[0] += 1
        return move(self, *args)

    monkeypatch.setattr(balance.WeightNormModel, "_move", counted)
    converged = solve(model, sites, radius=radius, max_sweeps=1000, tol=1e-12)
    found = {}
    for relaxation in (1.0, balance.RELAXATION):
        monkeypatch.setattr(balance, "RELAXATION", relaxation)
        solves[0] = 0
        result = solve(model, sites, radius=radius, trace=True)
        assert all(b <= a * (1 + 1e-14) for a, b in zip(result.norms, result.norms[1:]))
        error = max(float((a - b).abs().max()) for a, b in zip(result.coords, converged.coords))
        found[relaxation] = (solves[0], error, result.norms[-1])
    (plain_solves, plain_error, plain_norm), (solves_, error, norm) = found[1.0], found[balance.RELAXATION]
    assert balance.RELAXATION > 1.0 and solves_ < plain_solves, found
    assert error <= max(plain_error, 1e-3), found  # the documented tolerance: within tol = 1e-3 of the minimum
    assert norm <= plain_norm * (1 + 1e-6), found


def test_the_trust_region_bounds_every_log_scale():
    model = chain([5, 12, 10, 3], scales=[50.0, 0.01, 1.0])
    sites = relu_sites(2)
    r = math.log(2)
    found = solve(model, sites, radius=r, trace=True, tol=0.0, max_sweeps=100)
    assert max(float(c.abs().max()) for c in found.coords) <= r + 1e-15
    assert all(b <= a * (1 + 1e-14) for a, b in zip(found.norms, found.norms[1:]))
    unbounded = solve(model, sites)
    assert found.norms[-1] > float(norm_after(sites, model, unbounded.coords).detach())


def test_gradient_ascent_on_the_balance_objective_does_no_better_than_the_closed_form():
    model = chain([5, 12, 10, 3], scales=[3.0, 0.2, 1.0])
    x = torch.randn(16, 5, dtype=torch.float64)

    def run(search):
        m = chain([5, 12, 10, 3], scales=[3.0, 0.2, 1.0])
        opt = Teleport(torch.optim.SGD(m.parameters(), lr=1e-2), m, relu_sites(2), objective="balance", search=search)
        m(x).sum().backward()
        return opt.teleport()

    closed = run(None)
    ascent = run(SearchConfig(strategy=GradientAscent(steps=200, lr=0.05)))
    assert closed.accepted and ascent.accepted
    assert closed.objective_after <= ascent.objective_after + 1e-9
    assert model is not None


def test_optimizer_state_is_transported_by_the_scaling_rules():
    model = chain([6, 10, 4], scales=[3.0, 0.3])
    sites = relu_sites(1)
    x = torch.randn(16, 6, dtype=torch.float64)
    opt = Teleport(torch.optim.Adam(model.parameters(), lr=1e-3), model, sites, objective="balance")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    opt.zero_grad()
    model(x).square().mean().backward()
    report = opt.teleport()
    assert report.accepted, report.reason
    c = report.elements[sites[0].name]
    params = dict(model.named_parameters())
    # rows of layer 0 scale by c: their covectors by 1/c, second moments by 1/c^2; columns of layer 2 the inverse
    expected = {
        "0.weight": (1 / c[:, None], 1 / c[:, None] ** 2),
        "0.bias": (1 / c, 1 / c**2),
        "2.weight": (c[None, :], c[None, :] ** 2),
    }
    for name, (first, second) in expected.items():
        now = opt.state[params[name]]
        assert torch.allclose(now["exp_avg"], state[name]["exp_avg"] * first, rtol=1e-12)
        assert torch.allclose(now["exp_avg_sq"], state[name]["exp_avg_sq"] * second, rtol=1e-12)
        assert now["step"] == state[name]["step"]
    assert report.state_decisions.get("transport", 0) > 0


def test_a_teleport_without_schedule_arguments_never_fires_at_step_zero():
    model = chain([6, 10, 4])
    x = torch.randn(16, 6, dtype=torch.float64)

    def steps(opt, n):
        for _ in range(n):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [r.step for r in opt.reports]

    # a manual schedule (the papers' grad_norm objective, chosen by giving a schedule) teleports only on request
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), schedule=Schedule())
    assert opt.objective.name == "grad_norm" and opt.schedule.manual and steps(opt, 60) == []
    # balance: every 200 steps from step 200
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance")
    assert not opt.schedule.due(0, 0)
    assert steps(opt, 401) == [200, 400]
    # a given schedule replaces it all
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance", schedule=Schedule(every=50, warmup=70)
    )
    assert [t for t in range(200) if opt.schedule.due(t, 0)] == [70, 120, 170]
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance", schedule=Schedule(at=[3]))
    assert [t for t in range(200) if opt.schedule.due(t, 0)] == [3]


def test_auto_leaves_out_normalisation_affine_sites_under_adaptive_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="normalisation-affine"):
        adam = Teleport(torch.optim.AdamW(model.parameters()), model, "auto", example_inputs=x, schedule=Schedule())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, "auto", example_inputs=x, schedule=Schedule())
    names = lambda opt: {n for s in opt.sites for n in s.tensor_names}  # noqa: E731
    assert "2.weight" in names(sgd) and "2.weight" not in names(adam)
    assert "3.weight" in names(adam)  # the rescaling between the two later layers stays


def test_a_watch_rollback_backs_off_only_until_a_teleport_comes_through():
    model = chain([6, 10, 4], scales=[3.0, 0.3])
    x = torch.randn(16, 6, dtype=torch.float64)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        model,
        relu_sites(1),
        objective="balance",
        safety=SafetyConfig(watch_steps=3, backoff=0.5),
        schedule=Schedule(at=[2]),
    )
    opt.record.backoff = 0.25  # as after two rollbacks
    for _ in range(8):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert opt.reports[0].accepted
    assert opt.record.rollbacks == 0 and opt.record.backoff == 0.5


def test_balance_objective_is_registered_and_validated():
    model = chain([3, 4, 2])
    t = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, relu_sites(1), objective="balance")
    assert isinstance(t.objective, Balance) and t.objective.direction == "decrease"
    with pytest.raises(ValueError, match="max_sweeps"):
        Balance(max_sweeps=0)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="fraction"):
            Balance(fraction=bad)
    for bad in (0, 1, -1e-3):
        with pytest.raises(ValueError, match="rcond"):
            Balance(rcond=bad)
    with pytest.raises(ValueError, match="min_move"):
        Balance(min_move=-1)
    # the closed form is chosen unless a strategy is given
    assert isinstance(SearchConfig().strategy_for(Balance()), ClosedForm)
    assert isinstance(SearchConfig(strategy=GradientAscent(3, 0.1)).strategy_for(Balance()), GradientAscent)
    with pytest.raises(TypeError, match="objective='balance'"):
        SearchConfig(strategy=Balance())  # type: ignore[arg-type]  # the former search-strategy spelling


# -- the balanced point of one site (ported from the LoRA balance search) -----------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def balance_site(action, tensors, radius=None, **kw):
    """One site of ``action`` on the named ``tensors`` (dict, in member order), every member counted: its
    coordinates, and the tensors moved by exp of them."""
    names = tuple(tensors)
    site = Site(action, names)
    params = tuple(tensors.values())
    group = action.group(params)
    start = [torch.zeros(group.coord_shape, dtype=torch.float64)]
    found = balance_coordinates([site], [group], tensors, set(names), [radius], start, **kw)
    assert not found.skipped
    xi = found.coords[0]
    return xi, action.act(group.exp(xi), params)


@pytest.mark.parametrize("seed, scale_b", [(0, 1.0), (1, 1e-3), (2, 30.0)])
def test_lora_pair_is_balanced_and_unchanged(seed, scale_b):
    action = get_action("lora_gl")  # U (out, r) = B, V (r, in) = A
    g = _gen(seed)
    B = torch.randn(9, 4, generator=g, dtype=torch.float64) * scale_b
    A = torch.randn(4, 7, generator=g, dtype=torch.float64)
    xi, (B2, A2) = balance_site(action, {"B": B, "A": A})
    assert torch.allclose(xi, xi.mT, atol=1e-14)  # symmetric: g = exp(xi) is SPD
    assert _rel(B2 @ A2, B @ A) <= 1e-13  # the symmetry: B A unchanged
    assert _rel(A2 @ A2.T, B2.T @ B2) <= 1e-12  # balanced: A A^T = B^T B (measured ~5e-15)
    again, _ = balance_site(action, {"B": B2, "A": A2})
    assert float(again.abs().max()) <= 1e-12


def test_orthonormal_rows_give_the_fourth_root():
    """With A A^T = I the balancing element is (B^T B)^{1/4}."""
    action = get_action("lora_gl")
    g = _gen(3)
    A = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0].T  # (3, 8), orthonormal rows
    B = torch.randn(5, 3, generator=g, dtype=torch.float64)
    xi, _ = balance_site(action, {"B": B, "A": A})
    lam, vec = torch.linalg.eigh(B.T @ B)
    fourth_root = (vec * lam**0.25) @ vec.T
    assert _rel(torch.linalg.matrix_exp(xi), fourth_root) <= 1e-12


@pytest.mark.parametrize("radius", [None, math.log(4)])
def test_singular_gram_matrices_do_not_move(radius):
    """LoRA's initialisation B = 0, or A of rank 2 < r, has no balanced point in GL_r: zero coordinates."""
    action = get_action("lora_gl")
    A = torch.randn(4, 7, generator=_gen(4), dtype=torch.float64)
    xi, (B2, A2) = balance_site(action, {"B": torch.zeros(9, 4, dtype=torch.float64), "A": A}, radius)
    assert float(xi.abs().max()) == 0.0 and torch.equal(A2, A) and not B2.any()
    low = torch.randn(4, 2, generator=_gen(5), dtype=torch.float64) @ torch.randn(2, 7, generator=_gen(6), dtype=torch.float64)
    B = torch.randn(9, 4, generator=_gen(7), dtype=torch.float64)
    xi, (B2, A2) = balance_site(action, {"B": B, "A": low}, radius)
    assert float(xi.abs().max()) == 0.0 and torch.equal(A2, low) and torch.equal(B2, B)
    # per block: a singular block stays, the others balance
    grp = GeneralLinear(4, blocks=2)
    eye = torch.eye(4, dtype=torch.float64)
    P = torch.stack([A[:, :4] @ A[:, :4].T, eye])
    Q = torch.stack([B.T @ B, torch.zeros(4, 4, dtype=torch.float64)])
    coords = grp.balance({1.0: P, -1.0: Q}, radius)
    assert torch.isfinite(coords).all() and float(coords[1].abs().max()) == 0.0 and float(coords[0].abs().max()) > 0.1


def test_units_without_a_balanced_point_stay():
    """A unit whose outgoing column is zero (or a site with one side only) keeps its scale."""
    group = PositiveScaling(3)
    a = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64)
    b = torch.tensor([16.0, 0.0, 2.0], dtype=torch.float64)
    for radius in (None, 0.5):
        x = group.balance({1.0: a, -1.0: b}, radius)
        assert torch.isfinite(x).all() and float(x[1]) == 0.0
        assert float(x[0]) == pytest.approx(min(math.log(2.0), radius or math.inf)) and float(x[2]) == 0.0
        assert float(group.balance({1.0: a}, radius).abs().max()) == 0.0  # no readers at all
        assert float(GeneralLinear(2).balance({-1.0: torch.eye(2, dtype=torch.float64)}, radius).abs().max()) == 0.0


def test_blocks_and_slices_balance_per_block():
    """Per-head GL (blocks) on slices of a fused tensor: each block balanced on its own."""
    h, d = 2, 3
    action = AxisAction(
        "heads",
        "general",
        (Member("qkv", 0, 1, start=0, stop=h * d), Member("out", 1, -1)),
        blocks=h,
    )
    g = _gen(5)
    qkv = torch.randn(3 * h * d, 4, generator=g, dtype=torch.float64)
    out = torch.randn(5, h * d, generator=g, dtype=torch.float64) * 0.1
    xi, (qkv2, out2) = balance_site(action, {"qkv": qkv, "out": out})
    assert xi.shape == (h, d, d)
    assert torch.equal(qkv2[h * d :], qkv[h * d :])  # outside the slice: untouched
    for b in range(h):
        rows = qkv2[b * d : (b + 1) * d]
        cols = out2[:, b * d : (b + 1) * d]
        assert _rel(rows @ rows.T, cols.T @ cols) <= 1e-12
    assert _rel(out2 @ qkv2[: h * d], out @ qkv[: h * d]) <= 1e-13


def test_positive_rescaling_balances_each_unit():
    action = get_action("positive_rescaling", activation="relu")  # W1 rows and b1 by c, W2 columns by 1/c
    g = _gen(6)
    W1, b1, W2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in [(6, 4), (6,), (3, 6)])
    xi, (W1b, b1b, W2b) = balance_site(action, {"W1": W1, "b1": b1, "W2": W2})
    assert xi.shape == (6,)
    writers = W1b.square().sum(1) + b1b.square()
    assert _rel(writers, W2b.square().sum(0)) <= 1e-13


def test_other_groups_have_no_closed_form():
    perm = get_action("hidden_permutation")
    group = perm.group(perm.example().params)
    assert not group.has_balance and group.balance({1.0: torch.ones(group.dim)}, None) is None


def _linear_net(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.Linear(4, 6, bias=False)).to(dtype)


def test_balance_teleport_on_a_gl_site_is_exact_and_moves_state():
    """objective="balance" on a GL site: outputs unchanged, balanced, exp_avg moved like the gradient."""
    model = _linear_net()
    site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=0.05),
        model,
        [site],
        objective="balance",
        safety=SafetyConfig(max_predicted_decrease=None),
        search=SearchConfig(trust_region=None),
    )
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    assert opt.reports == []  # the default schedule starts at step 200
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    out = model(x).detach()
    W1, W2 = model[0].weight, model[1].weight
    m1, v1 = (opt.state[W1][k].clone() for k in ("exp_avg", "exp_avg_sq"))
    report = opt.teleport()
    assert report.accepted and report.state_decisions.get("transport") and report.state_decisions.get("fallback:keep")
    assert _rel(model(x).detach(), out) <= 1e-12
    assert _rel(W1 @ W1.T, W2.T @ W2) <= 1e-12
    g = report.elements[site.name]
    assert _rel(opt.state[W1]["exp_avg"], torch.linalg.solve(g.T, m1)) <= 1e-12  # covector: g^{-T} m
    assert torch.equal(opt.state[W1]["exp_avg_sq"], v1)  # no exact rule under GL: kept (the default fallback)
    again = opt.teleport()
    assert not again.accepted and again.reason == "declined: no improvement found"  # already balanced


def test_b_zero_declines_the_teleport_and_leaves_the_weights():
    """A LoRA-like pair at B = 0: nothing moves, nothing becomes non-finite, the teleport is declined."""
    model = _linear_net()
    with torch.no_grad():
        model[1].weight.zero_()
    before = [p.detach().clone() for p in model.parameters()]
    site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    opt = Teleport(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model, [site], objective="balance", search=SearchConfig(trust_region=None)
    )
    x = torch.randn(8, 5, dtype=torch.float64)
    model(x).square().sum().backward()
    report = opt.teleport()
    assert not report.accepted and report.reason == "declined: no improvement found"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fraction_moves_part_of_the_way():
    def teleported(**kw):
        model = _linear_net()
        with torch.no_grad():
            model[1].weight.mul_(1e-2)  # far from balanced
        site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
        opt = Teleport(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model,
            [site],
            objective=Balance(**kw),
            safety=SafetyConfig(max_predicted_decrease=None),
            search=SearchConfig(trust_region=None),
        )
        model(torch.randn(8, 5, dtype=torch.float64)).square().sum().backward()
        report = opt.teleport()
        assert report.accepted, report.reason
        return report.elements[site.name], model

    full, _ = teleported()
    half, model = teleported(fraction=0.5)
    assert _rel(half @ half, full) <= 1e-10  # exp(xi / 2) squared is exp(xi)
    W1, W2 = model[0].weight.detach(), model[1].weight.detach()
    assert _rel(W1 @ W1.T, W2.T @ W2) > 1e-3  # halfway: not balanced yet


def test_trust_region_clips_the_balance():
    model = _linear_net()
    with torch.no_grad():
        model[1].weight.mul_(1e-3)  # far from balanced
    site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    x = torch.randn(8, 5, dtype=torch.float64)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, [site], objective="balance")
    model(x).square().sum().backward()
    report = opt.teleport()
    assert report.accepted and report.coordinate_norms[site.name] <= math.log(4.0) + 1e-12


def test_independent_lora_pairs_of_one_rank_are_solved_in_one_batched_call(monkeypatch):
    """Sites sharing no tensor are independent: GL sites of one size go to one ``balance_many`` (a stacked,
    batched eigendecomposition), which gives each pair what its own ``balance`` gives (float64, 1e-12:
    the same LAPACK routine per block), and every pair ends balanced, A A^T = B^T B."""
    action = get_action("lora_gl")
    g = _gen(11)
    tensors = {}
    for k, scale in enumerate((1.0, 1e-2, 20.0)):
        tensors[f"B{k}"] = torch.randn(9, 4, generator=g, dtype=torch.float64) * scale
        tensors[f"A{k}"] = torch.randn(4, 7, generator=g, dtype=torch.float64)
    sites = [Site(action, (f"B{k}", f"A{k}")) for k in range(3)]
    groups = [action.group((tensors[f"B{k}"], tensors[f"A{k}"])) for k in range(3)]
    start = [torch.zeros(grp.coord_shape, dtype=torch.float64) for grp in groups]
    calls = []
    many = GeneralLinear.balance_many
    monkeypatch.setattr(GeneralLinear, "balance_many", lambda self, *a, **k: calls.append(len(a[0])) or many(self, *a, **k))
    found = balance_coordinates(sites, groups, tensors, set(tensors), [None] * 3, start)
    assert calls == [3] and found.sweeps == 1
    for k, (grp, xi) in enumerate(zip(groups, found.coords)):
        alone, _ = balance_site(action, {f"B{k}": tensors[f"B{k}"], f"A{k}": tensors[f"A{k}"]})
        assert _rel(xi, alone) <= 1e-12
        B2, A2 = action.act(grp.exp(xi), (tensors[f"B{k}"], tensors[f"A{k}"]))
        assert _rel(A2 @ A2.T, B2.T @ B2) <= 1e-12
