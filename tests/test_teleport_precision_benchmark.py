"""Smoke test of ``benchmarks/teleport_precision.py --quick``: teleports on a 4-layer Llama in float32
and under bfloat16 autocast, checking the figures its JSON reports."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark


def test_quick_run_has_no_round_off_rollback_and_bf16_stays_within_twice_its_round_off(tmp_path):
    pytest.importorskip("transformers")
    bench = load_benchmark("teleport_precision")
    out = tmp_path / "precision.json"
    bench.main(["--quick", "--json", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"float32 training", "bf16 training", "float32 back to back", "bf16 back to back"}
    for row in rows.values():
        assert row["model"] == "llama" and row["teleports"] == 3
        assert row["rolled_back_roundoff"] == 0 and row["inconclusive_f32"] == 0  # main: from the third teleport on
        assert row["accepted"] >= 1
    assert rows["float32 back to back"]["f32_change"] <= 1e-5
    bf16 = rows["bf16 back to back"]
    assert 0 < bf16["r0"] < 0.05 and bf16["bf16_drift"] <= 2 * bf16["r0"]  # main: 96.9 r0 after 20
