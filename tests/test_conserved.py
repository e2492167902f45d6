"""Conserved quantities of gradient flow (Zhao 2026, Sec. 2.5, App. A.4; Zhao et al. 2023, Sec. 5).

Every registered exact linear (and translation) action is checked through its own
example problem: Q matches the paper's closed forms, stays constant under gradient
flow to integration accuracy, changes by exactly lr^2 Q(grad) per gradient-descent
step, and transforms as Q_{g^T M g} under orthogonal elements.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import teleopt  # noqa: F401  (registers the known actions)
from teleopt.analysis.conserved import (
    angular_momentum,
    conserved_quantities,
    conserved_quantity_kind,
    expected_whitened_quantity,
    whitened_conserved_quantity,
)
from teleopt.analysis.gradient_flow import integrate_gradient_flow
from teleopt.registry import get_action, list_actions
from teleopt.site import Site
from teleopt.testing import strategies as tst
from teleopt.testing.assertions import relative_error

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CONSERVING = [d["name"] for d in list_actions() if conserved_quantity_kind(get_action(d["name"]))[0] is not None]
ORTHOGONAL_LINEAR = [
    d["name"]
    for d in list_actions()
    if get_action(d["name"]).group_type.kind == "orthogonal" and get_action(d["name"]).linear and d["exactness"] == "exact"
]


def as_site(action, params):
    """A site over a flat dict {"p0": ..., "p1": ...} (None for absent optional members)."""
    names = tuple(None if p is None else f"p{i}" for i, p in enumerate(params))
    flat = {f"p{i}": p for i, p in enumerate(params) if p is not None}
    return Site(action, names, name=action.name), flat


def problem(name, seed):
    action = get_action(name)
    prob = action.example(torch.Generator().manual_seed(seed), torch.float64)
    site, flat = as_site(action, prob.params)

    def loss(p):
        return prob.loss(tuple(None if m is None else p[m] for m in site.members))

    return action, prob, site, flat, loss


def test_registry_has_conserving_and_orthogonal_actions():
    # the generic tests below must cover the paper's examples
    assert {"gl_linear", "positive_rescaling", "lora_gl", "attention_qk_gl", "softmax_translation"} <= set(CONSERVING)
    assert {"radial_orthogonal", "quadratic_orthogonal"} <= set(ORTHOGONAL_LINEAR)


def test_result_is_a_full_read_only_mapping():
    """keys(), values() and items() agree with [] (a field named ``values`` used to shadow Mapping.values)."""
    g = torch.Generator().manual_seed(0)
    W1, b1, W2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 2), (3,), (2, 3)))
    site, flat = as_site(get_action("gl_linear"), (W1, b1, W2))
    result = conserved_quantities(flat, site)
    assert list(result.keys()) == [site.name]
    (q,) = result.values()
    assert q is result[site.name]
    assert dict(result.items()) == {site.name: q}


# ----------------------------------------------------------------------------- closed forms
@SETTINGS
@given(seed=tst.seeds(), h=st.integers(1, 5), n=st.integers(1, 4), m=st.integers(1, 4), bias=st.booleans())
def test_gl_linear_is_the_layer_imbalance(seed, h, n, m, bias):
    """Zhao 2026, Ex. 2.5.3: Q = V V^T - U^T U with V = [W1 b1], U = W2, every entry conserved."""
    g = torch.Generator().manual_seed(seed)
    W1, b1, W2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((h, n), (h,), (m, h)))
    site, flat = as_site(get_action("gl_linear"), (W1, b1 if bias else None, W2))
    q = conserved_quantities(flat, site)[site.name]
    V = torch.cat([W1, b1[:, None]], 1) if bias else W1
    # one vjp through matrix_exp at 0 against two matrix products: round-off only
    assert relative_error(q, V @ V.T - W2.T @ W2) < 1e-12


@SETTINGS
@given(seed=tst.seeds(), h=st.integers(1, 5), alpha=st.sampled_from([None, 0.5, 2.0, 3.0]))
def test_homogeneous_rescaling_is_the_weighted_diagonal(seed, h, alpha):
    """Zhao 2026, Ex. 2.5.4: Q = diag(V V^T - alpha U^T U) for a degree-alpha activation."""
    g = torch.Generator().manual_seed(seed)
    W1, b1, W2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((h, 3), (h,), (2, h)))
    action = get_action("positive_rescaling") if alpha is None else get_action("positive_rescaling", activation="relu_power", alpha=alpha)
    site, flat = as_site(action, (W1, b1, W2))
    q = conserved_quantities(flat, site)[site.name]
    expected = (W1**2).sum(1) + b1**2 - action.alpha * (W2**2).sum(0)
    assert relative_error(q, expected) < 1e-12


@SETTINGS
@given(seed=tst.seeds())
def test_parts_sum_to_q_and_every_q_m_is_the_paper_inner_product(seed):
    """Q_M = <theta, M . theta> (Prop. 2.5.1) for random symmetric M, with M . theta from a jvp of the orbit map."""
    for name in CONSERVING:
        action, prob, site, flat, _ = problem(name, seed)
        result = conserved_quantities(flat, site)
        q = result[site.name]
        assert relative_error(sum(result.parts[site.name].values()), q) < 1e-12
        params = action.check_params(prob.params)
        M = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        if conserved_quantity_kind(action)[0] == "symmetric":
            M = M + M.mT
        zero = torch.zeros_like(M)
        present = [i for i, p in enumerate(params) if p is not None]
        _, tangent = torch.func.jvp(
            lambda c, action=action, params=params, present=present: tuple(action.act(action.exp(c, params), params)[i] for i in present),
            (zero,),
            (M,),
        )
        # Q is linear in theta for translations (the charge <theta, J M>), quadratic otherwise: the same formula
        q_m = sum((params[i] * t).sum() for i, t in zip(present, tangent))
        assert abs(float((q * M).sum() - q_m)) <= 1e-12 * max(1.0, abs(float(q_m)))


# ----------------------------------------------------------------------------- gradient flow
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=tst.seeds())
@example(seed=0)
@example(seed=252)  # attention_qk_gl's largest RK4 error found (1.4e-7)
def test_q_is_constant_under_gradient_flow(seed):
    """d/dt Q_M = 0 along theta' = -grad L, for every registered action that has Q (RK4, 40 steps)."""
    for name in CONSERVING:
        action, prob, site, flat, loss = problem(name, seed)
        q0 = conserved_quantities(flat, site)
        # time scale: 1 / ||grad L|| moves theta by about its own size; integrate a quarter of it
        gnorm = sum(float(v.norm()) ** 2 for v in torch.func.grad(loss)(flat).values()) ** 0.5
        scale = sum(float(v.norm()) ** 2 for v in flat.values()) ** 0.5
        duration = 0.25 * scale / max(gnorm, 1e-12)
        path = integrate_gradient_flow(loss, flat, duration, 40, record_every=40)
        moved = sum(float((path.final[k] - flat[k]).norm()) ** 2 for k in flat) ** 0.5
        assert moved > 0.05 * scale, f"{name}: the flow did not move theta"  # it moves ~15% of |theta|
        drift = conserved_quantities(path.final, site).drift(q0)[site.name]
        # RK4's O(dt^4) error: measured <= 1.4e-7 relative over 13 seeds on the smooth examples (20 steps:
        # 16x more, fourth order); positive_rescaling's LeakyReLU kinks cost RK4 its order when a
        # pre-activation crosses 0 (worst 1.9e-6).  Euler (= gradient descent, App. A.4) drifts 2e-4 to
        # 7e-4 on the same paths, 20x above the bound.
        assert drift < 1e-5, f"{name}: Q drifted by {drift:.2e} along gradient flow"


