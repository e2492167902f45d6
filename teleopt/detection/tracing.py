"""Tracing a model into a graph of ops with concrete shapes (torch.fx).

Detection needs the real dataflow of ``forward``, not module adjacency: which op
reads which tensor, and the concrete shape of every intermediate value.  We trace
with ``torch.fx`` (modules of ``torch.nn`` stay leaves, everything else is traced
through, so a timm ``BatchNormAct2d`` shows its ``F.batch_norm`` and activation),
then run the graph once on the example inputs to record shapes.

Code that reads shapes as python values (``B, T, C = x.size()``, ``(*x.shape[:-1],
-1, d)``, transformers' attention) defeats plain symbolic tracing; such a model is
traced again with the example values computed alongside, so that shapes, dtypes and
devices are the example's python values (the graph is specialised to the example
shapes, which is all detection reads).  A submodule whose ``forward`` still cannot be
traced (data-dependent control flow) is retried as an opaque leaf: detection then freezes every axis it touches and
reports it, instead of failing on the whole model.  The model is traced in train
and in eval mode, because ``forward`` may branch on ``self.training``; the graphs
are analysed together so that every site holds in both modes.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from teleopt.detection.fx_args import positional

__all__ = ["TensorMeta", "TracedGraph", "DetectionError", "trace_model", "module_path", "graph_arguments"]

_MAX_OPAQUE = 64


class DetectionError(ValueError):
    """The model or its example inputs cannot be analysed (untraceable forward, wrong input shapes)."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a traced value."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point


@dataclass
class TracedGraph:
    """One traced ``forward`` (in one mode) with the recorded value of every node."""

    mode: str
    graph: fx.Graph
    values: dict[str, Any]
    modules: dict[str, nn.Module]
    opaque: frozenset[str] = field(default_factory=frozenset)

    def signature(self) -> list[tuple[str, str, str, str]]:
        """What the graph computes, node by node (to tell whether two modes differ)."""
        return [(n.op, str(n.target), n.name, repr((n.args, n.kwargs))) for n in self.graph.nodes]


def module_path(node: fx.Node) -> str:
    """Qualified name of the module a node belongs to ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(next(reversed(stack.values()))[0])
    return ""


def _autowrap_functions() -> tuple:
    """timm's no-trace functions, if timm is in use (never imported here: it is optional and slow to import)."""
    timm_fx = sys.modules.get("timm.layers._fx")
    if timm_fx is None:
        return ()
    return tuple(fn for fn in timm_fx.get_notrace_functions() if callable(fn))


class _Tracer(fx.Tracer):
    """fx tracer that keeps ``torch.nn`` modules as leaves and remembers which module failed."""

    def __init__(self, opaque: set[str], leaf_types: frozenset[type] = frozenset()) -> None:
        super().__init__(autowrap_functions=_autowrap_functions())
        self.opaque = opaque
        self.leaf_types = leaf_types
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.opaque or type(m) in self.leaf_types or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m)
            raise


_SHAPE_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "is_floating_point", "get_device", "is_contiguous"})


class _ShapeProxy(fx.Proxy):
    """A proxy whose example value is known: its shape, dtype, device and length are python values."""

    tracer: _ConcreteTracer

    def __getattr__(self, k: str) -> Any:
        value = self.tracer.example(self.node)
        if isinstance(value, Tensor) and (k in _SHAPE_ATTRIBUTES or k in _SHAPE_METHODS):
            return getattr(value, k)
        return super().__getattr__(k)

    def __len__(self) -> int:
        value = self.tracer.example(self.node)
        if isinstance(value, (Tensor, tuple, list)):
            return len(value)
        return super().__len__()

    def __iter__(self) -> Any:
        value = self.tracer.example(self.node)
        if isinstance(value, (Tensor, tuple, list)):
            return iter([self[i] for i in range(len(value))])  # type: ignore[index]
        return super().__iter__()


