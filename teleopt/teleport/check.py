"""Every teleport is checked: the model's outputs before and after it, compared (DESIGN.md, issue 13).

A teleport moves the parameters along a group orbit; an exact site leaves what the
model computes unchanged.  Whether it did is measured, never assumed, on one of

* ``"batch"``: the teleport batch (``teleport(batch=...)`` or ``batch_fn``), with the
  model in its current train/eval modes;
* ``"closure"``: the outputs of the model during the closure (``teleport(closure)``),
  which runs once before and once after the teleport;
* ``"probe"``: *probe inputs* when there is neither: the ``example_inputs`` (and
  ``example_kwargs``) given to ``Teleport``, or else the positional and keyword
  inputs of the model's last forward, recorded by a forward pre-hook
  (:class:`ProbeRecorder`: detached copies of the first :data:`PROBE_ROWS` rows of
  every tensor when they share their first dimension, else detached references to
  the inputs, which then stay alive until the next forward).  The probe check runs
  in eval mode (every module's mode is restored afterwards).

With none of them a teleport is declined.  The forwards before and after run under
a forked RNG with the same seed (CPU and the CUDA devices of the model), so Dropout
and DropPath draw the same masks in train mode and the training RNG stream is left
as it was; buffers are restored afterwards (BatchNorm statistics are left as they
were, a reassigned buffer is put back).  All tensor
leaves of the output are compared norm-relatively
(:func:`teleopt.detection.certify.output_error`; for the softmax translation their
log-softmax), against ``SafetyConfig.loss_tol`` or
:func:`teleopt.numerics.default_rtol` of the output dtype (1e-10 float64, 1e-5
float32, 1e-2 below).  A check above the tolerance but within 100 times it, in a
dtype below float64, on data-independent sites, is *inconclusive* (rounding of a
large element, or a real violation): it is re-run on a float64 copy of the model
(the pre-teleport values, the same elements, the same inputs) and decided there
against the float64 tolerance.
"""

from __future__ import annotations

import copy
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.detection.certify import log_softmax_leaves, output_error, output_leaves, to_float64
from teleopt.functional import Batch, batch_parts, has_rows
from teleopt.numerics import default_rtol
from teleopt.site import Site
from teleopt.teleport.pausable import Pausable
from teleopt.teleport.precision import Precision
from teleopt.teleport.transport import transport

__all__ = [
    "PROBE_ROWS",
    "first_rows",
    "INCONCLUSIVE_FACTOR",
    "ROUNDOFF_FACTOR",
    "ProbeRecorder",
    "KeywordCheck",
    "OutputCapture",
    "OutputCheck",
    "seeded",
    "modes",
    "forward",
    "float64_rerun",
]

#: Rows of the last forward's inputs a :class:`ProbeRecorder` keeps (copies).
PROBE_ROWS = 8
#: A check within this factor of its tolerance, below float64, is re-run in float64.
INCONCLUSIVE_FACTOR = 100.0
#: Keywords that choose what a model returns, not what it computes (transformers' ``labels`` adds the loss):
#: a training forward may pass them without ``example_kwargs``.
OUTPUT_KEYWORDS = frozenset({"labels", "return_dict", "output_attentions", "output_hidden_states", "use_cache"})
#: A training-precision (autocast) forward may move by this multiple of its round-off of the untouched model.
ROUNDOFF_FACTOR = 2.0
#: Elements of one output leaf a closure check keeps (of its first PROBE_ROWS rows).
_CLOSURE_LEAF_ELEMENTS = 1 << 20


def _tensors(value: Any, depth: int = 0) -> Iterator[Tensor]:
    if depth > 4:
        return
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v, depth + 1)


def _map(value: Any, fn: Callable[[Tensor], Tensor], depth: int = 0) -> Any:
    if depth > 4:
        return value
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        items = [_map(v, fn, depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_map(v, fn, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, fn, depth + 1) for k, v in value.items()}
    return value


def probe_slice(args: tuple[Any, ...], kwargs: Mapping[str, Any], rows: int = PROBE_ROWS) -> Batch:
    """A probe :class:`Batch` from one forward's inputs (see module docs).

    When every tensor with a dimension shares its first size B > ``rows``, each is cut to
    its first ``rows`` rows and copied; otherwise every tensor is kept as a detached
    reference (B <= ``rows``: copied, it is small).
    """
    tensors = [t for t in _tensors((args, kwargs)) if t.ndim >= 1]
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) == 1 and next(iter(sizes)) > rows:

        def cut(t: Tensor) -> Tensor:
            return t.detach()[:rows].clone() if t.ndim >= 1 else t.detach().clone()
    elif sizes and max(sizes) <= rows:

        def cut(t: Tensor) -> Tensor:
            return t.detach().clone()
    else:

        def cut(t: Tensor) -> Tensor:
            return t.detach()

    return Batch(tuple(_map(tuple(args), cut)), None, _map(dict(kwargs), cut) or None)


