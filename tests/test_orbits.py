"""teleopt.analysis.orbits: orbit points and one-parameter curves of a model's sites (Zhao 2026, Sec. 2.9, Zhao et al. 2023, Sec. 6).

Tolerances: exact symmetries in float64 keep the output to ~1e-15 relative error
with elements of condition number < 10 (``teleopt.testing.default_rtol`` explains
the 1e-10 budget); the one-parameter-subgroup identity exp((t+s)M) = exp(sM) exp(tM)
holds for matrix_exp to the same order for ||tM||, ||sM|| <= 1.2, so it gets 1e-10 too.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from teleopt.analysis.orbits import OrbitCurve, OrbitSample, orbit_curve, orbit_outputs, orbit_point, sample_orbit
from teleopt.registry import get_action
from teleopt.site import Site
from teleopt.testing import assert_close, default_rtol, lie_algebra_coordinates, seeds

RTOL = default_rtol(torch.float64)  # 1e-10: exact symmetries, see the module docstring


def _randomised(model: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.7)
    return model


def mixed_mlp(seed: int) -> nn.Sequential:
    """5 -> 7 (LeakyReLU) -> 6 (LeakyReLU) -> 6 (tanh) -> 3 with biases: rescaling of the first hidden layer and
    sign flips of the last act on disjoint tensors."""
    layers = [nn.Linear(5, 7), nn.LeakyReLU(0.2), nn.Linear(7, 6), nn.LeakyReLU(0.2), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)]
    model = nn.Sequential(*layers).double()
    return _randomised(model, seed)


def linear_net(seed: int) -> nn.Sequential:
    """5 -> 6 -> 3 without activation: GL_6 acts exactly between the layers (Zhao 2026, Ex. 1.2.2)."""
    return _randomised(nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3)).double(), seed)


RESCALE0 = Site(get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.2), ("0.weight", "0.bias", "2.weight"))
SIGN4 = Site(get_action("sign_flip", activation="tanh"), ("4.weight", "4.bias", "6.weight"))
PERM0 = Site(get_action("hidden_permutation"), ("0.weight", "0.bias", "2.weight"))
GL = Site(get_action("gl_linear"), ("0.weight", "0.bias", "1.weight"))


def inputs(seed: int, n: int = 5, k: int = 9) -> torch.Tensor:
    return torch.randn(k, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified"


@settings(deadline=None, max_examples=15)
@given(seeds(), st.floats(0.0, 1.5), st.sampled_from(["rescale+sign", "permutation", "gl"]))
@example(0, 0.0, "rescale+sign")
def test_random_orbit_points_of_exact_sites_keep_the_output(seed, scale, which):
    if which == "gl":
        model, sites = linear_net(seed % 1000), [GL]
    else:
        model, sites = mixed_mlp(seed % 1000), ([RESCALE0, SIGN4] if which == "rescale+sign" else [PERM0])
    x, before = inputs(seed), snapshot(model)
    sample = sample_orbit(model, sites, 3, scale=scale, generator=torch.Generator().manual_seed(seed))
    assert isinstance(sample, OrbitSample) and len(sample) == 3 and len(sample.elements[0]) == len(sites)
    expected = model(x).detach()
    outs = orbit_outputs(model, sample, x)
    for k in range(3):
        assert_close(outs[k], expected, RTOL, f"{which}: output at orbit point {k}")
    assert set(sample[0]) == {n for s in sites for n in s.tensor_names}
    assert_untouched(model, before)
    if scale > 0.1 and which != "permutation":  # the points really moved (catches an action that ignores g)
        moved = max(float((sample[0][n] - model.get_parameter(n).detach()).norm()) for n in sample[0])
        assert moved > 1e-3


def test_orbit_point_matches_the_action_and_chains_overlapping_sites_through_at():
    model, x = mixed_mlp(3), inputs(3)
    g = torch.tensor([0.5, 2.0, 1.5, 0.8, 3.0, 0.3, 1.1], dtype=torch.float64)
    point = orbit_point(model, RESCALE0, g)
    W1, b1, W2 = (model.get_parameter(n).detach() for n in RESCALE0.members)
    assert torch.equal(point["0.weight"], g[:, None] * W1) and torch.equal(point["0.bias"], g * b1)
    assert_close(point["2.weight"], W2 / g, 1e-15, "columns of the reader divided by g")  # one division per entry
    # RESCALE0 and PERM0 share all three tensors: one call refuses, chaining with at= composes them in that order
    with pytest.raises(ValueError, match="both act on '0.weight'"):
        orbit_point(model, [RESCALE0, PERM0], [g, torch.arange(7)])
    perm = torch.tensor([3, 1, 0, 6, 5, 2, 4])
    chained = orbit_point(model, PERM0, perm, at=point)
    assert torch.equal(chained["0.weight"], point["0.weight"][perm])
    assert_close(orbit_outputs(model, [chained], x)[0], model(x).detach(), RTOL, "chained rescaling then permutation")


@settings(deadline=None, max_examples=15)
@given(
    seeds(),
    lie_algebra_coordinates((6, 6), max_norm=0.6),
    st.floats(-1.0, 1.0),
    st.floats(-1.0, 1.0),
    st.sampled_from(["gl", "rescale"]),
)
@example(0, torch.zeros(6, 6, dtype=torch.float64), 0.0, 0.5, "gl")
def test_curves_start_at_theta_and_are_one_parameter_subgroups(seed, coords, t, s, which):
    if which == "gl":
        model, sites, M = linear_net(seed % 1000), [GL], [coords]
    else:
        model, sites, M = mixed_mlp(seed % 1000), [RESCALE0], [coords[0].repeat(2)[:7]]
    x, before = inputs(seed), snapshot(model)
    curve = orbit_curve(model, sites, M, [0.0, t, t + s])
    assert isinstance(curve, OrbitCurve) and curve.times.dtype == torch.float64 and len(curve) == 3
    for name, value in curve[0].items():  # exp(0 M) = I exactly, and acting with I is exact
        assert torch.equal(value, model.get_parameter(name).detach()), name
    # curve(t + s) = exp(s M) . curve(t)
    params = tuple(curve[1][n] for n in sites[0].members)
    g_s = sites[0].action.exp(s * M[0], params)
    shifted = orbit_point(model, sites, [g_s], at=curve[1])
    for name in curve[2]:
        assert_close(shifted[name], curve[2][name], RTOL, f"{which}: exp(sM) . curve(t) vs curve(t + s) for {name}")
    outs = orbit_outputs(model, curve, x)
    for k in range(3):
        assert_close(outs[k], model(x).detach(), RTOL, f"{which}: output along the curve at t = {curve.times[k]:.3f}")
    assert_untouched(model, before)


def data_dependent_site(k_max: str) -> Site:
    action = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=0.2)
    return Site(action, ("2.weight", "2.bias", "4.weight"), data_input="2", name=k_max)


def leaky_mlp(seed: int) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(5, 7), nn.LeakyReLU(0.2), nn.Linear(7, 6), nn.LeakyReLU(0.2), nn.Linear(6, 3)).double()
    return _randomised(model, seed)


@settings(deadline=None, max_examples=10)
@given(seeds(), st.floats(0.0, 1.0))
def test_data_dependent_points_keep_the_output_on_their_batch_only(seed, scale):
    model = leaky_mlp(seed % 1000)
    batch, other = inputs(seed, k=6), inputs(seed + 1, k=20)  # eq. 4.16 is exact for batches of <= h = 6 samples
    site = data_dependent_site("lstsq")
    sample = sample_orbit(model, site, 2, scale=scale, generator=torch.Generator().manual_seed(seed), inputs=batch)
    # exact on the batch: the least-squares solve has a residual of ~1e-14 relative for cond(sigma(Z g^T)) < 1e3
    for out in orbit_outputs(model, sample, batch):
        assert_close(out, model(batch).detach(), 1e-9, "data-dependent point on its own batch")
    if scale > 0.2:  # and not a symmetry elsewhere (Zhao et al. 2023, Sec. 4: the output changes off the batch)
        off = orbit_outputs(model, sample, other)[0]
        base = model(other).detach()
        assert float((off.detach() - base).norm() / base.norm()) > 1e-6


def test_a_data_dependent_site_reads_its_input_at_the_point_the_sites_before_it_produced():
    # 5 -> 7 -> 6 -> 9 -> 3, LeakyReLU.  Site A (hidden 7) is least squares on 8 > 7 samples: approximate.
    # Site B (hidden 9) is exact on 8 <= 9 samples *for the input it reads*: composed after A, it must read
    # layer 4's input at A's point, so the composed output equals A's output on the batch, not the model's.
    widths = (5, 7, 6, 9)
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.LeakyReLU(0.2))] + [nn.Linear(9, 3)]
    model, batch = _randomised(nn.Sequential(*layers).double(), 7), inputs(7, k=8)
    loose = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=0.2, strict=False)
    a = Site(loose, ("0.weight", "0.bias", "2.weight"), data_input="0", name="A")
    strict = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=0.2)
    b = Site(strict, ("4.weight", "4.bias", "6.weight"), data_input="4", name="B")
    generator = torch.Generator().manual_seed(0)
    g_a = a.action.random_element((model[0].weight, model[0].bias, model[2].weight), generator, scale=0.5)
    g_b = b.action.random_element((model[4].weight, model[4].bias, model[6].weight), generator, scale=0.5)
    with pytest.warns(UserWarning, match="least-squares residual"):
        only_a = orbit_point(model, a, g_a, inputs=batch)
    with pytest.warns(UserWarning, match="least-squares residual"):
        both = orbit_point(model, [a, b], [g_a, g_b], inputs=batch)
    out_a, out_both = orbit_outputs(model, [only_a, both], batch)
    assert_close(out_both, out_a, 1e-9, "B exact on the batch at A's point")  # lstsq residual ~1e-14, see above
    base = model(batch).detach()
    assert float((out_a.detach() - base).norm() / base.norm()) > 1e-4  # A really is approximate here


def test_bad_input_raises_named_errors():
    model, lin, x = mixed_mlp(0), linear_net(0), inputs(0)
    dd = data_dependent_site("lstsq")
    leaky = leaky_mlp(0)
    with pytest.raises(TypeError, match="finite group"):
        orbit_curve(model, SIGN4, torch.zeros(6), [0.0, 1.0])
    with pytest.raises(ValueError, match=r"shape \(6, 6\), got \(5, 5\)"):
        orbit_curve(lin, GL, torch.zeros(5, 5, dtype=torch.float64), [0.0])
    with pytest.raises(ValueError, match="times must be finite"):
        orbit_curve(lin, GL, torch.zeros(6, 6, dtype=torch.float64), [0.0, math.nan])
    with pytest.raises(ValueError, match="times must be finite"):
        orbit_curve(lin, GL, torch.zeros(6, 6, dtype=torch.float64), torch.tensor([math.inf]))
    with pytest.raises(ValueError, match="times is empty"):
        orbit_curve(lin, GL, torch.zeros(6, 6, dtype=torch.float64), [])
    with pytest.raises(ValueError, match="one-dimensional"):
        orbit_curve(lin, GL, torch.zeros(6, 6, dtype=torch.float64), torch.zeros(2, 2))
    with pytest.raises(TypeError, match="times must be"):
        orbit_curve(lin, GL, torch.zeros(6, 6, dtype=torch.float64), "soon")
    with pytest.raises(ValueError, match="non-finite"):
        orbit_curve(lin, GL, torch.full((6, 6), math.nan, dtype=torch.float64), [0.0])
    with pytest.raises(ValueError, match="one generator per site"):
        orbit_curve(lin, GL, [torch.zeros(6, 6), torch.zeros(6, 6)], [0.0])
    with pytest.raises(ValueError, match="one group element per site"):
        orbit_point(model, [RESCALE0, SIGN4], torch.ones(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="site 'positive_rescaling@0.weight': scaling element must be positive"):
        orbit_point(model, RESCALE0, -torch.ones(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="site 'gl_linear@0.weight'.*expects elements of shape"):
        orbit_point(lin, GL, torch.eye(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="not invertible"):
        orbit_point(lin, GL, torch.zeros(6, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="both act on"):
        sample_orbit(model, [RESCALE0, PERM0], 1)
    with pytest.raises(ValueError, match="count must be a positive int"):
        sample_orbit(model, RESCALE0, 0)
    with pytest.raises(ValueError, match="scale must be a finite number >= 0"):
        sample_orbit(model, RESCALE0, 1, scale=-1.0)
    with pytest.raises(ValueError, match="scale must be a finite number >= 0"):
        sample_orbit(model, RESCALE0, 1, scale=math.inf)
    with pytest.raises(ValueError, match="sites is empty"):
        sample_orbit(model, [], 1)
    with pytest.raises(TypeError, match="Site"):
        sample_orbit(model, ["0.weight"], 1)
    with pytest.raises(TypeError, match="nn.Module"):
        sample_orbit({"0.weight": torch.zeros(1)}, RESCALE0, 1)
    with pytest.raises(ValueError, match="data-dependent.*pass inputs="):
        sample_orbit(leaky, dd, 1)
    no_input = Site(dd.action, dd.members, name="no_input")
    with pytest.raises(ValueError, match="names no data_input"):
        sample_orbit(leaky, no_input, 1, inputs=x)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        sample_orbit(leaky, dd, 1, inputs={"x": x})
    with pytest.raises(ValueError, match="needs the model inputs"):
        orbit_outputs(model, [{}], None)
