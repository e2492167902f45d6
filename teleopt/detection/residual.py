"""The residual stream's rotation: detection of SliceGPT's computational invariance, and gain folding.

Ashkboos et al. 2024a (SliceGPT), Theorem 1: in a pre-RMSNorm transformer an orthogonal
Q acting on the stream (embeddings and writers' rows by Q, readers' columns by Q^T)
leaves the function unchanged (:mod:`teleopt.actions.residual`).  transformers' roots
cannot be traced by torch.fx, so the stream is followed through a *dynamic* trace: the
model runs once (a float64 copy, train mode) under a ``TorchFunctionMode`` that records
every torch call made outside leaf modules, and leaf modules (no children) are recorded
as one call each.  From the output of each ``nn.Embedding`` on, a tensor is *on the
stream* when it is rotated with it, and every call that reads one is classified:

* an ``nn.Linear`` reads the stream (its weight's columns by Q^T);
* an addition of a stream tensor and another: the other is written into the stream; it
  is traced back (through additions and calls that commute with Q) to the ``nn.Linear``
  rows and biases, embedding tables or parameters that wrote it;
* any other call is run again on the float64 copy with its stream inputs rotated by a
  random Q (same RNG draws): an output that rotates with them stays on the stream
  (RMSNorm with unit gain, dtype casts, slicing of other axes, dropout with p = 0), an
  output that does not change leaves it (shapes, rotary tables), anything else fails
  closed with the measured error (LayerNorm's mean subtraction, dropout masks in train
  mode, a rotary embedding applied to the stream, a view that splits its axis);
* a stream tensor among the model's outputs (a bare ``LlamaModel``) fails closed.

A leaf module that commutes with Q only once its ``weight`` is all ones is a norm with a
gain.  The rotation is exact for every value of the other parameters only if each such
gain is fixed at one: absent, or a frozen parameter of ones (certification perturbs
trainable ones, so a site that holds only at initialisation is never reported).
Otherwise the stream is left out with the reason; :func:`fold_norm_gains` makes a model
eligible by the function-preserving step SliceGPT starts from: W diag(w) into every
reader, then w = 1, frozen.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from teleopt.actions.axis import Member
from teleopt.actions.residual import residual_rotation
from teleopt.detection.certify import to_float64
from teleopt.detection.float64 import keep_float64
from teleopt.site import Site

__all__ = ["ResidualStream", "find_residual_sites", "fold_norm_gains"]

#: attribute reads and queries of a tensor that cannot depend on its values
_QUERIES = frozenset(
    {"shape", "dtype", "device", "size", "dim", "ndim", "ndimension", "numel", "is_floating_point", "requires_grad", "is_cuda"}
    | {"layout", "is_contiguous", "stride", "element_size", "get_device", "is_sparse", "is_nested", "__len__", "data_ptr"}
)
_ADDS = frozenset({"add", "__add__", "__radd__", "sub", "__sub__", "__rsub__"})
#: calls through which a norm's output keeps its gain as a column scaling (folding looks through them)
_PLAIN = frozenset({"to", "float", "type_as", "contiguous", "clone", "__getitem__"})
_RTOL = 1e-9  # float64 copies: the checks of rotated calls are exact to round-off (about 1e-15)


@dataclass
class ResidualStream:
    """What :func:`find_residual_sites` found: the site (none or one), and why a stream was left out."""

    sites: list[Site] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass
class _Call:
    """One recorded call: a leaf module (``module`` its name) or a torch function, with its tensors."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    name: str
    outputs: list[Tensor]
    module: str | None = None


def _tensors(value: Any) -> list[Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, Tensor)]


