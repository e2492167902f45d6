"""Functional evaluation of a module: the layer every algorithm above the sites shares.

A model is evaluated with ``torch.func.functional_call`` on a dictionary of
tensors, with *copies* of its buffers, so BatchNorm running statistics are never
touched by the extra passes teleports, orbits and ensembles make
(CONVENTIONS.md section 1).  Every pass of one :class:`FunctionalModel` draws the
same random numbers (dropout masks) and leaves the global generators as they were,
so a loss before and after a teleport compares like with like in train mode too,
and the training run's random stream does not depend on the checks.

A :class:`Batch` holds positional inputs, a target and keyword arguments
(``model(*inputs, **kwargs)``); keyword inputs come as a mapping such as a
tokenizer's ``BatchEncoding`` or a ``DataCollator``'s dict (``model(**inputs)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = ["Batch", "LossFn", "as_batch", "batch_parts", "check_has_rows", "has_rows", "FunctionalModel", "module_input"]


LossFn = Callable[[Any, Any], Tensor]


class Batch(NamedTuple):
    """A teleport batch, normalised: the model is called as ``model(*inputs, **kwargs)`` and
    ``loss_fn(output, target)`` gives the loss (``target`` is ``None`` when the output is the loss)."""

    inputs: tuple[Any, ...]
    target: Any
    kwargs: dict[str, Any] | None = None


def as_batch(batch: Any) -> Batch:
    """Normalise a batch to a :class:`Batch` ``(inputs tuple, target, kwargs)``.

    Accepted:

    * ``(inputs, target)``: ``inputs`` a tensor or a tuple/list of positional model
      inputs, or a mapping of keyword inputs (``model(**inputs)``: ``input_ids``,
      ``attention_mask``, ``labels`` of a transformers model), ``target`` anything the
      loss function takes (``None`` when the model output is the loss itself, or
      carries it as ``.loss``);
    * ``(inputs, target, kwargs)``: the same, plus a mapping of keyword arguments the
      model is called with as in training (``attention_mask=...``); ``inputs`` may then
      be ``()``;
    * a mapping: keyword inputs only, ``model(**batch)``, target ``None`` (a
      ``transformers`` batch with ``labels``: with ``loss_fn=None`` the loss is the
      output's ``.loss``).
    """
    if isinstance(batch, Batch):
        return batch
    if isinstance(batch, Mapping):
        return Batch((), None, _kwargs(batch))
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise TypeError(
            "a teleport batch must be a pair (inputs, target), a triple (inputs, target, kwargs) or a mapping of "
            "keyword inputs: inputs a tensor or a tuple of model inputs, target what loss_fn(output, target) takes; "
            f"got {type(batch).__name__}"
        )
    inputs, target = batch[0], batch[1]
    if isinstance(inputs, Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    elif isinstance(inputs, Mapping):  # keyword inputs: (model(**inputs), target)
        if len(batch) == 3 and batch[2]:
            raise TypeError("a batch with keyword inputs takes no separate kwargs: put them in the inputs mapping")
        return Batch((), target, _kwargs(inputs))
    elif not isinstance(inputs, tuple):
        raise TypeError(f"batch inputs must be a tensor, a tuple of tensors or a mapping of keyword inputs, got {type(inputs).__name__}")
    return Batch(inputs, target, _kwargs(batch[2]) if len(batch) == 3 else None)


def _leaves(value: Any, depth: int = 0) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v, depth + 1)
    elif depth < 4 and isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v, depth + 1)


def has_rows(inputs: Any, kwargs: Mapping[str, Any] | None = None) -> bool:
    """Whether no tensor (of one dimension or more) among ``inputs`` and ``kwargs`` has first size 0."""
    return all(t.ndim == 0 or t.shape[0] > 0 for t in _leaves((inputs, dict(kwargs or {}))))


def check_has_rows(inputs: Any, kwargs: Mapping[str, Any] | None, name: str) -> None:
    """``ValueError`` naming ``name`` unless :func:`has_rows`.

    A forward on a zero-row batch returns empty outputs, so an invariance check on it
    compares nothing and passes whatever the parameters became: it must not be run.
    """
    if not has_rows(inputs, kwargs):
        raise ValueError(
            f"{name} has a tensor with no rows (first dimension 0): the outputs on it are empty, so no symmetry "
            "or teleport could be checked on it; give at least one row"
        )


def _kwargs(kwargs: Any) -> dict[str, Any] | None:
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"batch keyword arguments must be a mapping with string keys, got {type(kwargs).__name__}")
    return dict(kwargs) or None


def batch_parts(batch: Any) -> tuple[tuple[Any, ...], Any, dict[str, Any]]:
    """``(inputs, target, kwargs)`` of a :class:`Batch` or a plain ``(inputs tuple, target)`` pair."""
    if isinstance(batch, Batch):
        return batch.inputs, batch.target, dict(batch.kwargs or {})
    inputs, target = batch
    return tuple(inputs), target, {}


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

    def output(self, tensors: Mapping[str, Tensor], batch: Batch | tuple[tuple[Any, ...], Any]) -> Any:
        """The model output at ``tensors`` on ``batch`` (a :class:`Batch` or an ``(inputs, target)`` pair)."""
        inputs, _, kwargs = batch_parts(batch)
        merged = {**self.buffers, **tensors}
        with torch.random.fork_rng(devices=self._cuda):
            torch.set_rng_state(self._rng)
            for index, state in zip(self._cuda, self._cuda_rng):
                torch.cuda.set_rng_state(state, index)
            return functional_call(self.module, merged, inputs, kwargs or None, strict=False, tie_weights=True)

    def loss(self, tensors: Mapping[str, Tensor], batch: Batch | tuple[tuple[Any, ...], Any]) -> Tensor:
        """The scalar loss at ``tensors`` (names missing from it take the live values)."""
        return self.loss_of(self.output(tensors, batch), batch_parts(batch)[1])

    def loss_of(self, out: Any, target: Any) -> Tensor:
        """The scalar loss of a model output ``out`` (``loss_fn(out, target)``, or ``out`` / ``out.loss``)."""
        if self.loss_fn is None and not isinstance(out, Tensor) and isinstance(getattr(out, "loss", None), Tensor):
            out = out.loss
        loss = out if self.loss_fn is None else self.loss_fn(out, target)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError("the teleport loss must be a scalar tensor: pass loss_fn(output, target) to Teleport")
        return loss.reshape(())

    def module_input(self, tensors: Mapping[str, Tensor], batch: Batch | tuple[tuple[Any, ...], Any], module_name: str) -> Tensor:
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

    This is the ``data`` a data-dependent or bound site reads (Zhao et al. 2024b, Prop. 4.1:
    S = h(theta_1, X)).  The forward pass runs functionally on copies of the
    buffers (BatchNorm running statistics are not updated) and stops at the module.
    """
    return FunctionalModel(model, None).module_input({}, (tuple(inputs), None), module_name)
