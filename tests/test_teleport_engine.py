"""Teleport's parts: group objects and shortcuts, a pluggable search strategy, the typed watch, group math on groups."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

from teleopt import Site, get_action
from teleopt.groups import (
    GeneralLinear,
    Group,
    Orthogonal,
    PositiveScaling,
    Translation,
)
from teleopt.teleport import (
    GradientAscent,
    SafetyConfig,
    Schedule,
    SearchConfig,
    SearchProblem,
    SearchResult,
    StatePolicy,
    Teleport,
)
from teleopt.teleport.safety import Snapshot
from teleopt.teleport.watch import InverseMove, TeleportRecord, Watch

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.LeakyReLU(0.1),
        nn.Linear(6, 7),
        nn.LeakyReLU(0.1),
        nn.Linear(7, 3),
    ).double()


def sites():
    return [
        Site(LEAKY, ("0.weight", "0.bias", "2.weight")),
        Site(LEAKY, ("2.weight", "2.bias", "4.weight")),
    ]


def data(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)


def mse(out, y):
    return ((out - y) ** 2).mean()


def backward(model, x, y):
    model.zero_grad()
    mse(model(x), y).backward()


# ---------------------------------------------------------------- configuration
def test_shortcuts_build_the_same_group_objects_as_explicit_ones():
    model = mlp()
    short = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites(),
        state_policy="reset",
        schedule=Schedule(every=3, warmup=1),
        search=SearchConfig(steps=7, lr=0.1, trust_region=0.5, path="fast"),
    )
    full = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites(),
        schedule=Schedule(every=3, warmup=1),
        search=SearchConfig(steps=7, lr=0.1, trust_region=0.5, path="fast"),
        state_policy=StatePolicy("reset"),
    )
    for opt in (short, full):
        assert (opt.schedule.every, opt.schedule.warmup) == (3, 1)
        assert (
            opt.search.steps,
            opt.search.lr,
            opt.search.trust_region,
            opt.search.path,
        ) == (7, 0.1, 0.5, "fast")
        assert opt.state_policy.describe()["first_moment"] == "reset"
        assert opt.param_groups[0]["teleopt_teleport_trust_region"] == 0.5


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"schedule": Schedule(every=2), "every": 3}, ValueError, "either schedule="),
        ({"search": "fast"}, TypeError, "SearchConfig"),
        ({"evry": 3}, TypeError, "unexpected keyword argument 'evry'"),
    ],
)
def test_a_group_object_and_its_shortcuts_are_not_given_together(kwargs, error, match):
    model = mlp()
    with pytest.raises(error, match=match):
        Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), **kwargs)


def test_a_strategy_without_a_search_method_is_refused():
    with pytest.raises(TypeError, match="search\\(problem\\)"):
        SearchConfig(strategy=object())  # type: ignore[arg-type]  # the wrong type is the point


# ---------------------------------------------------------------- search strategy
class FixedScales:
    """A strategy that never ascends: every log-scale set to ``value`` (clipped to the trust region)."""

    def __init__(self, value):
        self.value = value
        self.problems = []

    def search(self, problem: SearchProblem) -> SearchResult:
        self.problems.append(problem)
        coords = [torch.full_like(c, self.value) for c in problem.start]
        for c, g, r in zip(coords, problem.groups, problem.trust_regions):
            if r is not None:
                g.project_coordinates(c, r)
        return SearchResult(coords)


def test_a_search_strategy_chooses_the_elements_and_the_rest_of_the_teleport_is_unchanged():
    model, (x, y) = mlp(), data()
    strategy = FixedScales(0.3)
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites(),
        search=SearchConfig(strategy=strategy),
        loss_fn=mse,
        schedule=Schedule(),
    )
    backward(model, x, y)
    report = opt.teleport(batch=(x, y))
    assert report.accepted and report.path == "fast" and report.loss_drift < 1e-12
    assert len(strategy.problems) == 1 and len(strategy.problems[0].groups) == 2
    assert all(torch.allclose(e, torch.full_like(e, math.exp(0.3))) for e in report.elements.values())
    # no score from the strategy: the teleport evaluates the objective at the identity for its report
    assert report.objective_before == pytest.approx(report.grad_norm_before**2)


def test_the_caps_still_scale_a_strategy_choice_towards_the_identity():
    model, (x, y) = mlp(), data()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        sites(),
        search=SearchConfig(strategy=FixedScales(-1.0)),
        safety=SafetyConfig(max_gain=1.5, max_predicted_decrease=None),
        loss_fn=mse,
        schedule=Schedule(),
    )
    backward(model, x, y)
    report = opt.teleport(batch=(x, y))
    assert report.shrink < 1.0 and report.gain <= 1.5 + 1e-9


def test_gradient_ascent_is_the_default_strategy_and_matches_chosen_steps():
    model, (x, y) = mlp(), data()
    reports = []
    for search in (
        None,
        SearchConfig(steps=10, strategy=GradientAscent(steps=10, lr=0.2)),
    ):
        m = copy.deepcopy(model)
        opt = Teleport(
            torch.optim.SGD(m.parameters(), lr=0.1),
            m,
            sites(),
            search=search or SearchConfig(steps=10),
            schedule=Schedule(),
        )
        backward(m, x, y)
        reports.append(opt.teleport())
    assert all(torch.equal(reports[0].elements[k], reports[1].elements[k]) for k in reports[0].elements)


# ---------------------------------------------------------------- watch and record
def test_the_watch_round_trips_through_a_weights_only_state_dict():
    model, (x, y) = mlp(), data()
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model,
        sites(),
        every=1,
        search=SearchConfig(steps=5),
    )
    backward(model, x, y)
    opt.step()
    watch = opt.record.watch
    assert isinstance(watch, Watch) and watch.teleport_step == 0 and watch.until == SafetyConfig().watch_steps
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    fresh_model = copy.deepcopy(model)
    fresh = Teleport(
        torch.optim.SGD(fresh_model.parameters(), lr=0.01),
        fresh_model,
        sites(),
        every=1,
        search=SearchConfig(steps=5),
    )
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    loaded = fresh.record.watch
    assert loaded is not None and (
        loaded.until,
        loaded.teleport_step,
        loaded.grad_ref,
        loaded.loss_ref,
    ) == (watch.until, watch.teleport_step, watch.grad_ref, watch.loss_ref)
    assert fresh.record.step == opt.record.step == 1 and fresh.record.accepted == 1
    assert isinstance(loaded.snapshot, InverseMove)  # the default watch keeps the elements


def test_an_inverse_watch_round_trips_with_its_elements_alone():
    """``watch_restore="inverse"`` keeps the teleport's sites and elements, not a snapshot: the checkpoint
    stays its normal size, and a fresh Teleport rebuilds the move (its own sites, or the saved ones)."""
    model, (x, y) = mlp(), data()
    safety = SafetyConfig(watch_restore="inverse")
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, sites(), every=1, safety=safety)
    backward(model, x, y)
    opt.step()
    watch = opt.record.watch
    assert watch is not None and isinstance(watch.snapshot, InverseMove)
    kept = opt.state_dict()["teleopt_teleport"]["watch"]
    params = dict(model.named_parameters())
    units = sum(s.action.group(tuple(None if n is None else params[n] for n in s.members)).dim for s in sites())
    assert "snapshot" not in kept and sum(e.numel() for e in kept["inverse"]["elements"]) == units
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    for known in (sites(), "auto"):
        buf.seek(0)
        fresh_model = copy.deepcopy(model)
        fresh = Teleport(torch.optim.SGD(fresh_model.parameters(), lr=0.01), fresh_model, known, every=1, safety=safety, example_inputs=x)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        loaded = fresh.record.watch
        assert loaded is not None and isinstance(loaded.snapshot, InverseMove)
        assert [s.name for s in loaded.snapshot.sites] == [s.name for s in watch.snapshot.sites]
        assert all(torch.equal(a, b) for a, b in zip(loaded.snapshot.elements, watch.snapshot.elements))


def test_a_record_without_a_watch_saves_plain_counters():
    record = TeleportRecord(step=4, accepted=2, rollbacks=1, backoff=0.5)
    state = record.to_state(torch.zeros(3, dtype=torch.uint8))
    assert {k: v for k, v in state.items() if k != "rng"} == {
        "step": 4,
        "accepted": 2,
        "rollbacks": 1,
        "backoff": 0.5,
    }


def test_pickled_teleport_keeps_its_sites_action_classes():
    model = mlp()
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, sites(), every=2)
    clone = pickle.loads(pickle.dumps(opt))
    assert [type(s.action) for s in clone.sites] == [type(s.action) for s in opt.sites]
    assert clone.record is clone._engine.record and clone._generator is clone._engine.config.generator


# ---------------------------------------------------------------- group math on the group
@pytest.mark.parametrize(
    "group,radius,check",
    [
        (PositiveScaling(4), 0.5, lambda xi: float(xi.abs().max()) <= 0.5),
        (Translation(4), 0.5, lambda xi: float(xi.abs().max()) <= 0.5),
        (
            GeneralLinear(3),
            0.5,
            lambda xi: float(torch.linalg.matrix_norm(xi, ord=2)) <= 0.5 + 1e-12,
        ),
        (
            Orthogonal(3),
            0.5,
            lambda xi: float(xi.abs().max()) > 0.5,
        ),  # compact: no bound
    ],
)
def test_each_group_projects_coordinates_onto_its_trust_region(group, radius, check):
    xi = (
        torch.randn(
            group.coord_shape,
            generator=torch.Generator().manual_seed(0),
            dtype=torch.float64,
        )
        * 3
    )
    group.project_coordinates(xi, radius)
    assert check(xi)


def test_an_unknown_group_gets_the_euclidean_ball():
    class Custom(PositiveScaling):
        project_coordinates = Group.project_coordinates

    xi = torch.full((4,), 2.0, dtype=torch.float64)
    Custom(4).project_coordinates(xi, 1.0)
    assert float(xi.norm()) == pytest.approx(1.0)


def test_ascent_step_size_is_per_entry_for_matrix_groups():
    assert GeneralLinear(4).ascent_step_size(0.2) == 0.2 / 4 and PositiveScaling(4).ascent_step_size(0.2) == 0.2


@pytest.mark.parametrize(
    "group,power",
    [
        (PositiveScaling(3), -0.5),
        (GeneralLinear(3), 1),
        (GeneralLinear(3), -1),
        (Orthogonal(3), -1),
        (GeneralLinear(3, blocks=2), 1),
    ],
)
def test_algebra_action_is_the_derivative_of_the_representation(group, power):
    gen = torch.Generator().manual_seed(1)
    M = torch.randn(group.coord_shape, generator=gen, dtype=torch.float64)
    x = torch.randn(2, group.dim, 4, generator=gen, dtype=torch.float64)
    t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    _, derivative = torch.autograd.functional.jvp(
        lambda s: group.act_on_axis(group.exp(s * M), x, 1, power),
        (t,),
        (torch.ones(()),),
    )
    closed = group.algebra_action(M.unsqueeze(0).expand(2, *M.shape), x, 1, power)
    assert torch.allclose(closed, derivative, atol=1e-12)


def test_square_factor_is_the_squared_entrywise_scale_of_diagonal_groups():
    c = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64)
    x = torch.randn(3, 2, dtype=torch.float64)
    assert torch.allclose(
        PositiveScaling(3).act_on_axis(c, x, 0, -1) ** 2,
        PositiveScaling(3).square_factor(c, -1)[:, None] * x**2,
    )
    assert GeneralLinear(3).square_factor(torch.eye(3, dtype=torch.float64), 1) is None


def test_the_watch_checkpoints_exactly_what_its_rollback_uses():
    """The default watch keeps the teleport's elements in memory and in ``state_dict`` alike, whatever the
    elements (powers of two under the default trust region, e and 1/e under a trust region of 1); with
    ``watch_restore="snapshot"`` both hold the snapshot.  A watch resumed from the checkpoint is the same kind
    of rollback as the live one, so the resumed run rolls back as the uninterrupted run would."""
    params = dict(mlp().named_parameters())
    units = sum(s.action.group(tuple(None if n is None else params[n] for n in s.members)).dim for s in sites())
    for safety, trust, saved in (
        (SafetyConfig(), math.log(4), "inverse"),
        (SafetyConfig(), 1.0, "inverse"),
        (SafetyConfig(watch_restore="snapshot"), math.log(4), "snapshot"),
    ):
        model, (x, y) = mlp(), data()
        opt = Teleport(
            torch.optim.SGD(model.parameters(), lr=0.01), model, sites(), every=1, safety=safety, search=SearchConfig(trust_region=trust)
        )
        backward(model, x, y)
        opt.step()
        watch = opt.record.watch
        assert watch is not None and isinstance(watch.snapshot, InverseMove if saved == "inverse" else Snapshot)
        elements = torch.cat([e.flatten() for e in opt.reports[-1].elements.values()])
        assert bool((torch.frexp(elements).mantissa.abs() == 0.5).all()) == (trust == math.log(4))
        kept = opt.state_dict()["teleopt_teleport"]["watch"]
        assert sorted(kept) == sorted(["grad_ref", saved, "loss_ref", "strikes", "teleport_step", "until"])
        if saved == "inverse":
            assert sum(e.numel() for e in kept["inverse"]["elements"]) == units
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        fresh_model = copy.deepcopy(model)
        fresh = Teleport(torch.optim.SGD(fresh_model.parameters(), lr=0.01), fresh_model, sites(), every=1, safety=safety)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        assert fresh.record.watch is not None
        assert isinstance(fresh.record.watch.snapshot, InverseMove if saved == "inverse" else Snapshot)