class _Recorder(TorchFunctionMode):
    """Records torch calls outside leaf modules, and leaf modules as one call each (see module docs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.depth = 0
        self.handles = []
        for name, m in model.named_modules():
            if name and not any(True for _ in m.children()):
                self.handles.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._leave(name), with_kwargs=True))

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.depth += 1

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            self.depth -= 1
            if self.depth == 0 and _tensors((args, kwargs)):
                self.calls.append(_Call(module, args, dict(kwargs), type(module).__name__, _tensors(out), name))

        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0 and _tensors((args, kwargs)):
            name = getattr(func, "__name__", None) or getattr(getattr(func, "__self__", None), "__name__", None) or repr(func)
            self.calls.append(_Call(func, args, kwargs, str(name), _tensors(out)))
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class _Analysis:
    """The stream through one recorded forward (see module docs): members, assumed gains, failures."""

    def __init__(self, model: nn.Module, calls: list[_Call], outputs: list[Tensor], include_frozen: bool) -> None:
        self.model, self.calls, self.include_frozen = model, calls, include_frozen
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.producer = {id(t): c for c in calls for t in c.outputs}
        self.stream: set[int] = set()
        self.scaled: dict[int, str] = {}  # stream tensors carrying a gain: id -> the norm module's name
        self.members: dict[tuple[str, int], Member] = {}
        self.gains: dict[str, str] = {}  # norm module -> its weight's name
        self.folds: dict[str, set[str]] = {}  # norm module -> the reader weights its gain folds into
        self.unfoldable: dict[str, str] = {}
        self.failures: list[str] = []
        self.d = 0
        self.outputs = outputs
        self.R: Tensor | None = None
        self._gen = torch.Generator().manual_seed(0)

    # -- the rotation --------------------------------------------------------------------
    def rotate(self, t: Tensor) -> Tensor:
        assert self.R is not None
        return t @ self.R.mT.to(t.dtype)

    def _rerun(self, call: _Call, swap: Mapping[int, Tensor]) -> Any:
        args, kwargs = tree_map(lambda v: swap.get(id(v), v) if isinstance(v, Tensor) else v, (call.args, call.kwargs))
        with torch.random.fork_rng(devices=[]), torch.no_grad(), keep_float64():
            torch.manual_seed(0)
            return call.fn(*args, **kwargs)

    def classify(self, call: _Call) -> list[str] | str:
        """Per output: "stream" (rotates with the inputs) or "free" (unchanged); or why neither."""
        ins = [t for t in _tensors((call.args, call.kwargs)) if id(t) in self.stream]
        try:
            before = self._rerun(call, {})
            after = self._rerun(call, {id(t): self.rotate(t) for t in ins})
        except Exception as e:  # noqa: BLE001 - a call that cannot run on rotated inputs is not equivariant
            return f"it does not run on a rotated stream ({type(e).__name__})"
        b, a = _tensors(before), _tensors(after)
        if not b and not a:
            return ["free"] if call.name in _QUERIES or _same(before, after) else "its result depends on the stream's values"
        if len(a) != len(b):
            return "its outputs change"
        kinds: list[str] = []
        for x, y in zip(b, a):
            if x.shape == y.shape and _close(y, x):
                kinds.append("free")
            elif x.is_floating_point() and x.ndim and x.shape[-1] == self.d and x.shape == y.shape and _close(y, self.rotate(x)):
                kinds.append("stream")
            else:
                err = _error(y, self.rotate(x)) if x.shape == y.shape and x.is_floating_point() and x.shape[-1] == self.d else math.inf
                return f"neither rotates with the stream nor ignores it (relative error {err:.1e})"
        return kinds

    # -- the walk ------------------------------------------------------------------------
    def run(self) -> None:
        for call in self.calls:
            if call.module is not None and isinstance(call.fn, nn.Embedding):
                self._seed(call)
                continue
            ins = [t for t in _tensors((call.args, call.kwargs)) if id(t) in self.stream]
            if not ins:
                continue
            if call.name.endswith("_") and not call.name.endswith("__") or call.name.startswith("__i"):
                self.failures.append(f"{call.name} changes a stream tensor in place")
            elif call.module is not None and _is_linear(call.fn):
                self._read(call, ins)
            elif call.name in _ADDS and len(_tensors((call.args, call.kwargs))) == 2:
                self._add(call)
            else:
                self._other(call)
        for t in self.outputs:
            if id(t) in self.stream:
                self.failures.append("the stream is an output of the model (a rotation would rotate it)")
                break

    def _seed(self, call: _Call) -> None:
        emb = call.fn
        assert isinstance(emb, nn.Embedding)
        if not self.d:
            self.d = emb.embedding_dim
            self.R = _random_orthogonal(self.d, self._gen)
        if emb.embedding_dim != self.d:
            self.failures.append(f"embedding {call.module} has width {emb.embedding_dim}, the stream {self.d}")
            return
        self._member(emb.weight, 1, 1)
        self.stream.update(id(t) for t in call.outputs)

    def _member(self, p: Tensor, axis: int, power: int) -> None:
        name = self.names.get(id(p))
        if name is None:
            self.failures.append("a tensor that is not a parameter of the model reads or writes the stream")
            return
        if not p.requires_grad and not self.include_frozen:
            self.failures.append(f"{name} is frozen (requires_grad=False): the rotation cannot move it")
        if p.shape[axis] != self.d:
            self.failures.append(f"{name} meets the stream on an axis of length {p.shape[axis]}, not {self.d}")
        key = (name, axis % p.ndim)
        if key not in self.members:
            other = any(n == name for n, _ in self.members)
            self.members[key] = Member(f"{name}@{axis % p.ndim}" if other else name, axis % p.ndim, power, tensor=name if other else None)

    def _read(self, call: _Call, ins: list[Tensor]) -> None:
        lin = call.fn
        assert isinstance(lin, nn.Linear)
        self._member(lin.weight, 1, -1)
        for t in ins:
            norm = self.scaled.get(id(t))
            if norm is not None:
                self.folds.setdefault(norm, set()).add(self.names.get(id(lin.weight), "?"))

    def _add(self, call: _Call) -> None:
        for t in _tensors((call.args, call.kwargs)):
            if id(t) not in self.stream:
                self._written(t, 0)
            elif id(t) in self.scaled:
                self.unfoldable[self.scaled[id(t)]] = "its output is added to the stream"
        self.stream.update(id(t) for t in call.outputs)

    def _written(self, t: Tensor, depth: int) -> None:
        """Trace a tensor added to the stream back to the tensors that wrote it."""
        if id(t) in self.names:
            self._member(t, -1, 1)
            return
        call = self.producer.get(id(t))
        if call is None or depth > 16:
            self.failures.append("a tensor from outside the model (an input or a constant) is added to the stream")
        elif call.module is not None and _is_linear(call.fn):
            lin = call.fn
            assert isinstance(lin, nn.Linear)
            self._member(lin.weight, 0, 1)
            if lin.bias is not None:
                self._member(lin.bias, 0, 1)
        elif call.module is not None and isinstance(call.fn, nn.Embedding):
            self._member(call.fn.weight, 1, 1)
        elif call.name in _ADDS:
            for u in _tensors((call.args, call.kwargs)):
                self._written(u, depth + 1)
        else:
            self._written_through(call, depth)

    def _written_through(self, call: _Call, depth: int) -> None:
        ins = _tensors((call.args, call.kwargs))
        inner = [u for u in ins if u.is_floating_point() and u.ndim and u.shape[-1] == self.d and id(u) not in self.names]
        if len(inner) != 1:
            self.failures.append(f"{call.name} ({call.module or 'a function'}) writes into the stream: no writer rule")
            return
        self.stream.add(id(inner[0]))  # classify it as if it were on the stream
        kinds = self.classify(call)
        self.stream.discard(id(inner[0]))
        if kinds != ["stream"] * len(call.outputs):
            self.failures.append(f"{call.name} ({call.module or 'a function'}) writes into the stream and does not commute with a rotation")
            return
        self._written(inner[0], depth + 1)

    def _other(self, call: _Call) -> None:
        kinds = self.classify(call)
        owns = call.module is not None and isinstance(call.fn, nn.Module) and any(True for _ in call.fn.parameters(recurse=False))
        gain = self._gain(call) if owns and (isinstance(kinds, str) or "stream" in kinds) else None
        if gain is not None:
            kinds = ["stream"] * len(call.outputs)
            self.gains[str(call.module)] = gain
            self.scaled.update((id(t), str(call.module)) for t in call.outputs)
        elif owns and not isinstance(kinds, str) and "stream" in kinds:
            kinds = "it commutes with the rotation only at the current values of its parameters"
        if isinstance(kinds, str):
            where = f"{call.name} ({call.module})" if call.module else f"torch function {call.name}"
            hint = (
                "; it subtracts the mean (LayerNorm): only rotations fixing the all-ones vector commute with it" if _centres(call) else ""
            )
            self.failures.append(f"{where} reads the stream: {kinds}{hint}")
            return
        for t, kind in zip(call.outputs, kinds):
            if kind == "stream":
                self.stream.add(id(t))
        ins = [t for t in _tensors((call.args, call.kwargs)) if id(t) in self.scaled]
        for t in ins:
            if call.name in _PLAIN and call.module is None:
                self.scaled.update((id(o), self.scaled[id(t)]) for o in call.outputs)
            elif call.outputs:
                self.unfoldable[self.scaled[id(t)]] = f"its output feeds {call.name}"

    def _gain(self, call: _Call) -> str | None:
        """The weight's name if the leaf module commutes with a rotation once its weight is all ones."""
        module = call.fn
        assert isinstance(module, nn.Module)
        w = module._parameters.get("weight")
        if w is None or tuple(w.shape) != (self.d,) or len(list(module.parameters(recurse=False))) != 1:
            return None
        saved = w.detach().clone()
        with torch.no_grad():
            w.fill_(1.0)
        try:
            ok = self.classify(call) == ["stream"] * len(call.outputs)
        finally:
            with torch.no_grad():
                w.copy_(saved)
        return self.names.get(id(w)) if ok else None

    # -- the verdict -----------------------------------------------------------------------
    def gain_problems(self) -> list[str]:
        problems = []
        for weight in self.gains.values():
            w = self.model.get_parameter(weight)
            if w.requires_grad or self.include_frozen:
                problems.append(f"the gain {weight} is trainable: the rotation holds only while it is all ones")
            elif not bool((w == 1).all()):
                problems.append(f"the gain {weight} is not all ones: diag(w) Q != Q diag(w)")
        return problems


