"""A damaged checkpoint is refused with a ValueError naming the field, before anything is loaded.

Each case damages one field of a ``Teleport`` (or ``Syre``) state dict saved inside a watch window and
loads it into a wrapper that has trained on its own: the load must raise ``ValueError`` naming the
field, and the target's parameters, base optimizer state, param groups and record must be bitwise as
before (``Teleport.load_state_dict``, ``Syre.load_state_dict``, torch's ``set_state_dict`` and
``teleopt.checkpoint.load_optimizer_state_dict``).  A watch element that is not a group element (wrong
shape, NaN, zero) would move the weights by a non-finite inverse at the rollback.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_resume import mlp, optimizer, teleport_of, train

from teleopt import Syre
from teleopt.wrapper import encode_record


def saved_and_target(syre: bool = False) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    """A state dict saved one step after a teleport (the watch holds its elements), and a wrapper that
    trained on its own (its state must survive a refused load)."""
    model = mlp()
    opt = optimizer(model, "adam", syre)
    train(model, opt, range(4))
    assert teleport_of(opt).record.watch is not None
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    target_model = mlp(seed=2)
    target = optimizer(target_model, "adam", syre)
    train(target_model, target, range(7))
    return torch.load(buf, weights_only=True), target_model, target


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bytes:
    """Every parameter, the whole optimizer state dict (base state, groups, record) as bytes."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    return buf.getvalue()


def elements(sd: dict[str, Any]) -> list[torch.Tensor]:
    return sd["teleopt_teleport"]["watch"]["inverse"]["elements"]


DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "watch without its rollback": (lambda sd: sd["teleopt_teleport"]["watch"].pop("inverse"), r"\['watch'\] must have the keys"),
    "element of the wrong shape": (
        lambda sd: elements(sd).__setitem__(0, elements(sd)[0][:-1]),
        r"\['watch'\]\['inverse'\]\['elements'\]\[0\] has shape",
    ),
    "NaN element": (lambda sd: elements(sd)[1].__setitem__(0, float("nan")), r"\['elements'\]\[1\] is not an element"),
    "zero element": (lambda sd: elements(sd)[0].zero_(), r"\['elements'\]\[0\] is not an element"),
    "unknown site": (
        lambda sd: sd["teleopt_teleport"]["watch"]["inverse"]["sites"][0].update(name="x", members=["9.weight", None, "2.weight"]),
        r"\['sites'\]\[0\] does not name a site",
    ),
    "missing element": (lambda sd: elements(sd).pop(), r"has 2 site\(s\) but 1 element"),
    "negative step": (lambda sd: sd["teleopt_teleport"].update(step=-1), r"\['step'\] must be an int >= 0"),
    "NaN backoff": (lambda sd: sd["teleopt_teleport"].update(backoff=float("nan")), r"\['backoff'\] must be a number in \(0, 1\]"),
    "generator state": (lambda sd: sd["teleopt_teleport"].update(rng=torch.zeros(3, dtype=torch.uint8)), r"\['rng'\] is not a CPU"),
    "watch window": (lambda sd: sd["teleopt_teleport"]["watch"].update(until=0), r"\['watch'\]\['until'\] \(0\) is before"),
    "group flag": (lambda sd: sd["param_groups"][0].update(teleopt_teleport_enabled="yes"), r"teleopt_teleport_enabled='yes'"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_teleport_checkpoint_is_refused_naming_the_field_and_nothing_is_loaded(damage):
    sd, model, target = saved_and_target()
    change, message = DAMAGES[damage]
    change(sd)
    before = fingerprint(model, target)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(sd)
    assert fingerprint(model, target) == before


def test_a_damaged_snapshot_watch_is_refused():
    model = mlp()
    opt = optimizer(model, "sgd_momentum", watch_restore="snapshot")
    train(model, opt, range(4))
    sd = copy.deepcopy(opt.state_dict())
    snapshot = sd["teleopt_teleport"]["watch"]["snapshot"]
    target_model = mlp(seed=2)
    target = optimizer(target_model, "sgd_momentum", watch_restore="snapshot")
    train(target_model, target, range(7))
    before = fingerprint(target_model, target)
    for change, message in (
        (lambda s: s["tensors"].__setitem__("0.weight", torch.zeros(2, 2)), r"\['tensors'\]\['0.weight'\] has shape"),
        (lambda s: s["tensors"]["2.bias"].fill_(float("inf")), r"\['tensors'\]\['2.bias'\] has non-finite"),
        (lambda s: s["tensors"].__setitem__("head.weight", torch.zeros(1)), r"names 'head.weight', not a parameter"),
        (lambda s: s["state"].__setitem__(17, {}), r"\['state'\] has an entry 17"),
    ):
        damaged = copy.deepcopy(sd)
        change(damaged["teleopt_teleport"]["watch"]["snapshot"])
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(damaged)
        assert fingerprint(target_model, target) == before
    assert snapshot is not None


def test_a_damaged_syre_anchor_is_refused_and_nothing_is_loaded():
    sd, model, target = saved_and_target(syre=True)
    before = fingerprint(model, target)
    for change, message in (
        (lambda s: s["state"][0]["teleopt_syre_anchor"].__setitem__((0, 0), float("nan")), "non-finite"),
        (lambda s: s["state"][0].__setitem__("teleopt_syre_anchor", torch.zeros(3)), "has shape"),
        (lambda s: elements(s)[0].zero_(), r"\['elements'\]\[0\] is not an element"),  # Teleport's, inside Syre
    ):
        damaged = copy.deepcopy(sd)
        change(damaged)
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(damaged)
        assert fingerprint(model, target) == before
    assert isinstance(target, Syre)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torch_and_teleopt_distributed_loaders_refuse_a_damaged_record_before_loading(tmp_path):
    """The record travels in the first param group through torch's functions: a damaged one (not decodable,
    or decoding to a zero element) is refused by ``set_state_dict`` and ``load_optimizer_state_dict`` alike."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from teleopt.checkpoint import load_optimizer_state_dict

    sd, model, target = saved_and_target()
    key = "teleopt_teleport_state"
    zero = copy.deepcopy(sd["teleopt_teleport"])
    zero["watch"]["inverse"]["elements"][0].zero_()
    before = fingerprint(model, target)
    for text, message in (("not base64!", f"param_groups\\[0\\]\\['{key}'\\] cannot be read"), (encode_record(zero), "is not an element")):
        for load in (
            lambda osd: set_state_dict(model, target, model_state_dict={}, optim_state_dict=osd),
            lambda osd: load_optimizer_state_dict(model, target, osd),
        ):
            _, osd = get_state_dict(model, target)
            osd["param_groups"][0][key] = text
            with pytest.raises(ValueError, match=message):
                load(osd)
            assert fingerprint(model, target) == before


def test_a_singular_gl_element_in_the_watch_is_refused():
    """A GL site's watch element must be invertible: a rank-deficient matrix (its inverse would send the weights
    to infinity at the rollback) is refused by name, a regular one passes."""
    from teleopt import Site, get_action
    from teleopt.teleport.record_check import check_record

    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False))
    site = Site(get_action("gl_linear"), ("0.weight", None, "1.weight"))
    params = list(model.parameters())
    regular = torch.eye(3, dtype=torch.float32) * 2
    singular = torch.tensor([[1.0, 2, 3], [2, 4, 6], [0, 0, 1]])
    for element, ok in ((regular, True), (singular, False)):
        watch = {"until": 5, "teleport_step": 1, "grad_ref": 1.0, "loss_ref": None}
        watch["inverse"] = {"sites": [site.to_dict()], "elements": [element]}
        if ok:
            check_record({"step": 2, "watch": watch}, model, params, [site], "load")
        else:
            with pytest.raises(ValueError, match=r"\['elements'\]\[0\] is not an element .*not invertible"):
                check_record({"step": 2, "watch": watch}, model, params, [site], "load")
