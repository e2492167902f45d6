"""Recognising what a traced node computes, independently of how it is spelled.

``torch.relu(x)``, ``F.relu(x)``, ``x.relu()`` and ``nn.ReLU()(x)`` are one op; a
timm ``BatchNormAct2d`` is not a ``BatchNorm2d`` (it subclasses it but applies an
activation), so modules are matched by *exact* type and everything else is traced
through to the functions it calls (Zhao 2026, Sec. 1.2 reasons about what each
layer computes; so do we).  Pointwise functions carry the properties the symmetry
groups need: positive homogeneity of degree alpha (positive scaling, Ex. 1.2.4),
linearity (GL, Ex. 1.2.2); every pointwise function commutes with permutations
(Ex. 1.2.9).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from teleopt.detection.tracing import TensorMeta, TracedGraph

__all__ = [
    "Pointwise",
    "POINTWISE",
    "function_op",
    "method_op",
    "module_op",
    "identify_node",
    "custom_module_types",
    "set_custom_op",
    "user_op",
    "builtin_op",
    "is_user_op",
    "METADATA_ATTRIBUTES",
]


@dataclass(frozen=True)
class Pointwise:
    """A pointwise map and its symmetry properties: homogeneity ``degree`` (None: not homogeneous), linearity."""

    name: str
    degree: float | None = None
    linear: bool = False


POINTWISE: dict[str, Pointwise] = {
    p.name: p
    for p in (
        Pointwise("identity", 1.0, linear=True),
        Pointwise("neg", 1.0, linear=True),
        Pointwise("relu", 1.0),
        Pointwise("leaky_relu", 1.0),
        Pointwise("abs", 1.0),
        Pointwise("relu6"),
        Pointwise("hardtanh"),
        Pointwise("gelu"),
        Pointwise("silu"),
        Pointwise("sigmoid"),
        Pointwise("tanh"),
        Pointwise("hardswish"),
        Pointwise("hardsigmoid"),
        Pointwise("mish"),
        Pointwise("elu"),
        Pointwise("selu"),
        Pointwise("celu"),
        Pointwise("softplus"),
        Pointwise("softsign"),
        Pointwise("exp"),
        Pointwise("log"),
        Pointwise("sqrt"),
        Pointwise("rsqrt"),
        Pointwise("erf"),
        Pointwise("sin"),
        Pointwise("cos"),
    )
}

# -- functions --------------------------------------------------------------------
_FUNCTIONS: dict[str, tuple] = {
    "relu": (torch.relu, F.relu, torch.relu_),
    "leaky_relu": (F.leaky_relu,),
    "abs": (torch.abs, operator.abs),
    "neg": (torch.neg, operator.neg),
    "relu6": (F.relu6,),
    "hardtanh": (F.hardtanh,),
    "gelu": (F.gelu,),
    "silu": (F.silu,),
    "sigmoid": (torch.sigmoid, F.sigmoid),
    "tanh": (torch.tanh, F.tanh),
    "hardswish": (F.hardswish,),
    "hardsigmoid": (F.hardsigmoid,),
    "mish": (F.mish,),
    "elu": (F.elu,),
    "selu": (F.selu, torch.selu),
    "celu": (F.celu,),
    "softplus": (F.softplus,),
    "softsign": (F.softsign,),
    "exp": (torch.exp,),
    "log": (torch.log,),
    "sqrt": (torch.sqrt,),
    "rsqrt": (torch.rsqrt,),
    "erf": (torch.erf, torch.special.erf),
    "sin": (torch.sin,),
    "cos": (torch.cos,),
    "dropout": (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout),
    "add": (operator.add, torch.add, operator.iadd),
    "sub": (operator.sub, torch.sub, operator.isub),
    "mul": (operator.mul, torch.mul, operator.imul),
    "div": (operator.truediv, torch.div, operator.itruediv, torch.true_divide),
    "pow": (operator.pow, torch.pow),
    "square": (torch.square,),
    "clamp": (torch.clamp, torch.clip),
    "matmul": (operator.matmul, torch.matmul, torch.bmm, torch.mm),
    "linear": (F.linear,),
    "addmm": (torch.addmm,),
    "conv": (F.conv1d, F.conv2d, F.conv3d),
    "conv_transpose": (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
    "embedding": (F.embedding,),
    "batch_norm": (F.batch_norm,),
    "layer_norm": (F.layer_norm,),
    "group_norm": (F.group_norm,),
    "rms_norm": tuple(f for f in (getattr(F, "rms_norm", None),) if f is not None),
    "softmax": (F.softmax, torch.softmax),
    "log_softmax": (F.log_softmax, torch.log_softmax),
    "sdpa": (F.scaled_dot_product_attention,),
    "prelu": (F.prelu,),
    "pad": (F.pad,),
    "interpolate": (F.interpolate,),
    "avg_pool": (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d),
    "max_pool": (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d),
    "mean": (torch.mean,),
    "sum": (torch.sum,),
    "amax": (torch.amax, torch.amin),
    "max": (torch.max, torch.min),
    "reshape": (torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze, torch.unflatten),
    "permute": (torch.permute, torch.transpose, torch.t, torch.movedim, torch.swapaxes),
    "expand": (torch.broadcast_to,),
    "cat": (torch.cat, torch.concat, torch.concatenate),
    "stack": (torch.stack,),
    "split": (torch.split, torch.chunk, torch.tensor_split, torch.unbind),
    "narrow": (torch.narrow,),
    "select": (torch.select,),
    "identity_like": (torch.clone, torch.detach),
    "constant_like": (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like),
    "compare": (
        operator.gt,
        operator.lt,
        operator.ge,
        operator.le,
        torch.gt,
        torch.lt,
        torch.ge,
        torch.le,
        torch.eq,
        torch.ne,
        torch.greater,
        torch.less,
        torch.greater_equal,
        torch.less_equal,
        torch.not_equal,
    ),
    "where": (torch.where,),
    "masked_fill": (torch.masked_fill,),
    "topk": (torch.topk,),
    "argmax": (torch.argmax, torch.argmin),
    "one_hot": (F.one_hot,),
    "getitem": (operator.getitem,),
    "getattr": (getattr,),
}

_FUNCTION_OPS: dict[int, str] = {}
for _name, _fns in _FUNCTIONS.items():
    for _fn in _fns:
        _FUNCTION_OPS.setdefault(id(_fn), _name)

#: functions whose result never depends on tensor values (shape checks, assertions)
_METADATA_FUNCTIONS = {id(f) for f in (len, isinstance, torch._assert, operator.eq, operator.ne)}


def _timm_functions() -> dict[int, str]:
    """timm's autowrapped attention helpers (fx leaves): ``maybe_add_mask`` adds, the mask resolver builds a constant."""
    timm_attention = sys.modules.get("timm.layers.attention")
    if timm_attention is None:  # timm is optional and not imported here
        return {}
    out = {}
    for attr, name in (("maybe_add_mask", "maybe_add_mask"), ("resolve_self_attn_mask", "constant")):
        fn = getattr(timm_attention, attr, None)
        if fn is not None:
            out[id(fn)] = name
    return out