def _is_linear(module: Any) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _centres(call: _Call) -> bool:
    return call.module is not None and ("LayerNorm" in call.name or isinstance(call.fn, nn.LayerNorm))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _error(a: Tensor, b: Tensor) -> float:
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    scale = float(b64.norm())
    diff = float((a64 - b64).norm())
    return diff / scale if scale > 0 else diff


def _close(a: Tensor, b: Tensor) -> bool:
    if not b.is_floating_point():
        return torch.equal(a, b)
    return _error(a, b) <= _RTOL


def _random_orthogonal(d: int, gen: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def _leaves(value: Any, depth: int = 0) -> list[Tensor]:
    """The tensors of a model output, themselves (not detached: the stream is recognised by identity)."""
    if isinstance(value, Tensor):
        return [value]
    if depth > 8:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _leaves(v, depth + 1)]


def _trace(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any], include_frozen: bool) -> _Analysis:
    """Record one train-mode forward of a float64 copy of ``model`` and follow the stream through it."""
    twin = copy.deepcopy(model).to(torch.float64)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.requires_grad_(p.requires_grad)
    twin.train()
    recorder = _Recorder(twin)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), keep_float64(), recorder:
            torch.manual_seed(0)
            out = twin(*to_float64(tuple(inputs)), **to_float64(dict(kwargs)))
    finally:
        recorder.close()
    analysis = _Analysis(twin, recorder.calls, _leaves(out), include_frozen)
    analysis.run()
    return analysis


