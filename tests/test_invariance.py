"""Learned invariance of linear models (Gideoni 2023): groups, Reynolds split, asymmetry, Theorems 3.3 and 4.2.

Everything runs in float64.  Tolerances, unless a test says otherwise: the group
matrices have entries 0, +-1, cos/sin of 2 pi k / n, or are conjugated by a random
orthogonal matrix, so products and averages of a few of them are exact to
~1e-15 relative; ``RTOL = 1e-12`` leaves three orders of margin and still catches
any wrong transpose, missing inverse or unnormalised average (errors of order 1).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from teleopt.analysis.invariance import (
    FiniteLinearGroup,
    asymmetry,
    linear_regression_flow,
    orbit_closure,
    split_weights,
)
from teleopt.testing import assert_close, seeds

RTOL = 1e-12
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=F64))
    return q * torch.sign(torch.diagonal(r))


@functools.cache
def _group(name: str) -> FiniteLinearGroup:
    """Orthogonal groups of Gideoni 2023 and a few denser ones."""
    if name == "example_3_1":  # features (1, x), x -> -x
        return FiniteLinearGroup.reflection(2, [1])
    if name == "swap":  # x <-> y, Gideoni 2023, App. D-E
        return FiniteLinearGroup.permutations([[1, 0]])
    if name == "reflection_4":
        return FiniteLinearGroup.reflection(4, [1, 3])
    if name == "cyclic_4":
        return FiniteLinearGroup.permutations([[1, 2, 3, 0]])
    if name == "s3":
        return FiniteLinearGroup.symmetric(3)
    if name == "rotations_5":
        return FiniteLinearGroup.rotations(5)
    if name == "dihedral_4":
        rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=F64)
        return FiniteLinearGroup.from_generators([rot, torch.diag(torch.tensor([1.0, -1.0], dtype=F64))])
    if name == "klein_3":  # swap of coordinates 0, 1 and sign flip of 2: Z2 x Z2
        swap = torch.eye(3, dtype=F64)[[1, 0, 2]]
        return FiniteLinearGroup.from_generators([swap, torch.diag(torch.tensor([1.0, 1.0, -1.0], dtype=F64))])
    if name == "s3_rotated":  # S3 conjugated by a random orthogonal matrix: dense elements
        q = _orthogonal(3, 7)
        return FiniteLinearGroup(q @ _group("s3").elements @ q.T)
    if name == "s3_oblique":  # S3 conjugated by a non-orthogonal matrix: violates Assumption 3
        a = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.3], [0.2, 0.0, 1.0]], dtype=F64)
        return FiniteLinearGroup(a @ _group("s3").elements @ torch.linalg.inv(a))
    raise KeyError(name)


ORTHOGONAL = ["example_3_1", "swap", "reflection_4", "cyclic_4", "s3", "rotations_5", "dihedral_4", "klein_3", "s3_rotated"]
ALL = [*ORTHOGONAL, "s3_oblique"]


def _representation(group: FiniteLinearGroup, kind: str) -> torch.Tensor:
    """Output representations: the group itself (Theorem 4.2), the determinant (1 x 1) or trivial on R^2."""
    g = group.elements
    if kind == "same":
        return g
    if kind == "det":
        return torch.linalg.det(g)[:, None, None]
    return torch.eye(2, dtype=F64).expand(group.order, 2, 2).clone()


def _matrix_error(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> float:
    """Frobenius error relative to max(|expected|, scale): parts of weights can be exactly 0 (rotations fix nothing)."""
    return float((actual - expected).norm()) / max(float(expected.norm()), scale)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---------------------------------------------------------------------------------- groups


@pytest.mark.parametrize(
    "name, order",
    [
        ("example_3_1", 2),
        ("swap", 2),
        ("reflection_4", 2),
        ("cyclic_4", 4),
        ("s3", 6),
        ("rotations_5", 5),
        ("dihedral_4", 8),
        ("klein_3", 4),
        ("s3_rotated", 6),
        ("s3_oblique", 6),
    ],
)
def test_group_tables(name, order):
    """Known orders; the Cayley table, identity and inverses agree with the matrices."""
    group = _group(name)
    g, table, inv = group.elements, group.cayley_table, group.inverse_indices
    assert group.order == order == len(group)
    assert_close(g[:, None] @ g[None], g[table], RTOL, "cayley table")
    assert_close(g[inv] @ g, torch.eye(group.dim, dtype=F64).expand_as(g), RTOL, "inverses")
    assert_close(g[group.identity_index], torch.eye(group.dim, dtype=F64), RTOL, "identity")
    assert group.is_orthogonal() == (name != "s3_oblique")


@settings(deadline=None, max_examples=15)
@given(order=st.integers(1, 24))
@example(order=1)
def test_from_generators_closes_rotations(order):
    """One rotation by 2 pi / n generates exactly n elements despite the round-off of repeated products."""
    generator = FiniteLinearGroup.rotations(order).elements[1 % order]
    group = FiniteLinearGroup.from_generators(generator)
    assert group.order == order
    angles = torch.atan2(group.elements[:, 1, 0], group.elements[:, 0, 0]) % (2 * math.pi)
    expected = torch.arange(order, dtype=F64) * (2 * math.pi / order)
    # atan2 of entries exact to ~1e-15 (products of <= 24 rotations): 1e-12 on the angles
    assert_close(angles.sort().values, expected, RTOL, "rotation angles")


def test_symmetric_group_and_float32():
    assert FiniteLinearGroup.symmetric(4).order == 24
    group = FiniteLinearGroup.rotations(7, dtype=torch.float32)  # float32 tolerance sqrt(eps) = 3.5e-4
    assert group.order == 7 and group.dtype == torch.float32 and group.tol > 1e-4
    assert group.to(F64).dtype == F64 and group.to(F64).order == 7


# ------------------------------------------------------------------------- Reynolds split


@settings(deadline=None, max_examples=25)
@given(name=st.sampled_from(ALL))
def test_reynolds_projector(name):
    """P = R / |G| is idempotent, g P = P g = P (its image is fixed by the group), P^T too; P = P^T iff orthogonal."""
    group = _group(name)
    p, r = group.reynolds_operator(), group.reynolds_operator(normalized=False)
    assert_close(r, group.order * p, RTOL, "R = |G| P")
    # P may be 0 (plane rotations fix no vector): errors relative to the group's scale |g| ~ 1
    assert _matrix_error(p @ p, p) <= RTOL
    for g in group.elements:
        assert _matrix_error(g @ p, p) <= RTOL and _matrix_error(p @ g, p) <= RTOL
    assert (_matrix_error(p, p.T) <= RTOL) == (name != "s3_oblique")
    # rank P = dimension of the fixed subspace, computed independently as the common kernel of all g - I
    eye = torch.eye(group.dim, dtype=F64)
    fixed = group.dim - int(torch.linalg.matrix_rank(torch.cat(list(group.elements - eye)), atol=1e-10))
    assert int(torch.linalg.matrix_rank(p, atol=1e-10)) == fixed


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(ALL), seed=seeds(), out=st.sampled_from([0, 1, 3]))
def test_split_weights_invariance(name, seed, out):
    """W = W_sym + W_asym; x -> W_sym x is exactly invariant; the split is a projection (Gideoni 2023, Theorem 3.3.2)."""
    group = _group(name)
    w = _randn(group.dim, seed=seed) if out == 0 else _randn(out, group.dim, seed=seed)
    sym, asym = split_weights(w, group)
    assert_close(sym + asym, w, RTOL, "sym + asym")
    scale = float(w.norm())
    for g in group.elements:
        assert _matrix_error(sym @ g, sym, scale) <= RTOL  # w_sym . (g x) = w_sym . x
    assert _matrix_error(split_weights(sym, group).symmetric, sym, scale) <= RTOL  # P idempotent on weights
    assert float(split_weights(asym, group).symmetric.norm()) <= RTOL * float(w.norm())
    assert float(asym.norm()) > 1e-3 * float(w.norm())  # random weights are not invariant
    if group.is_orthogonal():  # orthogonal split: the parts are perpendicular (ker(R)^perp (+) ker(R))
        assert abs(float((sym * asym).sum())) <= RTOL * float(w.norm()) ** 2


@settings(deadline=None, max_examples=30)
@given(name=st.sampled_from(ALL), kind=st.sampled_from(["same", "det", "trivial"]), seed=seeds())
def test_split_weights_equivariance(name, kind, seed):
    """W_sym g = rho(g) W_sym for every g (Theorem 4.2.2's commutant when rho is the group itself)."""
    group = _group(name)
    rho = _representation(group, kind)
    w = _randn(rho.shape[1], group.dim, seed=seed)
    sym, asym = split_weights(w, group, output_representation=rho)
    assert_close(sym + asym, w, RTOL, "sym + asym")
    scale = float(w.norm())
    for g, r in zip(group.elements, rho):
        assert _matrix_error(sym @ g, r @ sym, scale) <= RTOL  # W_sym g = rho(g) W_sym
    assert _matrix_error(split_weights(sym, group, output_representation=rho).symmetric, sym, scale) <= RTOL  # idempotent
    if kind == "trivial":  # the trivial output representation is plain invariance
        assert _matrix_error(sym, split_weights(w, group).symmetric, scale) <= RTOL


# ---------------------------------------------------------------------------- asymmetry


@settings(deadline=None, max_examples=25)
@given(name=st.sampled_from(ALL), seed=seeds())
def test_asymmetry_of_linear_models(name, seed):
    """E_x |f(x) - E_g f(g x)| is E_x |W_asym x| for a linear model and 0 for its symmetric part."""
    group = _group(name)
    x = _randn(16, group.dim, seed=seed)
    model = nn.Linear(group.dim, 2, bias=True).double()
    with torch.no_grad():
        model.weight.copy_(_randn(2, group.dim, seed=seed + 1))
    sym, asym = split_weights(model.weight.detach(), group)
    expected = (x @ asym.T).norm(dim=1)
    per_input = asymmetry(model, x, group, reduction="none")
    assert_close(per_input, expected, RTOL, "asymmetry of W x + b = |W_asym x|")
    loss = asymmetry(model, x, group)
    assert float(loss.detach()) > 1e-3
    loss.backward()  # usable as a penalty: it depends on W_asym only, so for orthogonal groups so does its gradient
    if group.is_orthogonal():
        grad = model.weight.grad
        assert float(split_weights(grad, group).symmetric.norm()) <= RTOL * float(grad.norm())
        assert float(model.bias.grad.norm()) <= RTOL * float(grad.norm())
    with torch.no_grad():
        model.weight.copy_(sym)
        # exact invariance: only round-off of the orbit average remains (|f| ~ 1)
        assert float(asymmetry(model, x, group)) <= 1e-13


@settings(deadline=None, max_examples=20)
@given(name=st.sampled_from(ORTHOGONAL), seed=seeds())
def test_asymmetry_of_nonlinear_models(name, seed):
    """Zero for an orbit-averaged MLP and for |x|^2 (invariant, nonlinear); positive for the plain MLP."""
    group = _group(name)
    torch.manual_seed(seed % 2**31)
    mlp = nn.Sequential(nn.Linear(group.dim, 8), nn.Tanh(), nn.Linear(8, 1)).double().requires_grad_(False)
    x = _randn(12, group.dim, seed=seed)
    g = group.elements

    def averaged(inputs):
        return torch.stack([mlp(inputs @ h.T) for h in g]).mean(0)

    assert float(asymmetry(averaged, x, group)) <= 1e-13  # sums of |G| ~1 terms in another order
    assert float(asymmetry(lambda v: v.square().sum(1), x, group)) <= 1e-13
    assert float(asymmetry(mlp, x, group)) > 1e-6
    # equivariance: a commuting linear map gives 0, the same map on the non-commuting part does not
    w = _randn(group.dim, group.dim, seed=seed + 1)
    sym, asym = split_weights(w, group, output_representation=g)
    assert float(asymmetry(lambda v: v @ sym.T, x, group, output_representation=g)) <= 1e-13
    assert float(asymmetry(lambda v: v @ asym.T, x, group, output_representation=g)) > 1e-3


# ------------------------------------------------------------------ Theorems 3.3 and 4.2


def _symmetric_data(name: str, seed: int, kind: str | None, n: int = 6):
    group = _group(name)
    x0 = _randn(n, group.dim, seed=seed)
    if kind is None:
        y0 = torch.tanh(x0 @ _randn(group.dim, seed=seed + 1)) + x0[:, 0] ** 2  # nonlinear labels
        return group, None, *orbit_closure(x0, group, y0)
    rho = _representation(group, kind)
    y0 = torch.sin(x0 @ _randn(group.dim, rho.shape[1], seed=seed + 1))
    return group, rho, *orbit_closure(x0, group, y0, output_representation=rho)


def _sgd(w0: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    """nn.Linear (no bias) trained by torch.optim.SGD on 1/2 sum |y - W x|^2; returns the trajectory (steps + 1, *w0.shape)."""
    model = nn.Linear(x.shape[1], 1 if w0.ndim == 1 else w0.shape[0], bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w0.reshape(model.weight.shape))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    target = y.reshape(len(y), -1)
    path = [model.weight.detach().clone()]
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (target - model(x)).square().sum()).backward()
        opt.step()
        path.append(model.weight.detach().clone())
    return torch.stack(path).reshape(steps + 1, *w0.shape)


@settings(deadline=None, max_examples=8)
@given(name=st.sampled_from(ORTHOGONAL), kind=st.sampled_from([None, None, "same", "det"]), seed=seeds())
def test_gradient_descent_decouples_the_parts(name, kind, seed):
    """Theorem 3.3.2 / 4.2.2 under SGD: the asymmetric trajectory ignores the symmetric init, and vice versa.

    The GD map commutes with the Reynolds projection exactly (not only in the flow
    limit), so the trajectories agree to round-off; the asymmetric part follows
    (I - eta K)^k, the discrete form of Theorem 3.3.3.
    """
    group, rho, x, y = _symmetric_data(name, seed, kind)
    flow = linear_regression_flow(x, y, group, output_representation=rho)
    lr, steps = 0.2 / float(torch.linalg.matrix_norm(flow.kernel, 2)), 60
    shape = flow.moment.shape
    split = functools.partial(split_weights, group=group, output_representation=rho)
    base = _randn(*shape, seed=seed + 2)
    other = split(_randn(*shape, seed=seed + 3))
    sym_shift, asym_shift = (part / part.norm() if part.norm() > 1e-8 else part for part in other)  # unit shifts (0: no such part)
    same_asym = base + sym_shift  # base's asymmetric part, another symmetric part
    same_sym = base + asym_shift
    paths = {key: _sgd(w, x, y, lr, steps) for key, w in (("base", base), ("same_asym", same_asym), ("same_sym", same_sym))}
    parts = {key: [split(w) for w in path] for key, path in paths.items()}
    scale = max(float(path.flatten(1).norm(dim=1).max()) for path in paths.values())
    # round-off of 60 steps of |eta K| <= 0.2 products: ~1e-14 of the largest weights; 1e-11 leaves margin
    for k in range(steps + 1):
        assert float((parts["base"][k].asymmetric - parts["same_asym"][k].asymmetric).norm()) <= 1e-11 * scale
        assert float((parts["base"][k].symmetric - parts["same_sym"][k].symmetric).norm()) <= 1e-11 * scale
    # ... while the other part differs by a unit vector: the check is not vacuous (unless that subspace is {0})
    for key, which, shift in (("same_asym", "symmetric", sym_shift), ("same_sym", "asymmetric", asym_shift)):
        moved = float((getattr(parts["base"][0], which) - getattr(parts[key][0], which)).norm())
        assert moved == pytest.approx(float(shift.norm()), rel=1e-12)
    # asymmetric part: W_asym(k) = W_asym(0) (I - eta K)^k, independent of the labels
    step = torch.eye(group.dim, dtype=F64) - lr * flow.kernel
    asym0 = parts["base"][0].asymmetric
    predicted = asym0 @ torch.linalg.matrix_power(step, steps)
    assert float((parts["base"][steps].asymmetric - predicted).norm()) <= 1e-11 * scale  # same round-off budget


def _rk4_flow(w0, x, y, loss_scale, t_end, h):
    """Gradient flow dW/dt = -grad L of L = (s/2) sum |y - W x|^2, integrated by RK4.

    The velocity s (Y - X W^T)^T X is checked against autograd at the start and then
    used directly (an autograd call per stage costs ~1 ms on a loaded machine).
    """
    target = y.reshape(len(y), -1)

    def velocity(w):
        return (loss_scale * (target - x @ w.reshape(-1, x.shape[1]).T).T @ x).reshape(w.shape)

    probe = w0.clone().requires_grad_(True)
    loss = 0.5 * loss_scale * (target - x @ probe.reshape(-1, x.shape[1]).T).square().sum()
    assert_close(velocity(w0), -torch.autograd.grad(loss, probe)[0], RTOL, "velocity = -grad L")
    w, path = w0.clone(), [w0.clone()]
    for _ in range(round(t_end / h)):
        k1 = velocity(w)
        k2 = velocity(w + h / 2 * k1)
        k3 = velocity(w + h / 2 * k2)
        k4 = velocity(w + h * k3)
        w = w + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        path.append(w.clone())
    return torch.stack(path)


@settings(deadline=None, max_examples=8)
@given(name=st.sampled_from(ORTHOGONAL), kind=st.sampled_from([None, None, "same", "det"]), seed=seeds())
@example(name="example_3_1", kind=None, seed=0)
def test_gradient_flow_matches_theorem(name, kind, seed):
    """RK4-integrated gradient flow follows eq. (3)/(5); the asymmetric part decays at least at decay_rate.

    loss_scale = 1 / |K| makes the fastest rate 1; RK4 with h = 0.02 then has a
    local error of at most (0.02)^5 / 120 = 2.7e-11 per step, <= 5.3e-9 relative
    over the 200 steps to t = 4 (measured: 1.0e-9 at worst on the catalogue), so 1e-8.
    """
    group, rho, x, y = _symmetric_data(name, seed, kind)
    scale = 1 / float(torch.linalg.matrix_norm(x.T @ x, 2))
    flow = linear_regression_flow(x, y, group, output_representation=rho, loss_scale=scale)
    assert flow.data_asymmetry <= 1e-13  # orbit_closure makes the data exactly symmetric
    w0 = _randn(*flow.moment.shape, seed=seed + 2)
    h, t_end = 0.02, 4.0
    path = _rk4_flow(w0, x, y, scale, t_end, h)
    times = torch.arange(len(path), dtype=F64) * h
    assert_close(path, flow.weights(w0, times), 1e-8, "eq. (3) closed form")
    asym = torch.stack([split_weights(w, group, output_representation=rho).asymmetric for w in path])
    assert_close(asym, flow.asymmetric_part(w0, times), 1e-8, "Theorem 3.3.3: W_asym(t) = W_asym(0) exp(-sKt)")
    norms = asym.flatten(1).norm(dim=1)
    assert bool((norms <= norms[0] * torch.exp(-flow.decay_rate * times) * (1 + 1e-8)).all())  # exponential decay bound
    # the bound is tight: the slowest rate is the asymptotic log-slope (spectral gap allowing) or the fastest rate is not exceeded
    rates = flow.asymmetric_rates
    assert bool((rates > 0).all()) and float(rates[-1]) <= 1 + 1e-12 and flow.decay_rate == float(rates[0])


@settings(deadline=None, max_examples=20)
@given(name=st.sampled_from(ORTHOGONAL), kind=st.sampled_from([None, "same", "det"]), seed=seeds())
def test_decay_rates_against_brute_force(name, kind, seed):
    """asymmetric_rates are the eigenvalues of W -> s W K on the asymmetric subspace, built here from split_weights."""
    group, rho, x, y = _symmetric_data(name, seed, kind)
    flow = linear_regression_flow(x, y, group, output_representation=rho, loss_scale=0.5)
    shape = flow.moment.shape
    basis = torch.eye(math.prod(shape), dtype=F64).reshape(-1, *shape)

    def asym(w):
        return split_weights(w, group, output_representation=rho).asymmetric

    projector = torch.stack([asym(b).flatten() for b in basis], 1)  # matrix of the asymmetric projection
    operator = torch.stack([asym(0.5 * b.reshape(-1, group.dim) @ flow.kernel).reshape(shape).flatten() for b in basis], 1)
    eig = torch.linalg.eigvalsh((operator + operator.T) / 2)
    rank = int(torch.linalg.matrix_rank(projector))
    expected = eig.sort().values[-rank:] if rank else eig[:0]  # K is PD on this data: zeros are the symmetric subspace
    got = flow.asymmetric_rates
    if kind is None and flow.moment.ndim == 1:
        assert len(got) == rank
    assert_close(got.sort().values, expected, 1e-10, "asymmetric rates")  # eigvalsh of well-conditioned 2..9-dim matrices


def test_weights_limit_is_invariant():
    """Corollary 3.4: the t -> inf weights of Example 3.1 are the least-squares fit and invariant (w = (b, 0))."""
    group = _group("example_3_1")
    xs = torch.linspace(0.05, 1.0, 20, dtype=F64)
    x, y = orbit_closure(torch.stack([torch.ones_like(xs), xs], 1), group, xs.abs())
    flow = linear_regression_flow(x, y, group)
    assert flow.decay_rate == pytest.approx(float(x[:, 1].square().sum()), rel=1e-13)  # K_G = diag(2n, sum x^2)
    limit = flow.limit(torch.tensor([0.3, -1.2], dtype=F64))
    assert_close(limit, torch.linalg.lstsq(x, y).solution, 1e-12, "least squares")
    assert abs(float(limit[1])) <= 1e-14
    assert_close(flow.weights(torch.tensor([0.3, -1.2], dtype=F64), [1e3])[0], limit, 1e-12, "W(t) -> limit")


def test_trivial_group_has_nothing_to_decay():
    group = FiniteLinearGroup(torch.eye(3, dtype=F64)[None])
    w = _randn(2, 3, seed=0)
    assert torch.equal(split_weights(w, group).symmetric, w)
    x = _randn(5, 3, seed=1)
    flow = linear_regression_flow(x, _randn(5, 2, seed=2), group)
    assert flow.decay_rate == math.inf and len(flow.symmetric_rates) == 3
    assert float(asymmetry(lambda v: v @ w.T, x, group)) == 0.0


def test_oblique_group_breaks_decoupling_and_is_refused():
    """For a non-orthogonal group (Assumption 3 fails) GD mixes the parts; linear_regression_flow says so."""
    group, _, x, y = _symmetric_data("s3_oblique", 3, None)
    lr = 0.2 / float(torch.linalg.matrix_norm(x.T @ x, 2))
    base = _randn(3, seed=4)
    shifted = base + split_weights(_randn(3, seed=5), group).symmetric
    a, b = _sgd(base, x, y, lr, 30)[-1], _sgd(shifted, x, y, lr, 30)[-1]
    assert float((split_weights(a, group).asymmetric - split_weights(b, group).asymmetric).norm()) > 1e-4
    with pytest.raises(ValueError, match="Assumption 3"):
        linear_regression_flow(x, y, group)


def test_strict_refuses_asymmetric_data():
    group = _group("swap")
    x = _randn(10, 2, seed=1)  # not orbit-closed
    y = x.sum(1)
    with pytest.raises(ValueError, match="Assumption 1"):
        linear_regression_flow(x, y, group)
    flow = linear_regression_flow(x, y, group, strict=False)
    assert flow.data_asymmetry > 1e-3 and len(flow.asymmetric_rates) == 1


# ---------------------------------------------------------------------------- bad input


def test_bad_groups():
    eye = torch.eye(2, dtype=F64)
    rot90 = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=F64)
    with pytest.raises(ValueError, match="not closed"):
        FiniteLinearGroup(torch.stack([eye, rot90]))
    with pytest.raises(ValueError, match="identity"):
        FiniteLinearGroup(torch.stack([-eye]))
    with pytest.raises(ValueError, match="duplicate"):
        FiniteLinearGroup(torch.stack([eye, -eye, -eye]))
    with pytest.raises(ValueError, match="not invertible"):
        FiniteLinearGroup(torch.stack([eye, torch.zeros(2, 2, dtype=F64)]))
    with pytest.raises(ValueError, match="non-square"):
        FiniteLinearGroup(torch.zeros(1, 2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"shape \(n, d, d\)"):
        FiniteLinearGroup(eye)
    with pytest.raises(ValueError, match="empty"):
        FiniteLinearGroup(torch.zeros(0, 2, 2, dtype=F64))
    with pytest.raises(TypeError, match="floating-point"):
        FiniteLinearGroup(torch.eye(2, dtype=torch.long)[None])
    with pytest.raises(TypeError, match="torch.Tensor"):
        FiniteLinearGroup([[1.0]])
    with pytest.raises(ValueError, match="non-finite"):
        FiniteLinearGroup(torch.full((1, 2, 2), math.nan, dtype=F64))
    with pytest.raises(ValueError, match="max_order"):
        FiniteLinearGroup.from_generators(FiniteLinearGroup.rotations(8).elements[1], max_order=5)
    irrational = torch.tensor([[math.cos(1.0), -math.sin(1.0)], [math.sin(1.0), math.cos(1.0)]], dtype=F64)
    with pytest.raises(ValueError, match="may be infinite"):
        FiniteLinearGroup.from_generators(irrational, max_order=64)
    with pytest.raises(TypeError, match="generators"):
        FiniteLinearGroup.from_generators([])
    with pytest.raises(ValueError, match="coordinates"):
        FiniteLinearGroup.reflection(2, [2])
    with pytest.raises(ValueError, match="not a permutation"):
        FiniteLinearGroup.permutations([[0, 0]])


def test_bad_weights_inputs_and_representations():
    group = _group("s3")
    with pytest.raises(ValueError, match="weight must have shape"):
        split_weights(torch.zeros(2, 4, dtype=F64), group)
    with pytest.raises(TypeError, match="floating-point"):
        split_weights(torch.zeros(3, dtype=torch.long), group)
    with pytest.raises(TypeError, match="FiniteLinearGroup"):
        split_weights(torch.zeros(3, dtype=F64), group.elements)
    with pytest.raises(ValueError, match="not a homomorphism"):
        split_weights(torch.zeros(3, 3, dtype=F64), group, output_representation=group.elements[group.inverse_indices].mT.flip(0))
    with pytest.raises(ValueError, match="3 matrices, the group has 6"):
        split_weights(torch.zeros(3, 3, dtype=F64), group, output_representation=group.elements[:3])
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        split_weights(torch.zeros(3, dtype=F64), group, output_representation=group.elements)
    with pytest.raises(ValueError, match=r"inputs must have shape \(N, 3\)"):
        asymmetry(lambda v: v.sum(1), torch.zeros(4, 2, dtype=F64), group)
    with pytest.raises(ValueError, match="inputs is empty"):
        asymmetry(lambda v: v.sum(1), torch.zeros(0, 3, dtype=F64), group)
    with pytest.raises(ValueError, match="rows"):
        asymmetry(lambda v: v.sum(), torch.zeros(4, 3, dtype=F64), group)
    with pytest.raises(ValueError, match="reduction"):
        asymmetry(lambda v: v.sum(1), torch.zeros(4, 3, dtype=F64), group, reduction="sum")
    with pytest.raises(ValueError, match="loss_scale"):
        linear_regression_flow(torch.ones(6, 3, dtype=F64), torch.ones(6, dtype=F64), group, loss_scale=0.0)
    with pytest.raises(ValueError, match="targets must have shape"):
        orbit_closure(torch.ones(4, 3, dtype=F64), group, torch.ones(5, dtype=F64))
    with pytest.raises(ValueError, match="needs targets"):
        orbit_closure(torch.ones(4, 3, dtype=F64), group, output_representation=group.elements)
    with pytest.raises(ValueError, match="output_representation acts on 3"):
        asymmetry(lambda v: v[:, :2], torch.ones(4, 3, dtype=F64), group, output_representation=group.elements)
    with pytest.raises(TypeError, match="callable"):
        asymmetry(None, torch.ones(4, 3, dtype=F64), group)
