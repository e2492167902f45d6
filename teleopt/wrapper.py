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
  or ``GradScaler`` would skip unscaling);
* one user ``step()`` is one optimizer step to the outside world: the base is stepped
  through :meth:`OptimizerWrapper._step_base`, which runs the base's own instance
  step hooks but not torch's *global* step hooks (those fire for the wrapper only),
  and hands the closure to bases whose ``step`` requires it (``LBFGS``).

Subclasses implement ``step`` and the two state hooks.  A subclass's ``step`` is::

    @no_grad_step  # @torch.no_grad(), cheaper per call
    def step(self, closure=None):
        loss = self._closure_before_step(closure)  # None when the base evaluates it
        ...  # the wrapper's work (gradients exist unless base_needs_closure)
        return self._step_base(closure, loss)
"""

from __future__ import annotations

import base64
import functools
import inspect
import io
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "OptimizerWrapper",
    "decode_record",
    "encode_record",
    "is_scalar",
    "no_grad_step",
    "step_needs_closure",
    "torch_initialising_step",
]


def is_scalar(value: Any) -> bool:
    """Whether ``value`` may live in a param group (plain Python scalars, strings and None only)."""
    return value is None or isinstance(value, (bool, int, float, str))


def step_needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (``LBFGS``), read from its signature.

    A wrapper answers for the optimizer it wraps (:attr:`OptimizerWrapper.base_needs_closure`).
    """
    if isinstance(optimizer, OptimizerWrapper):
        return optimizer.base_needs_closure
    cls: Any = type(optimizer)  # classes hash by identity; typeshed's type[Optimizer] hides that
    return _class_needs_closure(cls)


@functools.cache
def _class_needs_closure(cls: Any) -> bool:
    try:
        parameters = list(inspect.signature(cls.step).parameters.values())[1:]
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return False
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name == "closure" or parameter.kind == parameter.POSITIONAL_ONLY:
            return parameter.default is inspect.Parameter.empty
    return False


def no_grad_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """``@torch.no_grad()`` for a wrapper's ``step``, without the context decorator's per-call machinery
    (a copy of the context manager per call).  Grad mode is off inside and restored afterwards, also on an exception."""

    @functools.wraps(step)
    def without_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        try:
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(grad)

    return without_grad


def _step_without_global_hooks(optimizer: Optimizer, args: tuple[Any, ...]) -> Any:
    """``optimizer.step(*args)`` with its instance step hooks but without torch's global ones.

    ``Optimizer`` patches every subclass's ``step`` with ``profile_hook_step``, which
    fires the global hooks (``register_optimizer_step_pre_hook``) and then the
    instance hooks.  Inside a wrapper the global hooks have already fired for the
    wrapper, so the base runs its unpatched ``step`` between its own instance hooks,
    as ``profile_hook_step`` would (same order, same ``(args, kwargs)`` rewriting).
    """
    patched = type(optimizer).step
    raw = getattr(patched, "__wrapped__", None)
    own = optimizer.__dict__.get("step")
    if own is not None and getattr(own, "_wrapped_by_lr_sched", False):
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what the scheduler's wrapper records
        own = None
    if raw is None or own is not None or not getattr(patched, "hooked", False):
        return optimizer.step(*args)  # not torch's patch, or replaced on the instance: call it as it is
    if torch.autograd._profiler_enabled():  # the profiler's label for the base's step, as torch's patch gives it
        with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
            return _between_instance_hooks(optimizer, raw, args)
    return _between_instance_hooks(optimizer, raw, args)  # no label without a profiler (it records nothing)