def test_q_of_a_broken_symmetry_is_not_conserved():
    """Negative control: an L2 term on W1 breaks GL invariance and Q changes at first order."""
    action, prob, site, flat, loss = problem("gl_linear", 3)

    def broken(p):
        return loss(p) + 0.5 * (p["p0"] ** 2).sum()

    q0 = conserved_quantities(flat, site)
    path = integrate_gradient_flow(broken, flat, 0.1, 50)
    assert conserved_quantities(path.final, site).drift(q0)[site.name] > 1e-3


@SETTINGS
@given(seed=tst.seeds(), lr=st.floats(1e-4, 1e-1))
def test_one_gradient_step_changes_q_by_exactly_lr_squared_q_of_the_gradient(seed, lr):
    """Q(theta - lr g) = Q(theta) + lr^2 Q(g): the linear term is <g, M . theta> = 0 (Zhao 2026, Prop. A.4.1, all actions).

    For translations Q is linear in theta, so the step leaves it unchanged.
    """
    for name in CONSERVING:
        action, prob, site, flat, loss = problem(name, seed)
        grad = torch.func.grad(loss)(flat)
        after = {k: flat[k] - lr * grad[k] for k in flat}
        q0, q1 = conserved_quantities(flat, site)[site.name], conserved_quantities(after, site)[site.name]
        if action.group_type.kind == "translation":
            predicted = q0
        else:
            predicted = q0 + lr**2 * conserved_quantities(grad, site)[site.name]
        # the step is exact algebra; round-off relative to the size of the parts
        scale = conserved_quantities(flat, site).scale(site.name)
        assert float((q1 - predicted).norm()) <= 1e-12 * scale, name


