"""The residual stream's rotation: detection of SliceGPT's computational invariance, and gain folding.

Ashkboos et al. 2024a (SliceGPT), Theorem 1: in a pre-norm transformer an orthogonal Q acting
on the stream (embeddings and writers' rows by Q, readers' columns by Q^T) leaves the function
unchanged (:mod:`teleopt.actions.residual`).  transformers' roots cannot be traced by torch.fx,
so the stream is followed through a *dynamic* trace: a float64 copy runs once in train mode
under a ``TorchFunctionMode`` recording every torch call outside leaf modules, leaf modules
recorded as one call each.  From each ``nn.Embedding``'s output on, a tensor *moves* in a
frame: the stream (x -> R x, R a random test rotation) or a norm's output (x -> D R D^{-1} x).
Each call reading a moving tensor is classified:

* an ``nn.Linear`` or GPT-2 ``Conv1D`` reads it (its weight's input axis by the frame's
  contragredient);
* an addition of a stream tensor and another: the other is written into the stream, traced
  back (through additions and parameter-free calls that commute with R) to the ``nn.Linear``
  / ``Conv1D`` rows and biases, embedding tables or parameters that wrote it; a norm's output
  added back (post-norm) fails closed;
* a leaf module whose parameters are a (d,) weight and optional bias is a norm if, with a
  random weight w and bias b, it maps R x (bias D R D^{-1} b) to D R D^{-1} out for D = w + c,
  c = 0 or 1 (a (1 + w) gain): its output moves in its own frame, its bias is a member; a zero
  entry of the actual gain fails closed;
* any other call is rerun with its moving inputs rotated (same RNG draws): an output that
  rotates with them keeps their frame, one that does not change leaves it, anything else
  fails closed with the measured error (dropout masks in train mode, rotary embeddings on the
  stream, a view splitting its axis, the stream among the model's outputs).

If that fails, the walk is repeated with R fixing the all-ones vector (LayerNorm streams:
:class:`~teleopt.groups.OrthogonalFixingOnes`).  A tensor that writes the stream and reads a
norm's output (a tied head) needs that norm's gain frozen at a multiple of ones.
:func:`fold_norm_gains` gives a plain, linear rotation (SliceGPT's first step: W diag(w) into
every reader, then w = 1, frozen).
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
from teleopt.actions.residual import GainedResidualRotation, residual_rotation
from teleopt.detection.certify import to_float64
from teleopt.detection.float64 import keep_float64
from teleopt.groups import OrthogonalFixingOnes
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
_CENTRES_HINT = "; it subtracts the mean (LayerNorm): only rotations fixing the all-ones vector commute with it"
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


@dataclass
class _Norm:
    """A norm with a gain on the stream: its output moves by P = D R D^{-1}, D = diag(weight + offset)."""

    weight: str
    bias: str | None
    offset: float
    gain: Tensor
    trivial: bool  # D is a frozen multiple of ones: P = R


class _Analysis:
    """The stream through one recorded forward (see module docs): members, norms, failures.

    ``frame`` holds the tensors that move with the rotation: ``None`` for the stream itself
    (x -> R x), a norm's name for its output (x -> D R D^{-1} x).  With ``centred`` the test
    rotation R fixes the all-ones vector (LayerNorm streams).
    """

    def __init__(self, model: nn.Module, calls: list[_Call], outputs: list[Tensor], include_frozen: bool, centred: bool) -> None:
        self.model, self.calls, self.include_frozen, self.centred = model, calls, include_frozen, centred
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.producer: dict[int, _Call] = {}
        for c in calls:  # the first call that made a tensor (dropout with p = 0 hands its input back)
            self.producer.update((id(t), c) for t in c.outputs if id(t) not in self.producer)
        self.frame: dict[int, str | None] = {}
        self.members: dict[tuple[str, int], tuple[Member, str | None]] = {}
        self.norms: dict[str, _Norm] = {}
        self.gains: dict[str, str] = {}  # norm module -> its weight's name
        self.folds: dict[str, set[str]] = {}  # norm module -> the reader weights its gain folds into
        self.unfoldable: dict[str, str] = {}
        self.ties: list[tuple[str, str | None, str | None]] = []  # a tensor on one axis in two frames
        self.failures: list[str] = []
        self.d = 0
        self.outputs = outputs
        self.R: Tensor | None = None
        self._gen = torch.Generator().manual_seed(0)

    def rotate(self, t: Tensor, frame: str | None = None, gain: Tensor | None = None) -> Tensor:
        """R x on the last axis; behind a norm (or with ``gain``) the conjugate D R D^{-1} x."""
        assert self.R is not None
        d = gain if gain is not None else None if frame is None else self.norms[frame].gain
        if d is None:
            return t @ self.R.mT.to(t.dtype)
        d = d.to(t.dtype)
        return ((t / d) @ self.R.mT.to(t.dtype)) * d

    def _rerun(self, call: _Call, swap: Mapping[int, Tensor]) -> Any:
        args, kwargs = tree_map(lambda v: swap.get(id(v), v) if isinstance(v, Tensor) else v, (call.args, call.kwargs))
        with torch.random.fork_rng(devices=[]), torch.no_grad(), keep_float64():
            torch.manual_seed(0)
            return call.fn(*args, **kwargs)

    def classify(self, call: _Call) -> tuple[list[str] | str, str | None]:
        """Per output: "stream" (moves with the inputs, in their frame) or "free" (unchanged); or why neither."""
        moving = [t for t in _tensors((call.args, call.kwargs)) if id(t) in self.frame]
        frames = {self.frame[id(t)] for t in moving}
        if len(frames) > 1:
            return "it mixes the stream with a norm's output", None
        f = next(iter(frames), None)
        try:
            before = self._rerun(call, {})
            after = self._rerun(call, {id(t): self.rotate(t, f) for t in moving})
        except Exception as e:  # noqa: BLE001 - a call that cannot run on rotated inputs is not equivariant
            return f"it does not run on a rotated stream ({type(e).__name__})", f
        b, a = _tensors(before), _tensors(after)
        if not b and not a:
            free = call.name in _QUERIES or _same(before, after)
            return (["free"] if free else "its result depends on the stream's values"), f
        if len(a) != len(b):
            return "its outputs change", f
        kinds: list[str] = []
        for x, y in zip(b, a):
            moves = x.is_floating_point() and x.ndim > 0 and x.shape[-1] == self.d and x.shape == y.shape
            if x.shape == y.shape and _close(y, x):
                kinds.append("free")
            elif moves and _close(y, self.rotate(x, f)):
                kinds.append("stream")
            else:
                err = _error(y, self.rotate(x, f)) if moves else math.inf
                return f"neither rotates with the stream nor ignores it (relative error {err:.1e})", f
        return kinds, f

    def run(self) -> None:
        for call in self.calls:
            if call.module is not None and isinstance(call.fn, nn.Embedding):
                self._seed(call)
                continue
            ins = [t for t in _tensors((call.args, call.kwargs)) if id(t) in self.frame]
            if not ins:
                continue
            if call.name.endswith("_") and not call.name.endswith("__") or call.name.startswith("__i"):
                self.failures.append(f"{call.name} changes a stream tensor in place")
            elif call.module is not None and _reader_axis(call.fn) is not None:
                self._read(call, ins)
            elif call.name in _ADDS and len(_tensors((call.args, call.kwargs))) == 2:
                self._add(call)
            elif call.module is not None and _norm_params(call.fn, self.d):
                self._norm(call, ins)
            else:
                self._other(call)
        if any(id(t) in self.frame for t in self.outputs):
            self.failures.append("the stream is an output of the model (a rotation would rotate it)")

    def _seed(self, call: _Call) -> None:
        emb = call.fn
        assert isinstance(emb, nn.Embedding)
        if not self.d:
            self.d = emb.embedding_dim
            self.R = _test_rotation(self.d, self._gen, self.centred)
        if emb.embedding_dim != self.d:
            self.failures.append(f"embedding {call.module} has width {emb.embedding_dim}, the stream {self.d}")
            return
        self._member(emb.weight, 1, 1)
        self.frame.update((id(t), None) for t in call.outputs)

    def _member(self, p: Tensor, axis: int, power: int, frame: str | None = None) -> None:
        name = self.names.get(id(p))
        if name is None:
            self.failures.append("a tensor that is not a parameter of the model reads or writes the stream")
            return
        if not p.requires_grad and not self.include_frozen:
            self.failures.append(f"{name} is frozen (requires_grad=False): the rotation cannot move it")
        if p.shape[axis] != self.d:
            self.failures.append(f"{name} meets the stream on an axis of length {p.shape[axis]}, not {self.d}")
        key = (name, axis % p.ndim)
        if key in self.members:
            if self.members[key][1] != frame:
                self.ties.append((name, self.members[key][1], frame))
            return
        other = any(n == name for n, _ in self.members)
        member = Member(f"{name}@{axis % p.ndim}" if other else name, axis % p.ndim, power, tensor=name if other else None)
        self.members[key] = (member, frame)

    def _read(self, call: _Call, ins: list[Tensor]) -> None:
        frames = {self.frame[id(t)] for t in ins}
        if len(frames) > 1:
            self.failures.append(f"{call.module} reads the stream and a norm's output at once")
            return
        frame = frames.pop()
        module: Any = call.fn
        self._member(module.weight, _reader_axis(module) or 0, -1, frame)
        if frame is not None:
            self.folds.setdefault(frame, set()).add(self.names.get(id(module.weight), "?"))

    def _add(self, call: _Call) -> None:
        for t in _tensors((call.args, call.kwargs)):
            if id(t) not in self.frame:
                self._written(t, 0)
            elif self.frame[id(t)] is not None:
                norm = str(self.frame[id(t)])
                self.failures.append(f"the output of {norm} is added to the stream (post-norm): its gain would rotate with it")
                self.unfoldable[norm] = "its output is added to the stream"
        self.frame.update((id(t), None) for t in call.outputs)

    def _written(self, t: Tensor, depth: int) -> None:
        """Trace a tensor added to the stream back to the tensors that wrote it."""
        if id(t) in self.names:
            self._member(t, -1, 1)
            return
        call = self.producer.get(id(t))
        if call is None or depth > 16:
            self.failures.append("a tensor from outside the model (an input or a constant) is added to the stream")
        elif call.module is not None and _reader_axis(call.fn) is not None:
            module: Any = call.fn
            self._member(module.weight, 1 - (_reader_axis(module) or 0), 1)
            if getattr(module, "bias", None) is not None:
                self._member(module.bias, 0, 1)
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
        if len(inner) != 1 or _owns(call):  # a norm after a writer (OLMo2) commutes only while its gain is ones
            self.failures.append(f"{call.name} ({call.module or 'a function'}) writes into the stream: no writer rule")
            return
        self.frame[id(inner[0])] = None  # classify it as if it were on the stream
        kinds, _ = self.classify(call)
        del self.frame[id(inner[0])]
        if kinds != ["stream"] * len(call.outputs):
            self.failures.append(f"{call.name} ({call.module or 'a function'}) writes into the stream and does not commute with a rotation")
            return
        self._written(inner[0], depth + 1)

    def _norm(self, call: _Call, ins: list[Tensor]) -> None:
        """A leaf module with a (d,) weight (and bias): a norm if it moves by D R D^{-1} for a random weight."""
        module: Any = call.fn
        name = str(call.module)
        if any(self.frame[id(t)] is not None for t in ins):
            self.failures.append(f"{name} reads a norm's output")
            return
        offset = self._probe(call, module)
        if offset is None:
            hint = _CENTRES_HINT if _centres(call) else ""
            self.failures.append(f"{call.name} ({name}) reads the stream: it commutes with no rotation for its gains{hint}")
            return
        weight = self.names.get(id(module.weight), "?")
        gain = module.weight.detach().to(torch.float64) + offset
        if not bool((gain != 0).all()):
            self.failures.append(f"the gain {weight} has a zero entry: no rotation of the stream passes {name}")
            return
        trainable = module.weight.requires_grad or self.include_frozen
        bias = module._parameters.get("bias")
        self.norms[name] = _Norm(weight, self.names.get(id(bias)), offset, gain, bool((gain == gain[0]).all()) and not trainable)
        self.gains[name] = weight
        if bias is not None:
            self._member(bias, 0, 1, name)
        if offset or bias is not None:
            self.unfoldable[name] = "only RMSNorm gains w (no bias, no 1 + w) fold"
        self.frame.update((id(t), name) for t in call.outputs)

    def _probe(self, call: _Call, module: nn.Module) -> float | None:
        """The offset c (0, or 1 for a (1 + w) gain) for which the module moves by D R D^{-1}, D = diag(w + c)."""
        w, b = module._parameters["weight"], module._parameters.get("bias")
        assert w is not None
        saved = [(p, p.detach().clone()) for p in (w, b) if p is not None]
        swap = {id(t): self.rotate(t) for t in _tensors((call.args, call.kwargs)) if id(t) in self.frame}
        try:
            with torch.no_grad():
                w.copy_(0.5 + torch.rand(w.shape, generator=self._gen, dtype=torch.float64).to(w.dtype))
                b0 = None if b is None else b.copy_(0.1 * torch.randn(b.shape, generator=self._gen, dtype=torch.float64)).clone()
            before = _tensors(self._rerun(call, {}))
            for offset in (0.0, 1.0):
                d = w.detach().to(torch.float64) + offset
                with torch.no_grad():
                    if b is not None and b0 is not None:
                        b.copy_(self.rotate(b0, gain=d))
                after = _tensors(self._rerun(call, swap))
                with torch.no_grad():
                    if b is not None and b0 is not None:
                        b.copy_(b0)
                if len(after) == len(before) and all(
                    x.shape == y.shape and _close(y, self.rotate(x, gain=d)) for x, y in zip(before, after)
                ):
                    return offset
            return None
        finally:
            with torch.no_grad():
                for p, value in saved:
                    p.copy_(value)

    def _other(self, call: _Call) -> None:
        kinds, frame = self.classify(call)
        if _owns(call) and not isinstance(kinds, str) and "stream" in kinds:
            kinds = "it commutes with the rotation only at the current values of its parameters"
        if isinstance(kinds, str):
            where = f"{call.name} ({call.module})" if call.module else f"torch function {call.name}"
            hint = _CENTRES_HINT if _centres(call) else ""
            self.failures.append(f"{where} reads the stream: {kinds}{hint}")
            return
        for t, kind in zip(call.outputs, kinds):
            if kind == "stream":
                self.frame[id(t)] = frame
        if frame is not None and call.outputs and not (call.name in _PLAIN and call.module is None):
            self.unfoldable[frame] = f"its output feeds {call.name}"

    def problems(self) -> list[str]:
        """Why the members found cannot share one rotation (tied tensors behind a norm with a varying gain)."""
        problems = []
        for name, *frames in self.ties:
            for f in frames:
                norm = self.norms.get(str(f)) if f is not None else None
                if norm is None or norm.trivial:
                    continue
                scalar = bool((norm.gain == norm.gain[0]).all())
                why = "is trainable" if scalar else "is not a multiple of ones"
                problems.append(
                    f"{name} writes the stream and reads it behind {f} (tied embeddings): one rotation of both needs the gain "
                    f"{norm.weight} to stay a multiple of ones, and it {why} (freeze it at a constant, or untie the head)"
                )
        return problems

    def site(self) -> Site | None:
        """The stream's site, or ``None`` without readers."""
        members, gains = [], {}
        for member, frame in self.members.values():
            members.append(member)
            norm = self.norms.get(str(frame)) if frame is not None else None
            if norm is not None and not norm.trivial:
                gains[member.name] = (norm.weight, norm.offset)
        if not any(m.power < 0 for m in members):
            return None
        action = GainedResidualRotation(members, gains, fixes_ones=self.centred) if gains or self.centred else residual_rotation(members)
        info = {
            "module": members[0].tensor_key.rsplit(".", 1)[0],
            "width": self.d,
            "assumes": sorted(n.weight for n in self.norms.values()),
            "fixes_ones": self.centred,
            "assumption": (
                "every norm on the stream divides by the RMS of its input"
                + (" after subtracting the mean (rotations fix the all-ones vector)" if self.centred else "")
                + " and scales by a nonzero gain D: what reads it moves by D Q D^-1; a tensor tied across the stream and a norm's"
                " output needs that norm's gain frozen at a multiple of ones"
            ),
        }
        return Site(action, tuple(m.tensor_key for m in action.members), info=info)