def function_op(fn: object) -> str | None:
    """Canonical op name of a ``call_function`` target (``None`` if unknown); user registrations first."""
    custom = _custom_function_op(fn)
    return custom if custom is not None else _builtin_function_op(fn)


def _builtin_function_op(fn: object) -> str | None:
    name = _FUNCTION_OPS.get(id(fn))
    if name is not None:
        return name
    if id(fn) in _METADATA_FUNCTIONS:
        return "metadata"
    name = _timm_functions().get(id(fn))
    if name is not None:
        return name
    if getattr(fn, "__name__", "") == "_assert":
        return "metadata"
    return None


# -- methods ----------------------------------------------------------------------
_METHODS: dict[str, tuple[str, ...]] = {
    "relu": ("relu", "relu_"),
    "abs": ("abs",),
    "neg": ("neg",),
    "sigmoid": ("sigmoid", "sigmoid_"),
    "tanh": ("tanh", "tanh_"),
    "exp": ("exp",),
    "log": ("log",),
    "sqrt": ("sqrt",),
    "rsqrt": ("rsqrt",),
    "add": ("add", "add_", "__add__", "__radd__", "__iadd__"),
    "sub": ("sub", "sub_", "__sub__", "__isub__"),
    "mul": ("mul", "mul_", "__mul__", "__rmul__", "__imul__"),
    "div": ("div", "div_", "__truediv__", "__itruediv__"),
    "pow": ("pow", "__pow__"),
    "square": ("square",),
    "clamp": ("clamp", "clamp_", "clip"),
    "matmul": ("matmul", "bmm", "mm", "__matmul__"),
    "mean": ("mean",),
    "sum": ("sum",),
    "amax": ("amax", "amin"),
    "max": ("max", "min"),
    "softmax": ("softmax",),
    "log_softmax": ("log_softmax",),
    "reshape": ("reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"),
    "permute": ("permute", "transpose", "t", "movedim", "swapaxes"),
    "expand": ("expand", "expand_as", "broadcast_to"),
    "split": ("split", "chunk", "tensor_split", "unbind"),
    "narrow": ("narrow",),
    "select": ("select",),
    "identity_like": ("contiguous", "clone", "detach", "to", "type", "float", "double", "half", "bfloat16", "type_as", "requires_grad_"),
    "compare": (
        "gt",
        "lt",
        "ge",
        "le",
        "eq",
        "ne",
        "greater",
        "less",
        "greater_equal",
        "less_equal",
        "not_equal",
        "__gt__",
        "__lt__",
        "__ge__",
        "__le__",
        "__eq__",
        "__ne__",
    ),
    "where": ("where",),
    "masked_fill": ("masked_fill", "masked_fill_"),
    "topk": ("topk",),
    "argmax": ("argmax", "argmin"),
    "metadata": ("size", "dim", "numel", "get_device", "is_contiguous", "is_floating_point"),
    "constant_like": ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"),
    "random_fill": ("bernoulli_", "uniform_", "normal_", "fill_", "zero_", "exponential_", "random_", "bernoulli"),
}
_METHOD_OPS = {m: name for name, methods in _METHODS.items() for m in methods}


