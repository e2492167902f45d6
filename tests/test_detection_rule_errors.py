"""A detection rule that raises is a bug in teleopt, never "no rule".

Layers and functions called with their input as a keyword (``layer(input=x)``,
``F.dropout(input=x, p=0.1)``) are understood like positional calls; a built-in
rule that raises anyway is reported as an internal error, and under
``TELEOPT_DETECTION_STRICT=1`` (set by ``tests/conftest.py`` for the whole suite)
it raises, so no test passes over a swallowed rule error.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teleopt.detection import find_symmetries
from teleopt.detection.rules.driver import STRICT_ENV, RuleError


class KeywordCalls(nn.Module):
    """An MLP whose layers and dropout receive their input by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 6), nn.Linear(6, 3)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(input=x))
        h = self.drop(input=h)
        h = F.dropout(input=h, p=0.1, training=self.training)
        return self.l2(input=h)


def _x() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_the_suite_runs_detection_in_strict_mode():
    assert os.environ.get(STRICT_ENV) == "1"


def test_inputs_passed_by_keyword_are_understood():
    model = KeywordCalls().double()
    report = find_symmetries(model, _x())
    assert not [e for e in report.skipped if e.kind in ("op", "internal_error")], report.skipped
    scaling = [set(s.tensor_names) for s in report.sites if s.action.name == "positive_rescaling"]
    assert {"l1.weight", "l1.bias", "l2.weight"} in scaling
    assert report.certified and not report.dropped


def _broken(ctx):
    raise IndexError("tuple index out of range")


def test_a_failing_builtin_rule_is_reported_as_an_internal_error(monkeypatch):
    from teleopt.detection import rules

    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setitem(rules.RULES, "relu", _broken)
    report = find_symmetries(KeywordCalls().double(), _x())
    errors = [e for e in report.skipped if e.kind == "internal_error"]
    assert errors and "internal error" in errors[0].reason and "IndexError" in errors[0].reason
    assert not any(e.kind == "op" and "has no detection rule" in e.reason for e in report.skipped)
    assert not any("l1.weight" in s.tensor_names for s in report.sites)  # still fails closed


def test_a_failing_builtin_rule_raises_in_strict_mode(monkeypatch):
    from teleopt.detection import rules

    monkeypatch.setenv(STRICT_ENV, "1")
    monkeypatch.setitem(rules.RULES, "relu", _broken)
    with pytest.raises(RuleError, match="IndexError"):
        find_symmetries(KeywordCalls().double(), _x())