class _ConcreteTracer(_Tracer):
    """``_Tracer`` that runs every traced op on the example values (real tensors, no gradient) as it records it.

    Leaf modules run their real ``forward``; while they do, calls and attribute reads
    are not recorded.  An op that cannot run leaves its value unknown (its proxy is
    then a plain one).
    """

    def __init__(self, opaque: set[str], leaf_types: frozenset[type], inputs: dict[str, Any]) -> None:
        super().__init__(opaque, leaf_types)
        self.inputs = inputs
        self.values: dict[fx.Node, Any] = {}
        self.running = 0

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    def example(self, node: fx.Node) -> Any:
        return self.values.get(node, None)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if self.running:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        if self.running:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not self.running:
            self._run(node)
        return node

    def _run(self, node: fx.Node) -> None:
        missing = object()
        unknown = [n for n in node.all_input_nodes if n not in self.values]
        if unknown:
            return
        args = fx.node.map_arg(node.args, lambda n: self.values[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.values[n])
        self.running += 1
        try:
            with torch.no_grad():
                if node.op == "placeholder":
                    value = self.inputs.get(str(node.target).lstrip("*"), missing)
                elif node.op == "get_attr":
                    value = _fetch(self.root, str(node.target))
                elif node.op == "call_function":
                    value = node.target(*args, **kwargs)  # type: ignore[operator]
                elif node.op == "call_method":
                    value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
                elif node.op == "call_module":
                    value = self.root.get_submodule(str(node.target)).forward(*args, **kwargs)
                else:
                    value = missing
        except Exception:  # noqa: BLE001 - the value stays unknown; tracing goes on as plain fx would
            value = missing
        finally:
            self.running -= 1
        if value is not missing:
            self.values[node] = value


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    return list(inspect.signature(model.forward).parameters.values())


def _concrete_args(model: nn.Module, n_inputs: int, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constants of the trace: non-tensor keyword arguments, and the defaults of the parameters nothing supplies.

    Tensor keyword arguments are traced as inputs (placeholders); everything else
    (``smooth=True``, ``use_cache=False``, ``None``) is specialised, so the graph
    computes what ``model(*inputs, **kwargs)`` computes.
    """
    kwargs = kwargs or {}
    all_params = _forward_parameters(model)
    params = [p for p in all_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind != p.KEYWORD_ONLY]
    if n_inputs > len(positional) and not any(p.kind == p.VAR_POSITIONAL for p in all_params):
        raise DetectionError(
            f"{type(model).__name__}.forward takes {len(positional)} positional inputs, but {n_inputs} example inputs were given"
        )
    names = {p.name for p in params}
    unknown = [k for k in kwargs if k not in names]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in all_params):
        raise DetectionError(f"{type(model).__name__}.forward has no parameter {unknown[0]!r} (example_kwargs)")
    if unknown:
        raise DetectionError(
            f"could not trace {type(model).__name__}.forward: it takes **kwargs, and torch.fx cannot trace the keyword "
            f"argument {unknown[0]!r} through it"
        )
    concrete = {}
    for i, p in enumerate(params):
        if i < n_inputs and p.kind != p.KEYWORD_ONLY:
            if p.name in kwargs:
                raise DetectionError(f"{p.name!r} is given both as an example input and in example_kwargs")
            continue
        if p.name in kwargs:
            if not isinstance(kwargs[p.name], Tensor):
                concrete[p.name] = kwargs[p.name]
            continue
        if p.default is inspect.Parameter.empty:
            raise DetectionError(f"{type(model).__name__}.forward needs the input {p.name!r}, which the example inputs do not supply")
        concrete[p.name] = p.default
    return concrete


def graph_arguments(model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple[Any, ...]:
    """The positional arguments of the traced graph (one per placeholder) for ``model(*inputs, **kwargs)``."""
    if not kwargs:
        return tuple(inputs)
    concrete = _concrete_args(model, len(inputs), kwargs)
    params = [p for p in _forward_parameters(model) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    args: list[Any] = []
    for i, p in enumerate(params):
        if i < len(inputs) and p.kind != p.KEYWORD_ONLY:
            args.append(inputs[i])
        elif p.name in kwargs:
            args.append(kwargs[p.name])
        else:
            args.append(concrete[p.name])
    return tuple(args)


def _trace_once(
    model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any] | None = None, leaf_types: frozenset[type] = frozenset()
) -> tuple[fx.Graph, set[str], list[str]]:
    opaque: set[str] = set()
    failures: list[str] = []
    concrete = _concrete_args(model, len(inputs), kwargs)
    try:
        graph = _Tracer(opaque, leaf_types).trace(model, concrete_args=concrete or None)
        _positional_calls(graph, model)
        return graph, opaque, failures
    except Exception:  # noqa: BLE001 - retried with example values (python shapes), then with opaque submodules
        pass
    params = [p.name for p in _forward_parameters(model) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    values = dict(zip(params, graph_arguments(model, inputs, kwargs)))
    for _ in range(_MAX_OPAQUE):
        tracer = _ConcreteTracer(opaque, leaf_types, values)
        try:
            with _restored(model):
                graph = tracer.trace(model, concrete_args=concrete or None)
            _positional_calls(graph, model)
            return graph, opaque, failures
        except Exception as e:  # fx raises many types (TraceError, TypeError, RuntimeError, ...)
            where = tracer.failed_in
            if not where:
                raise DetectionError(f"could not trace {type(model).__name__}.forward with torch.fx: {type(e).__name__}: {e}") from None
            opaque.add(where)
            failures.append(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise DetectionError(f"could not trace {type(model).__name__}: more than {_MAX_OPAQUE} untraceable submodules")


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Buffers and the RNG state as they were (ops run on example values may update or draw them)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _positional_calls(graph: fx.Graph, model: nn.Module) -> None:
    """Inputs of torch's modules and functions passed by keyword (``linear(input=x)``) become positional, as rules read them."""
    for node in graph.nodes:
        if node.op == "call_module":
            module = model.get_submodule(str(node.target))
            if type(module).__module__.startswith("torch."):
                positional(node, module.forward)
        elif node.op == "call_function" and str(getattr(node.target, "__module__", None)).startswith("torch"):
            positional(node, node.target)


def _meta(value: Any) -> Any:
    if isinstance(value, Tensor):
        return TensorMeta(tuple(value.shape), value.dtype)
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v) for v in value) if not hasattr(value, "_fields") else tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # run() would append fx's node dump and "Use tlparse" to the DetectionError
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as e:
            where = module_path(n) or "the root module"
            raise DetectionError(
                f"the example inputs do not fit the model: running node {n.name!r} "
                f"({n.op} {n.target if n.op != 'call_module' else type(self.module.get_submodule(str(n.target))).__name__} "
                f"in {where}) raised {type(e).__name__}: {str(e).split(chr(10) + chr(10) + 'While executing')[0]}"
            ) from None
        self.values[n.name] = _meta(result)
        return result


