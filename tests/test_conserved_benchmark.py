"""Smoke test of ``benchmarks/conserved.py --quick``: its figures meet the issue's criteria in the reduced run."""

from __future__ import annotations

import json

import torch
from conftest import load_benchmark


def test_quick_run_reproduces_eq_2_16_and_the_lr_squared_drift(tmp_path):
    module = load_benchmark("conserved")
    threads = torch.get_num_threads()
    try:
        module.main(["--quick", "--samples", "100", "--json", str(tmp_path / "c.json")])
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "c.json").read_text())
    paper = [r for r in result["xavier_linear"] if r["init"] == "paper"]
    assert len(paper) >= 3 and all(r["expected"] == r["m_minus_h"] for r in paper)
    # the criterion: E[Q] within 3 standard errors of m - h (fixed seeds, so deterministic)
    assert all(abs(r["z"]) < 3 for r in result["xavier_linear"] + result["xavier_nonlinear"])
    # Prop. A.4.1: per-step drift ~ lr^2 (measured slopes 2.005-2.08), accumulated drift at fixed T ~ lr
    for fit in result["fits"]:
        assert abs(fit["step_slope"] - 2) < 0.15, fit
        assert abs(fit["total_slope"] - 1) < 0.15, fit
    assert (tmp_path / "conserved.png").exists()