def find_residual_sites(
    model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *, include_frozen: bool = False
) -> ResidualStream:
    """The residual-stream rotation site of ``model`` (Ashkboos et al. 2024a, Theorem 1), or why there is none.

    ``inputs``/``kwargs`` are the example call (as for ``find_symmetries``).  The site is an
    ``AxisAction`` on O(d_model) whose ``info["assumes"]`` lists the norm gains fixed at one.
    Models without an ``nn.Embedding`` have no stream to rotate and report nothing.
    """
    if not any(isinstance(m, nn.Embedding) for m in model.modules()):
        return ResidualStream()  # no stream starts inside the model (a stream from the input is fixed)
    try:
        a = _trace(model, inputs, dict(kwargs or {}), include_frozen)
    except Exception as e:  # noqa: BLE001 - detection fails closed and says why
        return ResidualStream([], [("site", "residual stream", f"the forward could not be recorded ({type(e).__name__}: {e})")])
    if not a.d:
        return ResidualStream()
    failures = a.failures + a.gain_problems()
    if failures:
        hint = " (teleopt.detection.residual.fold_norm_gains folds trainable gains)" if a.gains and not a.failures else ""
        more = f" (and {len(failures) - 2} more)" if len(failures) > 2 else ""
        why = "; ".join(dict.fromkeys(failures[:2]))
        return ResidualStream([], [("site", "residual stream", f"no rotation of the residual stream: {why}{more}{hint}")])
    members = tuple(a.members.values())
    readers = sum(1 for m in members if m.power < 0)
    if not readers:
        return ResidualStream()
    info = {
        "module": next(iter(a.members))[0].rsplit(".", 1)[0],
        "width": a.d,
        "assumes": sorted(a.gains.values()),
        "assumption": "every norm on the stream has no gain or a frozen gain of ones (RMSNorm(Qx) = Q RMSNorm(x))",
    }
    site = Site(residual_rotation(members), tuple(m.tensor_key for m in members), info=info)
    return ResidualStream([site], [])


