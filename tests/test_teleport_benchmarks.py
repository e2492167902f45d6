"""Smoke tests of the Teleport benchmarks.

Booth (10 GD steps, one fast-path teleport) is small enough to run on every CI run
and checks the papers' numbers (3.12 without teleport; the papers' code reaches
4.9e-3 with one).  The ``--quick`` paths of the three scripts run longer and are
marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import load_benchmark

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")


def test_booth_reproduces_the_papers_numbers():
    bench = load_benchmark("teleport_testfunctions")

    plain = bench.run("booth", None)
    teleported = bench.run("booth", {})
    assert plain["last"] == pytest.approx(3.12, abs=0.01)  # Zhao 2026, Fig. 4.3 bottom row: 3.12 without teleport
    assert teleported["teleports"] == 1 and teleported["max_drift"] < 1e-12
    assert teleported["last"] < 1e-2  # the papers' code: 4.9e-3


@pytest.mark.slow
@pytest.mark.parametrize("script", ["teleport_testfunctions.py", "teleport_mlp.py", "teleport_cost.py"])
def test_quick_path_runs(script, tmp_path):
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.exists() and out.stat().st_size > 0
