"""General path (torch.func on a batch), the objectives of Zhao 2026, Ch. 5, and paper_compat.

float64 tolerances as in test_teleport_fast_path.py (1e-10 for exact symmetries);
data-dependent actions are exact on their batch, solved by least squares in
float64, which keeps the batch loss to ~1e-14 relative.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import example, given, settings
from torch import nn

from teleopt import Site, get_action
from teleopt.teleport import Curvature, Schedule, SearchConfig, Sharpness, Teleport
from teleopt.testing import assert_close, seeds

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")

RTOL = 1e-10
LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)
DD = get_action("data_dependent_gl", activation="leaky_relu", negative_slope=0.1)


def mse(out, y):
    return ((out - y) ** 2).mean()


def sse(out, y):
    return 0.5 * ((out - y) ** 2).sum()


def paper_mlp(seed=12345, dtype=torch.float32):
    """Zhao 2026, Sec. 4.6.1: W3 8x7, W2 7x6, W1 6x5, X 5x4, Y 8x4, all U[0, 1), LeakyReLU 0.1, no biases."""
    torch.manual_seed(seed)
    W = [torch.rand(6, 5), torch.rand(7, 6), torch.rand(8, 7)]
    X, Y = torch.rand(5, 4), torch.rand(8, 4)
    model = nn.Sequential(
        nn.Linear(5, 6, bias=False), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=False), nn.LeakyReLU(0.1), nn.Linear(7, 8, bias=False)
    )
    with torch.no_grad():
        for layer, w in zip(model[::2], W):
            layer.weight.copy_(w)
    return model.to(dtype), X.T.contiguous().to(dtype), Y.T.contiguous().to(dtype)


def dd_sites():
    return [Site(DD, ("0.weight", None, "2.weight"), data_input="0"), Site(DD, ("2.weight", None, "4.weight"), data_input="2")]


def grads_at(model, x, y, loss_fn):
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@settings(deadline=None, max_examples=3)
@given(seed=seeds())
@example(seed=12345)
def test_data_dependent_chain_is_exact_on_the_batch(seed):
    """Eq. 4.13 on both hidden layers, each reading its input after the layers below moved."""
    model, X, Y = paper_mlp(seed=seed, dtype=torch.float64)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        model,
        dd_sites(),
        loss_fn=sse,
        search=SearchConfig(steps=20, trust_region=0.5),
        schedule=Schedule(),
    )
    loss, _ = grads_at(model, X, Y, sse)
    report = opt.teleport(batch=(X, Y))
    assert report.path == "general" and report.accepted
    assert report.loss_drift <= RTOL and report.gain > 1
    moved = [p.grad.clone() for p in model.parameters()]
    new_loss, fresh = grads_at(model, X, Y, sse)
    assert abs(new_loss - loss) <= RTOL * loss
    for i, (m, f) in enumerate(zip(moved, fresh)):
        assert_close(m, f, RTOL, f".grad {i} is the gradient at the teleported point")


def test_general_path_leaves_batchnorm_statistics_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double().train()
    relu = get_action("positive_rescaling", activation="relu")
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        [Site(relu, ("1.weight", "1.bias", "3.weight"))],
        objective="lookahead",
        loss_fn=mse,
        search=SearchConfig(steps=5),
    )
    grads_at(model, x, y, mse)
    buffers = copy.deepcopy(dict(model.named_buffers()))
    report = opt.teleport(batch=(x, y))
    assert report.accepted and report.path == "general"
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), f"buffer {n} changed"


def test_verification_pass_of_a_closure_leaves_batchnorm_statistics_alone():
    """teleport(closure) runs the closure before (a training pass) and after (a check): the check is undone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double().train()
    relu = get_action("positive_rescaling", activation="relu")
    site = Site(relu, ("1.weight", "1.bias", "3.weight"))  # BatchNorm output scaling through the ReLU
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, [site], schedule=Schedule())
    reference = copy.deepcopy(model)
    reference(x)  # one forward pass in train mode: what the closure's first call does

    def closure():
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        return loss

    report = opt.teleport(closure)
    assert report.accepted and report.loss_drift <= RTOL
    for (n, b), (_, r) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b, r), f"buffer {n}"


