"""Rules of comparisons and of what selects entries by value: masks, ``where``, ``topk``, ``argmax``, ``one_hot``.

A comparison ``m = (h > t)`` works entry by entry, so it commutes with permutations
(Zhao 2026, Ex. 1.2.9) when the threshold is a scalar or is permuted with h.  It
commutes with positive scaling only when the threshold scales too: a sign test
(t = 0) is invariant, m(c h) = m(h), so the mask is fixed for scaling and leaves the
scaling of h free; any other threshold blocks the scaling of h.  GL never passes.

A product with a mask (``h * m``, ``where(m, h, 0)``, ``masked_fill(h, m, 0)``) is the
product rule (``NodeContext.product``): h's scaling passes when the mask is fixed
for scaling (``h * (h > 0)`` is ReLU), and is blocked when both factors would move.

``topk`` and ``argmax``/``argmin`` select along an axis by value: a per-channel
scaling or a permutation of that axis changes which entries win in a way no axis
class follows (the indices are data), so that axis is frozen; the other axes pass
permutations, and positive scaling (the selected values scale, the indices do not).
``one_hot`` of indices passes the index axes and fixes the new class axis.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from teleopt.detection.fx_args import arg, int_arg
from teleopt.detection.relations import ALL, D, G, P, Ref
from teleopt.detection.rules.context import OpRule, RuleContext, align
from teleopt.detection.tracing import TensorMeta

__all__ = ["RULES", "is_zeros"]


def is_zeros(node: Any) -> bool:
    """A tensor of zeros built in forward (``torch.zeros_like``, ``torch.zeros``, ``Tensor.new_zeros``)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == "new_zeros"
    return node.op == "call_function" and node.target in (torch.zeros_like, torch.zeros)