class _Run(nn.Module):
    """Runs a graph module through the recording interpreter (so ``functional_call`` can swap its tensors)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.values: dict[str, Any] = {}

    def forward(self, *inputs: Any) -> Any:
        recorder = _Recorder(self.gm)
        try:
            return recorder.run(*inputs)
        finally:
            self.values = recorder.values


def _record(model: nn.Module, graph: fx.Graph, inputs: Sequence[Any]) -> dict[str, Any]:
    """Shapes of every value: first on the meta device (no arithmetic), else for real."""
    gm = fx.GraphModule(model, graph)
    run = _Run(gm)
    meta = {
        f"gm.{name}": torch.empty_like(t, device="meta")
        for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    }
    try:
        with torch.no_grad():
            torch.func.functional_call(run, meta, tuple(t.to("meta") if isinstance(t, Tensor) else t for t in inputs))
        return run.values
    except Exception:  # an op without a meta kernel, or real tensors created in forward: run for real
        pass
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index or 0 for t in inputs if isinstance(t, Tensor) and t.device.type == "cuda"})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            run(*inputs)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return run.values


def trace_model(
    model: nn.Module, inputs: Sequence[Tensor], kwargs: dict[str, Any] | None = None, leaf_types: frozenset[type] = frozenset()
) -> tuple[list[TracedGraph], list[str]]:
    """Trace ``model`` in eval and in train mode and record every value's shape on ``inputs``.

    ``torch.nn`` modules and modules of exactly the types in ``leaf_types`` (those
    given a rule with ``register_op_rule``) stay leaves; the rest is traced through.

    Returns the distinct graphs (one if both modes compute the same thing) and the
    submodules that had to be kept opaque, each with the tracing error.  Shapes are
    recorded in eval mode (no BatchNorm statistics are updated, no random numbers
    drawn, a batch of one works), also for a train graph with a different structure
    (buffers and RNG state restored afterwards).  ``kwargs`` are the keyword
    arguments of ``model(*inputs, **kwargs)``: tensors are traced as inputs, other
    values are constants of the trace.
    """
    args = graph_arguments(model, inputs, kwargs)
    flags = [(m, m.training) for m in model.modules()]
    attributes = set(vars(model))
    graphs: list[TracedGraph] = []
    opaque_all: list[str] = []
    try:
        for mode in ("eval", "train"):
            model.train(mode == "train")
            graph, opaque, failures = _trace_once(model, inputs, kwargs, leaf_types)
            opaque_all.extend(f for f in failures if f not in opaque_all)
            traced = TracedGraph(mode, graph, {}, dict(model.named_modules()), frozenset(opaque))
            if graphs and graphs[0].signature() == traced.signature():
                continue
            if graphs and _structure(graphs[0]) == _structure(traced):
                traced.values = graphs[0].values
            else:  # shapes do not depend on the mode: record in eval mode (a batch of one passes BatchNorm)
                model.eval()
                traced.values = _record(model, graph, args)
            graphs.append(traced)
    finally:
        for m, flag in flags:
            m.training = flag
        for name in set(vars(model)) - attributes:  # fx stores tensor constants on the traced root
            if name.startswith("_tensor_constant"):
                delattr(model, name)
    return graphs, opaque_all


def _structure(traced: TracedGraph) -> list[tuple[str, str, str]]:
    return [(n.op, str(n.target), n.name) for n in traced.graph.nodes]
