"""Rules of reductions and pooling: mean, sum, max/amax, pooling, resampling, padding.

A sum or mean over an axis is unchanged by permuting it and blocks scaling and GL
there; the kept axes pass positive scaling and permutations (Zhao 2026, Ex. 1.2.4,
1.2.9), and GL too when the reduction is linear (Ex. 1.2.2).  Pooling acts on the
trailing spatial axes only, which it mixes; a maximum is positively homogeneous
but not linear.  Constant padding with a nonzero value blocks scaling.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from teleopt.detection.fx_args import arg, dims_arg
from teleopt.detection.relations import ALL, DP, GD, G, P
from teleopt.detection.rules.context import OpRule, RuleContext
from teleopt.detection.tracing import TensorMeta

__all__ = ["RULES"]


def _reduce(ctx: RuleContext, linear: bool) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    xshape = ctx.meta(x)
    dim = dims_arg(node, 1, "dim")
    keepdim = bool(arg(node, 2, "keepdim", False))
    value = ctx.value(node)
    path = (0,) if isinstance(value, tuple) else ()
    out = ctx.output(path)
    dims = set(range(len(xshape))) if dim is None else {d % len(xshape) for d in dim}
    k = 0
    for i in range(len(xshape)):
        if i in dims:
            ctx.mention(P, (x, i))  # a sum/max over permuted entries is unchanged
            ctx.block(GD, (x, i), "reduces over this axis")
            if keepdim:
                k += 1
            continue
        ctx.unify(DP, (x, i), (out, k))
        if linear:
            ctx.unify(G, (x, i), (out, k))
        else:
            ctx.block(G, (x, i), "a maximum is not linear")
        k += 1


def _linear_reduce(ctx: RuleContext) -> None:
    _reduce(ctx, linear=True)


def _amax(ctx: RuleContext) -> None:
    _reduce(ctx, linear=False)


def _max(ctx: RuleContext) -> None:
    node = ctx.node
    second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("dim"))
    if isinstance(ctx.value(second), TensorMeta):
        ctx.fail_closed(ctx.describe)  # max(x, y) of two tensors: elementwise, not a reduction
        return
    _reduce(ctx, linear=False)


_SPATIAL_DIMS: dict[Any, int] = {
    **{f: k for k, fs in ((1, (F.avg_pool1d, F.max_pool1d, F.adaptive_avg_pool1d, F.adaptive_max_pool1d)),
                          (2, (F.avg_pool2d, F.max_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d)),
                          (3, (F.avg_pool3d, F.max_pool3d, F.adaptive_avg_pool3d, F.adaptive_max_pool3d))) for f in fs},
    **{m: k for k, ms in ((1, (nn.AvgPool1d, nn.MaxPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)),
                          (2, (nn.AvgPool2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)),
                          (3, (nn.AvgPool3d, nn.MaxPool3d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d))) for m in ms},
}  # fmt: skip


def _pool(ctx: RuleContext, linear: bool) -> None:
    node = ctx.node
    k = _SPATIAL_DIMS.get(type(ctx.module) if node.op == "call_module" else node.target, 0)
    if not isinstance(ctx.value(node), TensorMeta):
        ctx.fail_closed(ctx.describe)
        return
    x, out = ctx.tensor(node.args[0]), ctx.output()
    n = len(ctx.meta(x))
    for i in range(n - k):
        ctx.unify(DP, (x, i), (out, i))
        if linear:
            ctx.unify(G, (x, i), (out, i))
        else:
            ctx.block(G, (x, i), "max pooling is not linear")
    for i in range(n - k, n):
        ctx.block(ALL, (x, i), "pooling mixes positions")
        ctx.block(ALL, (out, i), "pooling mixes positions")


def _avg_pool(ctx: RuleContext) -> None:
    _pool(ctx, linear=True)


def _max_pool(ctx: RuleContext) -> None:
    _pool(ctx, linear=False)


def _interpolate(ctx: RuleContext) -> None:
    x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    n = len(ctx.meta(x))
    for i in range(min(2, n)):
        ctx.unify(ALL, (x, i), (out, i))
    for i in range(2, n):
        ctx.block(ALL, (x, i), "resampling mixes positions")
        ctx.block(ALL, (out, i), "resampling mixes positions")


def _pad(ctx: RuleContext) -> None:
    node = ctx.node
    pad = arg(node, 1, "pad")
    if not isinstance(pad, (list, tuple)):
        raise TypeError(f"pad must be a sequence, got {pad!r}")
    mode = arg(node, 2, "mode", "constant")
    value = arg(node, 3, "value", None)
    x, out = ctx.tensor(node.args[0]), ctx.output()
    n = len(ctx.meta(x))
    padded = len(pad) // 2
    for i in range(n):
        if i >= n - padded and any(pad[2 * (n - 1 - i) : 2 * (n - 1 - i) + 2]):
            ctx.block(ALL, (x, i), "padding changes this axis")
            ctx.block(ALL, (out, i), "padding changes this axis")
        elif mode == "constant" and value not in (None, 0, 0.0):
            ctx.unify(P, (x, i), (out, i))
        else:
            ctx.unify(ALL, (x, i), (out, i))


RULES: dict[str, OpRule] = {
    "mean": _linear_reduce,
    "sum": _linear_reduce,
    "amax": _amax,
    "max": _max,
    "avg_pool": _avg_pool,
    "max_pool": _max_pool,
    "interpolate": _interpolate,
    "pad": _pad,
}
