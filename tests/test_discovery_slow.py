"""Slow reproductions of Zhao et al. 2024b, Sec. 5.3-5.4 and Zhao 2026, Sec. 6.5.5 (``pytest -m slow``).

Each trains with the configuration of ``benchmarks/discovery.py`` (minutes on a CPU)
and asserts the done-when figure of issue 6; the benchmark prints the same
figures with more detail.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark

from teleopt import discover
from teleopt.discovery import problems
from teleopt.discovery.diagnostics import compare_curves, data_sensitivity, span_residual

ROOT = Path(__file__).resolve().parents[1]
benchmark = load_benchmark("discovery")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _train(case: str):
    factory, kwargs, _ = benchmark.CASES[case]
    problem = factory()
    return problem, discover(problem, progress=False, seed=0, **kwargs)


@pytest.mark.parametrize("case", benchmark.SPAN_CASES)
def test_homogeneous_generators_lie_in_the_rescaling_span(case):
    problem, action = _train(case)
    config = problem.loss_fn.spec["config"]
    reference = problems.rescaling_generators(config["m"], config["hidden"], config["n"])
    assert float(span_residual(action.generators, reference).max()) <= 0.05


@pytest.mark.parametrize("case", benchmark.RATIO_CASES)
def test_data_dependent_symmetries_beat_random_curves(case):
    problem, action = _train(case)
    comparison = compare_curves(action, problem.sampler, num_samples=100, generator=torch.Generator().manual_seed(100))
    assert comparison.invariance_ratio >= 10
    sensitivity = data_sensitivity(action, problem.sampler, num_samples=100, generator=torch.Generator().manual_seed(200))
    assert float(sensitivity["relative"].min()) > 0


def test_benchmark_quick_run(tmp_path):
    out = tmp_path / "discovery.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "discovery.py"), "--quick", "--cases", "linear", "sigmoid", "--json", str(out)],
        check=True,
        cwd=ROOT,
    )
    assert out.exists() and (tmp_path / "discovery_linear_generators.png").exists() and (tmp_path / "discovery_sigmoid_curves.png").exists()