def _between_instance_hooks(optimizer: Optimizer, raw: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``raw(optimizer, *args)`` between ``optimizer``'s instance step pre- and post-hooks, as torch's patch runs it."""
    if not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks:  # most steps: no hooks
        out = raw(optimizer, *args)
        optimizer._optimizer_step_code()
        return out
    kwargs: dict[str, Any] = {}
    call_args: tuple[Any, ...] = (optimizer, *args)
    for pre_hook in optimizer._optimizer_step_pre_hooks.values():
        result = pre_hook(optimizer, call_args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{type(optimizer).step} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
            call_args, kwargs = result
    out = raw(*call_args, **kwargs)
    optimizer._optimizer_step_code()
    for post_hook in optimizer._optimizer_step_post_hooks.values():
        post_hook(optimizer, call_args, kwargs)
    return out


def encode_record(top: dict[str, Any]) -> tuple[dict[str, Any]]:
    """A wrapper's top-level record as the one-element tuple a param group carries it in.

    torch's ``get_optimizer_state_dict`` keeps only ``"state"`` and ``"param_groups"``, and ``dcp.load`` reads
    only the leaves the loading side already has: the record must travel as one leaf.  ``dcp`` walks into
    dicts and lists but keeps a tuple whole (``torch.distributed.checkpoint._traverse``) and saves it with
    ``torch.save``, tensors as raw storage; in a plain ``torch.save(opt.state_dict())`` the tuple holds the very
    objects of the top-level record, which pickle and ``torch.save`` write once.
    """
    return (top,)


def decode_record(value: Any, field: str) -> Any:
    """The record :func:`encode_record` wrapped, or one an older teleopt wrote as a base64 string of its
    ``torch.save`` (read with ``weights_only=True``); ``ValueError`` naming ``field``."""
    if isinstance(value, tuple) and len(value) == 1:
        return value[0]
    if not isinstance(value, str):
        raise ValueError(f"{field} must be the record state_dict() wrote, got {type(value).__name__}")
    try:
        return torch.load(io.BytesIO(base64.b64decode(value.encode("ascii"), validate=True)), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a damaged field
        raise ValueError(f"{field} cannot be read ({type(e).__name__}: {e})") from None


def torch_initialising_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` is being called by torch's ``_init_optim_state``: the learning-rate-0 step
    with zero gradients that ``torch.distributed.checkpoint.state_dict`` takes on an optimizer without state to
    create its state tensors.  It is not a training step (a wrapper runs none of its own work and counts
    nothing).  Cheap unless every group's ``lr`` is 0 and the innermost optimizer has no state."""
    inner = optimizer
    while isinstance(inner, OptimizerWrapper):
        inner = inner.base
    if inner.state:
        return False
    for group in optimizer.param_groups:
        if "lr" not in group or float(group["lr"]) != 0.0:
            return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_init_optim_state" and frame.f_globals.get("__name__") == _TORCH_STATE_DICT:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _cast_like(entries: dict[str, Any], p: Tensor) -> None:
    """Move the tensors of ``entries`` (wrapper state of ``p``) to ``p``'s device, floating ones to its dtype."""
    for key, value in entries.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            # a real entry of a complex parameter (kept in its real view) takes the real dtype
            dtype = p.dtype.to_real() if p.is_complex() else p.dtype
            entries[key] = value.to(device=p.device, dtype=dtype)
        elif isinstance(value, Tensor) and value.is_complex():
            entries[key] = value.to(device=p.device, dtype=p.dtype)
        elif isinstance(value, Tensor):
            entries[key] = value.to(device=p.device)


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

    @functools.cached_property
    def innermost(self) -> Optimizer:
        """The real optimizer at the bottom of a stack of wrappers (fixed at construction: read once)."""
        inner = self._base
        while isinstance(inner, OptimizerWrapper):
            inner = inner.base
        return inner

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

    @functools.cached_property
    def base_needs_closure(self) -> bool:
        """Whether the innermost optimizer's ``step`` requires the closure (``LBFGS``).

        Such a base evaluates the closure itself, as often as it needs: the wrapper
        then passes it on instead of running it (:meth:`_closure_before_step`).
        """
        return step_needs_closure(self._base)

    def _closure_before_step(self, closure: Callable[[], Any] | None) -> Any:
        """Run the closure once before the wrapper's work, unless the base evaluates it; returns its loss or None."""
        if self.base_needs_closure:
            if closure is None:
                raise TypeError(f"{type(self).__name__}.step: the base optimizer {type(self._base).__name__} needs a closure")
            return None
        return self._run_closure(closure)

    def _step_base(self, closure: Callable[[], Any] | None = None, loss: Any = None) -> Any:
        """Step the base once; returns the step's loss.

        A base that needs the closure gets it and its return value is the loss;
        any other base steps without it and ``loss`` (what
        :meth:`_closure_before_step` returned) is passed through.  The base's
        instance step hooks fire; torch's global step hooks do not (they fired for
        the wrapper).
        """
        if self.base_needs_closure:
            return _step_without_global_hooks(self._base, (closure,))
        _step_without_global_hooks(self._base, ())
        return loss

    # -- state --------------------------------------------------------------------------
    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """Per-parameter (index -> {key: tensor}) and top-level wrapper state; keys without prefix."""
        return {}, {}

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        """Restore what :meth:`_wrapper_state` returned (tensors already on the right device)."""

    def _portable_state(self, top: dict[str, Any]) -> dict[str, Any]:
        """What of the top-level state travels in the first param group (all of it unless overridden)."""
        return top

    @property
    def _top_key(self) -> str:
        return self.prefix.rstrip("_")

    @property
    def _group_key(self) -> str:
        """The first param group's key holding the top-level record (:func:`encode_record`: one leaf for ``dcp``).

        A wrapper with a top-level record also keeps the key, empty, in its live groups (a default ``state=""``):
        torch's ``flatten_optimizer_state_dict`` option restores only the group keys the live groups have."""
        return self.prefix + "state"

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
            # torch's get_optimizer_state_dict keeps "state" and "param_groups" only: the same record's objects
            groups = [dict(group) for group in sd["param_groups"]]
            groups[0][self._group_key] = encode_record(self._portable_state(top))
            sd["param_groups"] = groups
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split out the wrapper's entries, load the rest into the base, re-point ``param_groups``.

        Groups saved without the wrapper's keys (a checkpoint of the bare base, made
        before the wrapper was added) keep the values their group had before the load.
        Malformed input raises ``ValueError`` before anything changes.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must have the keys 'state' and 'param_groups'")
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        where = f"{type(self).__name__}.load_state_dict"
        saved_groups = self._saved_groups(state_dict, where)
        base_state, per_param = self._split_saved_state(state_dict["state"], saved_groups, where)
        encoded = [g[self._group_key] for g in saved_groups if self._group_key in g]
        saved_groups = [{k: v for k, v in g.items() if k != self._group_key} for g in saved_groups]
        top = self._saved_record(state_dict, encoded, where)
        params = {idx: p for idx, _, p in self.iter_params()}
        for idx in per_param:
            if idx not in params:
                raise ValueError(f"{where}: state_dict has wrapper state for parameter {idx}, but the optimizer has {len(params)}")
        mine_before = [{k: v for k, v in group.items() if k.startswith(self.prefix)} for group in self.param_groups]
        self._check_loaded(saved_groups, mine_before, per_param, top)
        base_sd = {k: v for k, v in state_dict.items() if k not in ("state", self._top_key)}
        base_sd["state"], base_sd["param_groups"] = base_state, saved_groups
        self._base.load_state_dict(base_sd)
        self.param_groups = self._base.param_groups
        for group, previous in zip(self.param_groups, mine_before):
            for key, value in previous.items():
                group.setdefault(key, value)
        for idx, entries in per_param.items():
            _cast_like(entries, params[idx])
        self._load_wrapper_state(per_param, top)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _saved_groups(state_dict: dict[str, Any], where: str) -> list[dict[str, Any]]:
        """The saved param groups, after checking the shape of ``state_dict``'s two entries."""
        saved_state, saved_groups = state_dict["state"], state_dict["param_groups"]
        if not isinstance(saved_state, dict):
            raise ValueError(f"{where}: 'state' must be a dict, got {type(saved_state).__name__}")
        if not isinstance(saved_groups, (list, tuple)) or not all(isinstance(g, dict) for g in saved_groups):
            raise ValueError(f"{where}: 'param_groups' must be a list of dicts")
        return list(saved_groups)

    def _split_saved_state(
        self, saved_state: dict[Any, Any], saved_groups: list[dict[str, Any]], where: str
    ) -> tuple[dict[Any, Any], dict[int, dict[str, Any]]]:
        """The base's per-parameter state (keys as saved) and the wrapper's (prefix stripped, by parameter index)."""
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{where}: the state_dict has {len(saved_groups)} param group(s), the optimizer {len(self.param_groups)}")
        base_state: dict[Any, Any] = {}
        per_param: dict[int, dict[str, Any]] = {}
        # torch's rule: the saved groups' "params" name the parameters in order, whatever their keys
        # (indices from state_dict(); fully qualified names from torch.distributed.checkpoint's
        # get_optimizer_state_dict)
        position: dict[Any, int] = {}
        for number, key in enumerate(k for group in saved_groups for k in group.get("params", [])):
            if isinstance(key, (int, str)):
                position.setdefault(key, number)
        for idx, entries in saved_state.items():
            if not isinstance(entries, dict):
                raise ValueError(f"{where}: the state of parameter {idx!r} must be a dict, got {type(entries).__name__}")
            mine = {k[len(self.prefix) :]: v for k, v in entries.items() if isinstance(k, str) and k.startswith(self.prefix)}
            rest = {k: v for k, v in entries.items() if not (isinstance(k, str) and k.startswith(self.prefix))}
            if mine:
                index = position.get(idx, idx) if isinstance(idx, (int, str)) and not isinstance(idx, bool) else idx
                if isinstance(index, bool) or not isinstance(index, int):
                    raise ValueError(
                        f"{where}: wrapper state is keyed by parameter index (int) or by a name in the param groups' 'params', got {idx!r}"
                    )
                per_param[index] = mine
            if rest:
                base_state[idx] = rest
        return base_state, per_param

    def _saved_record(self, state_dict: dict[str, Any], encoded: list[Any], where: str) -> dict[str, Any]:
        """The wrapper's top-level record: its own key, else (through torch's distributed-checkpoint
        functions) the encoded record in the first param group, else empty."""
        if self._top_key in state_dict:
            top = state_dict[self._top_key]
        else:
            top = decode_record(encoded[0], f"{where}: param_groups[0][{self._group_key!r}]") if encoded and encoded[0] else {}
        if not isinstance(top, dict):
            raise ValueError(f"{where}: {self._top_key!r} must be a dict, got {type(top).__name__}")
        return top

    def _check_loaded(
        self,
        saved_groups: Sequence[dict[str, Any]],
        current: list[dict[str, Any]],
        per_param: dict[int, dict[str, Any]],
        top: dict[str, Any],
    ) -> None:
        """Validate the wrapper's part of a state dict before anything is loaded; raise ``ValueError``.

        ``saved_groups`` are the saved param groups (all keys), ``current`` each group's
        wrapper keys now (saved groups without them keep these), ``per_param`` and
        ``top`` the wrapper's entries (prefix removed, tensors not yet cast).
        Subclasses with validated hyperparameters or state extend this.
        """
        del current, per_param, top
        for number, group in enumerate(saved_groups):
            for key, value in group.items():
                if isinstance(key, str) and key.startswith(self.prefix) and not is_scalar(value):
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: param group {number} has {key}={value!r}; "
                        "wrapper hyperparameters are plain scalars"
                    )

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
