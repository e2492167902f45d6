"""Smoke test of ``benchmarks/invariance.py --quick`` (Gideoni 2023, Fig. 1 and Fig. 4), checking its JSON figures."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


def test_quick_run_reproduces_theorem_3_3(tmp_path):
    bench = load_benchmark("invariance")

    out = tmp_path / "invariance.json"
    bench.main(["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    lr = data["config"]["lr"]
    results = {r["problem"]: r for r in data["results"]}
    assert set(results) == {"example_3_1", "swap_equivariant"}

    example = results["example_3_1"]
    points = data["config"]["points"]
    # Example 3.1: K_G = diag(2n, sum of x^2 over the mirrored grid), so the asymmetric rate is 2 sum ((i + 1/2) / n)^2
    expected_rate = 2 * sum(((i + 0.5) / points) ** 2 for i in range(points))
    assert example["decay_rate"] == pytest.approx(expected_rate, rel=1e-12)
    for run in example["runs"]:
        # the fitted rate is GD's exact per-step rate -log(1 - lr rate) / lr (single mode; fit error ~1e-8) ...
        assert run["rel_err_vs_gd"] < 1e-6
        # ... which exceeds Theorem 3.3's flow rate by GD's discretisation bias, lr * rate / 2 to first order
        assert run["rel_err_vs_theorem"] == pytest.approx(lr * expected_rate / 2, rel=0.02)
        assert run["max_deviation_from_gd"] < 1e-12  # W_asym(k) = W_asym(0) (I - lr K)^k up to round-off
        assert run["final_asymmetry_ratio"] < 1e-10  # Corollary 3.4: the model became invariant

    for result in results.values():
        d = result["decoupling"]
        # Theorem 3.3.2: parts that start equal stay equal to round-off, although the other parts start O(1) apart
        assert d["same_asym_max_asym_gap"] < 1e-13 and d["same_asym_initial_sym_gap"] > 1.0
        assert d["same_sym_max_sym_gap"] < 1e-13 and d["same_sym_initial_asym_gap"] > 1.0
        for run in result["runs"]:
            # fitted against the theorem's own curve (several modes mix in Fig. 4's problem): GD bias lr * rate / 2 < 1%
            assert run["rel_err_vs_theorem_curve"] < 0.01
            assert run["max_deviation_from_theorem"] < 0.01
    assert (tmp_path / "invariance_example_3_1.png").stat().st_size > 0
    assert (tmp_path / "invariance_swap_equivariant.png").stat().st_size > 0
