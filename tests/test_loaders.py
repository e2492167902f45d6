"""Loaders of saved teleopt data raise ValueError naming the problem, and bound every number they read.

Learned-action files (``LearnedAction.load`` / ``from_state``) and symmetry reports
(``SymmetryReport.from_dict``): a damaged or hand-made input never surfaces as a
``KeyError``/``AttributeError``/``OSError`` from inside the loader, and never makes
the loader allocate or loop as much as a number in the file says.
"""

from __future__ import annotations

import io
import random

import pytest
import torch

from teleopt import find_symmetries
from teleopt.detection.report import SymmetryReport
from teleopt.discovery import problems
from teleopt.discovery.action import LearnedAction
from teleopt.discovery.network import ActionNetwork
from teleopt.discovery.samples import SampleSpec


@pytest.fixture(scope="module")
def action() -> LearnedAction:
    problem = problems.two_layer(k=4, target="output")
    gen = torch.Generator().manual_seed(0)
    spec = SampleSpec.from_sample(problem.param_shapes, problem.member_names, problem.sampler(gen)[1])
    net = ActionNetwork(spec.num_params, spec.data_features, (16, 16), generator=gen)
    params, data = problem.sampler(gen)
    examples = (spec.flatten(params)[None], (data[None],))
    return LearnedAction(
        net, torch.randn(1, 2, 2, generator=gen, dtype=torch.float64), spec, "small", loss_fn=problem.loss_fn, examples=examples
    )


def damaged(state: dict, path: str, value) -> dict:
    """``state`` with the entry at ``path`` ("a/b/c") replaced (``...`` deletes it)."""
    state = {**state}
    keys = path.split("/")
    node = state
    for key in keys[:-1]:
        node[key] = dict(node[key]) if isinstance(node[key], dict) else node[key]
        node = node[key]
    if value is ...:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return state


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("integration_steps", 10**9, "integration_steps=1000000000, outside"),
        ("integration_steps", 0, "outside"),
        ("integration_steps", "8", "integration_steps is a str"),
        ("network/num_params", ..., "KeyError"),
        ("network/hidden", [10**6, 10**6], "do not match the saved configuration"),
        ("network/hidden", None, "hidden widths is a NoneType"),
        ("network", [], "network configuration is a list"),
        ("spec/param_shapes", ..., "KeyError"),
        ("spec", "spec", "spec is a str"),
        ("weights", {"layers.0.weight": "x"}, "floating-point tensors"),
        ("weights/layers.0.bias", torch.full((16,), float("nan")), "non-finite"),
        ("generators", [[1.0]], "generators is a list"),
        ("generators", torch.zeros(2, 2, dtype=torch.float64), "generators have shape"),
        ("examples", {"theta": 1}, "examples. theta is a int"),
        ("examples", {"theta": torch.zeros(1, 4)}, "KeyError"),
        ("examples/data", 3, "examples' data is a int"),
        ("history", {"terms": []}, "KeyError"),
        ("config", 5, "config is a int"),
        ("name", 7, "name is a int"),
    ],
)
def test_a_damaged_learned_action_state_raises_value_error(action, path, value, match):
    with pytest.raises(ValueError, match=match):
        LearnedAction.from_state(damaged(action.state(), path, value))


def test_integration_steps_are_bounded_when_made_too(action):
    from teleopt.discovery.action import MAX_INTEGRATION_STEPS

    with pytest.raises(ValueError, match=f"integration_steps must be an int in \\[1, {MAX_INTEGRATION_STEPS}\\]"):
        LearnedAction(action.network, action.generators, action.spec, integration_steps=MAX_INTEGRATION_STEPS + 1)


def test_byte_damaged_files_raise_value_error_or_load(action, tmp_path):
    """Random byte flips and truncations: torch.load's unpickler fails anywhere (KeyError, IndexError, ...)."""
    buffer = io.BytesIO()
    torch.save(action.state(), buffer)
    good = buffer.getvalue()
    rng = random.Random(0)
    path = tmp_path / "damaged.pt"
    outcomes = set()
    for _ in range(150):
        data = bytearray(good)
        for _ in range(rng.choice([1, 4, 32])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data))]
        path.write_bytes(bytes(data))
        try:
            LearnedAction.load(path)
            outcomes.add("loaded")
        except ValueError:
            outcomes.add("ValueError")
    assert "ValueError" in outcomes


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        LearnedAction.load(tmp_path / "nothing.pt")


# -- symmetry reports -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    return find_symmetries(model, (torch.randn(3, 4),)).to_dict()


def test_a_report_round_trips(report):
    assert SymmetryReport.from_dict(report).to_dict() == report


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("sites", ..., "needs 'sites'"),
        ("sites", {}, "needs 'sites'"),
        ("sites/0", {"members": []}, "site 0 is malformed"),
        ("sites/0/action", {"registered": "no_such_action"}, "site 0 is malformed"),
        ("sites/0/members", None, "site 0 is malformed"),
        ("skipped", [{"kind": "op"}], "skipped entry 0"),
        ("skipped", "none", "'skipped' has type str"),
        ("frozen", {"w": 3}, "'frozen' must map"),
        ("coverage", 1.5, r"coverage=1.5 is outside \[0.0, 1.0\]"),
        ("coverage_exact", float("nan"), "coverage_exact=nan"),
        ("parameters", -1, "negative"),
        ("parameters", 2.5, "'parameters' has type float"),
        ("seconds", "1s", "'seconds' has type str"),
        ("model", None, "'model' has type NoneType"),
    ],
)
def test_a_malformed_report_raises_value_error(report, path, value, match):
    data = {**report, "sites": [dict(s) for s in report["sites"]]}
    keys = path.split("/")
    node = data
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    with pytest.raises(ValueError, match=match):
        SymmetryReport.from_dict(data)


def test_a_report_that_is_not_a_dict_raises_value_error():
    with pytest.raises(ValueError, match="is a dict"):
        SymmetryReport.from_dict([1, 2])