def _reader_axis(module: Any) -> int | None:
    """The weight axis that meets the input: 1 for ``nn.Linear`` (out, in), 0 for GPT-2's ``Conv1D`` (in, out)."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return 1
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), Tensor) and module.weight.ndim == 2:
        return 0
    return None


def _norm_params(module: Any, d: int) -> bool:
    """A leaf module whose own parameters are a (d,) ``weight`` and optionally a (d,) ``bias``."""
    if not isinstance(module, nn.Module):
        return False
    own = dict(module.named_parameters(recurse=False))
    return set(own) in ({"weight"}, {"weight", "bias"}) and all(tuple(p.shape) == (d,) for p in own.values())


def _test_rotation(d: int, gen: torch.Generator, centred: bool) -> Tensor:
    """A random rotation of the stream, or one that fixes the all-ones vector."""
    if centred:
        coords = torch.randn(d, d, generator=gen, dtype=torch.float64)
        return OrthogonalFixingOnes(d).exp(3.0 * coords / math.sqrt(d))
    return _random_orthogonal(d, gen)


def _owns(call: _Call) -> bool:
    return call.module is not None and isinstance(call.fn, nn.Module) and any(True for _ in call.fn.parameters(recurse=False))


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
    if isinstance(value, Tensor) or depth > 8:
        return [value] if isinstance(value, Tensor) else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _leaves(v, depth + 1)]


def _record(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[nn.Module, list[_Call], list[Tensor]]:
    """One recorded train-mode forward of a float64 copy of ``model``: the copy, its calls and its outputs."""
    memo: dict[int, Any] = {id(p): nn.Parameter(p.detach().to(torch.float64), p.requires_grad) for p in model.parameters()}
    twin = copy.deepcopy(model, memo).to(torch.float64)  # the parameters copied once, in float64
    twin.train()
    recorder = _Recorder(twin)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), keep_float64(), recorder:
            torch.manual_seed(0)
            out = twin(*to_float64(tuple(inputs)), **to_float64(dict(kwargs)))
    finally:
        recorder.close()
    return twin, recorder.calls, _leaves(out)


def _trace(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any], include_frozen: bool) -> _Analysis:
    """Follow the stream through one recorded forward, under all rotations and, if that fails, under those fixing 1."""
    twin, calls, outputs = _record(model, inputs, kwargs)
    full = _Analysis(twin, calls, outputs, include_frozen, centred=False)
    full.run()
    if not (full.failures or full.problems()) or not full.d:
        return full
    centred = _Analysis(twin, calls, outputs, include_frozen, centred=True)
    centred.run()
    clean = not (centred.failures or centred.problems())
    return centred if clean or any("all-ones" in f for f in full.failures) else full


def find_residual_sites(
    model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *, include_frozen: bool = False
) -> ResidualStream:
    """The residual-stream rotation site of ``model`` (Ashkboos et al. 2024a, Theorem 1), or why there is none.

    ``inputs``/``kwargs`` are the example call (as for ``find_symmetries``).  The site is an
    ``AxisAction`` on O(d_model), or a :class:`~teleopt.actions.residual.GainedResidualRotation`
    behind trainable gains or LayerNorm; ``info["assumption"]`` says what it assumes.  Models
    without an ``nn.Embedding`` have no stream to rotate and report nothing."""
    if not any(isinstance(m, nn.Embedding) for m in model.modules()):
        return ResidualStream()  # no stream starts inside the model (a stream from the input is fixed)
    try:
        a = _trace(model, inputs, dict(kwargs or {}), include_frozen)
    except Exception as e:  # noqa: BLE001 - detection fails closed and says why
        return ResidualStream([], [("site", "residual stream", f"the forward could not be recorded ({type(e).__name__}: {e})")])
    if not a.d:
        return ResidualStream()
    failures = a.failures + a.problems()
    if failures:
        more = f" (and {len(failures) - 2} more)" if len(failures) > 2 else ""
        why = "; ".join(dict.fromkeys(failures[:2]))
        return ResidualStream([], [("site", "residual stream", f"no rotation of the residual stream: {why}{more}")])
    site = a.site()
    return ResidualStream([] if site is None else [site], [])


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
