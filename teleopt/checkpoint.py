"""Distributed checkpoints (``torch.distributed.checkpoint``) of teleopt's optimizer wrappers.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` turn an
optimizer's state dict into one keyed by parameter names, with sharded
(``DTensor``) values that ``dcp.save`` / ``dcp.load`` write and read shard by
shard.  They accept the wrappers as they are, and so does torch's
``get_state_dict`` / ``set_state_dict`` (the path torchtitan and accelerate's
FSDP2 take): the wrappers are real ``Optimizer``s sharing ``param_groups`` and
``state`` with their base; :class:`~teleopt.Syre`'s anchors are per-parameter
state; ``Teleport``'s record (step and teleport counters, the caps' backoff, its
generator state and the watch in progress) travels in the first param group
(``"teleopt_teleport_state"``, a one-element tuple: one leaf that ``dcp.load`` reads whole),
since torch drops top-level entries; and torch's initialising step (an optimizer
without state is stepped once with zero gradients at learning rate 0) is not a
training step: ``Teleport`` neither teleports nor counts in it
(:func:`teleopt.wrapper.torch_initialising_step`).

The two functions here are torch's, with that initialising step taken by the
innermost optimizer alone (the wrappers are not stepped at all).

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
    """``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` on a fresh wrapper without its step.

    torch's result (parameter names as keys, sharded values for FSDP2 models); the
    wrappers' own records travel in its first param group.  On a fresh wrapper the
    innermost optimizer creates the state, the wrappers do not step.  Every rank
    calls it, as torch's.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _initialised(optimizer):
        return dict(get_optimizer_state_dict(model, optimizer, options=options))


def load_optimizer_state_dict(model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any], *, options: Any = None) -> None:
    """``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` for what :func:`optimizer_state_dict`
    returned (after ``dcp.load`` filled it).  Every rank calls it, as torch's."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with _initialised(optimizer):
        set_optimizer_state_dict(model, optimizer, state_dict, options=options)