def fold_norm_gains(model: nn.Module, example_inputs: Any = None, *, example_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """Fold the gains of the residual stream's norms into their readers and freeze them at one.

    For each RMSNorm-like leaf module on the stream with gain w, every ``nn.Linear`` reading
    its output becomes W diag(w) and w becomes ones with ``requires_grad=False``: the same
    function (SliceGPT's first step, Ashkboos et al. 2024a, Sec. 3), on which the stream's
    rotation is exact for every value of the other parameters.  Call it before building the
    optimizer.  Returns the names of the folded gains.

    Raises ``ValueError`` naming the reason when the stream has no such structure, a gain's
    output reaches anything but linear readers, or a reader is tied to another tensor.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = () if example_inputs is None else (example_inputs,) if isinstance(example_inputs, Tensor) else tuple(example_inputs)
    a = _trace(model, inputs, dict(example_kwargs or {}), include_frozen=False)
    problems = a.failures + [f"the gain of {n} cannot be folded: {why}" for n, why in a.unfoldable.items()]
    tied = {n for names in _aliases(model).values() if len(names) > 1 for n in names}
    problems += [
        f"the gain {a.gains[norm]} cannot be folded into {w}: that tensor is tied to another (untie it, or freeze the gain at one)"
        for norm, ws in a.folds.items()
        for w in sorted(ws)
        if w in tied
    ]
    if not a.d or problems:
        raise ValueError(f"fold_norm_gains: {problems[0] if problems else 'the model has no residual stream (no nn.Embedding)'}")
    folded = []
    with torch.no_grad():
        for norm, weight in a.gains.items():
            w = model.get_parameter(weight)
            for reader in sorted(a.folds.get(norm, ())):
                W = model.get_parameter(reader)
                W.mul_(w.to(W.dtype).unsqueeze(0))
            w.fill_(1.0)
            w.requires_grad_(False)
            folded.append(weight)
    return folded


def _aliases(model: nn.Module) -> dict[int, list[str]]:
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return seen
