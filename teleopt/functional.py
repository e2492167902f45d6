"""Functional evaluation of a module: the layer every algorithm above the sites shares.

A model is evaluated with ``torch.func.functional_call`` on a dictionary of
tensors, with *copies* of its buffers, so BatchNorm running statistics are never
touched by the extra passes teleports, orbits and ensembles make
(CONVENTIONS.md section 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["Batch", "LossFn", "as_batch", "FunctionalModel", "module_input"]


Batch = tuple[tuple[Any, ...], Any]
LossFn = Callable[[Any, Any], Tensor]


def as_batch(batch: Any) -> Batch:
    """Normalise a batch to ``(inputs tuple, target)``.

    Accepted: ``(inputs, target)`` where ``inputs`` is a tensor or a tuple/list of
    positional model inputs, and ``target`` anything the loss function takes
    (``None`` when the model output is the loss itself).
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            "a teleport batch must be a pair (inputs, target): inputs a tensor or a tuple of model inputs, "
            f"target what loss_fn(output, target) takes; got {type(batch).__name__}"
        )
    inputs, target = batch
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif not isinstance(inputs, tuple):
        raise TypeError(f"batch inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}")
    return inputs, target


class _Captured(Exception):
    """Raised by a forward pre-hook to stop a pass once a module input is captured."""


class FunctionalModel:
    """A module evaluated functionally on name -> tensor dictionaries, buffers copied.

    ``loss_fn(output, target)`` gives the scalar loss; with ``loss_fn=None`` the
    model output must itself be the scalar loss.
    """

    def __init__(self, module: nn.Module, loss_fn: LossFn | None) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.buffers = {n: b.detach().clone() for n, b in module.named_buffers()}

    def output(self, tensors: Mapping[str, Tensor], batch: Batch) -> Any:
        inputs, _ = batch
        merged = {**self.buffers, **tensors}
        return functional_call(self.module, merged, inputs, strict=False, tie_weights=True)

    def loss(self, tensors: Mapping[str, Tensor], batch: Batch) -> Tensor:
        """The scalar loss at ``tensors`` (names missing from it take the live values)."""
        out = self.output(tensors, batch)
        loss = out if self.loss_fn is None else self.loss_fn(out, batch[1])
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("the teleport loss must be a scalar tensor: pass loss_fn(output, target) to Teleport")
        return loss.reshape(())

    def module_input(self, tensors: Mapping[str, Tensor], batch: Batch, module_name: str) -> Tensor:
        """The first positional input of submodule ``module_name`` at ``tensors``.

        The forward pass stops as soon as the module is reached (a partial forward).
        """
        try:
            sub = self.module.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"{module_name!r} is not a submodule of {type(self.module).__name__}") from None
        captured: list[Tensor] = []

        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            captured.append(args[0])
            raise _Captured

        handle = sub.register_forward_pre_hook(hook)
        try:
            self.output(tensors, batch)
        except _Captured:
            pass
        finally:
            handle.remove()
        if not captured:
            raise ValueError(f"module {module_name!r} was not called by the forward pass")
        return captured[0]


@torch.no_grad()
def module_input(model: nn.Module, module_name: str, *inputs: Any) -> Tensor:
    """The first positional input that module ``module_name`` receives when ``model(*inputs)`` runs.

    This is the ``data`` a data-dependent or bound site reads (papers/000 Prop. 4.1:
    S = h(theta_1, X)).  The forward pass runs functionally on copies of the
    buffers (BatchNorm running statistics are not updated) and stops at the module.
    """
    return FunctionalModel(model, None).module_input({}, (tuple(inputs), None), module_name)
