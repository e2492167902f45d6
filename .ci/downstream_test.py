"""A downstream project's test file: teleopt installed from a wheel with the ``testing`` extra.

``.ci/downstream.sh`` copies it into a temporary directory outside the clone and runs it
with the fresh virtual environment's pytest: the ``teleopt`` pytest plugin (fixtures
``torch_generator`` and ``float64``) loads by itself, and the strategies and assertions of
``teleopt.testing`` check a rescaling symmetry in float64.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import teleopt
from teleopt.testing import assert_close, group_elements

RESCALING = teleopt.get_action("positive_rescaling", activation="relu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def test_teleopt_comes_from_the_installed_wheel_not_the_clone():
    clone = Path(os.environ["TELEOPT_CLONE"]).resolve()
    installed = Path(teleopt.__file__).resolve()
    assert clone not in installed.parents, installed


def test_the_plugin_fixtures_load(torch_generator, float64):
    assert isinstance(torch_generator, torch.Generator) and torch.get_default_dtype() == torch.float64


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_a_relu_rescaling_leaves_the_output_unchanged(data):
    model = _model()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    site = teleopt.Site(RESCALING, ("0.weight", "0.bias", "2.weight"))
    moved = copy.deepcopy(model)
    site.apply_(moved, data.draw(group_elements(site.action, site.tensors(moved))))
    assert_close(moved(x), model(x), 1e-10, "output after the rescaling")
