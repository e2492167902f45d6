"""Sites: actions bound to a model's named tensors act in place and serialise by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from teleopt import AxisAction, Member, Site, get_action
from teleopt.testing import assert_close


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()


def test_apply_in_place_preserves_outputs_and_parameter_identity():
    model = _mlp()
    site = Site(get_action("positive_rescaling", activation="relu"), ("0.weight", "0.bias", "2.weight"))
    ids = [id(p) for p in model.parameters()]
    x = torch.randn(5, 4, dtype=torch.float64)
    before = model(x)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(1), 1.0)
    site.apply_(model, g)
    assert [id(p) for p in model.parameters()] == ids
    assert not torch.equal(model[0].weight, _mlp()[0].weight)
    assert_close(model(x), before, 1e-12)
    # no hidden state: the transformed state_dict reproduces the outputs in a fresh model
    fresh = _mlp()
    fresh.load_state_dict(model.state_dict())
    assert_close(fresh(x), before, 1e-12)


def test_round_trip_by_name():
    axis = AxisAction("custom", "general", [Member("A", 0), Member("B", 1, -1)], reference="test")
    for site in (
        Site(axis, ("0.weight", "2.weight"), info={"axis": 0}),
        Site(get_action("gl_linear"), ("0.weight", None, "2.weight"), name="gl"),
    ):
        back = Site.from_dict(site.to_dict())
        assert back.members == site.members and back.name == site.name and back.info == site.info
        assert back.action.member_names == site.action.member_names


def test_bad_sites():
    action = get_action("gl_linear")
    with pytest.raises(ValueError, match="needs 3 members"):
        Site(action, ("0.weight",))
    with pytest.raises(ValueError, match="required member"):
        Site(action, ("0.weight", "0.bias", None))
    with pytest.raises(TypeError, match="GroupAction"):
        Site("gl_linear", ("a", "b", "c"))
    with pytest.raises(KeyError, match="no parameter or buffer named 'nope.weight'"):
        Site(action, ("nope.weight", None, "2.weight")).tensors(_mlp())
