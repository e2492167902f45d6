"""The boundary step: the trust region's linear maximisation oracle per group, and the search that
steps there (``BoundaryStep``, the default search of fast-path teleports with GL sites, and with
positive-scaling sites under the gradient norm when no ascent was configured)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.groups import GeneralLinear, PositiveScaling, Translation
from teleopt.teleport import BoundaryStep, GradientAscent, SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.objectives import GradientNorm, get_objective

F64 = torch.float64
R = math.log(4)


@pytest.mark.parametrize(
    ("group", "dual_norm"),
    [
        (PositiveScaling(7), lambda d: d.abs().sum()),
        (Translation(5), lambda d: d.abs().sum()),
        (GeneralLinear(6), lambda d: torch.linalg.matrix_norm(d, "nuc").sum()),
        (GeneralLinear(4, blocks=3), lambda d: torch.linalg.matrix_norm(d, "nuc").sum()),
    ],
    ids=["scaling", "translation", "gl", "gl-blocks"],
)
def test_the_boundary_point_maximises_the_linear_score_over_the_trust_region(group, dual_norm):
    """<d, xi> over the trust region of radius r peaks at r times the dual norm of d (l1 for boxes,
    nuclear for the spectral ball), at a feasible point that the projection leaves where it is, and no
    projected random point does better."""
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(group.coord_shape, generator=gen, dtype=F64)
    point = group.boundary_point(d, R)
    assert point is not None and point.shape == d.shape
    projected = point.clone()
    group.project_coordinates(projected, R)
    torch.testing.assert_close(projected, point, rtol=1e-12, atol=1e-12)
    best = float((d * point).sum())
    assert best == pytest.approx(R * float(dual_norm(d)), rel=1e-12)
    for _ in range(200):
        xi = torch.randn(group.coord_shape, generator=gen, dtype=F64) * 3
        group.project_coordinates(xi, R)
        assert float((d * xi).sum()) <= best * (1 + 1e-12)
    at_zero = group.boundary_point(torch.zeros_like(d), R)  # no move: None, or zeros where deciding costs no read
    assert at_zero is None or (at_zero.shape == d.shape and not bool(at_zero.any()))


@pytest.mark.parametrize("blocks", [None, 3])
def test_a_gl_boundary_point_leaves_round_off_directions_at_zero(blocks):
    """A direction of rank 2 plus round-off (1e-14 of its scale): the boundary point moves along its two
    significant singular directions only, so it does not follow the round-off (sharded and unsharded
    reductions add in different orders); without noise it is the same point."""
    group = GeneralLinear(5, blocks=blocks)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(group.coord_shape[:-1] + (2,), generator=gen, dtype=F64)
    b = torch.randn(group.coord_shape[:-2] + (2, 5), generator=gen, dtype=F64)
    d = a @ b
    noisy = d + 1e-14 * torch.randn(d.shape, generator=gen, dtype=F64)
    point, from_noisy = group.boundary_point(d, R), group.boundary_point(noisy, R)
    assert point is not None and from_noisy is not None
    torch.testing.assert_close(from_noisy, point, rtol=0, atol=1e-10)
    assert torch.linalg.matrix_rank(point).max() == 2
    assert float((d * point).sum()) == pytest.approx(R * float(torch.linalg.matrix_norm(d, "nuc").sum()), rel=1e-12)


@pytest.mark.parametrize("blocks", [None, 3])
def test_a_symmetric_direction_takes_the_eigendecomposition_to_the_same_point(blocks):
    """The gradient norm's direction at the identity is symmetric, 2 (B - A), up to round-off: the boundary
    point then comes from an eigendecomposition (U sign(Lambda) U^T), which must be the SVD's polar factor
    r U V^T, also for a rank-deficient direction (its null directions stay at 0) and with asymmetric
    round-off of 1e-15; a direction asymmetric beyond round-off takes the SVD."""
    group = GeneralLinear(6, blocks=blocks)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(group.coord_shape, generator=gen, dtype=F64)
    low = torch.randn(group.coord_shape[:-1] + (3,), generator=gen, dtype=F64)
    for d in (a + a.mT, low @ torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=F64)) @ low.mT):
        noisy = d + 1e-15 * d.abs().amax() * torch.randn(d.shape, generator=gen, dtype=F64)
        U, S, Vh = torch.linalg.svd(d, full_matrices=False)
        kept = (S > 1e-6 * S.amax(dim=-1, keepdim=True)).to(F64)
        polar = R * ((U * kept.unsqueeze(-2)) @ Vh)
        for direction in (d, noisy):
            point = group.boundary_point(direction, R)
            assert point is not None
            torch.testing.assert_close(point, polar, rtol=0, atol=1e-10)
    skew = group.boundary_point(a, R)  # not symmetric: the SVD
    U, _, Vh = torch.linalg.svd(a, full_matrices=False)
    assert skew is not None
    torch.testing.assert_close(skew, R * (U @ Vh), rtol=0, atol=1e-12)


@pytest.mark.parametrize("blocks", [None, 3])
def test_exp_of_a_symmetric_boundary_point_comes_from_its_eigendecomposition(blocks):
    """exp of the point a symmetric direction gives, U diag(lambda) U^T, is U diag(e^lambda) U^T, with its
    contragredient U diag(e^-lambda) U^T remembered for the apply: both within float64 round-off of
    matrix_exp and of the solve they replace (entries of size e^r, r = log 4).  A point changed in place, a
    copy of it takes matrix_exp (one differentiated through: expm_pair, tested with the group)."""
    from teleopt.groups import GroupCache

    group = GeneralLinear(6, blocks=blocks)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(group.coord_shape, generator=gen, dtype=F64)
    with GroupCache().active() as cache:
        point = group.boundary_point(a + a.mT, R)
        assert point is not None
        g = group.exp(point)
        torch.testing.assert_close(g, torch.linalg.matrix_exp(point), rtol=0, atol=1e-13)
        assert not torch.equal(g, torch.linalg.matrix_exp(point))  # not matrix_exp: the eigendecomposition
        hit = cache.get("contragredient", g, (id(g), GeneralLinear, 6))
        blocked = g if blocks else g.unsqueeze(0)
        torch.testing.assert_close(hit, torch.linalg.solve(blocked.mT, torch.eye(6, dtype=F64).expand(blocked.shape)), rtol=0, atol=1e-13)
        assert torch.equal(group.block_matrices(g, -1), hit)  # the apply's g^-T is the remembered one
        other = point.clone()
        assert torch.equal(group.exp(other), torch.linalg.matrix_exp(other))
        point.mul_(0.5)  # changed in place: its eigenvalues are no longer the remembered ones
        assert torch.equal(group.exp(point), torch.linalg.matrix_exp(point))
    point.mul_(2.0)  # no active cache: nothing remembered, matrix_exp
    assert torch.equal(group.exp(point), torch.linalg.matrix_exp(point))


def _linear_net(seed):
    """A linear 12-16-10 network: GL(16) acts exactly on its hidden layer (``gl_linear``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 10, bias=False)).to(F64)
    x, y = torch.randn(32, 12, dtype=F64), torch.randn(32, 10, dtype=F64)
    return model, x, y


