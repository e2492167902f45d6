"""teleopt.discover and LearnedAction: training, the GroupAction contract, files, registry, binding, diagnostics.

One small discovery run per problem is shared by the tests of this module
(module-scoped fixtures): the two-layer linear network with scalar parameters and
data of Zhao et al. 2024b, Sec. 5.3 (loss target, for the generator figure) and the same
block learned on its output with a batch of 4 (for binding into larger models).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import teleopt
from teleopt.discovery import ActionNetwork, DiscoveryConfig, LearnedAction, discover, problems
from teleopt.discovery.binding import SubnetworkAction, bind, module_input
from teleopt.discovery.diagnostics import abs_cosine, compare_curves, data_sensitivity, principal_angles, span_residual
from teleopt.discovery.samples import SampleSpec
from teleopt.teleport import Schedule, SearchConfig
from teleopt.testing import assert_group_axioms, check_action, group_elements
from teleopt.testing.strategies import default_max_norm

F64 = torch.float64
RESCALING = torch.diag(torch.tensor([1.0, -1.0], dtype=F64))

# Measured tolerances of the learned actions below (float64 evaluation).  A learned
# action is only approximately invariant.  check_action (coordinates N(0, 0.5^2);
# exp(c h) moves theta by about |c| beta = |c| in parameter space): the block action
# (300 steps) changes the block output by <= 9.1e-3 relative over seeds 0-5;
# 3e-2 leaves a factor 3.  An untrained network changes it by O(1).
LEARNED_INVARIANCE_RTOL = 3e-2
# Over the whole hypothesis range |c| <= 1.15 the change of the output, in units of
# the median output norm of the held-out samples, is <= 0.022 (32 samples x 9 values
# of c).  Relative to the sample's own output it can be large where that output is
# near zero (w1 w2 ~ 0), which is why the scale is the typical one, not the sample's.
LEARNED_OUTPUT_TOL = 5e-2
# Identity is exact by construction; inverse and composition along one generator
# hold up to the RK4 error (8 steps per unit time): <= 1.1e-5 over check_action
# seeds 0-5, but 2.2e-4 at the edge of the hypothesis range (a 9 x 9 grid of both
# coordinates in [-1.15, 1.15] on the untrained network; hypothesis found 1.15e-4
# there in CI); composition of different generators needs the Lie bracket
# condition (a random two-generator network misses it by >= 6.7e-4, deterministic).
LEARNED_AXIOM_RTOL = 4e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def linear_action() -> LearnedAction:
    """Zhao et al. 2024b, Sec. 5.3: m = h = n = k = 1, sigma = identity, L = (w2 w1 x - y)^2."""
    return discover(problems.two_layer(), steps=200, progress=False, seed=0)


@pytest.fixture(scope="module")
def block_action() -> LearnedAction:
    """The same block learned on its output sigma(X W1^T) W2^T for a batch of 4 inputs (bindable, Prop. 4.1)."""
    return discover(problems.two_layer(k=4, target="output"), steps=300, progress=False, seed=0)


def _untrained(num_generators: int = 1, seed: int = 0, init_scale: float = 0.1) -> LearnedAction:
    """An action network as discover() starts it (init_scale 0.1), or fully random (1.0)."""
    problem = problems.two_layer(k=4, target="output")
    gen = torch.Generator().manual_seed(seed)
    spec = SampleSpec.from_sample(problem.param_shapes, problem.member_names, problem.sampler(gen)[1])
    net = ActionNetwork(spec.num_params, spec.data_features, (64, 64, 64), generator=gen, init_scale=init_scale)
    gens = torch.randn(num_generators, 2, 2, generator=gen, dtype=F64)
    params, data = problem.sampler(gen)
    theta, leaves = spec.flatten(params)[None], (data[None],)
    return LearnedAction(net, gens, spec, "untrained", loss_fn=problem.loss_fn, examples=(theta, leaves))


# -- done-when: the rescaling generator ----------------------------------------------------
def test_linear_network_learns_the_rescaling_generator(linear_action):
    """Zhao et al. 2024b, Sec. 5.3 / Fig. 2: |cos(h, diag(1, -1))| >= 0.99."""
    assert abs_cosine(linear_action.generators[0], RESCALING) >= 0.99
    history = linear_action.history["values"]
    total = linear_action.history["terms"].index("total")
    assert float(history[-20:, total].mean()) < 0.1 * float(history[:20, total].mean())


def test_discover_is_seeded_and_reproducible():
    problem = problems.two_layer()
    a = discover(problem, steps=15, batch_size=8, progress=False, seed=3)
    b = discover(problem, steps=15, batch_size=8, progress=False, seed=3)
    c = discover(problem, steps=15, batch_size=8, progress=False, seed=4)
    assert torch.equal(a.generators, b.generators) and not torch.equal(a.generators, c.generators)
    assert all(torch.equal(x, y) for x, y in zip(a.network.state_dict().values(), b.network.state_dict().values()))
    assert torch.equal(a.history["values"], b.history["values"])


def test_a_config_object_and_keywords_train_the_same_run():
    problem = problems.two_layer()
    config = DiscoveryConfig(steps=6, batch_size=4, hidden=(8,), seed=2)
    a = discover(problem, config=config, progress=False)
    b = discover(problem, steps=6, batch_size=4, hidden=(8,), seed=2, progress=False)
    assert torch.equal(a.generators, b.generators) and torch.equal(a.history["values"], b.history["values"])
    assert a.config == b.config
    c = discover(problem, config=config, seed=3, progress=False)  # a keyword replaces the config's field
    assert (c.config["seed"], c.config["steps"]) == (3, 6) and not torch.equal(a.generators, c.generators)
    with pytest.raises(TypeError, match="stpes"):
        discover(problem, stpes=5)
    with pytest.raises(TypeError, match="config must be a DiscoveryConfig"):
        discover(problem, config={"steps": 5})
    with pytest.raises(ValueError, match="generator_lr"):
        DiscoveryConfig(generator_lr=float("nan"))


def test_progress_bar_shows_the_losses(capsys):
    discover(problems.two_layer(), steps=12, batch_size=4, progress=True)
    err = capsys.readouterr().err
    assert "inv=" in err and "assoc=" in err and "id=" in err


def test_restarts_keep_the_run_with_the_lowest_objective():
    problem = problems.two_layer()
    kwargs = dict(steps=30, batch_size=8, hidden=(8,), progress=False)
    best = discover(problem, seed=3, restarts=3, **kwargs)
    singles = [discover(problem, seed=s, **kwargs) for s in (3, 4, 5)]
    objectives = [float(a.history["values"][-50:, -1].mean()) for a in singles]
    assert best.config["restarts"] == {"seeds": [3, 4, 5], "objectives": objectives}
    chosen = singles[objectives.index(min(objectives))]
    assert best.config["seed"] == chosen.config["seed"] and torch.equal(best.generators, chosen.generators)


def test_discover_rejects_bad_input():
    problem = problems.two_layer()

    def nan_sampler(gen):
        params, data = problem.sampler(gen)
        return (params[0], params[1] * float("nan")), data

    with pytest.raises(ValueError, match="non-finite parameters.*'W2'"):
        discover(problem.loss_fn, problem.param_shapes, nan_sampler, steps=2, progress=False, member_names=("W1", "W2"))

    def inf_data(gen):
        params, (x, y) = problem.sampler(gen)
        return params, (x, y + float("inf"))

    with pytest.raises(ValueError, match=r"non-finite data \(data\[1\]"):
        discover(problem.loss_fn, problem.param_shapes, inf_data, steps=2, progress=False)
    with pytest.raises(ValueError, match="has shape"):
        discover(problem.loss_fn, [(1, 2), (1, 1)], problem.sampler, steps=2, progress=False)
    with pytest.raises(ValueError, match="num_generators"):
        discover(problem, num_generators=0)
    with pytest.raises(TypeError, match="LossWeights"):
        discover(problem, weights={"invariance": 1.0})
    with pytest.raises(ValueError, match="restarts"):
        discover(problem, restarts=0)
    with pytest.raises(TypeError, match="vmap"):
        discover(lambda p, d: torch.tensor(float(p[0].sum())), problem.param_shapes, problem.sampler, steps=2, progress=False)


class _Poisoned:
    """A sampler that turns non-finite after ``after`` calls, with or without ``sample_batch``."""

    def __init__(self, sampler, after: int, batched: bool) -> None:
        self.sampler, self.after, self.calls = sampler, after, 0
        if batched:
            self.sample_batch = self._sample_batch

    def _poison(self, params, data):
        self.calls += 1
        if self.calls > self.after:
            params = (params[0], params[1].clone().fill_(float("nan")))
        return params, data

    def __call__(self, gen):
        return self._poison(*self.sampler(gen))

    def _sample_batch(self, gen, n):
        return self._poison(*self.sampler.sample_batch(gen, n))


@pytest.mark.parametrize("batched", [False, True])
def test_a_sampler_turning_non_finite_mid_training_is_caught(batched, linear_action):
    """Every step's draw is checked, not only the first one (also the diagnostics' draws)."""
    problem = problems.two_layer()
    # the first call only probes the data shapes; then 1 call per step (batched) or 4 (batch_size)
    per_step = 1 if batched else 4
    poisoned = _Poisoned(problem.sampler, after=1 + 2 * per_step, batched=batched)
    with pytest.raises(ValueError, match="non-finite parameters.*'W2'"):
        discover(problem.loss_fn, problem.param_shapes, poisoned, steps=5, batch_size=4, progress=False, member_names=("W1", "W2"))
    assert poisoned.calls == 1 + 3 * per_step  # stopped at the end of step 3's draw, the first bad one
    with pytest.raises(ValueError, match="non-finite parameters"):
        compare_curves(linear_action, _Poisoned(problem.sampler, after=0, batched=batched), num_samples=4, num_points=3, num_random=1)


# -- the GroupAction contract --------------------------------------------------------------
def test_learned_action_is_a_data_dependent_nonlinear_group_action(linear_action):
    assert isinstance(linear_action, teleopt.GroupAction)
    assert linear_action.exactness == "data-dependent" and linear_action.needs_data and not linear_action.linear
    assert not linear_action.has_gradient_transport and linear_action.continuous
    params, data = linear_action.example(torch.Generator().manual_seed(0)).params, None
    assert linear_action.coord_shape(params) == (1,)
    with pytest.raises(ValueError, match="needs data"):
        linear_action.act(linear_action.identity(params), params, data)
    with pytest.raises(TypeError, match="no closed-form gradient transport"):
        linear_action.transport_gradient(linear_action.identity(params), params)


def test_teleopt_testing_accepts_the_trained_action_with_its_stated_tolerances(block_action):
    for seed in range(3):
        worst = check_action(block_action, seed=seed, scale=0.5, rtol=LEARNED_INVARIANCE_RTOL)
        assert worst["invariance"] <= LEARNED_INVARIANCE_RTOL


def test_teleopt_testing_rejects_an_untrained_action():
    untrained = _untrained()
    with pytest.raises(AssertionError, match="invariance"):
        check_action(untrained, seed=0, scale=0.5, rtol=LEARNED_INVARIANCE_RTOL)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_two_generator_action_fails_the_composition_axiom(seed):
    """Flows of one generator always compose; two generators need the Lie bracket condition."""
    untrained = _untrained(num_generators=2, seed=seed, init_scale=1.0)
    problem = untrained.example(torch.Generator().manual_seed(0))
    group = untrained.group(problem.params)
    g1, g2 = group.exp(torch.tensor([0.8, 0.0], dtype=F64)), group.exp(torch.tensor([0.0, 0.8], dtype=F64))
    with pytest.raises(AssertionError, match="composition axiom"):
        assert_group_axioms(untrained, problem.params, g1, g2, problem.data, rtol=LEARNED_AXIOM_RTOL)


# The learned flow's invariance error grows about linearly with the coordinate |c|
# (measured on a 32-sample x 21-point grid: worst 2.1e-3, 4.5e-3, 9.0e-3, 1.5e-2 of the
# typical output at 1/4, 1/2, 3/4 and all of default_max_norm = 1.15).  Training is
# chaotic across BLAS builds and torch versions, and at the edge of the range other
# platforms exceeded 5e-2 on some draws; half the range keeps an 11x margin here.
LEARNED_PROPERTY_RANGE = 0.5


@settings(deadline=None, max_examples=10)
@given(st.data())
def test_learned_invariance_property(block_action, data):
    problem = block_action.example(torch.Generator().manual_seed(data.draw(st.integers(0, 31), label="sample")))
    bound = LEARNED_PROPERTY_RANGE * default_max_norm(block_action.group(problem.params))
    g = data.draw(group_elements(block_action, problem.params, max_norm=bound), label="g")
    scale = _typical_output(block_action)
    moved = block_action.act(g, problem.params, problem.data)
    change = problem.fn(moved, problem.data) - problem.fn(problem.params, problem.data)
    assert float(change.norm()) <= LEARNED_OUTPUT_TOL * scale


def _typical_output(action: LearnedAction) -> float:
    """Median output norm over the action's held-out samples."""
    theta, leaves = action.examples
    spec = action.spec
    norms = [
        action.loss_fn(spec.unflatten(theta[i]), spec.rebuild_data([leaf[i] for leaf in leaves])).norm() for i in range(theta.shape[0])
    ]
    return float(torch.stack(norms).median())


