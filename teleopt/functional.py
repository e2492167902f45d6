"""Functional evaluation of a module: the layer every algorithm above the sites shares.

A model is evaluated with ``torch.func.functional_call`` on a dictionary of
tensors, with *copies* of its buffers, so BatchNorm running statistics are never
touched by the extra passes teleports, orbits and ensembles make
(CONVENTIONS.md section 1).  Every pass of one :class:`FunctionalModel` draws the
same random numbers (dropout masks) and leaves the global generators as they were,
so a loss before and after a teleport compares like with like in train mode too,
and the training run's random stream does not depend on the checks.

A batch's inputs are positional (a tensor or a tuple) or keyword arguments (a
mapping such as a tokenizer's ``BatchEncoding`` or a ``DataCollator``'s dict:
``model(**inputs)``, held as :class:`KeywordInputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["Batch", "LossFn", "KeywordInputs", "as_batch", "split_inputs", "FunctionalModel", "module_input"]


Batch = tuple[tuple[Any, ...], Any]
LossFn = Callable[[Any, Any], Tensor]


class KeywordInputs(dict):
    """The keyword arguments of a batch's model call, ``model(**inputs)``: the last entry of its inputs tuple."""


def split_inputs(inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch's inputs as (positional arguments, keyword arguments)."""
    if inputs and isinstance(inputs[-1], KeywordInputs):
        return inputs[:-1], dict(inputs[-1])
    return inputs, {}


def as_batch(batch: Any) -> Batch:
    """Normalise a batch to ``(inputs tuple, target)``.

    Accepted: ``(inputs, target)`` where ``inputs`` is a tensor or a tuple/list of
    positional model inputs, or a mapping of keyword arguments (``input_ids``,
    ``attention_mask``, ``labels`` of a transformers model; kept as one
    :class:`KeywordInputs` entry), and ``target`` anything the loss function takes
    (``None`` when the model output is the loss itself, or carries it as ``.loss``).
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
    elif isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise TypeError("keyword batch inputs must have string keys")
        inputs = (KeywordInputs(inputs),)
    elif not isinstance(inputs, tuple):
        raise TypeError(f"batch inputs must be a tensor, a tuple of tensors or a mapping of keyword inputs, got {type(inputs).__name__}")
    return inputs, target


class _Captured(Exception):
    """Raised by a forward pre-hook to stop a pass once a module input is captured."""


class FunctionalModel:
    """A module evaluated functionally on name -> tensor dictionaries, buffers copied.

    ``loss_fn(output, target)`` gives the scalar loss; with ``loss_fn=None`` the
    model output must itself be the scalar loss, or carry it as a tensor attribute
    ``loss`` (a transformers ``ModelOutput`` when the batch has ``labels``).  Every
    pass runs on the random state the global generators (CPU and the module's
    CUDA devices) had when this object was made, and restores them afterwards: the
    same dropout masks each time (see module docs).
    """

    def __init__(self, module: nn.Module, loss_fn: LossFn | None) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
        devices = {t.device for t in (*module.parameters(), *module.buffers()) if t.device.type == "cuda"}
        self._cuda = sorted(d.index if d.index is not None else torch.cuda.current_device() for d in devices)
        self._rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(i) for i in self._cuda]

    def output(self, tensors: Mapping[str, Tensor], batch: Batch) -> Any:
        args, kwargs = split_inputs(batch[0])
        merged = {**self.buffers, **tensors}
        with torch.random.fork_rng(devices=self._cuda):
            torch.set_rng_state(self._rng)
            for index, state in zip(self._cuda, self._cuda_rng):
                torch.cuda.set_rng_state(state, index)
            return functional_call(self.module, merged, args, kwargs, strict=False, tie_weights=True)

    def loss(self, tensors: Mapping[str, Tensor], batch: Batch) -> Tensor:
        """The scalar loss at ``tensors`` (names missing from it take the live values)."""
        out = self.output(tensors, batch)
        if self.loss_fn is None and not isinstance(out, Tensor) and isinstance(getattr(out, "loss", None), Tensor):
            out = out.loss
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