# ----------------------------------------------------------------------------- the group acts on Q
@SETTINGS
@given(seed=tst.seeds(), size=st.floats(0.0, 3.0))
def test_orthogonal_elements_transform_q_as_q_of_g_t_m_g(seed, size):
    """Q_M(g . theta) = Q_{g^T M g}(theta), i.e. Q(g . theta) = g Q(theta) g^T, for g in O(h) inside GL_h (Zhao et al. 2023, Sec. 5)."""
    for name in ("gl_linear", "lora_gl", "attention_qk_gl", "attention_vo_gl"):
        action, prob, site, flat, _ = problem(name, seed)
        params = action.check_params(prob.params)
        skew = torch.randn(action.coord_shape(params), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        skew = skew - skew.mT
        g = torch.linalg.matrix_exp(size * skew / max(float(torch.linalg.matrix_norm(skew, 2).max()), 1e-12))
        _, moved = as_site(action, action.act(g, params))
        q, q_moved = conserved_quantities(flat, site)[site.name], conserved_quantities(moved, site)[site.name]
        assert relative_error(q_moved, g @ q @ g.mT) < 1e-10, name


@SETTINGS
@given(seed=tst.seeds(), perm=tst.permutations(4))
def test_hidden_permutations_permute_q(seed, perm):
    """Permutation matrices are orthogonal: Q(P . theta) = P Q P^T (GL) and the permuted vector (rescaling)."""
    g = torch.Generator().manual_seed(seed)
    params = tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in ((4, 3), (4,), (2, 4)))
    permuted = get_action("hidden_permutation").act(perm, params)
    for name in ("gl_linear", "positive_rescaling"):
        site, flat = as_site(get_action(name), params)
        _, flat_p = as_site(get_action(name), permuted)
        q, q_p = conserved_quantities(flat, site)[site.name], conserved_quantities(flat_p, site)[site.name]
        expected = q[perm][:, perm] if q.ndim == 2 else q[perm]
        assert relative_error(q_p, expected) < 1e-12