def _is_tensor_arg(ctx: RuleContext, a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(ctx.value(a), TensorMeta)


def _elementwise(ctx: RuleContext, operands: list[Ref], out: Ref) -> list[list[tuple[Ref, int] | None]]:
    """Tie every operand axis spanning an output axis to it for permutations; broadcast axes are frozen.

    Returns, per output axis, the full-length handle of each operand (``None`` where it is broadcast or absent).
    """
    oshape = ctx.meta(out)
    full: list[list[tuple[Ref, int] | None]] = []
    for j in range(len(oshape)):
        row: list[tuple[Ref, int] | None] = []
        for t in operands:
            h = align(ctx, t, out, j)
            if h is not None and ctx.meta(t)[h[1]] == oshape[j]:
                ctx.unify(P, h, (out, j))
                row.append(h)
            else:
                if h is not None:
                    ctx.block(ALL, h, "broadcast axis")
                row.append(None)
        full.append(row)
    return full


def _compare(ctx: RuleContext) -> None:
    node = ctx.node
    if not isinstance(ctx.value(node), TensorMeta):  # a comparison of sizes or python numbers
        ctx.constant()
        return
    a_arg = node.args[0]
    b_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
    tensors = [a for a in (a_arg, b_arg) if _is_tensor_arg(ctx, a)]
    scalars = [ctx.value(a) for a in (a_arg, b_arg) if not _is_tensor_arg(ctx, a)]
    refs = [ctx.tensor(a) for a in tensors]
    out = ctx.output()
    full = _elementwise(ctx, refs, out)
    sign_test = len(refs) == 1 and len(scalars) == 1 and isinstance(scalars[0], (int, float)) and scalars[0] == 0
    for j, row in enumerate(full):
        handles = [h for h in row if h is not None]
        if sign_test:
            for h in handles:
                ctx.mention(D, h)  # m(c h) = m(h) for c > 0: no constraint on h
            ctx.block(D, (out, j), "a sign test is invariant under positive scaling (the mask does not scale)")
        else:
            for h in handles:
                ctx.block(D, h, f"{ctx.describe} compares with a threshold that does not scale")
            ctx.block(D, (out, j), "a mask does not scale")
        for h in handles:
            ctx.block(G, h, f"{ctx.describe} is not linear")
        ctx.block(G, (out, j), "a mask is not linear")


def _select(ctx: RuleContext, cond_arg: Any, a_arg: Any, b_arg: Any) -> None:
    """out = a where cond else b (entry by entry, with broadcasting)."""
    # a zero filler built in forward is left out: zero is fixed by every group
    operands = [x for x in (cond_arg, a_arg, b_arg) if _is_tensor_arg(ctx, x) and not (x is not cond_arg and is_zeros(x))]
    refs = {id(x): ctx.tensor(x) for x in operands}
    out = ctx.output()
    full = _elementwise(ctx, [refs[id(x)] for x in operands], out)

    def zero(x: Any) -> bool:
        return is_zeros(x) or (not _is_tensor_arg(ctx, x) and isinstance(ctx.value(x), (int, float)) and ctx.value(x) == 0)

    # out = x * mask with mask = cond (or not cond): scaling passes through the product rule
    kept = b_arg if zero(a_arg) else a_arg if zero(b_arg) else None
    kept_float = kept is not None and not is_zeros(kept) and ctx.is_tensor(kept)
    for j, row in enumerate(full):
        handles = dict(zip([id(x) for x in operands], row))
        for h in row:
            if h is not None:
                ctx.block(G, h, f"{ctx.describe} is not linear")
        ctx.block(G, (out, j), f"{ctx.describe} is not linear")
        hx = handles.get(id(kept)) if kept_float else None
        hc = handles.get(id(cond_arg))
        if hx is None:
            for h in row:
                if h is not None:
                    ctx.block(D, h, f"{ctx.describe} selects between values that do not scale alike")
            ctx.block(D, (out, j), f"{ctx.describe} selects between values that do not scale alike")
            continue
        for x in operands:  # the zero filler (a constant) is not scaled
            h = handles.get(id(x))
            if h is not None and x is not kept and x is not cond_arg:
                ctx.block(D, h, "a constant filler")
        if hc is None:
            ctx.unify(D, hx, (out, j))
        else:
            ctx.product(hx, hc, (out, j))


def _where(ctx: RuleContext) -> None:
    node = ctx.node
    if node.op == "call_method":  # x.where(cond, y) = torch.where(cond, x, y)
        _select(ctx, arg(node, 1, "condition"), node.args[0], arg(node, 2, "other"))
        return
    if len(node.args) + len(node.kwargs) < 3:
        raise TypeError("torch.where(condition) returns indices: no rule")
    _select(ctx, arg(node, 0, "condition"), arg(node, 1, "input"), arg(node, 2, "other"))


def _masked_fill(ctx: RuleContext) -> None:
    node = ctx.node
    _select(ctx, arg(node, 1, "mask"), arg(node, 2, "value"), node.args[0])


def _select_along(ctx: RuleContext, x: Ref, dim: int, outs: list[tuple[Ref, bool]], keepdim: bool) -> None:
    """Entries of ``x`` picked by value along ``dim``; outs: (tensor, whether it carries x's values)."""
    n = len(ctx.meta(x))
    ctx.block(ALL, (x, dim), f"{ctx.describe} selects along this axis by value")
    for out, values in outs:
        k = 0
        for i in range(n):
            if i == dim:
                if keepdim:
                    ctx.block(ALL, (out, k), f"{ctx.describe} selects along this axis by value")
                    k += 1
                continue
            ctx.unify(P, (x, i), (out, k))
            if values:
                ctx.unify(D, (x, i), (out, k))
            else:
                ctx.mention(D, (x, i))  # the indices do not change when x is scaled
                ctx.block(D, (out, k), "indices do not scale")
            ctx.block(G, (x, i), f"{ctx.describe} is not linear")
            ctx.block(G, (out, k), f"{ctx.describe} is not linear")
            k += 1


def _argmax(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    out = ctx.output()
    dim = arg(node, 1, "dim")
    if dim is None:
        ctx.block_tensor(ALL, x, f"{ctx.describe} over all entries")
        ctx.block_tensor(ALL, out, f"{ctx.describe} over all entries")
        return
    _select_along(ctx, x, int_arg(node, 1, "dim") % len(ctx.meta(x)), [(out, False)], bool(arg(node, 2, "keepdim", False)))


def _topk(ctx: RuleContext) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    value = ctx.value(node)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("topk returns (values, indices)")
    dim = int_arg(node, 2, "dim", -1) % len(ctx.meta(x))
    values, indices = ctx.output((0,)), ctx.output((1,))
    _select_along(ctx, x, dim, [(values, True), (indices, False)], keepdim=True)


def _one_hot(ctx: RuleContext) -> None:
    idx, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    for i in range(len(ctx.meta(idx))):
        ctx.unify(ALL, (idx, i), (out, i))
    ctx.block(ALL, (out, -1), "one_hot makes an axis of classes")


RULES: dict[str, OpRule] = {
    "compare": _compare,
    "where": _where,
    "masked_fill": _masked_fill,
    "topk": _topk,
    "argmax": _argmax,
    "one_hot": _one_hot,
}