def _teleported(model, x, y, strategy):
    site = Site(get_action("gl_linear"), ("0.weight", "0.bias", "1.weight"))
    search = SearchConfig(strategy=strategy) if strategy is not None else None
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3), model, [site], safety=SafetyConfig(watch_steps=0), search=search, schedule=Schedule()
    )
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return opt.teleport()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gl_teleport_steps_to_the_boundary_by_default_and_gains_at_least_what_ascent_does(seed):
    """On the gradient norm of a GL(16) site, one boundary step (one gradient, three line-search
    points) reaches at least the gain of 100 projected-Adam steps, and the outputs are unchanged
    (float64, relative 1e-10)."""
    model, x, y = _linear_net(seed)
    before = model(x).detach()
    boundary = _teleported(copy.deepcopy(model), x, y, None)
    ascent = _teleported(copy.deepcopy(model), x, y, GradientAscent())
    assert boundary.accepted and ascent.accepted
    assert boundary.gain >= ascent.gain > 1
    moved = copy.deepcopy(model)
    _teleported(moved, x, y, None)
    assert float((moved(x).detach() - before).norm() / before.norm()) <= 1e-10


def _relu_mlp(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 3)).to(F64)
    x, y = torch.randn(32, 6, dtype=F64), torch.randn(32, 3, dtype=F64)
    return model, x, y


