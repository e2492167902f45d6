"""Rules of shape ops: reshape, permute, expand, indexing, narrow, cat, stack, split, constants.

Shape ops move entries without computing: every group kind passes an axis they
keep.  A reshape that merges or splits axes makes the merged axis the row-major
(Kronecker) product of the factors (``NodeContext.kron``); concatenation, chunks
and slices cut an axis into segments that each carry their own group; indexing a
single entry, striding and stacking block the axis.  Tensors built in ``forward``
(zeros, random fills) are constants: fixed.
"""

from __future__ import annotations

import torch.fx as fx

from teleopt.detection.fx_args import arg, int_arg, nodes_in
from teleopt.detection.relations import ALL, GD, P, Ref
from teleopt.detection.rules.context import OpRule, RuleContext, tensor_paths
from teleopt.detection.tracing import TensorMeta
from teleopt.detection.views import index_items, perm_of, reshape_groups

__all__ = ["RULES", "reshape"]


def reshape(ctx: RuleContext, x: Ref, out: Ref) -> None:
    """``out`` is ``x`` reshaped row-major: merged axes are Kronecker products of their factors."""
    groups = reshape_groups(ctx.meta(x), ctx.meta(out))
    if groups is None:
        return
    for src, dst in groups:
        if len(src) == 1 and len(dst) == 1:
            ctx.unify(ALL, (x, src[0]), (out, dst[0]))
        elif len(dst) == 1:
            ctx.kron(ALL, (out, dst[0]), [(x, i) for i in src])
        elif len(src) == 1:
            ctx.kron(ALL, (x, src[0]), [(out, j) for j in dst])
        else:
            for i in src:
                ctx.block(ALL, (x, i), "a reshape regroups this axis")
            for j in dst:
                ctx.block(ALL, (out, j), "a reshape regroups this axis")


def _reshape(ctx: RuleContext) -> None:
    x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    reshape(ctx, x, out)


def _permute(ctx: RuleContext) -> None:
    x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    perm = perm_of(ctx.node, len(ctx.meta(x)))
    if perm is None:
        return
    for k, i in enumerate(perm):
        ctx.unify(ALL, (x, i), (out, k))


def _expand(ctx: RuleContext) -> None:
    x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    xs, os_ = ctx.meta(x), ctx.meta(out)
    off = len(os_) - len(xs)
    for j in range(len(os_)):
        i = j - off
        if i >= 0 and xs[i] == os_[j]:
            ctx.unify(ALL, (x, i), (out, j))
        else:
            ctx.mention(P, (out, j))
            ctx.block(GD, (out, j), "constant along a broadcast axis")


def _getitem_view(ctx: RuleContext) -> None:
    node = ctx.node
    x, out = ctx.tensor(node.args[0]), ctx.output()
    items = index_items(node.args[1], len(ctx.meta(x)))
    if items is None:
        ctx.fail_closed("advanced indexing")
        return
    xs = ctx.meta(x)
    ia = oa = 0
    for item in items:
        if item is None:
            oa += 1
        elif isinstance(item, int):
            ctx.block(ALL, (x, ia), "indexing picks single entries of this axis")
            ia += 1
        else:
            start, stop, step = item.indices(xs[ia])
            if step != 1 or stop <= start:
                ctx.block(ALL, (x, ia), "strided slicing")
                ctx.block(ALL, (out, oa), "strided slicing")
            elif (start, stop) == (0, xs[ia]):
                ctx.unify(ALL, (out, oa), (x, ia))
            else:
                ctx.unify(ALL, (x, ia), (out, oa), a_range=(start, stop))
            ia += 1
            oa += 1


def _getitem_tuple(ctx: RuleContext) -> None:
    """An entry (or a slice) of a tuple output: the same tensors under another name.

    Negative indices and slices are resolved against the recorded tuple (``parts[-1]``
    after ``torch.split`` in timm Res2Net and EdgeNeXt): an unresolved entry would leave
    the chunk it names tied to its source but to none of its readers.  What cannot be
    resolved freezes the getitem's output and every tensor of the tuple (fail closed).
    """
    node = ctx.node
    parent, index = node.args
    entries = ctx.value(parent) if isinstance(parent, fx.Node) else None
    if isinstance(parent, fx.Node) and isinstance(entries, (tuple, list)):
        n = len(entries)
        if isinstance(index, int) and not isinstance(index, bool) and -n <= index < n:
            src = ctx.node_ref(parent, (index % n,))
            if src in ctx.rel.axes:
                ctx.rel.aliases[("t", ctx.gi, node.name, ())] = src
                return
            if isinstance(entries[index], TensorMeta) and not entries[index].is_float:
                return  # indices no rule declared (max(dim)[1]): fixed where they are used
            if not isinstance(entries[index], TensorMeta):  # a nested tuple: alias its tensors one by one
                if _alias_entries(ctx, parent, [(index % n, ())]):
                    return
        elif isinstance(index, slice):
            picked = list(range(n))[index]
            if _alias_entries(ctx, parent, [(i, (j,)) for j, i in enumerate(picked)]):
                return
        for path, meta in tensor_paths(entries):
            src = ctx.node_ref(parent, path)
            if meta.is_float and src in ctx.rel.axes:
                ctx.block_tensor(ALL, src, "getitem: an entry of this tuple could not be followed")
    value = ctx.value(node)
    if any(meta.is_float for _, meta in tensor_paths(value)):
        ctx.fail_closed("getitem")


