"""Rules of elementwise arithmetic: add, sub, mul, div (with broadcasting) and timm's masked add.

A sum of two tensors passes every group acting alike on both (a residual stream,
Zhao 2026, Sec. 1.2); adding a constant blocks scaling and GL.  A product of two
tensors varying along an axis passes permutations, and positive scaling through
out = a**ea * b**eb once the classes of a and b are known (``NodeContext.product``);
a per-channel parameter factor (LayerScale) absorbs the scaling of its input and
writes that of its output.  A scalar factor passes everything; ``scalar / x`` is
homogeneous of degree -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from teleopt.detection.relations import ALL, GD, D, G, P, ParamView, Ref
from teleopt.detection.rules.context import OpRule, RuleContext, align
from teleopt.detection.tracing import TensorMeta

__all__ = ["RULES", "binary"]

Handle = tuple[Ref, int]


def _operand(ctx: RuleContext, arg: Any) -> tuple[str, Any]:
    if isinstance(arg, fx.Node):
        view = ctx.view_of(arg)
        if view is not None:
            return "view", arg
        value = ctx.value(arg)
        if isinstance(value, TensorMeta):
            if value.is_float:
                return "tensor", ctx.tensor(arg)
            # a mask a rule followed (a comparison, one_hot) keeps its classes; any other is fixed
            return "tensor", ctx.tensor(arg)
        return "scalar", value
    return "scalar", arg


def binary(ctx: RuleContext, op: str) -> None:
    """The rule of ``op`` in ``add``, ``sub``, ``mul``, ``div`` on the node's two operands."""
    node = ctx.node
    a_arg = node.args[0]
    b_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    ka, a = _operand(ctx, a_arg)
    kb, b = _operand(ctx, b_arg)
    if ka == "scalar" and kb == "scalar":  # constants (or python values: shape tuples joined with +)
        for ref in ctx.outputs():
            ctx.block_tensor(ALL, ref, "arithmetic on constants")
        return
    out = ctx.output()
    oshape = ctx.meta(out)
    if ka == "scalar" or kb == "scalar":
        scalar, tensor_kind, t_arg = (a, kb, b) if ka == "scalar" else (b, ka, a)
        t = ctx.tensor(t_arg) if tensor_kind == "view" else t_arg
        _scalar_binary(ctx, op, t, scalar, out, scalar_first=(ka == "scalar"))
        return
    if op in ("add", "sub"):
        ta = ctx.tensor(a) if ka == "view" else a
        tb = ctx.tensor(b) if kb == "view" else b
        _add(ctx, ta, tb, out, oshape)
        return
    ea, eb = (1.0, 1.0) if op == "mul" else (1.0, -1.0)
    if (ka == "view") != (kb == "view") and _movable(ctx, ctx.view_of(a if ka == "view" else b)):
        _scale_by_parameter(ctx, a, b, ka, ea, eb, out, oshape)
        return
    ta = ctx.tensor(a) if ka == "view" else a
    tb = ctx.tensor(b) if kb == "view" else b
    _product(ctx, ta, tb, ea, eb, out, oshape)


def _movable(ctx: RuleContext, view: ParamView | None) -> bool:
    """A parameter a site may move (fixed buffers and constants are plain fixed operands)."""
    return view is not None and view.kind == "parameter" and view.name in ctx.rel.tensors.movable


def _scalar_binary(ctx: RuleContext, op: str, t: Ref, scalar: Any, out: Ref, scalar_first: bool) -> None:
    n = len(ctx.meta(out))
    handles = [(h, i) for h, i in ((align(ctx, t, out, i), i) for i in range(n)) if h is not None]
    if op in ("add", "sub"):
        shift = isinstance(scalar, (int, float)) and scalar == 0
        for h, i in handles:
            ctx.unify(P, h, (out, i))
            power = -1.0 if op == "sub" and scalar_first else 1.0
            if shift:
                ctx.unify(GD, h, (out, i), power)
            else:
                ctx.block(GD, h, "adding a constant is not linear")
                ctx.block(GD, (out, i), "adding a constant is not linear")
        return
    if op == "mul" or (op == "div" and not scalar_first):
        for h, i in handles:
            ctx.unify(ALL, h, (out, i))
        return
    for h, i in handles:  # scalar / tensor: homogeneous of degree -1
        ctx.unify(P, h, (out, i))
        ctx.unify(D, h, (out, i), -1.0)
        ctx.block(G, h, "a reciprocal is not linear")


def _add(ctx: RuleContext, ta: Ref, tb: Ref, out: Ref, oshape: tuple[int, ...]) -> None:
    for j in range(len(oshape)):
        full = []
        for t in (ta, tb):
            h = align(ctx, t, out, j)
            if h is None:
                continue
            if ctx.meta(t)[h[1]] == oshape[j]:
                full.append(h)
            else:
                ctx.block(ALL, h, "broadcast axis")
        for h in full:
            ctx.unify(ALL, h, (out, j))
        if len(full) < 2 and oshape[j] > 1:
            ctx.block(GD, (out, j), "adds a tensor that is constant along this axis")


def _full(ctx: RuleContext, t: Ref, h: Handle | None, n: int) -> Handle | None:
    """The aligned axis if it has the output's full length (not broadcast), else ``None``."""
    return h if h is not None and ctx.meta(t)[h[1]] == n else None