@SETTINGS
@given(seed=tst.seeds(), size=st.floats(0.1, 1.0))
def test_general_elements_move_q_member_by_member(seed, size):
    """For g not orthogonal, Q(g . theta) is not g Q g^T (Zhao 2026 footnote 8): each member's part transforms
    in its own representation, V V^T -> g V V^T g^T and U^T U -> g^{-T} U^T U g^{-1}; scalings c^2 and c^(-2 alpha)."""
    action, prob, site, flat, _ = problem("gl_linear", seed)
    params = action.check_params(prob.params)
    c = torch.randn(action.coord_shape(params), generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    c = c + c.mT  # a symmetric generator: exp(c) is symmetric positive definite, not orthogonal
    g = torch.linalg.matrix_exp(size * c / float(torch.linalg.matrix_norm(c, 2)))
    before = conserved_quantities(flat, site).parts[site.name]
    _, moved = as_site(action, action.act(g, params))
    after = conserved_quantities(moved, site)[site.name]
    gi = torch.linalg.inv(g)
    expected = g @ (before["W1"] + before["b1"]) @ g.T + gi.T @ before["W2"] @ gi
    assert relative_error(after, expected) < 1e-10
    assert relative_error(after, g @ (before["W1"] + before["b1"] + before["W2"]) @ g.T) > 1e-3

    action = get_action("positive_rescaling", activation="relu_power", alpha=2.0)
    site, flat = as_site(action, params)
    hidden = params[0].shape[0]
    scales = torch.exp(size * torch.randn(hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    before = conserved_quantities(flat, site).parts[site.name]
    _, moved = as_site(action, action.act(scales, params))
    expected = scales**2 * (before["W1"] + before["b1"]) + scales ** (-4) * before["W2"]
    assert relative_error(conserved_quantities(moved, site)[site.name], expected) < 1e-10


# ----------------------------------------------------------------------------- angular momentum
@SETTINGS
@given(seed=tst.seeds())
def test_angular_momentum_vanishes_for_the_gradient_of_an_invariant_loss(seed):
    """eq. 2.11 for the anti-symmetric generators: the residual of Theorem 2.5.6 at theta' = -grad L is round-off."""
    for name in ORTHOGONAL_LINEAR:
        action, prob, site, flat, loss = problem(name, seed)
        grad = torch.func.grad(loss)(flat)
        omega = angular_momentum(flat, {k: -v for k, v in grad.items()}, site)
        size = sum(float(v.norm()) ** 2 for v in flat.values()) ** 0.5 * sum(float(v.norm()) ** 2 for v in grad.values()) ** 0.5
        assert float(omega.norm()) <= 1e-12 * size, name
        # a random velocity is not orthogonal to the orbit: the residual is of the size of the bound
        noise = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(seed), dtype=v.dtype) for k, v in flat.items()}
        omega = angular_momentum(flat, noise, site)
        size = sum(float(v.norm()) ** 2 for v in flat.values()) ** 0.5 * sum(float(v.norm()) ** 2 for v in noise.values()) ** 0.5
        assert float(omega.norm()) > 1e-3 * size, name


def test_angular_momentum_is_eq_2_13_for_two_layers():
    g = torch.Generator().manual_seed(0)
    W1, b1, W2, dW1, db1, dW2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((4, 3), (4,), (2, 4)) * 2)
    site, flat = as_site(get_action("radial_orthogonal"), (W1, b1, W2))
    _, vel = as_site(get_action("radial_orthogonal"), (dW1, db1, dW2))
    V, Vd = torch.cat([W1, b1[:, None]], 1), torch.cat([dW1, db1[:, None]], 1)
    expected = V @ Vd.T - Vd @ V.T + W2.T @ dW2 - dW2.T @ W2
    assert relative_error(angular_momentum(flat, vel, site), expected) < 1e-12


@settings(max_examples=3, deadline=None)
@given(seed=tst.seeds())
@example(seed=0)
def test_integrated_angular_momentum_of_a_radial_network_vanishes_along_the_flow(seed):
    """Theorem 2.5.6 on a trajectory: sum over RK4 steps of Omega(theta_mid, delta theta) stays at integration error,
    while the same sum for a loss that breaks O(h) (an L2 term on W1 rows weighted by unit) does not."""
    action, prob, site, flat, loss = problem("radial_orthogonal", seed)
    weights = torch.arange(1, flat["p0"].shape[0] + 1, dtype=torch.float64)[:, None]

    def broken(p):
        return loss(p) + 0.1 * (weights * p["p0"] ** 2).sum()

    for fn, invariant in ((loss, True), (broken, False)):
        path = integrate_gradient_flow(fn, flat, 0.05, 100)
        total, bound = 0.0, 0.0
        for a, b in zip(path.points[:-1], path.points[1:]):
            mid = {k: (a[k] + b[k]) / 2 for k in a}
            step = {k: b[k] - a[k] for k in a}
            omega = angular_momentum(mid, step, site)
            total = total + omega
            bound += sum(float(v.norm()) ** 2 for v in mid.values()) ** 0.5 * sum(float(v.norm()) ** 2 for v in step.values()) ** 0.5
        ratio = float(total.norm()) / bound
        if invariant:
            # midpoint rule on an RK4 path: O(dt^2) per step relative, measured ~1e-7 at dt = 5e-4
            assert ratio < 1e-5
        else:
            assert ratio > 1e-3