def _alias_entries(ctx: RuleContext, parent: fx.Node, picks: list[tuple[int, tuple]]) -> bool:
    """Alias every tensor of the picked entries of ``parent``; False (nothing aliased) if one is missing."""
    pairs = []
    for i, prefix in picks:
        value = ctx.value(parent)[i]
        for path, meta in tensor_paths(value):
            src = ctx.node_ref(parent, (i, *path))
            if src not in ctx.rel.axes:
                if meta.is_float:
                    return False
                continue
            pairs.append((("t", ctx.gi, ctx.node.name, (*prefix, *path)), src))
    for dst, src in pairs:
        ctx.rel.aliases[dst] = src
    return True


def _select(ctx: RuleContext) -> None:
    node = ctx.node
    x, out = ctx.tensor(node.args[0]), ctx.output()
    dim = int_arg(node, 1, "dim") % len(ctx.meta(x))
    ctx.block(ALL, (x, dim), "indexing picks single entries of this axis")
    k = 0
    for i in range(len(ctx.meta(x))):
        if i != dim:
            ctx.unify(ALL, (x, i), (out, k))
            k += 1


def _narrow(ctx: RuleContext) -> None:
    node = ctx.node
    x, out = ctx.tensor(node.args[0]), ctx.output()
    dim = int_arg(node, 1, "dim") % len(ctx.meta(x))
    start = ctx.value(arg(node, 2, "start"))
    length = ctx.value(arg(node, 3, "length"))
    start %= ctx.meta(x)[dim]
    for i in range(len(ctx.meta(x))):
        if i == dim:
            ctx.unify(ALL, (x, i), (out, i), a_range=(start, start + length))
        else:
            ctx.unify(ALL, (x, i), (out, i))


def _tensors(ctx: RuleContext) -> list:
    tensors = arg(ctx.node, 0, "tensors")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"expected a sequence of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _cat(ctx: RuleContext) -> None:
    tensors = _tensors(ctx)
    out = ctx.output()
    oshape = ctx.meta(out)
    dim = int_arg(ctx.node, 1, "dim", 0) % len(oshape)
    offset = 0
    for a in tensors:
        if not ctx.is_operand(a):
            ctx.fail_closed("concatenation of non-float tensors")
            return
        t = ctx.tensor(a)
        shape = ctx.meta(t)
        if len(shape) != len(oshape):
            ctx.fail_closed("concatenation of 1-d empty tensors")
            return
        for i in range(len(oshape)):
            if i == dim:
                if shape[i]:
                    ctx.unify(ALL, (out, i), (t, i), a_range=(offset, offset + shape[i]))
            else:
                ctx.unify(ALL, (out, i), (t, i))
        offset += shape[dim]


def _stack(ctx: RuleContext) -> None:
    tensors = _tensors(ctx)
    out = ctx.output()
    oshape = ctx.meta(out)
    dim = int_arg(ctx.node, 1, "dim", 0) % len(oshape)
    ctx.block(ALL, (out, dim), "stacking makes an axis of distinct tensors")
    for a in tensors:
        if not ctx.is_operand(a):
            ctx.fail_closed("stacking non-float tensors")
            return
        t = ctx.tensor(a)
        for i in range(len(ctx.meta(t))):
            ctx.unify(ALL, (t, i), (out, i if i < dim else i + 1))


def _split(ctx: RuleContext) -> None:
    node = ctx.node
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    x = ctx.tensor(node.args[0])
    xs = ctx.meta(x)
    value = ctx.value(node)
    if not isinstance(value, (tuple, list)):
        ctx.fail_closed(ctx.describe)
        return
    if name == "unbind":
        dim = int_arg(node, 1, "dim", 0) % len(xs)
        ctx.block(ALL, (x, dim), "unbind picks single entries of this axis")
        for k in range(len(value)):
            out = ctx.output((k,))
            j = 0
            for i in range(len(xs)):
                if i != dim:
                    ctx.unify(ALL, (x, i), (out, j))
                    j += 1
        return
    dim_index = 2 if name in ("split", "chunk", "tensor_split") else 1
    dim = int_arg(node, dim_index, "dim", 0) % len(xs)
    offset = 0
    for k, meta in enumerate(value):
        out = ctx.output((k,))
        for i in range(len(xs)):
            if i == dim:
                if meta.shape[i]:
                    ctx.unify(ALL, (x, i), (out, i), a_range=(offset, offset + meta.shape[i]))
            else:
                ctx.unify(ALL, (x, i), (out, i))
        offset += meta.shape[dim]


def _constant(ctx: RuleContext) -> None:
    ctx.constant()


def _random_fill(ctx: RuleContext) -> None:
    for a in nodes_in(ctx.node.args):
        if ctx.is_operand(a):
            ctx.block_tensor(ALL, ctx.tensor(a), "filled with constants or random numbers")
    ctx.constant()


RULES: dict[str, OpRule] = {
    "reshape": _reshape,
    "permute": _permute,
    "expand": _expand,
    "getitem_view": _getitem_view,
    "getitem_tuple": _getitem_tuple,
    "select": _select,
    "narrow": _narrow,
    "cat": _cat,
    "stack": _stack,
    "split": _split,
    "constant": _constant,
    "constant_like": _constant,
    "random_fill": _random_fill,
}