def _rescaled(model, x, y, **kwargs):
    relu = get_action("positive_rescaling", activation="relu")
    sites = [Site(relu, ("0.weight", "0.bias", "2.weight")), Site(relu, ("2.weight", "2.bias", "4.weight"))]
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=1e-3), model, sites, safety=SafetyConfig(watch_steps=0), **kwargs, schedule=Schedule()
    )
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return opt.teleport()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scaling_teleport_steps_to_the_boundary_by_default_and_gains_what_ascent_does(seed):
    """Two chained ReLU rescaling sites, gradient norm: the default boundary step (one gradient of the
    gradient-norm model and 3 line-search points) gains at least what 100 projected-Adam steps
    (``SearchConfig(steps=100)``: steps chosen keep the ascent) do, and the outputs are unchanged."""
    model, x, y = _relu_mlp(seed)
    before = model(x).detach()
    boundary = _rescaled(copy.deepcopy(model), x, y)
    ascent = _rescaled(copy.deepcopy(model), x, y, search=SearchConfig(steps=100))
    assert boundary.accepted and ascent.accepted
    assert boundary.gain >= ascent.gain * (1 - 1e-9) and boundary.gain > 1
    moved = copy.deepcopy(model)
    _rescaled(moved, x, y)
    assert float((moved(x).detach() - before).norm() / before.norm()) <= 1e-10


def test_the_default_search_is_a_boundary_step_for_fast_path_gl_and_unconfigured_scaling_problems():
    """GL sites on the fast path with a trust region: BoundaryStep; scalings: BoundaryStep for the increasing
    gradient norm (convex in the log-scales) unless the ascent was configured or the objective decreases; an
    explicit strategy always wins; without a trust region BoundaryStep itself falls back to ascent."""
    from teleopt.teleport.search import SearchProblem

    objective = get_objective("grad_norm")

    class Fast:
        moves_gradients = True

    def problem(groups, radius=R):
        return SearchProblem([], groups, Fast(), objective, None, [], [radius] * len(groups))  # type: ignore[arg-type]

    config = SearchConfig()
    assert isinstance(config.strategy_for(objective, problem([GeneralLinear(4), PositiveScaling(3)])), BoundaryStep)
    assert isinstance(config.strategy_for(objective, problem([PositiveScaling(3)])), BoundaryStep)
    assert isinstance(SearchConfig(steps=10).strategy_for(objective, problem([PositiveScaling(3)])), GradientAscent)
    configured = SearchConfig(steps=100)  # steps chosen, even at the default value: the ascent as chosen
    assert isinstance(configured.strategy_for(objective, problem([PositiveScaling(3)])), GradientAscent)
    assert isinstance(configured.strategy_for(objective, problem([GeneralLinear(4)])), BoundaryStep)
    decrease = GradientNorm(direction="decrease")
    assert isinstance(config.strategy_for(decrease, problem([PositiveScaling(3)])), GradientAscent)
    assert isinstance(config.strategy_for(objective, problem([GeneralLinear(4)], radius=None)), GradientAscent)
    assert isinstance(SearchConfig(strategy=GradientAscent(5)).strategy_for(objective, problem([GeneralLinear(4)])), GradientAscent)


class _Elements:
    """A stand-in evaluator: the elements are each group's exp of the coordinates."""

    moves_gradients = True

    def __init__(self, groups):
        self.groups = groups

    def elements(self, coords):
        return [g.exp(c) for g, c in zip(self.groups, coords)]


