"""teleopt.analysis.ensemble: group-action ensembles and the random baselines of Zhao et al. 2023, App. I.

Tolerances (float64): exact symmetries keep outputs to ~1e-15 relative error, so an
ensemble of exact members matches the model to 1e-10 (``default_rtol``); the
least-squares solves of eq. 4.16 / eq. 112 on well-conditioned hidden activations
(cond < 1e3 here) agree to ~1e-13, given a 1e-9 budget.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import load_benchmark
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from teleopt.analysis.ensemble import BASELINES, BaselineEnsemble, GroupEnsemble, ParameterEnsemble
from teleopt.registry import get_action
from teleopt.site import Site
from teleopt.testing import assert_close, default_rtol, seeds

RTOL = default_rtol(torch.float64)
LSTSQ_RTOL = 1e-9  # least-squares solutions, see the module docstring


def leaky_mlp(seed: int) -> nn.Sequential:
    """5 -> 7 -> 6 -> 4 classes, LeakyReLU(0.2), biases, float64."""
    model = nn.Sequential(nn.Linear(5, 7), nn.LeakyReLU(0.2), nn.Linear(7, 6), nn.LeakyReLU(0.2), nn.Linear(6, 4)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.7)
    return model


def data(seed: int, k: int) -> torch.Tensor:
    return torch.randn(k, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


RESCALE = Site(get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.2), ("2.weight", "2.bias", "4.weight"))
LOOSE = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=0.2, strict=False)
STRICT = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=0.2)
PAPER_SITE = Site(LOOSE, ("2.weight", "2.bias", "4.weight"), data_input="2", name="last_hidden")
EXACT_ON_BATCH_SITE = Site(STRICT, ("2.weight", "2.bias", "4.weight"), data_input="2", name="last_hidden_strict")


def build_group(model, site, eps, reference=None, seed=0, members=4, combine="probabilities"):
    generator = torch.Generator().manual_seed(seed)
    return GroupEnsemble(model, site, eps, members, reference=reference, generator=generator, combine=combine)


@settings(deadline=None, max_examples=10)
@given(seeds(), st.sampled_from(["exact", "paper", "exact-on-batch"]), st.sampled_from(["probabilities", "mean"]))
def test_the_ensemble_at_eps_zero_is_the_model(seed, which, combine):
    model, x = leaky_mlp(seed % 1000), data(seed, 30)
    site, reference = {
        "exact": (RESCALE, None),
        "paper": (PAPER_SITE, data(seed + 1, 40)),
        "exact-on-batch": (EXACT_ON_BATCH_SITE, data(seed + 1, 6)),
    }[which]
    ensemble = build_group(model, site, 0.0, reference, seed, combine=combine)
    with torch.no_grad():
        expected = model(x) if combine == "mean" else F.log_softmax(model(x), dim=1)
        assert_close(ensemble(x), expected, RTOL, f"{which} ensemble at eps = 0 ({combine})")


@settings(deadline=None, max_examples=12)
@given(seeds(), st.floats(0.0, 2.0), st.sampled_from(["probabilities", "mean"]))
@example(0, 2.0, "probabilities")
def test_an_exact_site_gives_the_model_for_every_eps(seed, eps, combine):
    model, x = leaky_mlp(seed % 1000), data(seed, 30)
    ensemble = build_group(model, RESCALE, eps, seed=seed, combine=combine)
    with torch.no_grad():
        expected = model(x) if combine == "mean" else F.log_softmax(model(x), dim=1)
        assert_close(ensemble(x), expected, RTOL, f"exact-site ensemble at eps = {eps}")
        assert float(ensemble.member_deviation(x).max()) <= RTOL
    if eps > 0.1:  # the members are different parameters (the invariance is not an identity map)
        assert float((ensemble.member_point(0)["2.weight"] - model[2].weight.detach()).norm()) > 1e-3


@settings(deadline=None, max_examples=8)
@given(seeds(), st.floats(0.3, 1.5))
def test_data_dependent_members_are_exact_on_the_reference_batch_and_differ_elsewhere(seed, eps):
    model, reference, new = leaky_mlp(seed % 1000), data(seed + 1, 6), data(seed, 30)  # 6 samples <= h = 6: eq. 4.16 exact
    ensemble = build_group(model, EXACT_ON_BATCH_SITE, eps, reference, seed)
    assert float(ensemble.member_deviation(reference).max()) <= LSTSQ_RTOL
    assert float(ensemble.member_deviation(new).min()) > 1e-6  # Zhao et al. 2023, Sec. 4: not a symmetry off the batch


def test_the_paper_members_are_u_pi_g_h_of_eq_112_and_the_baselines_share_their_g():
    model, reference = leaky_mlp(4), data(5, 50)  # 50 training samples > h = 6: least squares, as in App. I
    with pytest.warns(UserWarning, match="warning\\(s\\) while building 3 members"):
        group = build_group(model, PAPER_SITE, 0.4, reference, seed=9, members=3)
    W1, b1, W2 = (t.detach() for t in (model[2].weight, model[2].bias, model[4].weight))
    X = torch.nn.functional.leaky_relu(model[0](reference), 0.2).detach()  # the input of module "2"
    H = (X @ W1.T + b1).T  # the paper's H = V X (hidden x samples)
    sigma = lambda z: F.leaky_relu(z, 0.2)  # noqa: E731
    for k, (g,) in enumerate(group.elements):
        pi = sigma(H) @ torch.linalg.pinv(sigma(g @ H))  # eq. 112
        member = group.member_point(k)
        assert_close(member["4.weight"], W2 @ pi, LSTSQ_RTOL, f"member {k}: U pi(g, H)")
        assert_close(member["2.weight"], g @ W1, RTOL, f"member {k}: g V")
    # the same seed draws the same g for every baseline (before the baseline's own randomness)
    for kind in ("g_inverse", "random", "shuffle"):
        generator = torch.Generator().manual_seed(9)
        baseline = BaselineEnsemble(model, PAPER_SITE, kind, 0.4, 3, reference=reference, generator=generator)
        for k in range(3):
            assert_close(baseline.member_point(k)["2.weight"], group.member_point(k)["2.weight"], RTOL, f"{kind}: same g V")
    inverse = BaselineEnsemble(model, PAPER_SITE, "g_inverse", 0.4, 3, generator=torch.Generator().manual_seed(9))
    g = group.elements[0][0]
    assert_close(inverse.member_point(0)["4.weight"] @ g, W2, RTOL, "g_inverse: U g^-1")


@settings(deadline=None, max_examples=6)
@given(seeds(), st.sampled_from(BASELINES), st.floats(0.2, 2.0))
@example(seed=19147335, kind="perm_interp", eps=1.0)  # one member drew the identity permutation (A = I)
def test_the_baselines_change_the_output_at_positive_eps(seed, kind, eps):
    model, reference, x = leaky_mlp(seed % 1000), data(seed + 1, 40), data(seed, 30)
    generator = torch.Generator().manual_seed(seed)
    baseline = BaselineEnsemble(model, PAPER_SITE, kind, eps, 3, reference=reference, generator=generator)
    # none of them is a symmetry: their change is many orders above the 1e-15 round-off of an exact action
    assert float(baseline.member_deviation(x).min()) > 1e-6
    with torch.no_grad():
        assert float((baseline(x) - F.log_softmax(model(x), 1)).norm()) > 1e-6


def test_the_ensemble_is_a_self_contained_module():
    model, x = leaky_mlp(1), data(1, 10)
    with pytest.warns(UserWarning, match="least-squares residual"):  # 40 samples > h = 6: the paper's approximate case
        ensemble = build_group(model, PAPER_SITE, 0.5, data(2, 40), members=3)
    before = ensemble(x).detach()
    with torch.no_grad():
        # training the model further (here a tensor no member overrides) does not change the ensemble built from it
        model[0].weight.mul_(3.0)
    assert_close(ensemble(x).detach(), before, 0.0, "ensemble after the model changed")
    state = ensemble.state_dict()
    assert state["member_0"].shape[0] == 3 and set(ensemble.member_names) == {"2.weight", "2.bias", "4.weight"}
    clone = copy.deepcopy(ensemble)
    assert_close(clone(x).detach(), before, 0.0, "deepcopy")
    as32 = ensemble.to(torch.float32)
    assert as32.member_0.dtype == torch.float32
    assert_close(as32(x.float()).double().detach(), before, 1e-5, "float32 copy")  # float32 round-off
    plain = ParameterEnsemble(leaky_mlp(1), [{}, {}], combine="mean")
    assert_close(plain(x).detach(), leaky_mlp(1)(x).detach(), RTOL, "members without changed tensors")
    votes = ensemble.member_outputs(x.float())
    assert votes.shape == (3, 10, 4)


def test_bad_input_raises_named_errors():
    model, reference = leaky_mlp(0), data(0, 40)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        GroupEnsemble(model, RESCALE, -0.1)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        GroupEnsemble(model, RESCALE, math.nan)
    with pytest.raises(ValueError, match="members must be a positive int"):
        GroupEnsemble(model, RESCALE, 0.1, 0)
    with pytest.raises(ValueError, match="combine must be one of"):
        GroupEnsemble(model, RESCALE, 0.1, combine="vote")
    with pytest.raises(ValueError, match="data-dependent.*pass inputs="):
        GroupEnsemble(model, PAPER_SITE, 0.1)
    with pytest.raises(ValueError, match="too large for an exact action"):  # strict eq. 4.16 on 40 > 6 samples
        GroupEnsemble(model, EXACT_ON_BATCH_SITE, 0.1, reference=reference)
    with pytest.raises(ValueError, match="kind must be one of"):
        BaselineEnsemble(model, PAPER_SITE, "noise", 0.1)
    with pytest.raises(ValueError, match="GL_h or O\\(h\\) site"):
        BaselineEnsemble(model, RESCALE, "g_inverse", 0.1)
    with pytest.raises(ValueError, match="shuffle baseline needs reference"):
        BaselineEnsemble(model, PAPER_SITE, "shuffle", 0.1)
    lora = Site(get_action("lora_gl"), ("2.weight", "4.weight"))
    with pytest.raises(ValueError, match="two-layer site"):
        BaselineEnsemble(model, lora, "random", 0.1)
    with pytest.raises(ValueError, match="needs outputs of shape \\(batch, classes"):
        build_group(model, RESCALE, 0.1)(data(0, 3)[0])
    with pytest.raises(ValueError, match="at least one member"):
        ParameterEnsemble(model, [])
    with pytest.raises(ValueError, match="member 1 has tensors"):
        ParameterEnsemble(model, [{"4.bias": torch.zeros(4, dtype=torch.float64)}, {}])
    with pytest.raises(ValueError, match="has shape \\(3,\\)"):
        ParameterEnsemble(model, [{"4.bias": torch.zeros(3, dtype=torch.float64)}])


def test_benchmark_quick_keeps_the_model_at_small_eps_and_beats_three_baselines_at_large_eps(tmp_path):
    module = load_benchmark("ensemble")
    out = tmp_path / "ensemble.json"
    printed = module.main(["--quick", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(printed["rows"])), "--json must hold the printed figures"
    assert (tmp_path / "ensemble.png").exists()

    def row(kind: str, eps: float) -> dict:
        (found,) = [r for r in rows if r["kind"] == kind and r["eps"] == eps]
        return found

    single = row("single model", 0.0)
    small, large = min(printed["settings"]["eps"]), max(printed["settings"]["eps"])
    # eps = 1e-3 moves the members by ~3e-4 in function space (measured), so the loss moves by ~1e-4 relative: 1% is loose
    assert abs(row("group", small)["test_loss"] - single["test_loss"]) <= 0.01 * single["test_loss"]
    assert row("group", small)["test_accuracy"] == single["test_accuracy"]
    for eps in printed["settings"]["eps"]:  # an exact symmetry: the ensemble is the model
        assert abs(row("rescaling (exact)", eps)["test_loss"] - single["test_loss"]) <= 1e-10 * single["test_loss"]
    # Zhao et al. 2023, Fig. 10: at large eps the group ensemble degrades much less than g_inverse, random and shuffle
    # (measured: loss 0.4 vs 6-12, accuracy 0.93 vs 0.09-0.26); perm_interp is not asserted: its A stays within
    # (I + S)/2 of the identity whatever eps, and it degrades less than the group ensemble here (see the README)
    for kind in ("g_inverse", "random", "shuffle"):
        assert row("group", large)["test_loss"] < 0.5 * row(kind, large)["test_loss"], kind
        assert row("group", large)["test_accuracy"] > row(kind, large)["test_accuracy"] + 0.3, kind
