"""The registry: lookup with options, registration forms, duplicates, the printed table."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import teleopt
from teleopt import AxisAction, GroupAction, Member, get_action, list_actions, register_action, unregister_action
from teleopt.registry import format_table
from teleopt.testing import check_action

# one entry per action family of Zhao 2026, Table 1.1, attention, LoRA, Ch. 4 and Zhao et al. 2023
EXPECTED = {
    "gl_linear",
    "positive_rescaling",
    "sign_flip",
    "radial_orthogonal",
    "batchnorm_scaling",
    "softmax_translation",
    "hidden_permutation",
    "rbf_permutation",
    "attention_qk_gl",
    "attention_vo_gl",
    "attention_head_permutation",
    "lora_gl",
    "data_dependent_gl",
    "data_dependent_gl_lstsq",
    "nonlinear_gl",
    "rosenbrock_so2",
    "booth_so2",
    "quadratic_orthogonal",
    "residual_rotation",
}


def test_known_actions_are_registered_with_references():
    rows = {r["name"]: r for r in list_actions()}
    assert EXPECTED <= set(rows)
    for name in EXPECTED:
        row = rows[name]
        assert row["reference"].startswith(("Zhao", "Ziyin et al. 2025", "Gideoni 2023", "Ashkboos et al. 2024a")), name  # a paper by name
        assert row["exactness"] in ("exact", "data-dependent", "approximate")
        assert isinstance(row["linear"], bool) and isinstance(row["continuous"], bool)


def test_get_action_with_options_builds_a_new_instance():
    default = get_action("attention_qk_gl")
    assert get_action("attention_qk_gl") is default
    eight = get_action("attention_qk_gl", num_heads=8)
    assert eight.num_heads == 8 and eight is not default
    assert get_action("positive_rescaling", activation="relu_power", alpha=3.0).alpha == 3.0


def _custom(name: str) -> AxisAction:
    return AxisAction(name, "diagonal", [Member("A", 0), Member("B", 1, -1)], reference="user")


def test_register_instance_class_and_factory():
    inst = register_action(_custom("user_scaling_a"))
    try:
        assert get_action("user_scaling_a") is inst

        @register_action(name="user_scaling_b")
        def factory(k: int = 1) -> AxisAction:
            a = _custom("user_scaling_b")
            a.k = k
            return a

        assert get_action("user_scaling_b", k=3).k == 3

        @register_action
        class Mine(AxisAction):
            def __init__(self):
                super().__init__("user_scaling_c", "diagonal", [Member("A", 0)])

        assert isinstance(get_action("user_scaling_c"), Mine)
        assert {"user_scaling_a", "user_scaling_b", "user_scaling_c"} <= {r["name"] for r in list_actions()}
    finally:
        for n in ("user_scaling_a", "user_scaling_b", "user_scaling_c"):
            try:
                unregister_action(n)
            except KeyError:
                pass
    assert "user_scaling_a" not in {r["name"] for r in list_actions()}


def test_registry_errors():
    with pytest.raises(ValueError, match="already registered"):
        register_action(_custom("gl_linear"))
    with pytest.raises(KeyError, match="no action named 'nope'"):
        get_action("nope")
    with pytest.raises(TypeError, match="string"):
        get_action(3)
    with pytest.raises(TypeError, match="GroupAction"):
        register_action(42)
    with pytest.raises(TypeError, match="not a GroupAction"):
        register_action(lambda: "x", name="bad")
    inst = register_action(_custom("user_fixed"))
    try:
        with pytest.raises(TypeError, match="takes no options"):
            get_action("user_fixed", k=1)
    finally:
        unregister_action("user_fixed")
    with pytest.raises(KeyError):
        unregister_action("user_fixed")
    assert isinstance(inst, GroupAction)


def test_overwrite_replaces():
    register_action(_custom("user_over"))
    try:
        new = register_action(_custom("user_over"), overwrite=True)
        assert get_action("user_over") is new
    finally:
        unregister_action("user_over")


def test_user_action_checked_with_the_kit():
    """A user-defined action runs through check_action like the built-in ones."""

    def example(gen, dtype):
        A, B, X = (torch.randn(s, generator=gen, dtype=dtype) for s in ((4, 3), (2, 4), (5, 3)))
        return teleopt.ExampleProblem((A, B), X, lambda p, x: torch.relu(x @ p[0].T) @ p[1].T)

    action = AxisAction("user_relu_scaling", "diagonal", [Member("A", 0), Member("B", 1, -1)]).with_example(example)
    worst = check_action(action)
    assert worst["invariance"] < 1e-10 and worst["gradient_transport"] < 1e-10


def test_table_and_cli():
    table = format_table()
    assert table.splitlines()[0].split() == ["name", "group", "exactness", "linear", "reference"]
    out = subprocess.run([sys.executable, "-m", "teleopt", "list"], capture_output=True, text=True, check=True).stdout
    for name in EXPECTED:
        assert name in out


def test_docs_registry_table_is_current():
    """docs/actions.md shows the registry table as `python -m teleopt list` prints it, citing papers by name."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("docs_hooks_citations", root / "docs" / "_hooks" / "citations.py")
    assert spec is not None and spec.loader is not None
    citations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(citations)
    page = (root / "docs" / "actions.md").read_text()
    block = page.split("<!-- registry-table -->")[1].split("<!-- /registry-table -->")[0]
    builtin = [r for r in list_actions() if r["name"] in EXPECTED or r["reference"].startswith(("Zhao", "Ziyin", "Gideoni"))]
    cited = [dict(r, reference=citations.cite(r["reference"])) for r in builtin]
    assert block.strip().strip("`").strip() == format_table(cited)
