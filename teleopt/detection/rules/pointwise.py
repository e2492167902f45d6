"""Rules of pointwise ops: activations, powers, clamps, dropout, PReLU, identities.

Every pointwise map commutes with permutations (Zhao 2026, Ex. 1.2.9); one that is
positively homogeneous of degree alpha passes positive scaling with power alpha
(Ex. 1.2.4); a linear one passes GL (Ex. 1.2.2).  Dropout passes positive scaling
only: its masks are drawn independently per entry in training.
"""

from __future__ import annotations

import math
from typing import Any

from teleopt.detection.fx_args import arg, nodes_in
from teleopt.detection.ops import POINTWISE, Pointwise
from teleopt.detection.relations import DP, D, G, P
from teleopt.detection.rules.context import OpRule, RuleContext
from teleopt.detection.tracing import TensorMeta

__all__ = ["RULES", "pointwise", "pointwise_rule"]


def pointwise(ctx: RuleContext, pw: Pointwise, x_arg: Any) -> None:
    """out = f(x) entry by entry, with the symmetry properties of ``pw``."""
    x, out = ctx.tensor(x_arg), ctx.output()
    for i in range(len(ctx.meta(out))):
        ctx.unify(P, (x, i), (out, i))
        if pw.degree is not None:
            ctx.unify(D, (x, i), (out, i), pw.degree)
        else:
            ctx.block(D, (x, i), f"{ctx.describe} is not positively homogeneous")
            ctx.block(D, (out, i), f"{ctx.describe} is not positively homogeneous")
        if pw.linear:
            ctx.unify(G, (x, i), (out, i))
        else:
            ctx.block(G, (x, i), f"{ctx.describe} is not linear")
            ctx.block(G, (out, i), f"{ctx.describe} is not linear")


def pointwise_rule(*, degree: float | None = None, linear: bool = False, arg: int = 0) -> OpRule:
    """A rule for an op that is pointwise in its positional argument ``arg``, its only tensor argument.

    ``degree``: the op is positively homogeneous of this degree, f(c x) = c**degree f(x)
    for c > 0 (positive scaling passes, Zhao 2026, Ex. 1.2.4); ``None``: it is not, so
    only permutations pass (Ex. 1.2.9).  ``linear=True``: f is linear (GL passes,
    Ex. 1.2.2), which needs ``degree=1``.
    """
    if degree is not None and (isinstance(degree, bool) or not isinstance(degree, (int, float)) or not math.isfinite(degree)):
        raise TypeError(f"degree must be a finite number or None, got {degree!r}")
    if degree == 0:
        raise ValueError("degree must be nonzero: an op with f(c x) = f(x) forgets the scaling, it does not pass it")
    if not isinstance(linear, bool):
        raise TypeError(f"linear must be a bool, got {type(linear).__name__}")
    if linear and degree != 1:
        raise ValueError(f"a linear op is homogeneous of degree 1; got linear=True with degree={degree!r}")
    if isinstance(arg, bool) or not isinstance(arg, int) or arg < 0:
        raise TypeError(f"arg must be a non-negative int (a positional argument), got {arg!r}")
    pw = Pointwise("custom", None if degree is None else float(degree), linear)

    def rule(ctx: RuleContext) -> None:
        x = ctx.node.args[arg]
        others = [a for a in nodes_in((ctx.node.args, ctx.node.kwargs)) if a is not x and ctx.is_operand(a)]
        if others:  # permuting x alone is not a symmetry when other tensors vary along the same axes
            raise TypeError(
                f"pointwise_rule(arg={arg}) is for ops whose other arguments are not tensors; "
                f"{ctx.describe} also reads {others[0].name} (write a rule(ctx) for it)"
            )
        pointwise(ctx, pw, x)

    rule.__doc__ = f"pointwise in argument {arg} (degree={degree}, linear={linear})"
    return rule


def _activation(name: str) -> OpRule:
    pw = POINTWISE[name]

    def rule(ctx: RuleContext) -> None:
        pointwise(ctx, pw, ctx.node.args[0])

    rule.__name__ = rule.__qualname__ = f"rule_{name}"
    return rule


def _identity(ctx: RuleContext) -> None:
    if not isinstance(ctx.value(ctx.node), TensorMeta):  # x.type() without a dtype: the type's name
        ctx.constant()
        return
    ctx.same(ctx.node.args[0])


def _dropout(ctx: RuleContext) -> None:
    node = ctx.node
    p = ctx.module.p if node.op == "call_module" else arg(node, 1, "p", 0.5)
    if not p:
        ctx.same(node.args[0])
        return
    x, out = ctx.tensor(node.args[0]), ctx.output()
    for i in range(len(ctx.meta(out))):
        ctx.unify(D, (x, i), (out, i))
        why = f"dropout (p={p}) draws independent random masks in training"
        ctx.block(("general", "permutation"), (x, i), why)
        ctx.block(("general", "permutation"), (out, i), why)


def _clamp(ctx: RuleContext) -> None:
    lo, hi = ctx.arg(1, "min"), ctx.arg(2, "max")
    pointwise(ctx, POINTWISE["relu" if lo == 0 and hi is None else "hardtanh"], ctx.node.args[0])


def _power(ctx: RuleContext, x_arg: Any, e: float) -> None:
    x, out = ctx.tensor(x_arg), ctx.output()
    for i in range(len(ctx.meta(out))):
        ctx.unify(P, (x, i), (out, i))
        if e != 0:
            ctx.unify(D, (x, i), (out, i), e)
        if e == 1:
            ctx.unify(G, (x, i), (out, i))


def _pow(ctx: RuleContext) -> None:
    node = ctx.node
    e = ctx.value(node.args[1]) if len(node.args) > 1 else node.kwargs.get("exponent")
    if not isinstance(e, (int, float)) or isinstance(e, bool) or not ctx.is_operand(node.args[0]):
        ctx.fail_closed(ctx.describe)
        return
    _power(ctx, node.args[0], float(e))


def _square(ctx: RuleContext) -> None:
    _power(ctx, ctx.node.args[0], 2.0)


def _prelu(ctx: RuleContext) -> None:
    node = ctx.node
    if node.op == "call_module":
        x = ctx.tensor(node.args[0])
        w = ctx.param(ctx.module, "weight", "slope")
    else:
        x, w = ctx.tensor(node.args[0]), ctx.tensor(node.args[1], role="slope")
    out = ctx.output()
    shape = ctx.meta(out)
    ch = 1 if len(shape) >= 2 else 0
    for i in range(len(shape)):
        ctx.unify(DP, (x, i), (out, i))
        ctx.block(G, (x, i), "PReLU is not linear")
    if w is not None and ctx.meta(w) and ctx.meta(w)[0] == shape[ch] and shape[ch] > 1:
        ctx.unify(P, (x, ch), (w, 0))  # slopes are permuted with their channels, never scaled


RULES: dict[str, OpRule] = {
    **{name: _activation(name) for name in POINTWISE if name != "identity"},
    "pointwise": pointwise_rule(),
    "identity": _identity,
    "identity_like": _identity,
    "dropout": _dropout,
    "clamp": _clamp,
    "pow": _pow,
    "square": _square,
    "prelu": _prelu,
}
