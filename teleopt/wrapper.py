"""The drop-in optimizer-wrapper contract shared by ``Teleport`` and ``Syre``.

A wrapper must work wherever its base optimizer worked (DESIGN.md, CONVENTIONS.md
section 1):

* it is a real ``torch.optim.Optimizer`` (``Optimizer.__init__`` runs, so hook
  dictionaries exist and LR schedulers accept it), whose ``param_groups`` is the
  *same list object* as the base's and whose ``state`` is the base's real state;
* its hyperparameters live in the base's group dicts under namespaced keys
  (``teleopt_<wrapper>_<name>``, plain Python scalars), added with ``setdefault``
  to every group, including groups added later with ``add_param_group``;
* ``state_dict()`` has the standard shape ``{"state": {int: {...}}, "param_groups":
  [...]}``; wrapper per-parameter tensors are merged under namespaced keys and
  wrapper-level values go under one top-level key; ``load_state_dict`` splits them
  out again *before* delegating to the base, then re-points ``param_groups`` at the
  base's new list;
* ``deepcopy``/``pickle`` keep every wrapper attribute; unknown attributes are never
  forwarded to the base (a fused base's ``_step_supports_amp_scaling`` must not leak,
  or ``GradScaler`` would skip unscaling).

Subclasses implement ``step`` and the two state hooks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["OptimizerWrapper", "is_scalar"]


def is_scalar(value: Any) -> bool:
    """Whether ``value`` may live in a param group (plain Python scalars, strings and None only)."""
    return value is None or isinstance(value, (bool, int, float, str))


class OptimizerWrapper(Optimizer):
    """Base class of teleopt's optimizer wrappers (see module docs for the contract).

    Parameters
    ----------
    optimizer:
        The base optimizer (any ``torch.optim.Optimizer``, including another wrapper).
    defaults:
        Wrapper hyperparameters, without prefix; stored in every param group as
        ``prefix + name``.
    """

    prefix: ClassVar[str] = "teleopt_"

    def __init__(self, optimizer: Optimizer, defaults: dict[str, Any]) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(self).__name__} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for key, value in defaults.items():
            if not is_scalar(value):
                raise TypeError(f"{type(self).__name__}: default {key!r} must be a plain scalar, got {type(value).__name__}")
        self._base = optimizer
        self._initialising = True
        super().__init__([{"params": []}], {})
        self._initialising = False
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        for key, value in defaults.items():
            full = self.prefix + key
            self.defaults.setdefault(full, value)
            for group in self.param_groups:
                group.setdefault(full, value)

    # -- sharing with the base ------------------------------------------------------
    @property
    def base(self) -> Optimizer:
        """The wrapped optimizer."""
        return self._base

    @property
    def state(self) -> Any:
        """The base optimizer's real per-parameter state."""
        return self._base.state

    @state.setter
    def state(self, value: Any) -> None:
        # Optimizer.__init__ assigns an empty state; the base's state is never replaced.
        if not getattr(self, "_initialising", False):
            raise AttributeError(f"{type(self).__name__}.state is the base optimizer's state and cannot be replaced")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer; it receives the wrapper's defaults too."""
        if getattr(self, "_initialising", False):
            return
        self._base.add_param_group(param_group)
        self.param_groups = self._base.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Delegate to the base (respects its foreach/fused choices)."""
        self._base.zero_grad(set_to_none=set_to_none)

    def group_value(self, group: dict[str, Any], key: str) -> Any:
        """A wrapper hyperparameter of ``group`` (``key`` without prefix)."""
        return group[self.prefix + key]

    def iter_params(self) -> Iterator[tuple[int, dict[str, Any], Tensor]]:
        """(state_dict index, group, parameter) in ``state_dict`` order."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield index, group, p
                index += 1

    # -- step -------------------------------------------------------------------------
    @staticmethod
    def _run_closure(closure: Callable[[], Any] | None) -> Any:
        """Run a closure once with gradients enabled (torch's meaning of ``closure``)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # -- state --------------------------------------------------------------------------
    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """Per-parameter (index -> {key: tensor}) and top-level wrapper state; keys without prefix."""
        return {}, {}

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        """Restore what :meth:`_wrapper_state` returned (tensors already on the right device)."""

    @property
    def _top_key(self) -> str:
        return self.prefix.rstrip("_")

    def state_dict(self) -> dict[str, Any]:
        """The base's state dict with the wrapper's state merged under namespaced keys."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self._base.state_dict()
        per_param, top = self._wrapper_state()
        state = dict(sd["state"])
        for idx, entries in per_param.items():
            merged = dict(state.get(idx, {}))
            for key, value in entries.items():
                merged[self.prefix + key] = value
            state[idx] = merged
        sd = {**sd, "state": state}
        if top:
            sd[self._top_key] = top
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split out the wrapper's entries, load the rest into the base, re-point ``param_groups``."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have the keys 'state' and 'param_groups'")
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        base_state: dict[Any, Any] = {}
        per_param: dict[int, dict[str, Any]] = {}
        for idx, entries in state_dict["state"].items():
            mine = {k[len(self.prefix):]: v for k, v in entries.items() if k.startswith(self.prefix)}
            rest = {k: v for k, v in entries.items() if not k.startswith(self.prefix)}
            if mine:
                per_param[int(idx)] = mine
            if rest:
                base_state[idx] = rest
        top = state_dict.get(self._top_key, {})
        base_sd = {k: v for k, v in state_dict.items() if k not in ("state", self._top_key)}
        base_sd["state"] = base_state
        self._base.load_state_dict(base_sd)
        self.param_groups = self._base.param_groups
        params = {idx: p for idx, _, p in self.iter_params()}
        for idx, entries in per_param.items():
            if idx not in params:
                raise ValueError(f"state_dict has wrapper state for parameter {idx}, but the optimizer has {len(params)}")
            p = params[idx]
            for key, value in entries.items():
                if isinstance(value, Tensor) and value.is_floating_point():
                    entries[key] = value.to(device=p.device, dtype=p.dtype)
                elif isinstance(value, Tensor):
                    entries[key] = value.to(device=p.device)
        self._load_wrapper_state(per_param, top)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- copy and pickle ----------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            self.__dict__.setdefault(name, OrderedDict())
        self._patch_step_function()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._base!r})"