UNTRAINED = _untrained()
UNTRAINED_PROBLEM = UNTRAINED.example(torch.Generator().manual_seed(0))


@settings(deadline=None, max_examples=10)
@given(group_elements(UNTRAINED, UNTRAINED_PROBLEM.params), group_elements(UNTRAINED, UNTRAINED_PROBLEM.params))
@example(torch.eye(2, dtype=F64), torch.eye(2, dtype=F64))
@example(*[torch.tensor([[1.6479, 1.1895], [1.6348, 2.1184]], dtype=F64)] * 2)  # found by hypothesis in CI (error 1.15e-4)
def test_flow_axioms_hold_for_any_network(g1, g2):
    """Identity (exact), inverse and composition along one generator (RK4 error) hold even untrained."""
    params, data = UNTRAINED_PROBLEM.params, UNTRAINED_PROBLEM.data
    assert_group_axioms(UNTRAINED, params, g1, g2, data, rtol=LEARNED_AXIOM_RTOL)
    moved = UNTRAINED.act(UNTRAINED.identity(params), params, data)
    assert all(torch.equal(a, b) for a, b in zip(moved, params))


def test_act_rejects_mismatched_shapes_and_elements(linear_action):
    problem = linear_action.example(torch.Generator().manual_seed(0))
    g = linear_action.random_element(problem.params, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="'W1' has shape"):
        linear_action.act(g, (torch.zeros(2, 1, dtype=F64), problem.params[1]), problem.data)
    with pytest.raises(ValueError, match=r"data\[0\] has shape"):
        linear_action.act(g, problem.params, (torch.zeros(3, 1, dtype=F64), problem.data[1]))
    with pytest.raises(ValueError, match="expected 2 tensor"):
        linear_action.act(g, problem.params, problem.data[0])
    with pytest.raises(ValueError, match="negative real axis"):
        linear_action.act(-torch.eye(2, dtype=F64), problem.params, problem.data)
    with pytest.raises(ValueError, match="shape"):
        linear_action.act(torch.eye(3, dtype=F64), problem.params, problem.data)