def first_rows(batch: Batch, rows: int = PROBE_ROWS) -> Batch:
    """The first ``rows`` rows of ``batch`` (views: inputs, target and keyword tensors) when every tensor of
    it with a dimension shares its first size B > ``rows``; else ``batch`` itself (the check of a batch with
    unequal first sizes runs on all of it)."""
    tensors = [t for t in _tensors((batch.inputs, batch.target, batch.kwargs or {})) if t.ndim >= 1]
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) <= rows:
        return batch

    def cut(t: Tensor) -> Tensor:
        return t[:rows] if t.ndim >= 1 else t

    return Batch(tuple(_map(tuple(batch.inputs), cut)), _map(batch.target, cut), _map(dict(batch.kwargs), cut) if batch.kwargs else None)


class ProbeRecorder(Pausable):
    """Forward pre-hook (``with_kwargs=True``) keeping the inputs of the model's last forward.

    ``Teleport`` registers one on its model; ``batch`` is then a :class:`Batch` of at most
    :data:`PROBE_ROWS` rows (see :func:`probe_slice`).  Forwards made while ``paused``
    (the teleport's own) are not recorded.
    """

    def __init__(self) -> None:
        self.batch: Batch | None = None
        self.paused = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.paused and has_rows(args, kwargs):  # a zero-row forward would make the probe check vacuous
            self.batch = probe_slice(args, kwargs)


