"""Validating a saved ``Teleport`` record before anything is loaded.

``Teleport.load_state_dict`` calls :func:`check_record` on the record (the
``"teleopt_teleport"`` entry of ``state_dict``, or its serialised copy in the
first param group) before the base optimizer or the wrapper changes: counters,
the caps' backoff, the generator state and the watch (its sites and elements, or
its snapshot, and those of the earlier teleports it still watches) must be what
:meth:`~teleopt.teleport.watch.TeleportRecord.to_state` writes.  A watch element
must be a valid element of its site's group (shape, finite, positive scalings,
nonsingular matrices: ``Group.validate``) with a finite inverse, since the rollback moves the weights by that inverse (Zhao 2026,
Prop. 4.5.1).  Every failure is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from teleopt.sharding import local
from teleopt.site import Site, lookup_tensor

__all__ = ["check_groups", "check_record"]

_TOP_KEYS = ("step", "accepted", "rollbacks", "backoff", "rng", "watch", "recent", "tally", "last", "lean_check")
_WATCH_KEYS = ("until", "teleport_step", "grad_ref", "loss_ref")


class _Fields:
    """Raise ``ValueError`` naming a field of the record under ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, why: str) -> None:
        raise ValueError(f"{self.where}: teleopt_teleport{field} {why}")

    def count(self, value: Any, field: str) -> int:
        if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(field, f"must be an int >= 0, got {value!r}")
        return int(value)

    def number(self, value: Any, field: str, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            self.fail(field, f"must be a finite number >= 0{' or None' if optional else ''}, got {value!r}")

    def finite(self, value: Any, field: str) -> None:
        if not isinstance(value, Tensor):
            self.fail(field, f"must be a tensor, got {type(value).__name__}")
        if value.is_floating_point() and not bool(torch.isfinite(local(value)).all()):
            self.fail(field, "has non-finite entries")


def check_groups(groups: Sequence[Mapping[str, Any]], per_param: Mapping[int, Any], prefix: str, where: str) -> None:
    """Raise ``ValueError`` unless the saved param groups' ``Teleport`` keys (``prefix`` + ``enabled``, a bool;
    ``trust_region``, positive finite or None) are valid and there are no per-parameter ``Teleport`` entries."""
    if per_param:
        raise ValueError(f"{where}: unexpected per-parameter entries {sorted(next(iter(per_param.values())))} ({prefix}*)")
    for number, group in enumerate(groups):
        enabled, radius = group.get(prefix + "enabled", True), group.get(prefix + "trust_region")
        if not isinstance(enabled, bool):
            raise ValueError(f"{where}: param group {number} has {prefix}enabled={enabled!r}; a bool")
        if radius is not None and (isinstance(radius, bool) or not isinstance(radius, (int, float)) or not 0 < radius < math.inf):
            raise ValueError(f"{where}: param group {number} has {prefix}trust_region={radius!r}; a positive finite number or None")


def check_record(top: Any, module: nn.Module, params: Sequence[Tensor], known: Sequence[Site], where: str) -> None:
    """Raise ``ValueError`` (naming the field) unless ``top`` is a record ``module``'s ``Teleport`` can load.

    ``params`` are the optimizer's parameters in ``state_dict`` order, ``known`` the wrapper's own sites
    (a saved site of the same name is taken from them, as the loader does).
    """
    f = _Fields(where)
    if not isinstance(top, Mapping):
        f.fail("", f"must be a dict, got {type(top).__name__}")
    unknown = sorted(str(k) for k in top if k not in _TOP_KEYS)
    if unknown:
        f.fail("", f"has unknown keys {unknown}")
    for key in ("step", "accepted", "rollbacks"):
        if key in top:
            f.count(top[key], f"[{key!r}]")
    backoff = top.get("backoff", 1.0)
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 < backoff <= 1:
        f.fail("['backoff']", f"must be a number in (0, 1], got {backoff!r}")
    if "rng" in top:
        rng = top["rng"]
        try:
            torch.Generator().set_state(rng.to(torch.uint8).cpu())
        except Exception as e:  # noqa: BLE001 - whatever torch refuses
            f.fail("['rng']", f"is not a CPU generator state ({type(e).__name__}: {e})")
    _check_samples(top, f)
    _check_lean(top, f)
    if top.get("watch") is not None:
        _check_watch(top["watch"], f, module, params, known)


def _check_lean(top: Mapping[str, Any], f: _Fields) -> None:
    """The last report's [step, accepted, whole move] and the lean balance's check (``TeleportRecord``)."""
    last = top.get("last")
    if last is not None:
        if not isinstance(last, (list, tuple)) or len(last) != 3 or not all(isinstance(v, bool) for v in last[1:]):
            f.fail("['last']", f"must be [step, accepted, whole move], got {last!r}")
        f.count(last[0], "['last'][0]")
    lean = top.get("lean_check")
    if lean is None:
        return
    keys = {"sites", "backoff", "checked_at", "verified", "lean_step"}
    if not isinstance(lean, Mapping) or set(lean) != keys:
        f.fail("['lean_check']", f"must be a dict with the keys {sorted(keys)}, got {lean!r}")
    if not isinstance(lean["sites"], (list, tuple)) or not all(isinstance(n, str) for n in lean["sites"]):
        f.fail("['lean_check']['sites']", f"must be a list of site names, got {lean['sites']!r}")
    f.number(lean["backoff"], "['lean_check']['backoff']")
    for key in ("checked_at", "lean_step"):
        if isinstance(lean[key], bool) or not isinstance(lean[key], int) or lean[key] < -2:
            f.fail(f"['lean_check'][{key!r}]", f"must be a step (an int >= -2), got {lean[key]!r}")
    if not isinstance(lean["verified"], bool):
        f.fail("['lean_check']['verified']", f"must be a bool, got {lean['verified']!r}")


def _check_samples(top: Mapping[str, Any], f: _Fields) -> None:
    """The watch's recent squared gradient norms ([step, value] pairs) and the teleports' tally (counts)."""
    recent = top.get("recent", [])
    if not isinstance(recent, (list, tuple)) or any(not isinstance(r, (list, tuple)) or len(r) != 2 for r in recent):
        f.fail("['recent']", f"must be a list of [step, squared gradient norm] pairs, got {recent!r}")
    for i, (t, v) in enumerate(recent):
        f.count(t, f"['recent'][{i}][0]")
        f.number(v, f"['recent'][{i}][1]")
    tally = top.get("tally") or {}
    if not isinstance(tally, Mapping):
        f.fail("['tally']", f"must be a dict of counts, got {type(tally).__name__}")
    for key, value in tally.items():
        f.count(value, f"['tally'][{key!r}]")


def _check_watch(watch: Any, f: _Fields, module: nn.Module, params: Sequence[Tensor], known: Sequence[Site]) -> None:
    """The watch, and the earlier teleports it still watches (``"earlier"``, oldest first, each the same record
    without ``strikes``), whose steps must come before the watch's own."""
    target = _Target(module, params, known)
    _check_link(watch, "['watch']", f, target)
    earlier = watch.get("earlier", [])
    if not isinstance(earlier, list):
        f.fail("['watch']['earlier']", f"must be a list of watches, got {type(earlier).__name__}")
    last = -1
    for i, link in enumerate([*earlier, watch]):
        here = f"['watch']['earlier'][{i}]" if i < len(earlier) else "['watch']"
        if i < len(earlier):
            _check_link(link, here, f, target)
            if "earlier" in link or "strikes" in link:
                f.fail(here, "must not have 'earlier' or 'strikes' of its own")
        if link["teleport_step"] <= last:
            f.fail(f"{here}['teleport_step']", f"({link['teleport_step']}) is not after the earlier teleport's ({last})")
        last = link["teleport_step"]


class _Target(NamedTuple):
    """The model a record is loaded into: its module, the optimizer's parameters, the wrapper's sites."""

    module: nn.Module
    params: Sequence[Tensor]
    known: Sequence[Site]


def _check_link(watch: Any, field: str, f: _Fields, target: _Target) -> None:
    if not isinstance(watch, Mapping):
        f.fail(field, f"must be a dict, got {type(watch).__name__}")
    missing = [k for k in _WATCH_KEYS if k not in watch]
    kinds = [k for k in ("inverse", "snapshot") if k in watch]
    if missing or len(kinds) != 1:
        f.fail(field, f"must have the keys {list(_WATCH_KEYS)} and one of 'inverse', 'snapshot'; got {sorted(map(str, watch))}")
    until, start = f.count(watch["until"], f"{field}['until']"), f.count(watch["teleport_step"], f"{field}['teleport_step']")
    if until < start:
        f.fail(f"{field}['until']", f"({until}) is before the teleport step ({start})")
    f.number(watch["grad_ref"], f"{field}['grad_ref']")
    f.number(watch["loss_ref"], f"{field}['loss_ref']", optional=True)
    f.count(watch.get("strikes", 0), f"{field}['strikes']")
    strike_loss = watch.get("strike_loss")  # a loss read at the first strike (any sign: an NLL may be negative)
    if strike_loss is not None and (
        isinstance(strike_loss, bool) or not isinstance(strike_loss, (int, float)) or not math.isfinite(strike_loss)
    ):
        f.fail(f"{field}['strike_loss']", f"must be a finite number or None, got {strike_loss!r}")
    strike_batch = watch.get("strike_batch")  # the batch that loss was read on (Watch.to_state)
    if strike_batch is not None and not (isinstance(strike_batch, Mapping) and isinstance(strike_batch.get("inputs"), list)):
        f.fail(f"{field}['strike_batch']", f"must be a dict with a list 'inputs' or None, got {type(strike_batch).__name__}")
    elif strike_batch is not None and not isinstance(strike_batch.get("kwargs"), (Mapping, type(None))):
        f.fail(f"{field}['strike_batch']['kwargs']", f"must be a dict or None, got {type(strike_batch['kwargs']).__name__}")
    if kinds[0] == "inverse":
        _check_inverse(watch["inverse"], f"{field}['inverse']", f, target.module, target.known)
    else:
        _check_snapshot(watch["snapshot"], f"{field}['snapshot']", f, target.module, target.params)


def _check_inverse(data: Any, field: str, f: _Fields, module: nn.Module, known: Sequence[Site]) -> None:
    if not isinstance(data, Mapping) or not isinstance(data.get("sites"), list) or not isinstance(data.get("elements"), list):
        f.fail(field, "must be a dict with the lists 'sites' and 'elements'")
    sites, elements = data["sites"], data["elements"]
    if len(sites) != len(elements):
        f.fail(field, f"has {len(sites)} site(s) but {len(elements)} element(s)")
    by_name = {s.name: s for s in known}
    for i, (spec, g) in enumerate(zip(sites, elements)):
        here = f"{field}['elements'][{i}]"
        try:
            site = by_name.get(spec["name"]) or Site.from_dict(spec)
            group = site.action.group(tuple(None if n is None else lookup_tensor(module, n) for n in site.members))
        except Exception as e:  # noqa: BLE001 - a site this model cannot hold
            f.fail(f"{field}['sites'][{i}]", f"does not name a site of this model ({type(e).__name__}: {e})")
        if not isinstance(g, Tensor) or not g.is_floating_point():
            f.fail(here, f"must be a floating-point tensor, got {type(g).__name__ if not isinstance(g, Tensor) else g.dtype}")
        if tuple(g.shape) != tuple(group.element_shape):
            f.fail(here, f"has shape {tuple(g.shape)}; site {site.name!r} takes {tuple(group.element_shape)}")
        try:
            group.validate(g)
            inverse = group.inverse(g)
        except Exception as e:  # noqa: BLE001 - not a group element: the rollback would destroy the weights
            f.fail(here, f"is not an element of site {site.name!r}'s group ({type(e).__name__}: {e})")
        if not bool(torch.isfinite(inverse).all()):
            f.fail(here, f"has no finite inverse in site {site.name!r}'s group (singular)")


def _check_snapshot(data: Any, field: str, f: _Fields, module: nn.Module, params: Sequence[Tensor]) -> None:
    if not isinstance(data, Mapping) or not isinstance(data.get("tensors"), Mapping) or not isinstance(data.get("state"), Mapping):
        f.fail(field, "must be a dict with the dicts 'tensors' and 'state'")
    for name, value in data["tensors"].items():
        try:
            live = lookup_tensor(module, str(name))
        except KeyError:
            f.fail(f"{field}['tensors']", f"names {name!r}, not a parameter or buffer of the model")
        f.finite(value, f"{field}['tensors'][{name!r}]")
        if tuple(value.shape) != tuple(live.shape):
            f.fail(f"{field}['tensors'][{name!r}]", f"has shape {tuple(value.shape)}, the model's {tuple(live.shape)}")
    for index, state in data["state"].items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(state, Mapping):
            f.fail(f"{field}['state']", f"has an entry {index!r}; the optimizer has {len(params)} parameter(s)")
        for key, value in state.items():
            if isinstance(value, Tensor):
                f.finite(value, f"{field}['state'][{index}][{key!r}]")
