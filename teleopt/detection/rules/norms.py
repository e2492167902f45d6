"""Rules of normalisation layers: BatchNorm, LayerNorm, RMSNorm, GroupNorm.

BatchNorm's output scaling is written by its affine weight and bias (exact); scaling
its input is invariant up to eps with the running mean times c and the running
variance times c^2 (Zhao 2026, Ex. 1.2.7, declared approximate).  LayerNorm,
RMSNorm and GroupNorm normalise: they block scaling and GL of their input, and
permutations pass with their affine parameters permuted (GroupNorm: only with one
group or one channel per group).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from teleopt.detection.fx_args import arg, float_arg, int_arg
from teleopt.detection.relations import GD, D, G, P, Ref
from teleopt.detection.rules.context import OpRule, RuleContext

__all__ = ["RULES", "normalise"]


def _optional(ctx: RuleContext, i: int, name: str, role: str, movable: bool = False) -> Ref | None:
    a = arg(ctx.node, i, name)
    return ctx.tensor(a, role=role, movable=movable) if isinstance(a, fx.Node) else None


def _batch_norm(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    eps: float
    if node.op == "call_module":
        m: Any = ctx.module
        rm = ctx.param(m, "running_mean", "running_mean", movable=True)
        rv = ctx.param(m, "running_var", "running_var", movable=True)
        w, b, eps = ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias"), m.eps
    else:
        rm = _optional(ctx, 1, "running_mean", "running_mean", True)
        rv = _optional(ctx, 2, "running_var", "running_var", True)
        w, b = _optional(ctx, 3, "weight", "weight"), _optional(ctx, 4, "bias", "bias")
        eps = float_arg(node, 7, "eps", 1e-5)
    out = ctx.output()
    n = len(ctx.meta(x))
    ch = 1
    ctx.unify(P, (x, ch), (out, ch))
    for t in (rm, rv, w, b):
        if t is not None:
            ctx.unify(P, (x, ch), (t, 0))
    if rm is not None:
        ctx.unify(D, (x, ch), (rm, 0))
    if rv is not None:
        ctx.unify(D, (x, ch), (rv, 0), 2.0)
    ctx.approximate((x, ch), f"BatchNorm input scaling is exact only up to eps={eps:g}")
    ctx.mention(D, (x, ch))
    if w is not None:
        ctx.unify(D, (out, ch), (w, 0))
        if b is not None:
            ctx.unify(D, (out, ch), (b, 0))
    else:
        ctx.block(D, (out, ch), "a BatchNorm without affine weight cannot absorb a scaling of its output")
    ctx.block(G, (x, ch), "BatchNorm normalises each channel")
    ctx.block(G, (out, ch), "BatchNorm normalises each channel")
    for i in range(n):
        if i != ch:
            ctx.unify(P, (x, i), (out, i))
            ctx.block(GD, (x, i), "BatchNorm statistics mix this axis")


def normalise(ctx: RuleContext, x: Ref, w: Ref | None, b: Ref | None, axes: list[int], what: str) -> None:
    """``what`` normalises ``x`` over ``axes``, with optional affine weight ``w`` and bias ``b`` on them."""
    out = ctx.output()
    n = len(ctx.meta(x))
    for j, ax in enumerate(axes):
        ctx.unify(P, (x, ax), (out, ax))
        for t in (w, b):
            if t is not None:
                ctx.unify(P, (x, ax), (t, j))
        ctx.block(GD, (x, ax), f"{what} normalises over this axis")
        if w is not None:
            ctx.unify(D, (out, ax), (w, j))
            if b is not None:
                ctx.unify(D, (out, ax), (b, j))
        else:
            ctx.block(D, (out, ax), f"{what} has no affine weight to absorb a scaling of its output")
        ctx.block(G, (out, ax), f"{what} output is not GL-equivariant")
    for i in range(n):
        if i not in axes:
            ctx.unify(P, (x, i), (out, i))
            ctx.block(GD, (x, i), f"{what} is not linear")


def _normalized_dims(value: Any) -> int:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"normalized_shape must be a sequence, got {type(value).__name__}")
    return len(value)


def _layer_norm(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    n = len(ctx.meta(x))
    if node.op == "call_module":
        m: Any = ctx.module
        k = len(m.normalized_shape)
        w, b = ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias")
    else:
        k = _normalized_dims(arg(node, 1, "normalized_shape"))
        w, b = _optional(ctx, 2, "weight", "weight"), _optional(ctx, 3, "bias", "bias")
    normalise(ctx, x, w, b, list(range(n - k, n)), "LayerNorm")


def _rms_norm(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    n = len(ctx.meta(x))
    if node.op == "call_module":
        m: Any = ctx.module
        k = len(m.normalized_shape)
        w = ctx.param(m, "weight", "weight")
    else:
        k = _normalized_dims(arg(node, 1, "normalized_shape"))
        w = _optional(ctx, 2, "weight", "weight")
    normalise(ctx, x, w, None, list(range(n - k, n)), "RMSNorm")


def _group_norm(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    if node.op == "call_module":
        m: Any = ctx.module
        groups, w, b = m.num_groups, ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias")
    else:
        groups = int_arg(node, 1, "num_groups")
        w, b = _optional(ctx, 2, "weight", "weight"), _optional(ctx, 3, "bias", "bias")
    out = ctx.output()
    xs = ctx.meta(x)
    c = xs[1]
    if groups in (1, c):
        ctx.unify(P, (x, 1), (out, 1))
        for t in (w, b):
            if t is not None:
                ctx.unify(P, (x, 1), (t, 0))
    else:
        why = f"GroupNorm with {groups} groups mixes the statistics of channels within a group"
        ctx.block(P, (x, 1), why)
        ctx.block(P, (out, 1), why)
    ctx.block(GD, (x, 1), "GroupNorm normalises over this axis")
    if w is not None:
        ctx.unify(D, (out, 1), (w, 0))
        if b is not None:
            ctx.unify(D, (out, 1), (b, 0))
    else:
        ctx.block(D, (out, 1), "GroupNorm has no affine weight to absorb a scaling of its output")
    ctx.block(G, (out, 1), "GroupNorm output is not GL-equivariant")
    for i in range(len(xs)):
        if i != 1:
            ctx.unify(P, (x, i), (out, i))
            ctx.block(GD, (x, i), "GroupNorm statistics mix this axis")


RULES: dict[str, OpRule] = {
    "batch_norm": _batch_norm,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "group_norm": _group_norm,
}