def method_op(method: str) -> str | None:
    """Canonical op name of a ``call_method`` target (``None`` if unknown); user registrations first."""
    return _CUSTOM_METHODS.get(method) or _METHOD_OPS.get(method)


#: tensor attributes that only read metadata
METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"})

# -- modules (exact types) --------------------------------------------------------------
_MODULES: dict[str, tuple[type, ...]] = {
    "linear": (nn.Linear,),
    "conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d),
    "conv_transpose": (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    "batch_norm": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
    "layer_norm": (nn.LayerNorm,),
    "group_norm": (nn.GroupNorm,),
    "rms_norm": tuple(m for m in (getattr(nn, "RMSNorm", None),) if m is not None),
    "embedding": (nn.Embedding,),
    "mha": (nn.MultiheadAttention,),
    "prelu": (nn.PReLU,),
    "identity": (nn.Identity,),
    "dropout": (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d),
    "relu": (nn.ReLU,),
    "leaky_relu": (nn.LeakyReLU,),
    "relu6": (nn.ReLU6,),
    "hardtanh": (nn.Hardtanh,),
    "gelu": (nn.GELU,),
    "silu": (nn.SiLU,),
    "sigmoid": (nn.Sigmoid,),
    "tanh": (nn.Tanh,),
    "hardswish": (nn.Hardswish,),
    "hardsigmoid": (nn.Hardsigmoid,),
    "mish": (nn.Mish,),
    "elu": (nn.ELU,),
    "selu": (nn.SELU,),
    "celu": (nn.CELU,),
    "softplus": (nn.Softplus,),
    "softsign": (nn.Softsign,),
    "softmax": (nn.Softmax,),
    "log_softmax": (nn.LogSoftmax,),
    "reshape": (nn.Flatten, nn.Unflatten),
    "avg_pool": (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    "max_pool": (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    "interpolate": (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d),
}
_MODULE_OPS = {t: name for name, types in _MODULES.items() for t in types}


def module_op(module: nn.Module) -> str | None:
    """Canonical op name of a leaf module, by exact type (subclasses are traced through); user registrations first."""
    return _CUSTOM_MODULES.get(type(module)) or _MODULE_OPS.get(type(module))


# -- user registrations (``teleopt.detection.register_op_rule``) -------------------------
_CUSTOM_FUNCTIONS: dict[int, tuple[object, str]] = {}  # id(target) -> (target, op); the target is kept alive
_CUSTOM_METHODS: dict[str, str] = {}
_CUSTOM_MODULES: dict[type, str] = {}


def _custom_function_op(fn: object) -> str | None:
    entry = _CUSTOM_FUNCTIONS.get(id(fn))
    if entry is None and isinstance(fn, torch._ops.OpOverload):  # a registered op covers its overloads
        entry = _CUSTOM_FUNCTIONS.get(id(fn.overloadpacket))
    return entry[1] if entry is not None else None


def set_custom_op(target: object, op: str | None) -> str | None:
    """Map a call target (function or op, method name, module type) to op ``op`` (``None``: remove); returns the previous op."""
    if isinstance(target, str):
        previous = _CUSTOM_METHODS.pop(target, None)
        if op is not None:
            _CUSTOM_METHODS[target] = op
    elif isinstance(target, type):
        previous = _CUSTOM_MODULES.pop(target, None)
        if op is not None:
            _CUSTOM_MODULES[target] = op
    else:
        entry = _CUSTOM_FUNCTIONS.pop(id(target), None)
        previous = entry[1] if entry is not None else None
        if op is not None:
            _CUSTOM_FUNCTIONS[id(target)] = (target, op)
    return previous


def user_op(target: object) -> str | None:
    """The op a user registration gave a call target (function or op, method name, module type), if any."""
    if isinstance(target, str):
        return _CUSTOM_METHODS.get(target)
    if isinstance(target, type):
        return _CUSTOM_MODULES.get(target)
    entry = _CUSTOM_FUNCTIONS.get(id(target))
    return entry[1] if entry is not None else None


def builtin_op(target: object) -> str | None:
    """The library's own op for a call target, ignoring user registrations."""
    if isinstance(target, str):
        return _METHOD_OPS.get(target)
    if isinstance(target, type):
        return _MODULE_OPS.get(target)
    return _builtin_function_op(target)


def custom_module_types() -> frozenset[type]:
    """Module types given a rule by the user: the tracer keeps them as leaves."""
    return frozenset(_CUSTOM_MODULES)


def identify_node(node: fx.Node, traced: TracedGraph) -> tuple[str | None, str]:
    """Canonical op name and a readable description of a traced node."""
    if node.op == "call_module":
        target = str(node.target)
        module = traced.modules.get(target)
        if target in traced.opaque:
            return None, f"untraceable module {type(module).__name__}"
        op = module_op(module) if module is not None else None
        return op, type(module).__name__ if module is not None else target
    if node.op == "call_method":
        return method_op(str(node.target)), f"Tensor.{node.target}"
    if node.op != "call_function":
        return None, node.op
    fn = node.target
    op = function_op(fn)
    if (
        op == "metadata"
        and fn in (operator.eq, operator.ne)
        and any(isinstance(a, fx.Node) and isinstance(traced.values.get(a.name), TensorMeta) for a in node.args)
    ):
        op = "compare"  # ``h == t`` on a tensor is a mask, not a shape check
    if op == "getitem":
        parent = node.args[0]
        value = traced.values.get(parent.name) if isinstance(parent, fx.Node) else None
        if isinstance(value, TensorMeta):
            return "getitem_view", "indexing"
        return "getitem_tuple", "getitem"
    if op == "getattr":
        attr = node.args[1]
        if attr in METADATA_ATTRIBUTES:
            return "metadata", f"getattr {attr}"
        if attr in ("T", "mT"):
            return "permute", f"Tensor.{attr}"
        return None, f"getattr {attr}"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", str(fn))
    module_name = getattr(fn, "__module__", None) or ""
    return op, f"{module_name + '.' if module_name else ''}{name}"


def is_user_op(node: fx.Node, traced: TracedGraph) -> bool:
    """Whether the node's target was given its rule by ``register_op_rule`` (the driver then seals it)."""
    if node.op == "call_module":
        module = traced.modules.get(str(node.target))
        return module is not None and type(module) in _CUSTOM_MODULES
    if node.op == "call_method":
        return str(node.target) in _CUSTOM_METHODS
    return node.op == "call_function" and _custom_function_op(node.target) is not None