def test_lookahead_objective_predicts_the_real_next_step():
    model, X, Y = paper_mlp(dtype=torch.float64)
    sites = [Site(LEAKY, ("0.weight", None, "2.weight")), Site(LEAKY, ("2.weight", None, "4.weight"))]
    base = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    opt = Teleport(base, model, sites, objective="lookahead", loss_fn=sse, search=SearchConfig(steps=30))
    for _ in range(3):
        grads_at(model, X, Y, sse)
        opt.step()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-4, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(base.state_dict()))  # load_state_dict shares tensors
    grads_at(reference, X, Y, sse)
    ref_opt.step()
    untele = sse(reference(X), Y).item()

    grads_at(model, X, Y, sse)
    report = opt.teleport(batch=(X, Y))
    assert report.accepted and report.objective_after < report.objective_before
    assert report.objective_before == pytest.approx(untele, rel=1e-10)
    base.step()  # the base step from the teleported point, with the transported momentum
    assert sse(model(X), Y).item() == pytest.approx(report.objective_after, rel=1e-10)


def test_preconditioned_norm_is_adagrads_eq_5_7():
    model, X, Y = paper_mlp(dtype=torch.float64)
    sites = [Site(LEAKY, ("0.weight", None, "2.weight")), Site(LEAKY, ("2.weight", None, "4.weight"))]
    base = torch.optim.Adagrad(model.parameters(), lr=0.1)
    opt = Teleport(base, model, sites, objective="preconditioned_norm", search=SearchConfig(steps=20))
    for _ in range(3):
        grads_at(model, X, Y, sse)
        opt.step()
    grads_at(model, X, Y, sse)
    expected = 0.0
    for p in model.parameters():
        G = base.state[p]["sum"] + p.grad**2
        expected += float((0.1 * p.grad**2 / (G.sqrt() + 1e-10)).sum())
    report = opt.teleport()
    assert report.path == "fast" and report.accepted
    assert report.objective_before == pytest.approx(expected, rel=1e-12)
    assert report.objective_after > report.objective_before


def test_sharpness_is_eq_5_1_with_unit_random_directions():
    model, X, Y = paper_mlp(dtype=torch.float64)
    sites = [Site(LEAKY, ("0.weight", None, "2.weight"))]
    objective = Sharpness(displacements=(0.01, 0.03), directions=3)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-4), model, sites, objective=objective, loss_fn=sse, search=SearchConfig(steps=15, seed=4)
    )
    grads_at(model, X, Y, sse)
    gen = torch.Generator().manual_seed(4)
    dirs = objective.prepare(type("E", (), {"ctx": type("C", (), {"trainable": dict(model.named_parameters())})})(), gen)
    for d in dirs:
        assert math.sqrt(sum(float(v.square().sum()) for v in d.values())) == pytest.approx(1.0, rel=1e-12)
    expected = 0.0
    with torch.no_grad():
        for d in dirs:
            for t in (0.01, 0.03):
                moved = {n: p + t * d[n] for n, p in model.named_parameters()}
                expected += float(sse(torch.func.functional_call(model, moved, (X,)), Y))
    expected /= 6
    report = opt.teleport(batch=(X, Y))
    assert report.objective_before == pytest.approx(expected, rel=1e-10)
    assert report.accepted and report.objective_after < report.objective_before


def test_curvature_is_eq_5_2_and_vectorised():
    """For a scaling, gamma(t) = exp(tM) . w has gamma' = rho(M) w and gamma'' = rho(M)^2 w in closed form."""
    model, X, Y = paper_mlp(dtype=torch.float64)
    site = Site(LEAKY, ("0.weight", None, "2.weight"))
    objective = Curvature(curves=3)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=1e-4), model, [site], objective=objective, search=SearchConfig(steps=10, seed=2))
    grads_at(model, X, Y, sse)
    report = opt.teleport()
    assert report.path == "fast" and report.accepted and report.objective_after > report.objective_before
    gen = torch.Generator().manual_seed(2)
    (Ms,) = [torch.randn(3, 6, generator=gen, dtype=torch.float64)]
    c = report.elements[site.name]
    W1, W2 = model[0].weight.detach(), model[2].weight.detach()  # at g . w already
    kappas = []
    for M in Ms:
        v = torch.cat([(M[:, None] * W1).reshape(-1), (-M[None, :] * W2).reshape(-1)])
        a = torch.cat([(M[:, None] ** 2 * W1).reshape(-1), (M[None, :] ** 2 * W2).reshape(-1)])
        kappas.append(torch.sqrt(v.dot(v) * a.dot(a) - v.dot(a) ** 2) / v.dot(v) ** 1.5)
    assert report.objective_after == pytest.approx(float(torch.stack(kappas).mean()), rel=1e-9)
    assert float(c.log().abs().max()) <= math.log(4) + 1e-12


