"""Distributed checkpoints (``torch.distributed.checkpoint``) of teleopt's optimizer wrappers.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` turn an
optimizer's state dict into one keyed by parameter names, with sharded
(``DTensor``) values that ``dcp.save`` / ``dcp.load`` write and read shard by
shard.  They accept the wrappers (real ``Optimizer``s sharing ``param_groups``
and ``state`` with their base), and :class:`~teleopt.Syre` needs nothing more:
its anchors are per-parameter state.  Two things do not survive them, and the
two functions here add them:

* torch keeps only ``"state"`` and ``"param_groups"``, so a wrapper's top-level
  entry (``Teleport``'s step and teleport counters, the caps' backoff and its
  generator state under ``"teleopt_teleport"``) is dropped: it is carried next to
  them and handed back to the wrapper's own ``load_state_dict``;
* on an optimizer without state (freshly made, about to be loaded into) torch
  takes one step with zero gradients and learning rate 0 to create the state
  tensors.  Through a ``Teleport`` that step counts as a training step and may
  run a scheduled teleport (drawing from ``batch_fn``); here the innermost
  optimizer takes it instead, and the wrappers are not stepped.

A watch in progress (``SafetyConfig.watch_steps`` after a teleport) is not
carried: a freshly made ``Teleport`` has no watch for ``dcp.load`` to read into,
so the resumed run is not watched for the rest of that window.

Usage (every rank)::

    state = {"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    ...  # fresh model and optimizer, same construction
    state = {"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    load_optimizer_state_dict(model, opt, state["optim"])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.wrapper import OptimizerWrapper

__all__ = ["optimizer_state_dict", "load_optimizer_state_dict"]

_TORCH_KEYS = ("state", "param_groups")


@contextmanager
def _initialised(optimizer: Optimizer) -> Iterator[None]:
    """Make torch's state-dict functions skip their initialising step through a wrapper.

    torch steps an optimizer whose ``state`` is empty and whose parameters have no
    gradients (zero gradients, learning rate 0).  For a wrapper, the innermost
    optimizer takes that step here, and every trainable parameter holds a zero
    gradient while torch runs (so it does not step the wrapper even when the
    innermost optimizer keeps no state, like plain SGD); gradients are put back after.
    """
    if not isinstance(optimizer, OptimizerWrapper) or optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.grad for p in params]
    if all(grad is None for grad in saved):
        for p in params:
            p.grad = torch.zeros_like(p)
        inner = optimizer.innermost
        lrs = [group.get("lr") for group in inner.param_groups]
        for group in inner.param_groups:
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
        try:
            inner.step()
        finally:
            for group, lr in zip(inner.param_groups, lrs):
                if lr is not None:
                    group["lr"] = lr
    try:
        yield
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer, *, options: Any = None) -> dict[str, Any]:
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` that keeps the wrappers' own state.

    The result is torch's (parameter names as keys, sharded values for FSDP2
    models) plus every top-level entry of ``optimizer.state_dict()`` besides
    ``"state"`` and ``"param_groups"`` (``Teleport``'s ``"teleopt_teleport"``).  On a
    fresh wrapper the innermost optimizer creates the state, the wrappers do not
    step.  Every rank calls it, as torch's.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    extras: dict[str, Any] = {}

    def capture(_: Optimizer, state_dict: dict[str, Any]) -> None:
        extras.clear()
        extras.update({k: v for k, v in state_dict.items() if k not in _TORCH_KEYS})

    handle = optimizer.register_state_dict_post_hook(capture)
    try:
        with _initialised(optimizer):
            osd = dict(get_optimizer_state_dict(model, optimizer, options=options))
    finally:
        handle.remove()
    osd.update(extras)
    return osd


def load_optimizer_state_dict(model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any], *, options: Any = None) -> None:
    """``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` that restores the wrappers' own state.

    Loads what :func:`optimizer_state_dict` returned (after ``dcp.load`` filled it):
    torch's part through torch, with the top-level wrapper entries handed to the
    wrapper's ``load_state_dict`` alongside it.  Every rank calls it, as torch's.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    extras = {k: v for k, v in state_dict.items() if k not in _TORCH_KEYS}
    handle = optimizer.register_load_state_dict_pre_hook(lambda _, sd: {**sd, **extras})
    try:
        with _initialised(optimizer):
            set_optimizer_state_dict(model, optimizer, {k: v for k, v in state_dict.items() if k in _TORCH_KEYS}, options=options)
    finally:
        handle.remove()