def _product(ctx: RuleContext, ta: Ref, tb: Ref, ea: float, eb: float, out: Ref, oshape: tuple[int, ...]) -> None:
    for j in range(len(oshape)):
        ha, hb = align(ctx, ta, out, j), align(ctx, tb, out, j)
        fa, fb = _full(ctx, ta, ha, oshape[j]), _full(ctx, tb, hb, oshape[j])
        if oshape[j] == 1:
            for h in (ha, hb):
                if h is not None:
                    ctx.unify(ALL, h, (out, j))
            continue
        if fa is not None and fb is not None:
            ctx.unify(P, fa, (out, j))
            ctx.unify(P, fb, (out, j))
            for h in (fa, fb, (out, j)):
                ctx.block(G, h, "an elementwise product of two tensors varying along this axis is not linear")
            ctx.product(fa, fb, (out, j), ea, eb)
            continue
        (hf, ef), hs = ((fa, ea), hb) if fa is not None else ((fb, eb), ha)
        if hs is not None:
            ctx.block(ALL, hs, "broadcast axis")
        if hf is None:  # neither operand varies along an output axis longer than 1: not a broadcast
            raise ValueError(f"no operand spans output axis {j}")
        ctx.unify(P, hf, (out, j))
        ctx.unify(D, hf, (out, j), ef)
        if ef == 1:
            ctx.unify(G, hf, (out, j))


@dataclass(frozen=True)
class _ParameterFactor:
    """``out = x**ex * v**ev`` with ``v`` a movable parameter, seen as its value and its two roles."""

    x: Ref
    ex: float
    value: Ref  # v as the operand
    absorbs: Ref  # v absorbing the scaling of x
    writes: Ref  # v writing the scaling of out
    ev: float


def _scale_by_parameter(ctx: RuleContext, a: Any, b: Any, ka: str, ea: float, eb: float, out: Ref, oshape: tuple[int, ...]) -> None:
    """out = x^ex * v^ev with v a parameter: v absorbs the scaling of x and writes the scaling of out."""
    if ka == "view":
        v_arg, x, ev, ex = a, b, ea, eb
    else:
        v_arg, x, ev, ex = b, a, eb, ea
    v_val = ctx.tensor(v_arg, role="value")
    v_in = ctx.tensor(v_arg, role="absorbs")
    v_out = ctx.tensor(v_arg, role="writes")
    factor = _ParameterFactor(x, ex, v_val, v_in, v_out, ev)
    for j in range(len(oshape)):
        _scale_axis(ctx, factor, (out, j), oshape[j])


def _scale_axis(ctx: RuleContext, f: _ParameterFactor, o: Handle, n: int) -> None:
    """Output axis ``o`` (length ``n``) of ``x**ex * v**ev``: which operand varies along it says how it scales."""
    out, j = o
    hx, hv = align(ctx, f.x, out, j), align(ctx, f.value, out, j)
    if n == 1:
        for h in (hx, hv):
            if h is not None:
                ctx.unify(ALL, h, o)
        return
    fx_, fv = _full(ctx, f.x, hx, n), _full(ctx, f.value, hv, n)
    if fx_ is not None and fv is not None:
        ctx.unify(P, fx_, o)
        ctx.unify(P, fv, o)
        for h in (fx_, fv, o):
            ctx.block(G, h, "multiplies by a per-channel parameter (not GL-equivariant)")
        ctx.unify(D, fx_, (f.absorbs, fv[1]), -f.ex / f.ev)
        ctx.unify(D, o, (f.writes, fv[1]), 1.0 / f.ev)
    elif fx_ is not None:
        if hv is not None:
            ctx.block(ALL, hv, "broadcast axis")
        ctx.unify(P, fx_, o)
        ctx.unify(D, fx_, o, f.ex)
        if f.ex == 1:
            ctx.unify(G, fx_, o)
    else:
        _scale_by_parameter_only(ctx, f, o, hx, hv)


def _scale_by_parameter_only(ctx: RuleContext, f: _ParameterFactor, o: Handle, hx: Handle | None, hv: Handle | None) -> None:
    """An output axis along which only ``v`` varies: ``v`` writes its scaling (``x`` is broadcast)."""
    if hx is not None:
        ctx.block(ALL, hx, "broadcast axis")
    if hv is None:
        raise ValueError(f"no operand spans output axis {o[1]}")
    ctx.unify(P, hv, o)
    ctx.unify(D, o, (f.writes, hv[1]), 1.0 / f.ev)
    ctx.block(G, o, "multiplies by a per-channel parameter (not GL-equivariant)")


def _maybe_add_mask(ctx: RuleContext) -> None:
    mask = ctx.arg(1, "attn_mask")
    if mask is None or ctx.value(mask) is None:
        ctx.same(ctx.node.args[0])
    else:
        binary(ctx, "add")


def _rule(op: str) -> OpRule:
    def rule(ctx: RuleContext) -> None:
        binary(ctx, op)

    rule.__name__ = rule.__qualname__ = f"rule_{op}"
    return rule


RULES: dict[str, OpRule] = {
    "add": _rule("add"),
    "sub": _rule("sub"),
    "mul": _rule("mul"),
    "div": _rule("div"),
    "maybe_add_mask": _maybe_add_mask,
}