def test_nonlinear_data_dependent_action_through_act_only():
    """Zhao et al. 2023, Theorem 2.4.1: a non-linear GL action exact at one input (the shape learned actions take)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 2)).double()
    action = get_action("nonlinear_gl", activation="sigmoid")
    site = Site(action, ("2.weight", "0.weight", "0.bias"), data_input="0")
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        [site],
        loss_fn=mse,
        search=SearchConfig(steps=10, trust_region=0.5),
        schedule=Schedule(),
    )
    grads_at(model, x, y, mse)
    report = opt.teleport(batch=(x, y))
    assert report.path == "general" and report.accepted and report.loss_drift <= RTOL and report.gain > 1


def test_paper_compat_is_not_loss_preserving_and_exact_is():
    """The official first-order teleport changes the loss; the exact eq. 4.13 teleport does not."""
    model, X, Y = paper_mlp(seed=12345)
    exact = copy.deepcopy(model)
    compat = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-4),
        model,
        dd_sites(),
        loss_fn=sse,
        search=SearchConfig(paper_compat=True, steps=8, lr=1e-7),
        schedule=Schedule(),
    )
    for _ in range(5):
        grads_at(model, X, Y, sse)
        compat.step()
    grads_at(model, X, Y, sse)
    report = compat.teleport(batch=(X, Y))
    assert report.path == "paper_compat" and "not loss-preserving" in report.reason
    assert report.loss_drift > 1e-2

    opt = Teleport(
        torch.optim.SGD(exact.parameters(), lr=1e-4),
        exact,
        dd_sites(),
        loss_fn=sse,
        search=SearchConfig(steps=20, trust_region=0.5),
        schedule=Schedule(),
    )
    for _ in range(5):
        grads_at(exact, X, Y, sse)
        opt.step()
    grads_at(exact, X, Y, sse)
    report = opt.teleport(batch=(X, Y))
    assert report.accepted and report.loss_drift <= 1e-6  # float32 data, as in the paper


def test_closed_form_curvature_matches_autograd_through_act():
    """The batched Lie-algebra form of eq. 5.2 equals differentiating ``act`` twice (commuting sites)."""
    from teleopt import AxisAction, Member
    from teleopt.teleport.context import TeleportContext
    from teleopt.teleport.fast_path import FastEvaluator
    from teleopt.teleport.state_policy import StatePolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Identity(), nn.Linear(6, 12), nn.Linear(12, 3)).double()
    fused = AxisAction("fused", "general", (Member("Q", 0, 1, start=0, stop=4), Member("K", 0, -1, start=4, stop=8)), blocks=2)
    sites = [
        Site(get_action("positive_rescaling", activation="relu"), ("0.weight", "0.bias", "2.weight")),
        Site(get_action("gl_linear"), ("2.weight", "2.bias", "4.weight")),
        Site(fused, ("4.weight", "4.weight")),
    ]
    model.zero_grad()
    model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    evaluator = FastEvaluator(sites, TeleportContext.build(model, opt, StatePolicy()))
    objective = Curvature(curves=3)
    prepared = objective.prepare(evaluator, torch.Generator().manual_seed(1))
    coords = [0.2 * torch.randn(g.coord_shape, dtype=torch.float64) for g in evaluator.groups]
    elements = evaluator.elements(coords)
    v1, a1 = objective._closed_form(evaluator, elements, prepared)
    v2, a2 = objective._autograd(evaluator, elements, prepared)
    assert_close(v1, v2, 1e-10, "gamma'")
    assert_close(a1, a2, 1e-10, "gamma''")


def test_an_op_without_double_backward_fails_with_what_to_do_and_moves_nothing():
    """torch's fused CPU attention kernel has no double backward, which the general path's search
    needs (it differentiates the gradient): the error says so and names the fast path and timm's
    unfused attention; nothing moved. With the unfused attention the same teleport runs."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=8, depth=1).double()
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 3, (4,))

    def teleport(m):
        opt = Teleport(
            torch.optim.SGD(m.parameters(), lr=1e-3),
            m,
            "auto",
            example_inputs=x[:2],
            loss_fn=nn.functional.cross_entropy,
            search=SearchConfig(path="general", steps=2),
            schedule=Schedule(),
        )
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        return opt.teleport(batch=(x, y))

    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="double backward.*path='fast'.*fused_attn = False"):
        teleport(model)
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n
    model.blocks[0].attn.fused_attn = False
    report = teleport(model)
    assert report.accepted and report.check_error <= 1e-10  # float64: outputs unchanged to round-off
