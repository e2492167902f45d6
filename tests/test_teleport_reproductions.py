"""benchmarks/teleport_classification.py and teleport_generalization.py: the arms are wired as their docs claim.

Fast tests check the ablation's logic on one epoch (an epoch-0 teleport meets an
empty optimizer state, so every state policy and the reset-only arm must coincide
with what they claim); the ``--quick`` end-to-end runs check the JSON and the plot
and take 15-40 s each on two shared cores, so they are marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
pytest.importorskip("sklearn")


load = load_benchmark


@pytest.fixture(scope="module")
def data():
    from teleopt.datasets import load_digits

    return load_digits(seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_classification_arms_at_epoch_zero(data):
    bench = load("teleport_classification")
    runs = {
        arm: bench.run("RMSprop", arm, seed=0, epochs=1, data=data)
        for arm in ("none", "reset only", "teleport+transport", "teleport+reset", "teleport+keep")
    }
    # a fresh optimizer at epoch 0 is the optimizer it replaces: the reset-only arm is the baseline, bit for bit
    assert runs["reset only"]["train"] == runs["none"]["train"] and runs["reset only"]["accepted"] == 0
    # the state is still empty at an epoch-0 teleport, so the three policies take the same path
    assert runs["teleport+transport"]["train"] == runs["teleport+reset"]["train"] == runs["teleport+keep"]["train"]
    teleported = runs["teleport+transport"]
    assert teleported["accepted"] + teleported["declined"] == bench.TELEPORTS and teleported["accepted"] >= 1
    # exact symmetry: the loss before the first update (index 0) does not see the teleport, training after it does
    assert teleported["train"][0] == runs["none"]["train"][0] and teleported["train"][1] != runs["none"]["train"][1]


def test_classification_reset_only_resets_at_the_teleport_epoch(data):
    bench = load("teleport_classification")
    none = bench.run("AdaGrad", "none", seed=1, epochs=3, data=data)
    reset = bench.run("AdaGrad", "reset only", seed=1, epochs=3, data=data)
    assert bench.TELEPORT_EPOCH["AdaGrad"] == 2
    assert reset["train"][:3] == none["train"][:3]  # identical until the reset before epoch 2
    assert reset["train"][3] != none["train"][3]


def test_generalization_measure_changes_nothing_and_teleports_move_the_objective(data):
    bench = load("teleport_generalization")
    from teleopt.datasets import digits_mlp
    from teleopt.teleport import Curvature

    model = digits_mlp(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    value = bench.measure(model, Curvature(curves=4), (data.x_train[:100], data.y_train[:100]), seed=0)
    assert value > 0 and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    down = bench.teleport_run("curvature down", 0, data, epochs=2, teleport_epoch=1, quick=True)
    up = bench.teleport_run("curvature up", 0, data, epochs=2, teleport_epoch=1, quick=True)
    assert down["objective_after"] < down["objective_before"] and up["objective_after"] > up["objective_before"]
    assert down["accepted"] == up["accepted"] == bench.TELEPORT_BATCHES
    assert max(down["max_drift"], up["max_drift"]) <= 1e-5  # exact rescaling: float32 rounding only


@pytest.mark.slow  # 15-40 s each on two shared cores; the arms' logic is checked above on every run
@pytest.mark.parametrize("name", ["teleport_classification", "teleport_generalization"])
def test_quick_end_to_end(name, tmp_path):
    out = tmp_path / f"{name}.json"
    printed = load(name).main(["--quick", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(printed["rows"])), "--json must hold the printed figures"
    assert (tmp_path / f"{name}.png").exists()
    assert "stand-in for MNIST" in written["settings"]["dataset"]