# ----------------------------------------------------------------------------- eq. 2.17
# name -> (sigma, what whitened_conserved_quantity is given); softplus goes through the quadrature path.
# Kinked activations (ReLU family) are covered by the positive-rescaling site: RK4 loses its order at kinks.
ACTIVATIONS = {
    "identity": (lambda z: z, "identity"),
    "tanh": (torch.tanh, "tanh"),
    "sigmoid": (torch.sigmoid, "sigmoid"),
    "softplus": (nn.functional.softplus, nn.functional.softplus),
}


@settings(max_examples=4, deadline=None)
@given(seed=tst.seeds(), name=st.sampled_from(sorted(ACTIVATIONS)))
@example(seed=0, name="softplus")
def test_whitened_quantity_is_conserved_only_for_whitened_input(seed, name):
    """eq. 2.17 is conserved by gradient flow of ||Y - U sigma(V X)||^2 with X = I, and not for a generic X."""
    g = torch.Generator().manual_seed(seed)
    m, h, n = 3, 5, 4
    U = torch.randn(m, h, generator=g, dtype=torch.float64) / h**0.5
    V = torch.randn(h, n, generator=g, dtype=torch.float64) / n**0.5
    Y = torch.randn(m, n, generator=g, dtype=torch.float64)
    X = torch.randn(n, n, generator=g, dtype=torch.float64)
    sigma, activation = ACTIVATIONS[name]
    for inputs, conserved in ((torch.eye(n, dtype=torch.float64), True), (X, False)):

        def loss(p, inputs=inputs):
            return 0.5 * ((Y - p["U"] @ sigma(p["V"] @ inputs)) ** 2).sum()

        start = {"U": U, "V": V}
        path = integrate_gradient_flow(loss, start, 0.5, 100)
        q0 = whitened_conserved_quantity(U, V, activation)
        q1 = whitened_conserved_quantity(path.final["U"], path.final["V"], activation)
        size = 0.5 * float((U**2).sum()) + float((V**2).sum())
        if conserved:
            # RK4 with dt = 5e-3: measured up to 1.4e-8 relative (softplus, seed 0; 16x less at dt / 2, so
            # integration error), while non-whitened input moves Q by more than 1e-4
            assert abs(float(q1 - q0)) < 1e-6 * size, name
        elif name != "identity":  # a linear network keeps its GL_h symmetry (and Q) for any X
            assert abs(float(q1 - q0)) > 1e-4 * size, name


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "identity"])
def test_quadrature_matches_the_closed_forms(name):
    """A callable activation is integrated by Gauss-Legendre quadrature; it agrees with the closed forms."""
    g = torch.Generator().manual_seed(1)
    U, V = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    fn = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "identity": lambda z: z * 1.0}[name]
    closed = whitened_conserved_quantity(U, V, name)
    # 32 Gauss-Legendre nodes integrate these analytic integrands on |v| <= 3 to round-off
    assert abs(float(whitened_conserved_quantity(U, V, fn) - closed)) < 1e-10 * abs(float(closed))


def test_expected_whitened_quantity_matches_the_gaussian_moments():
    """E[Q] = m/2 - h n E[F(v)], v ~ N(0, 1/n): (m - h)/2 for the identity (eq. 2.16 for eq. 2.14's Q),
    E[sinh^2 v / 2] = (e^{2/n} - 1)/4 for tanh, E[v + e^v - 1] = e^{1/(2n)} - 1 for sigmoid."""
    m, h, n = 30, 20, 10
    # Gauss-Hermite with 64 nodes is exact for polynomials of degree < 128 and converges fast for e^v
    assert expected_whitened_quantity(m, h, n, "identity") == pytest.approx((m - h) / 2, rel=1e-12)
    assert expected_whitened_quantity(m, h, n, "tanh") == pytest.approx(m / 2 - h * n * math.expm1(2 / n) / 4, rel=1e-12)
    assert expected_whitened_quantity(m, h, n, "sigmoid") == pytest.approx(m / 2 - h * n * math.expm1(1 / (2 * n)), rel=1e-12)


