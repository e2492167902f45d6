"""The mathematics of teleopt.discovery, checked against exact actions (Zhao et al. 2024b, Sec. 3, 5; Zhao 2026, Theorem 6.3.2).

No training here: the losses are evaluated on actions whose properties are known
(linear actions, a conjugated non-linear action, a right action that is no left
action), the matrix logarithm and RK4 against closed forms.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.func import jvp

from teleopt.discovery import ActionNetwork, LearnedLieGroup, LossWeights, discovery_losses, matrix_log, problems
from teleopt.discovery.flow import rk4
from teleopt.discovery.losses import infinitesimal_action, loss_derivative, loss_gradient_norms
from teleopt.discovery.problems import rescaling_generators, two_layer
from teleopt.discovery.samples import SampleSpec
from teleopt.testing import assert_close, seeds

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- exact actions written as action_fn(vec(g - I), theta, x) ------------------------------
def linear_action(g_offset, theta, x):
    p = theta.shape[-1]
    return theta + (g_offset.unflatten(-1, (p, p)) @ theta.unsqueeze(-1)).squeeze(-1)


def right_action(g_offset, theta, x):
    """theta -> g^T theta: a(g2, a(g1, .)) = (g1 g2)^T theta, not (g2 g1)^T theta."""
    p = theta.shape[-1]
    return theta + (g_offset.unflatten(-1, (p, p)).transpose(-1, -2) @ theta.unsqueeze(-1)).squeeze(-1)


def conjugated_action(g_offset, theta, x):
    """asinh(g sinh(theta)): a non-linear left action (conjugate of the linear one)."""
    p = theta.shape[-1]
    g = g_offset.unflatten(-1, (p, p)) + torch.eye(p, dtype=theta.dtype)
    return torch.asinh((g @ torch.sinh(theta).unsqueeze(-1)).squeeze(-1))


def _terms(action_fn, generators, batch=16, p=4, seed=0, **kw):
    gen = _gen(seed)
    theta = torch.randn(batch, p, generator=gen, dtype=F64)
    X = torch.randn(batch, 3, generator=gen, dtype=F64)
    leaves = (X,)

    def loss_fn(params, data):
        return params[0].square().sum() * data.square().sum()

    spec = SampleSpec(((p,),), ("w",), ((3,),), True)
    loss_jvp = loss_derivative(loss_fn, spec.unflatten, spec.rebuild_data)
    return discovery_losses(action_fn, loss_jvp, theta, leaves, X, generators, beta=1.0, **kw)


# -- matrix logarithm -------------------------------------------------------------------------
@settings(deadline=None, max_examples=30)
@given(seeds(), st.floats(min_value=1e-3, max_value=2.5), st.integers(min_value=1, max_value=6))
@example(0, 1e-3, 3)
def test_matrix_log_inverts_matrix_exp(seed, size, n):
    A = torch.randn(n, n, generator=_gen(seed), dtype=F64)
    A = A * (size / float(torch.linalg.matrix_norm(A, ord=2)))
    # spectral norm <= 2.5 < pi bounds the imaginary parts of the eigenvalues: principal branch.
    # float64: exp(A) is known to ~1e-16 |exp(A)|, so log(exp(A)) to ~1e-16 e^{2|A|} / |A| relative:
    # below 1e-12 for |A| >= 1e-3; 1e-9 leaves margin
    assert_close(matrix_log(torch.linalg.matrix_exp(A)), A, 1e-9, "log(exp(A))")


def test_matrix_log_of_the_identity_is_zero():
    assert torch.equal(matrix_log(torch.eye(4, dtype=F64)), torch.zeros(4, 4, dtype=F64))


def test_matrix_log_gradient_matches_finite_differences():
    A = 0.7 * torch.randn(3, 3, generator=_gen(1), dtype=F64)
    g = torch.linalg.matrix_exp(A).requires_grad_(True)
    assert torch.autograd.gradcheck(matrix_log, (g,))
    eye = torch.eye(2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(matrix_log, (eye,))  # d log at I is the identity map


def test_matrix_log_rejects_bad_input():
    with pytest.raises(ValueError, match="negative real axis"):
        matrix_log(-torch.eye(2, dtype=F64))
    with pytest.raises(ValueError, match="square"):
        matrix_log(torch.ones(2, 3, dtype=F64))
    with pytest.raises(TypeError, match="floating"):
        matrix_log(torch.eye(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="non-finite"):
        matrix_log(torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=F64))


# -- RK4 --------------------------------------------------------------------------------------
def test_rk4_is_fourth_order_on_a_linear_flow():
    M = torch.randn(4, 4, generator=_gen(2), dtype=F64)
    y0 = torch.randn(4, generator=_gen(3), dtype=F64)
    exact = torch.linalg.matrix_exp(M) @ y0
    errors = [float((rk4(lambda y: M @ y, y0, 1.0, s) - exact).norm()) for s in (8, 16, 32)]
    # global error O(dt^4): halving dt divides it by ~16
    assert 12 < errors[0] / errors[1] < 20 and 12 < errors[1] / errors[2] < 20
    path = rk4(lambda y: M @ y, y0, 1.0, 8, path=True)
    assert path.shape == (9, 4) and torch.equal(path[0], y0) and torch.equal(path[-1], rk4(lambda y: M @ y, y0, 1.0, 8))
    with pytest.raises(ValueError, match="steps"):
        rk4(lambda y: y, y0, 1.0, 0)


# -- the learned group ------------------------------------------------------------------------
def test_learned_lie_group_elements_are_exact():
    gens = torch.randn(2, 3, 3, generator=_gen(4), dtype=F64)
    group = LearnedLieGroup(gens)
    assert group.coord_shape == (2,) and group.element_shape == (3, 3) and group.continuous
    c = torch.tensor([0.3, -0.2], dtype=F64)
    g = group.exp(c)
    assert_close(g, torch.linalg.matrix_exp(0.3 * gens[0] - 0.2 * gens[1]), 1e-14, "exp")
    assert_close(group.log(g), 0.3 * gens[0] - 0.2 * gens[1], 1e-12, "log")
    assert_close(group.compose(g, group.inverse(g)), torch.eye(3, dtype=F64), 1e-13, "g g^-1")
    assert torch.equal(group.random(_gen(5)), group.random(_gen(5)))
    assert group == LearnedLieGroup(gens.clone()) and group != LearnedLieGroup(2 * gens)
    with pytest.raises(ValueError, match="shape"):
        group.exp(torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="not invertible"):
        group.validate(torch.zeros(3, 3, dtype=F64))
    with pytest.raises(TypeError, match="non-linearly"):
        group.act_on_axis(g, torch.zeros(3, 2, dtype=F64), 0)
    with pytest.raises(ValueError, match="shape"):
        LearnedLieGroup(torch.zeros(3, 3))


# -- the losses on exact actions --------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3])
def test_losses_vanish_for_the_linear_action(n):
    gens = torch.randn(n, 4, 4, generator=_gen(n), dtype=F64)
    terms = _terms(linear_action, gens)
    # exact group action: identity, both associativity orders and linearity are zero up to rounding
    for name in ("identity", "associativity_first_order", "associativity_bracket", "linearity"):
        assert float(terms[name]) < 1e-12, (name, float(terms[name]))


def test_bracket_term_vanishes_for_a_nonlinear_left_action():
    gens = 0.5 * torch.randn(3, 4, 4, generator=_gen(7), dtype=F64)
    terms = _terms(conjugated_action, gens)
    assert float(terms["identity"]) < 1e-14
    assert float(terms["associativity_first_order"]) < 1e-12
    assert float(terms["associativity_bracket"]) < 1e-11  # [xi_1, xi_2] = -xi_[h1,h2] holds exactly
    assert float(terms["linearity"]) > 0.1  # and the action is not linear


def test_first_order_associativity_misses_a_right_action_and_the_bracket_catches_it():
    gens = torch.randn(2, 4, 4, generator=_gen(8), dtype=F64)
    terms = _terms(right_action, gens)
    # Zhao 2026, Theorem 6.3.2 only differentiates the identity axiom: zero for g^T theta
    assert float(terms["associativity_first_order"]) < 1e-12
    # the second-order (Lie bracket) condition sees that g^T theta is no left action
    assert float(terms["associativity_bracket"]) > 0.5


def test_theorem_6_3_2_as_printed_equals_the_reduced_form():
    net = ActionNetwork(3, 2, (8, 8), generator=_gen(9), dtype=F64)
    theta = torch.randn(5, 3, generator=_gen(10), dtype=F64)
    x = torch.randn(5, 2, generator=_gen(11), dtype=F64)
    h1, h2 = torch.randn(2, 3, 3, generator=_gen(12), dtype=F64)
    zeros = torch.zeros(5, 9, dtype=F64)
    xi1 = infinitesimal_action(net, theta, x, h1)[1]
    xi2 = infinitesimal_action(net, theta, x, h2)[1]
    xi12 = infinitesimal_action(net, theta, x, h1 + h2)[1]
    d_theta_a = jvp(lambda t: net(zeros, t, x), (theta,), (xi1,))[1]
    printed = d_theta_a + xi2 - xi12
    assert_close(printed, d_theta_a - xi1, 1e-12, "D_theta a(xi_h1) + xi_h2 - xi_(h1+h2)")


def test_invariance_term_is_the_derivative_of_the_loss_along_the_orbit():
    problem = two_layer()  # L = (w2 w1 x - y)^2, rescaling generator diag(1, -1)
    spec = SampleSpec(((1, 1), (1, 1)), ("W1", "W2"), ((1, 1), (1, 1)), False)
    loss_jvp = loss_derivative(problem.loss_fn, spec.unflatten, spec.rebuild_data)
    gen = _gen(13)
    theta = torch.randn(32, 2, generator=gen, dtype=F64)
    leaves = (torch.randn(32, 1, 1, generator=gen, dtype=F64), torch.randn(32, 1, 1, generator=gen, dtype=F64))
    x = spec.features(leaves, batch_dims=1)
    rescaling = rescaling_generators(1, 1, 1)
    terms = discovery_losses(linear_action, loss_jvp, theta, leaves, x, rescaling, beta=1.0)
    assert float(terms["invariance"]) < 1e-13
    # a non-symmetry: the mean |d/dt L(exp(t h) theta)| at t = 0, by central differences
    h = torch.diag(torch.tensor([1.0, 0.5], dtype=F64))
    terms = discovery_losses(linear_action, loss_jvp, theta, leaves, x, h[None], beta=1.0)
    eps = 1e-6
    plus, minus = theta @ torch.linalg.matrix_exp(eps * h).T, theta @ torch.linalg.matrix_exp(-eps * h).T
    values = [
        abs(
            float(
                problem.loss_fn(spec.unflatten(a), (leaves[0][i], leaves[1][i]))
                - problem.loss_fn(spec.unflatten(b), (leaves[0][i], leaves[1][i]))
            )
        )
        / (2 * eps)
        for i, (a, b) in enumerate(zip(plus, minus))
    ]
    assert math.isclose(float(terms["invariance"]), sum(values) / len(values), rel_tol=1e-7)
    # gradient-normalised invariance: each sample weighted by 1 / |D_theta L|
    norms = loss_gradient_norms(problem.loss_fn, spec.unflatten, spec.rebuild_data)(theta, leaves)
    weighted = discovery_losses(linear_action, loss_jvp, theta, leaves, x, h[None], beta=1.0, gradient_norms=norms)
    xi = theta @ h.T
    grads = torch.stack(
        [torch.func.grad(lambda t, i=i: problem.loss_fn(spec.unflatten(t), (leaves[0][i], leaves[1][i])))(theta[i]) for i in range(32)]
    )
    expected = ((grads * xi).sum(-1).abs() / grads.norm(dim=-1)).mean()
    assert math.isclose(float(weighted["invariance"]), float(expected), rel_tol=1e-10)


def test_regularisers():
    h = torch.randn(4, 4, generator=_gen(14), dtype=F64)
    q, _ = torch.linalg.qr(torch.randn(16, 2, generator=_gen(15), dtype=F64))
    orthogonal = q.T.reshape(2, 4, 4)
    assert float(_terms(linear_action, orthogonal)["orthogonality"]) < 1e-14
    # anti-parallel generators span one line: penalised like parallel ones (|cos| = 1), not rewarded
    assert math.isclose(float(_terms(linear_action, torch.stack([h, -h]))["orthogonality"]), 1.0, rel_tol=1e-12)
    terms = _terms(linear_action, torch.stack([h, 2 * h, -h]))
    assert math.isclose(float(terms["orthogonality"]), 3.0, rel_tol=1e-12)
    assert math.isclose(float(terms["sparsity"]), 4 * float(h.abs().sum()), rel_tol=1e-12)
    theta = torch.randn(16, 4, generator=_gen(0), dtype=F64)
    expected_norm = sum(float((1.0 - (theta @ g.T).norm(dim=-1)).abs().mean()) for g in (h, 2 * h, -h))
    assert math.isclose(float(terms["norm"]), expected_norm, rel_tol=1e-12)


def test_loss_weights_defaults_and_validation():
    w = LossWeights()
    assert (w.invariance, w.identity, w.norm, w.orthogonality, w.sparsity) == (10.0, 1.0, 1.0, 1.0, 0.1)  # Zhao et al. 2024b, Sec. 5.3
    d = LossWeights.data_dependent()
    assert (d.invariance, d.identity, d.norm, d.orthogonality, d.sparsity) == (1.0, 10.0, 10.0, 1.0, 0.1)  # Sec. 5.4
    assert LossWeights.from_dict(w.as_dict()) == w
    with pytest.raises(ValueError, match="invariance"):
        LossWeights(invariance=-1.0)
    with pytest.raises(ValueError, match="sparsity"):
        LossWeights(sparsity=float("nan"))


# -- network and sample shapes ----------------------------------------------------------------
def test_action_network_initialisation_is_seeded_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a = ActionNetwork(4, 3, (16, 16), generator=_gen(0))
    b = ActionNetwork(4, 3, (16, 16), generator=_gen(0))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    out = a(torch.zeros(2, 16), torch.ones(2, 4), torch.zeros(2, 3))
    assert out.shape == (2, 4)
    with pytest.raises(ValueError, match="activation"):
        ActionNetwork(4, 3, activation="relu6")
    with pytest.raises(ValueError, match="hidden"):
        ActionNetwork(4, 3, hidden=())
    with pytest.raises(ValueError, match="num_params"):
        ActionNetwork(0, 3)


def test_sample_spec_round_trip_and_errors():
    spec = SampleSpec.from_sample([(2, 3), (4,)], ("W", "b"), (torch.zeros(5, 3), torch.zeros(5, 1)))
    params = (torch.randn(2, 3, generator=_gen(0)), torch.randn(4, generator=_gen(1)))
    theta = spec.flatten(params)
    assert theta.shape == (10,) and all(torch.equal(a, b) for a, b in zip(spec.unflatten(theta), params))
    assert spec.num_params == 10 and spec.data_features == 20
    with pytest.raises(ValueError, match="'W' has shape"):
        spec.flatten((torch.zeros(3, 2), torch.zeros(4)))
    with pytest.raises(ValueError, match=r"data\[0\] has shape"):
        spec.data_leaves((torch.zeros(4, 3), torch.zeros(5, 1)))
    with pytest.raises(ValueError, match="member_names"):
        SampleSpec.from_sample([(2,)], ("a", "b"), torch.zeros(1))
    with pytest.raises(TypeError, match="param_shapes"):
        SampleSpec.from_sample("2x3", None, torch.zeros(1))


# -- the papers' problems ---------------------------------------------------------------------
def test_rescaling_generators_are_symmetries_of_the_relu_network():
    problem = two_layer(m=2, hidden=3, n=2, k=5, activation="relu", target="output")
    params, X = problem.sampler(_gen(16))
    spec = SampleSpec.from_sample(problem.param_shapes, problem.member_names, X)
    theta = spec.flatten(params)
    for R in rescaling_generators(2, 3, 2):
        moved = spec.unflatten(torch.linalg.matrix_exp(0.7 * R) @ theta)
        assert_close(problem.loss_fn(moved, X), problem.loss_fn(params, X), 1e-13, "ReLU output")  # exact symmetry


def test_tiny_transformer_matches_papers_001_sec_6_5_5():
    problem = problems.tiny_transformer()
    assert sum(math.prod(s) for s in problem.param_shapes) == 32  # p = 32 (W_Q, W_K, W_V, W_O 2x2; W_1 2x4; W_2 4x2)
    params, (X, Y) = problem.sampler(_gen(17))
    assert X.shape == Y.shape == (8, 2, 2)
    # the known exact symmetry GL(2) on (W_Q, W_K): Q K^T is unchanged by W_Q A, W_K A^{-T}
    A = torch.linalg.matrix_exp(0.5 * torch.randn(2, 2, generator=_gen(18), dtype=F64))
    WQ, WK, *rest = params
    moved = (WQ @ A, WK @ torch.linalg.inv(A).T, *rest)
    assert_close(problem.loss_fn(moved, (X, Y)), problem.loss_fn(params, (X, Y)), 1e-12, "transformer loss")


def test_problems_rebuild_from_their_spec_and_sample_in_batches():
    for problem in (two_layer(m=2, hidden=3, n=2, k=4, activation="leaky_relu"), problems.three_layer(), problems.tiny_transformer()):
        rebuilt = problems.build_problem(problem.loss_fn.spec)
        params, data = problem.sampler(_gen(19))
        assert torch.equal(rebuilt.loss_fn(params, data), problem.loss_fn(params, data))
        batch_params, batch_data = problem.sampler.sample_batch(_gen(20), 5)
        assert [tuple(p.shape) for p in batch_params] == [(5, *s) for s in problem.param_shapes]
        assert all(d.shape[0] == 5 for d in batch_data)
    with pytest.raises(ValueError, match="unknown discovery problem"):
        problems.build_problem({"problem": "resnet", "config": {}})
    with pytest.raises(ValueError, match="target"):
        two_layer(target="gradient")