# -- files and the registry ----------------------------------------------------------------
def test_save_load_round_trip(linear_action, tmp_path):
    path = tmp_path / "linear.pt"
    linear_action.save(path)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "teleopt.learned_action" and raw["version"] == 1
    loaded = LearnedAction.load(path)
    assert torch.equal(loaded.generators, linear_action.generators)
    problem = linear_action.example(torch.Generator().manual_seed(2))
    g = linear_action.random_element(problem.params, torch.Generator().manual_seed(3))
    before = linear_action.act(g, problem.params, problem.data)
    after = loaded.act(g, problem.params, problem.data)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert loaded.loss_fn is not None and loaded.config["problem"]["problem"] == "two_layer"
    assert torch.equal(loaded.history["values"], linear_action.history["values"])
    custom = LearnedAction.load(path, loss_fn=problems.two_layer().loss_fn, name="renamed")
    assert custom.name == "renamed"


def test_load_rejects_incompatible_files(linear_action, tmp_path):
    state = linear_action.state()
    path = tmp_path / "bad.pt"
    torch.save(state | {"version": 99}, path)
    with pytest.raises(ValueError, match="format version 99"):
        LearnedAction.load(path)
    torch.save(state | {"format": "something else"}, path)
    with pytest.raises(ValueError, match="not a teleopt learned-action file"):
        LearnedAction.load(path)
    weights = dict(state["weights"])
    weights["layers.0.weight"] = weights["layers.0.weight"][:, :-1]
    torch.save(state | {"weights": weights}, path)
    with pytest.raises(ValueError, match="layers.0.weight"):
        LearnedAction.load(path)
    torch.save(state | {"generators": torch.zeros(1, 3, 3, dtype=F64)}, path)
    with pytest.raises(ValueError, match="generators"):
        LearnedAction.load(path)