class KeywordCheck:
    """Warns when the training forward's arguments differ from ``example_inputs``/``example_kwargs``.

    Detection and the probe check run the model on ``example_inputs``/``example_kwargs``; an
    argument the training loop passes and they do not (``model(x, scale=s)``) can change what the
    model computes, and neither would see it.  A one-shot forward pre-hook (``with_kwargs=True``)
    records which arguments of ``forward`` the next forward supplies (bound to its signature, so an
    input given by position or by keyword counts the same; a ``**kwargs`` catch-all by its keys),
    then removes itself (:meth:`arm` re-registers it), so the training loop keeps torch's fast call
    path.  Forwards while ``probe`` is paused (the teleport's own) are not recorded.
    """

    def __init__(self, target: nn.Module, example: Batch, probe: ProbeRecorder) -> None:
        self._target, self._probe = target, probe
        self.expected = self._supplied(example.inputs, example.kwargs or {})
        self.seen: frozenset[str] | None = None
        self._handle: Any = None
        self._warned: set[frozenset[str]] = set()

    def _supplied(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> frozenset[str]:
        """The names of the arguments a call supplies (its keyword names where the signature does not bind)."""
        try:
            bound = inspect.signature(self._target.forward).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return frozenset(kwargs)
        names: set[str] = set()
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                names.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                names.add(name)
        return frozenset(names)

    def arm(self) -> None:
        """Record the arguments of the next (unpaused) forward."""
        if self._handle is None:
            self._handle = self._target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._probe.paused and self._handle is not None:
            self._handle.remove()
            self._handle = None
            self.seen = self._supplied(args, kwargs)

    def warn_if_different(self, stacklevel: int = 2) -> None:
        """One ``UserWarning`` per distinct set of arguments that differs from ``expected`` (ignoring
        :data:`OUTPUT_KEYWORDS`); then record the next forward's."""
        self.arm()
        seen = self.seen
        if seen is None or seen - OUTPUT_KEYWORDS == self.expected - OUTPUT_KEYWORDS or seen in self._warned:
            return
        self._warned.add(seen)
        extra, missing = sorted(seen - self.expected - OUTPUT_KEYWORDS), sorted(self.expected - seen - OUTPUT_KEYWORDS)
        what = f"passes argument(s) {extra} that example_inputs/example_kwargs do not give" if extra else ""
        what += (" and " if extra and missing else "") + (f"omits argument(s) {missing} they give" if missing else "")
        warnings.warn(
            f"Teleport: the model's training forward {what}; sites='auto' detection and the teleport's check ran "
            "on example_inputs/example_kwargs, so they do not see what these arguments change. Pass the forward's "
            "keyword arguments as Teleport(..., example_kwargs={...}) (or teleport batches with them through batch_fn)",
            UserWarning,
            stacklevel=stacklevel + 1,
        )


def _bounded(leaf: Tensor) -> Tensor:
    """The first PROBE_ROWS rows of an output leaf, at most _CLOSURE_LEAF_ELEMENTS elements, copied."""
    t = leaf.detach()
    if t.ndim >= 1:
        t = t[:PROBE_ROWS]
    if t.numel() > _CLOSURE_LEAF_ELEMENTS:
        t = t.reshape(-1)[:_CLOSURE_LEAF_ELEMENTS]
    return t.clone()


class OutputCapture:
    """Forward hook recording the (bounded) output leaves of every forward of a module while active."""

    def __init__(self) -> None:
        self.leaves: list[Tensor] = []

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.leaves.extend(_bounded(t) for t in output_leaves(output))

    @contextmanager
    def on(self, module: nn.Module) -> Iterator[OutputCapture]:
        """Record the forwards of ``module`` inside."""
        handle = module.register_forward_hook(self)
        try:
            yield self
        finally:
            handle.remove()


@contextmanager
def seeded(module: nn.Module, seed: int) -> Iterator[None]:
    """Run inside with the RNG forked (CPU and the model's CUDA devices) and seeded by ``seed``."""
    places = {t.device for t in module.parameters()}
    devices = sorted({int(d.index or 0) for d in places if d.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        # the forked generators alone, each seeded directly: ``torch.manual_seed`` also queues a lazy seeding of
        # every device type not yet initialised, which records a Python stack trace (slow, every check), and would
        # seed generators that fork_rng does not restore
        if any(d.type not in ("cpu", "cuda") for d in places):
            torch.manual_seed(seed)  # another accelerator's generator (not forked, as before)
        else:
            torch.default_generator.manual_seed(seed)
            for index in devices:
                torch.cuda.default_generators[index].manual_seed(seed)
        yield


@contextmanager
def modes(module: nn.Module, train: bool | None) -> Iterator[None]:
    """Run inside with every submodule in train (``True``) or eval (``False``) mode, each
    module's own flag restored afterwards; ``None`` leaves the modes as they are."""
    if train is None:
        yield
        return
    flags = [(m, m.training) for m in module.modules()]
    module.train(train)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@torch.no_grad()
def forward(module: nn.Module, batch: Batch, train: bool | None, seed: int) -> Any:
    """The model output on ``batch`` at the live parameters, buffers restored afterwards, RNG seeded."""
    inputs, _, kwargs = batch_parts(batch)
    with modes(module, train), seeded(module, seed), buffers_restored(module):
        return module(*inputs, **kwargs)


def _output_dtype(leaves: Sequence[Tensor]) -> torch.dtype:
    """The least precise floating dtype among ``leaves`` (float64 when there is none)."""
    return max((t.dtype for t in leaves if t.is_floating_point()), key=lambda d: torch.finfo(d).eps, default=torch.float64)


@dataclass
class OutputCheck:
    """One teleport's check (see module docs): what it runs on and the outputs before.

    ``kind`` is ``"batch"``, ``"closure"`` or ``"probe"``; ``batch`` the inputs the
    forwards run on (``None`` for a closure); ``train`` the mode they run in (``None``:
    as the model is); ``seed`` the RNG seed of both forwards; ``translation`` whether to
    compare log-softmaxes; ``source`` says where the inputs came from.

    When the model trains under autocast (``precision``), each forward runs twice: in full
    precision (autocast off), compared as above, and in the training precision (autocast's weight
    cache off), whose outputs after the teleport may differ from those before by at most
    :data:`ROUNDOFF_FACTOR` times ``roundoff``, that precision's own error on the untouched model (its
    outputs against the full-precision ones before the teleport).
    """

    kind: str
    batch: Batch | None
    train: bool | None
    seed: int
    translation: bool = False
    source: str = ""
    before: list[Tensor] = field(default_factory=list)
    precision: Precision = field(default_factory=Precision)
    trained_before: list[Tensor] = field(default_factory=list)
    trained_after: list[Tensor] = field(default_factory=list)

    @classmethod
    def of_sites(cls, kind: str, batch: Batch | None, train: bool | None, seed: int, sites: Sequence[Site], source: str) -> OutputCheck:
        translation = any(s.action.name == "softmax_translation" for s in sites)
        return cls(kind, batch, train, seed, translation, source)

    def run(self, module: nn.Module) -> Any:
        """Forward on the check's inputs (``batch`` or ``probe`` kinds)."""
        assert self.batch is not None, "a closure check has no inputs of its own"
        if self.precision.autocast:  # the training forward (recorded), then the full-precision one (returned)
            with self.precision.forward():
                self.trained_after = output_leaves(forward(module, self.batch, self.train, self.seed))
        with Precision().forward():
            return forward(module, self.batch, self.train, self.seed)

    def reference(self, module: nn.Module) -> Any:
        """Record the outputs before the teleport; returns the model output."""
        out = self.run(module)
        self.before = output_leaves(out)
        self.trained_before, self.trained_after = self.trained_after, []
        return out

    def trained_error(self) -> tuple[float, float] | None:
        """In the training precision (autocast): the relative output change and its tolerance,
        :data:`ROUNDOFF_FACTOR` times that precision's round-off of the untouched model, at least the
        full-precision tolerance (``None``: no autocast, or no outputs to compare)."""
        if not self.trained_before or not self.trained_after:
            return None
        roundoff = output_error([self.trained_before], [self.before])
        tol = max(ROUNDOFF_FACTOR * roundoff, default_rtol(self.output_dtype()))
        return output_error([self.trained_after], [self.trained_before]), tol

    def error(self, after: list[Tensor]) -> float:
        """The relative output change (see module docs)."""
        if not self.before and not after:
            return math.nan
        a, b = [after], [self.before]
        if self.translation:
            a, b = [log_softmax_leaves(after)], [log_softmax_leaves(self.before)]
        return output_error(a, b)

    def tolerance(self, loss_tol: float | None) -> float:
        """``loss_tol`` if set, else the default tolerance of the output dtype."""
        return loss_tol if loss_tol is not None else default_rtol(self.output_dtype())

    def describe(self) -> str:
        mode = {True: "train mode", False: "eval mode", None: "the model's modes"}[self.train]
        where = {"batch": "the teleport batch", "closure": "the closure's forwards", "probe": f"probe inputs ({self.source})"}
        return f"outputs on {where.get(self.kind, self.kind)}, {mode}, forked RNG"

    def output_dtype(self) -> torch.dtype:
        """The least precise floating dtype of the outputs before."""
        return _output_dtype(self.before)


@torch.no_grad()
def float64_rerun(
    module: nn.Module,
    saved: Mapping[str, Tensor],
    sites: Sequence[Site],
    elements: Sequence[Tensor],
    check: OutputCheck,
) -> float:
    """The check re-run on a float64 copy of ``module``: at the pre-teleport values ``saved``
    (every site member), then after the same ``elements``; the relative output change."""
    assert check.batch is not None
    copy64 = copy.deepcopy(module).to(torch.float64)
    live = copy64.state_dict(keep_vars=True)
    for n, v in saved.items():
        if n in live:
            live[n].copy_(v.to(torch.float64))
    inputs, target, kwargs = batch_parts(check.batch)
    batch64 = Batch(tuple(to_float64(inputs)), target, to_float64(kwargs) or None)
    check64 = OutputCheck(check.kind, batch64, check.train, check.seed, check.translation, check.source)
    check64.reference(copy64)
    names = {n for s in sites for n in s.tensor_names}
    tensors = {n: live[n] for n in names}
    moved, _ = transport(list(sites), [e.to(torch.float64) for e in elements], tensors, tensors, "params")
    for n in names:
        live[n].copy_(moved[n])
    return check64.error(output_leaves(check64.run(copy64)))


@contextmanager
def buffers_restored(module: nn.Module) -> Iterator[None]:
    """Run inside with copies of the module's buffers in their place, then put the buffers back (check
    forwards, extra closure passes), as ``torch.func.functional_call`` does: what a forward writes (BatchNorm
    statistics) or reassigns (a cache rebuilt for a longer input) goes to the copies, an output that is a
    buffer stays what the forward made it, and a buffer that cannot be written (an inference tensor, an
    expanded view) is never written.  A tensor registered in several modules gets one copy."""
    saved = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if b is not None]
    copies: dict[int, Tensor] = {}
    for owner, name, b in saved:
        if id(b) not in copies:
            copies[id(b)] = b.detach().clone()
        owner._buffers[name] = copies[id(b)]
    try:
        yield
    finally:
        for owner, name, b in saved:
            owner._buffers[name] = b
