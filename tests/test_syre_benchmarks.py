"""Smoke runs of the syre benchmarks' --quick paths, checking the qualitative claims of Ziyin et al. 2025 they print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(name: str, tmp_path: Path, *extra: str) -> dict:
    module = load_benchmark(name)
    out = tmp_path / f"{name}.json"
    printed = module.main(["--quick", "--json", str(out), *extra])
    written = json.loads(out.read_text())
    assert written["rows"] == json.loads(json.dumps(printed["rows"])), "--json must hold the printed figures"
    assert (tmp_path / f"{name}.png").exists()
    return written


def row(rows, **match):
    (found,) = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return found


def test_collapse_fig1(tmp_path):
    rows = run("syre_collapse", tmp_path)["rows"]
    for method in ("plain", "weight decay"):
        assert row(rows, initial_distinct=1, method=method)["distinct_neurons"] == 1  # trapped (Prop. 3)
    escaped = row(rows, initial_distinct=1, method="syre")
    assert escaped["distinct_neurons"] == 64
    assert escaped["final_loss"] < 0.2 * row(rows, initial_distinct=1, method="plain")["final_loss"]


def test_dead_units_fig3(tmp_path):
    rows = run("syre_dead_units", tmp_path)["rows"]
    last = max(r["step"] for r in rows)
    assert row(rows, method="weight decay", step=last)["dead_1e-5"] > 0
    assert row(rows, method="syre", step=last)["dead_1e-5"] == 0


def test_symmetry_degree_fig4(tmp_path):
    rows = run("syre_symmetry_degree", tmp_path)["rows"]
    for kind in ("unstructured", "structured"):
        plain = row(rows, spectrum=kind, method="plain")["degree_of_symmetry"]
        assert row(rows, spectrum=kind, method="weight decay", gamma=10.0)["degree_of_symmetry"] >= plain
        assert row(rows, spectrum=kind, method="syre", gamma=10.0)["degree_of_symmetry"] < 0.7 * plain


def test_digits_fig5(tmp_path):
    rows = run("syre_digits", tmp_path)["rows"]
    vanilla = row(rows, gamma=0.1, method="vanilla")
    syre = row(rows, gamma=0.1, method="syre")
    assert vanilla["test_accuracy"] < 0.2 and syre["test_accuracy"] > 0.8
    assert syre["rank_post"] > vanilla["rank_post"]


def test_cost_on_a_small_timm_model(tmp_path):
    result = run("syre_cost", tmp_path, "--model", "test_resnet")
    rows = result["rows"]
    anchored = sum(r["kept_mib"] for r in rows if r["mode"] == "syre decoupled")
    # Stored anchors of every >= 2-D tensor: close to the model's size (1-D tensors are excluded).
    assert 0.9 * result["parameter_mib"] < anchored <= result["parameter_mib"]
    # eq. 7 keeps D and a reused w - theta_0 buffer besides the anchors.
    assert row(rows, mode="syre decoupled eq.7")["kept_mib"] == pytest.approx(3 * anchored)
    assert row(rows, mode="syre decoupled regen")["kept_mib"] == 0
    assert all(r["median_step_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_cost_on_resnet18(tmp_path):
    rows = run("syre_cost", tmp_path)["rows"]
    assert row(rows, mode="syre decoupled")["kept_mib"] > 40