def test_load_rejects_unreadable_and_damaged_files(linear_action, tmp_path):
    """Files torch.load(weights_only=True) cannot read, or that lack a part, raise ValueError naming why."""
    good = tmp_path / "good.pt"
    linear_action.save(good)
    path = tmp_path / "bad.pt"
    path.write_bytes(good.read_bytes()[:300])  # truncated
    with pytest.raises(ValueError, match="not a teleopt learned-action file readable with weights_only=True.*zip archive"):
        LearnedAction.load(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="readable with weights_only=True") as info:
        LearnedAction.load(path)
    assert "weights_only` set to `False`" not in str(info.value)  # never advise loading untrusted pickles
    torch.save(linear_action.state() | {"config": {"problem": _Poisoned}}, path)  # a pickled class, not plain data
    with pytest.raises(ValueError, match=r"readable with weights_only=True \(Unsupported global"):
        LearnedAction.load(path)
    for key in ("spec", "weights", "generators"):
        state = linear_action.state()
        del state[key]
        torch.save(state, path)
        with pytest.raises(ValueError, match=f"lacks '{key}'"):
            LearnedAction.load(path)


def test_registered_from_file_next_to_the_known_actions(linear_action, tmp_path):
    path = tmp_path / "linear.pt"
    linear_action.save(path)
    action = teleopt.register_action(LearnedAction.load(path, name="learned_two_layer_linear"))
    try:
        rows = {row["name"]: row for row in teleopt.list_actions()}
        assert rows["learned_two_layer_linear"]["exactness"] == "data-dependent"
        assert "gl_linear" in rows and teleopt.get_action("learned_two_layer_linear") is action
        with pytest.raises(ValueError, match="already registered"):
            teleopt.register_action(LearnedAction.load(path, name="learned_two_layer_linear"))
    finally:
        teleopt.unregister_action("learned_two_layer_linear")


