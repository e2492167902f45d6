"""The balance objective: the least weight norm on the orbit, in closed form, exact and cheap."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.groups import GeneralLinear, PositiveScaling
from teleopt.teleport import Balance, GradientAscent, SafetyConfig, SearchConfig, Teleport
from teleopt.teleport.balance import balance_coordinates

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
    # brute force: gradient descent on the log-scales from the identity lands on the same point
    x = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([x], lr=1, max_iter=200, tolerance_grad=1e-14, tolerance_change=1e-16, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = norm_after(sites, model, [x])
        value.backward()
        return value

    opt.step(closure)
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
    opt = Teleport(torch.optim.SGD(attn.parameters(), lr=0.1), attn, found, objective="balance", trust_region=None)
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

    # the default objective (grad_norm) teleports only on request
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1))
    assert opt.schedule.manual and steps(opt, 60) == []
    # balance: every 50 steps from step 50
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance")
    assert not opt.schedule.due(0, 0)
    assert steps(opt, 101) == [50, 100]
    # a given warm-up replaces the default one; a given schedule replaces it all
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance", warmup=70)
    assert [t for t in range(200) if opt.schedule.due(t, 0)] == [70, 120, 170]
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2), model, relu_sites(1), objective="balance", at=[3])
    assert [t for t in range(200) if opt.schedule.due(t, 0)] == [3]


def test_auto_leaves_out_normalisation_affine_sites_under_adaptive_optimizers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="normalisation-affine"):
        adam = Teleport(torch.optim.AdamW(model.parameters()), model, "auto", example_inputs=x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, "auto", example_inputs=x)
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
        at=[2],
        safety=SafetyConfig(watch_steps=3, backoff=0.5),
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
