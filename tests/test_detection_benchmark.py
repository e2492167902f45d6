"""Smoke test of benchmarks/coverage.py --quick (three small timm models, one detection each)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("timm")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "coverage.py"


def test_coverage_benchmark_quick(tmp_path, monkeypatch, capsys):
    out = tmp_path / "coverage.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--quick", "--json", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    printed = capsys.readouterr().out
    assert "coverage" in printed and "resnet18" in printed
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"resnet18", "vit_tiny_patch16_224", "convnext_atto"}
    assert rows["resnet18"]["coverage"] > 0.999  # all but the classifier bias (no loss given: no translation)
    assert 0.5 < rows["vit_tiny_patch16_224"]["coverage"] < 0.8  # GELU MLP rows: permutations only
    assert all(r["sites"] == r["continuous"] + r["discrete"] for r in rows.values())
    assert (tmp_path / "coverage.png").stat().st_size > 0


def test_coverage_benchmark_has_the_hugging_face_roots(tmp_path, monkeypatch, capsys):
    """The hf: rows (transformers roots built from configs, called through example_kwargs): a 2-layer
    Llama has rescaling and permutation sites, BERT permutations; no proposed site fails certification."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "coverage.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--models", "hf:bert,hf:llama", "--repeats", "1", "--json", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"hf:bert", "hf:llama"}
    assert rows["hf:llama"]["continuous"] >= 4 and rows["hf:llama"]["coverage"] > 0.5
    assert rows["hf:bert"]["discrete"] >= 2
    assert all(r["dropped"] == 0 for r in rows.values())