# -- binding into larger models (Zhao et al. 2024b, Prop. 4.1, Cor. 4.2-4.3) ------------------------
class _Wide(nn.Module):
    """input -> Linear(3, 1) -> [block: Linear(1, 1), Linear(1, 1)] -> Linear(1, 2); plus a wide pair for Cor. 4.2."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.stem = nn.Linear(3, 1).double()
        self.block1 = nn.Linear(1, 1, bias=False).double()
        self.block2 = nn.Linear(1, 1, bias=False).double()
        self.head = nn.Linear(1, 2).double()
        self.wide1 = nn.Linear(1, 3, bias=False).double()
        self.wide2 = nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=F64))

    def forward(self, x):
        z = self.stem(x)
        return self.head(self.block2(self.block1(z)) + self.wide2(self.wide1(z)))


def test_bound_learned_action_preserves_the_larger_model(block_action):
    model = _Wide()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=F64)
    site = bind(block_action, model, ["block1.weight", "block2.weight"], "block1")
    assert isinstance(site, teleopt.Site) and site.data_input == "block1" and site.action is block_action
    data = module_input(model, "block1", x)
    out = model(x)
    g = block_action.group(site.tensors(model)).exp(torch.tensor([0.5], dtype=F64))
    site.apply_(model, g, data)
    moved = (model.block1.weight.detach().clone(), model.block2.weight.detach().clone())
    # the weights moved along the orbit, the output did not (up to the learned action's accuracy)
    assert not torch.allclose(moved[0], _Wide().block1.weight)
    teleopt.testing.assert_close(model(x), out, LEARNED_INVARIANCE_RTOL, "model output after the learned teleport")


def test_bound_to_a_slice_of_a_wider_layer(block_action):
    """Zhao et al. 2024b, Cor. 4.2: the first unit of a width-3 hidden layer carries the width-1 symmetry."""
    model = _Wide()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(6), dtype=F64)
    site = bind(block_action, model, {"W1": "wide1.weight", "W2": "wide2.weight"}, "wide1", slices={"W1": (0, 0, 1), "W2": (1, 0, 1)})
    assert isinstance(site.action, SubnetworkAction)
    data = module_input(model, "wide1", x)
    out = model(x)
    g = site.action.group(site.tensors(model)).exp(torch.tensor([0.5], dtype=F64))
    w1_before = model.wide1.weight.detach().clone()
    site.apply_(model, g, data)
    assert torch.equal(model.wide1.weight[1:], w1_before[1:]) and not torch.equal(model.wide1.weight[0], w1_before[0])
    teleopt.testing.assert_close(model(x), out, LEARNED_INVARIANCE_RTOL, "wide model output")
    worst = check_action(site.action, seed=0, scale=0.5, rtol=LEARNED_INVARIANCE_RTOL)
    assert worst["invariance"] <= LEARNED_INVARIANCE_RTOL


def test_bind_rejects_mismatches(block_action):
    model = _Wide()
    with pytest.raises(ValueError, match="'W1' -> 'wide1.weight' has shape"):
        bind(block_action, model, ["wide1.weight", "wide2.weight"], "wide1")
    with pytest.raises(ValueError, match="no parameter or buffer named 'nope.weight'"):
        bind(block_action, model, ["nope.weight", "block2.weight"], "block1")
    with pytest.raises(ValueError, match="data_input 'missing'"):
        bind(block_action, model, ["block1.weight", "block2.weight"], "missing")
    with pytest.raises(ValueError, match="acts on 2 tensors"):
        bind(block_action, model, ["block1.weight"], "block1")
    with pytest.raises(ValueError, match="slice has shape"):
        bind(block_action, model, ["wide1.weight", "wide2.weight"], "wide1", slices={"W1": (0, 0, 2), "W2": (1, 0, 1)})
    site = bind(block_action, model, ["block1.weight", "block2.weight"], "block1")
    g = block_action.group(site.tensors(model)).exp(torch.tensor([0.5], dtype=F64))
    with pytest.raises(ValueError, match=r"learned on data of shape \(4, 1\)"):
        site.act(model, g, torch.zeros(8, 1, dtype=F64))


# -- diagnostics -----------------------------------------------------------------------------
def test_curve_comparison_and_data_sensitivity(linear_action):
    problem = problems.two_layer()
    comparison = compare_curves(linear_action, problem.sampler, num_samples=24, num_points=9, num_random=2)
    assert comparison.learned.shape == (24, 1, 9) and comparison.random.shape == (24, 2, 9)
    assert torch.equal(comparison.learned[..., 0], torch.zeros(24, 1, dtype=F64))
    assert comparison.invariance_ratio >= 10 and comparison.straight_ratio >= 10
    sensitivity = data_sensitivity(linear_action, problem.sampler, num_samples=8)
    assert sensitivity["relative"].shape == (8, 1) and bool(torch.isfinite(sensitivity["relative"]).all())


def test_span_residual_and_principal_angles():
    reference = problems.rescaling_generators(2, 3, 2)
    inside = torch.einsum("i,ijk->jk", torch.tensor([0.3, -1.0, 2.0], dtype=F64), reference)
    outside = torch.zeros(12, 12, dtype=F64)
    outside[0, 1] = 1.0
    residual = span_residual(torch.stack([inside, outside, inside + outside]), reference)
    assert float(residual[0]) < 1e-14 and math.isclose(float(residual[1]), 1.0)
    assert math.isclose(float(residual[2]), 1.0 / math.sqrt(float((inside + outside).square().sum())), rel_tol=1e-12)
    angles = principal_angles(reference[:2], reference)
    assert float(angles.max()) < 1e-7
    assert math.isclose(float(principal_angles(outside[None], reference)[0]), math.pi / 2, rel_tol=1e-12)


def test_plots_are_written(linear_action, tmp_path):
    pytest.importorskip("matplotlib")
    from teleopt.discovery.plots import plot_curves, plot_generators

    plot_generators(linear_action, tmp_path / "generators.png", labels=["w1", "w2"])
    comparison = compare_curves(linear_action, problems.two_layer().sampler, num_samples=8, num_points=5, num_random=1)
    plot_curves(comparison, tmp_path / "curves.png")
    assert (tmp_path / "generators.png").stat().st_size > 1000 and (tmp_path / "curves.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="generators"):
        plot_generators(torch.zeros(2, 3))


# -- Teleport's general path with a learned action from file ---------------------------------
# The learned block action changes the loss on the teleport batch by <= 5e-3 relative
# at trust-region-sized coordinates (measured); Teleport's default float64 tolerance
# (1e-10) is for exact symmetries, so the learned site is given its own budget.
LEARNED_LOSS_TOL = 2e-2


def test_teleport_uses_a_learned_action_loaded_from_file(block_action, tmp_path):
    from teleopt.teleport.safety import SafetyConfig

    path = tmp_path / "block.pt"
    block_action.save(path)
    teleopt.register_action(LearnedAction.load(path, name="learned_block_for_teleport"))
    try:
        model = _Wide()
        gen = torch.Generator().manual_seed(7)
        batch = (torch.randn(4, 3, generator=gen, dtype=F64), torch.randn(4, 2, generator=gen, dtype=F64))
        site = bind(teleopt.get_action("learned_block_for_teleport"), model, ["block1.weight", "block2.weight"], "block1")
        before = {n: t.detach().clone() for n, t in model.state_dict().items()}
        mse = nn.functional.mse_loss

        def teleporter(tol):
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            return teleopt.Teleport(
                opt,
                model,
                [site],
                loss_fn=mse,
                safety=SafetyConfig(loss_tol=tol),
                search=SearchConfig(path="general", steps=3),
                schedule=Schedule(),
            )

        report = teleporter(LEARNED_LOSS_TOL).teleport(batch=batch)
        assert report.accepted, report.reason
        assert report.path == "general" and report.loss_before is not None
        assert abs(report.loss_after - report.loss_before) <= LEARNED_LOSS_TOL * abs(report.loss_before)
        assert not torch.equal(model.block1.weight, before["block1.weight"])
        assert all(torch.equal(model.state_dict()[n], before[n]) for n in before if not n.startswith("block"))
        # the post-condition is really checked: with the exact-symmetry tolerance the move is rolled back
        moved = {n: t.detach().clone() for n, t in model.state_dict().items()}
        strict = teleporter(1e-10).teleport(batch=batch)
        assert not strict.accepted and "loss changed" in strict.reason
        assert all(torch.equal(model.state_dict()[n], moved[n]) for n in moved)
    finally:
        teleopt.unregister_action("learned_block_for_teleport")


def test_teleport_rejects_a_learned_site_that_does_not_match(block_action):
    """A site built by hand on tensors of other shapes fails when Teleport is built; a batch of
    another size than the action was learned on fails the teleport, before the model is touched."""
    model = _Wide()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    wrong = teleopt.Site(block_action, ("wide1.weight", "wide2.weight"), data_input="wide1")
    with pytest.raises(ValueError, match=r"'W1' has shape \(3, 1\), but the learned action acts on shape \(1, 1\)"):
        teleopt.Teleport(opt, model, [wrong], loss_fn=nn.functional.mse_loss, search=SearchConfig(path="general"), schedule=Schedule())
    site = bind(block_action, model, ["block1.weight", "block2.weight"], "block1")
    teleport = teleopt.Teleport(
        opt, model, [site], loss_fn=nn.functional.mse_loss, search=SearchConfig(path="general"), schedule=Schedule()
    )
    gen = torch.Generator().manual_seed(8)
    batch = (torch.randn(8, 3, generator=gen, dtype=F64), torch.randn(8, 2, generator=gen, dtype=F64))
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"data\[0\] has shape \(8, 1\), but the action was learned on data of shape \(4, 1\)"):
        teleport.teleport(batch=batch)
    assert all(torch.equal(model.state_dict()[n], before[n]) for n in before)