class _Smooth:
    """A smooth score of the elements, not invariant under anything: sum <W, E> + <V, E^2>."""

    name, direction, maximum_on_boundary = "smooth", "increase", False

    def __init__(self, groups, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.w = [torch.randn(g.element_shape, generator=gen, dtype=F64) for g in groups]
        self.v = [torch.randn(g.element_shape, generator=gen, dtype=F64) for g in groups]

    def score(self, evaluator, elements, prepared):
        return sum((w * e).sum() + (v * e * e).sum() for w, v, e in zip(self.w, self.v, elements))


def test_the_gradient_at_the_identity_is_taken_in_the_elements_where_exp_is_plain(monkeypatch):
    """GL_n and positive scalings: d exp at 0 is the identity map, so the gradient in the coordinates at
    the identity is the gradient in the elements there; ``score_and_gradient`` takes it without calling
    exp (no ``matrix_exp`` forward or backward) and matches autograd through exp to round-off.  O(n)'s
    exp is not plain (it takes the skew part): its gradient still goes through exp."""
    from teleopt.groups import Orthogonal
    from teleopt.teleport.search import SearchProblem

    def problem(groups):
        zeros = [torch.zeros(g.coord_shape, dtype=F64) for g in groups]
        return SearchProblem(
            [Site(get_action("gl_linear"), ("a", "b", "c"))] * len(groups),
            groups,
            _Elements(groups),
            _Smooth(groups),
            None,
            zeros,
            [R] * len(groups),
        )  # type: ignore[arg-type]

    def through_exp(p):
        xs = [c.clone().requires_grad_(True) for c in p.start]
        score = p.score(xs)
        return float(score.detach()), torch.autograd.grad(score, xs)

    plain = problem([GeneralLinear(4, blocks=2), PositiveScaling(5), GeneralLinear(3)])
    expected_score, expected = through_exp(plain)
    for g in plain.groups:
        monkeypatch.setattr(g, "exp", lambda c: pytest.fail("exp was called"))
    score, grads = plain.score_and_gradient()
    assert score == pytest.approx(expected_score, rel=1e-15)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-13)
    monkeypatch.undo()
    skew = problem([Orthogonal(4), PositiveScaling(3)])
    expected_score, expected = through_exp(skew)
    score, grads = skew.score_and_gradient()
    assert score == pytest.approx(expected_score, rel=1e-15)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(grads[0], -grads[0].mT)  # only the skew part moves an O(n) element


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_the_gradient_norm_the_boundary_is_the_best_point_of_the_ray(seed):
    """The gradient norm is a nonnegative sum of exponentials of t along the boundary step's ray (scalings
    and GL blocks), so its maximum on [0, 1] is at t = 1: the default evaluates that point alone, and the
    line search over 1, 0.5, 0.25 chooses the same element with the same gain."""
    model, x, y = _linear_net(seed)
    alone = _teleported(copy.deepcopy(model), x, y, None)
    searched = _teleported(copy.deepcopy(model), x, y, BoundaryStep(fractions=(1.0, 0.5, 0.25)))
    assert alone.accepted and searched.accepted
    assert alone.gain == pytest.approx(searched.gain, rel=1e-12)
    for name, element in alone.elements.items():
        torch.testing.assert_close(element, searched.elements[name], rtol=1e-12, atol=1e-12)
    mlp, xm, ym = _relu_mlp(seed)
    alone = _rescaled(copy.deepcopy(mlp), xm, ym)
    searched = _rescaled(copy.deepcopy(mlp), xm, ym, search=SearchConfig(strategy=BoundaryStep(fractions=(1.0, 0.5, 0.25))))
    assert alone.gain == pytest.approx(searched.gain, rel=1e-12) and alone.gain > 1


def test_the_line_search_is_one_point_only_where_the_score_is_convex_along_the_ray():
    """By default: the boundary point alone for the increasing gradient norm over GL and scalings, the three
    fractions for an objective without that property; given fractions are used as they are, and bad ones are
    refused with a clear error."""
    from teleopt.teleport.search import SearchProblem

    class Fast:
        moves_gradients = True

    def problem(objective, groups):
        return SearchProblem([], groups, Fast(), objective, None, [], [R] * len(groups))  # type: ignore[arg-type]

    convex = problem(get_objective("grad_norm"), [GeneralLinear(4), PositiveScaling(3)])
    assert BoundaryStep()._fractions(convex) == (1.0,)
    assert BoundaryStep()._fractions(problem(GradientNorm(direction="decrease"), [GeneralLinear(4)])) == (1.0, 0.5, 0.25)
    assert BoundaryStep()._fractions(problem(_Smooth([GeneralLinear(4)]), [GeneralLinear(4)])) == (1.0, 0.5, 0.25)
    assert BoundaryStep(fractions=(0.5,))._fractions(convex) == (0.5,)
    for bad in [(), (0.0,), (1.5,), (True,), [1.0], 0.5]:
        with pytest.raises(ValueError, match="fractions"):
            BoundaryStep(fractions=bad)  # type: ignore[arg-type]