# ----------------------------------------------------------------------------- bad input
def test_sites_without_conserved_quantities_are_reported():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    members = ("0.weight", "0.bias", "2.weight")
    sites = [
        Site(get_action("positive_rescaling", activation="relu"), members, name="scale"),
        Site(get_action("hidden_permutation"), members, name="perm"),
        Site(get_action("sign_flip"), members, name="signs"),
        Site(get_action("data_dependent_gl"), members, name="data"),
        Site(get_action("radial_orthogonal"), members, name="radial"),
        Site(get_action("batchnorm_scaling"), ("0.weight", "0.bias", None, None), name="bn"),
    ]
    with pytest.warns(UserWarning, match="no conserved quantity for 5 site"):
        result = conserved_quantities(model, sites)
    assert list(result) == ["scale"]
    assert set(result.unavailable) == {"perm", "signs", "data", "radial", "bn"}
    assert "discrete" in result.unavailable["perm"] and "data-dependent" in result.unavailable["data"]
    assert "angular_momentum" in result.unavailable["radial"] and "approximate" in result.unavailable["bn"]
    # an exact but non-linear SO(2) action is not pointed to angular_momentum(), which needs a linear one
    assert "non-linearly" in conserved_quantity_kind(get_action("rosenbrock_so2"))[1]
    with pytest.raises(KeyError, match="discrete"):
        result["perm"]
    with pytest.raises(ValueError, match="5 site"):
        conserved_quantities(model, sites, missing="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(conserved_quantities(model, sites, missing="ignore").unavailable) == set(result.unavailable)
    with pytest.raises(ValueError, match="missing must be"):
        conserved_quantities(model, sites, missing="silent")


def test_bad_inputs_raise_named_errors():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    site = Site(get_action("gl_linear"), ("0.weight", "0.bias", "2.weight"), name="gl")
    with pytest.raises(KeyError, match="2.weight"):
        conserved_quantities({"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)}, site)
    with pytest.raises(TypeError, match="nn.Module or a mapping"):
        conserved_quantities([torch.zeros(3)], site)
    with pytest.raises(TypeError, match="Site"):
        conserved_quantities(model, ["gl"])
    with pytest.raises(ValueError, match="unique"):
        conserved_quantities(model, [site, site])
    scale = Site(get_action("positive_rescaling"), ("0.weight", "0.bias", "2.weight"))
    with pytest.raises(ValueError, match="matrix group"):
        angular_momentum(model, model.state_dict(), scale)
    with pytest.raises(ValueError, match="shape"):
        angular_momentum(model, {**model.state_dict(), "2.weight": torch.zeros(2, 5)}, site)
    with pytest.raises(ValueError, match="columns must match"):
        whitened_conserved_quantity(torch.zeros(2, 3), torch.zeros(4, 5), "tanh")
    with pytest.raises(ValueError, match="unknown activation"):
        whitened_conserved_quantity(torch.zeros(2, 3), torch.zeros(3, 5), "gelu")
    with pytest.raises(ValueError, match="nodes"):
        whitened_conserved_quantity(torch.zeros(2, 3), torch.zeros(3, 5), torch.tanh, nodes=1)
    with pytest.raises(ValueError, match="nodes"):
        expected_whitened_quantity(3, 2, 2, "tanh", nodes=0)
    with pytest.raises(ValueError, match="positive int"):
        expected_whitened_quantity(0, 2, 2, "tanh")
    with pytest.raises(ValueError, match="derivative vanishes"):
        whitened_conserved_quantity(torch.zeros(2, 3), -torch.ones(3, 5), torch.relu)
    with pytest.raises(ValueError, match="duration"):
        integrate_gradient_flow(lambda p: (p["a"] ** 2).sum(), {"a": torch.ones(2)}, -1.0, 10)
    with pytest.raises(ValueError, match="method"):
        integrate_gradient_flow(lambda p: (p["a"] ** 2).sum(), {"a": torch.ones(2)}, 1.0, 10, method="rk45")


def test_gradient_flow_integrators_have_their_orders():
    """On L = |a|^2 / 2 the flow is a e^{-t}: RK4's error falls 16x when dt halves, Euler's (= GD) 2x."""
    start = {"a": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    exact = start["a"] * torch.exp(torch.tensor(-1.0, dtype=torch.float64))
    for method, order in (("rk4", 4), ("euler", 1)):
        errors = [
            float(
                (integrate_gradient_flow(lambda p: 0.5 * (p["a"] ** 2).sum(), start, 1.0, steps, method=method).final["a"] - exact).norm()
            )
            for steps in (10, 20)
        ]
        assert errors[0] / errors[1] == pytest.approx(2**order, rel=0.1)
