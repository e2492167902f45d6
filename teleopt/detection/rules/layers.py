"""Rules of layers with weights: linear, matmul, convolutions (grouped, depthwise, transposed), embedding.

A layer y = W x + b is a boundary (Zhao 2026, Prop. 1.2.3): its output axis is
written by the rows of W and by b (g), its input axis read by the columns of W
(g^{-T}).  A product of two activations contracts their shared axis the same way.
A grouped convolution allows positive scaling of its channels through the grouped
weight layout only (a virtual axis over the weight's two channel axes); a
depthwise one scales each channel by its own filter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from teleopt.detection.fx_args import arg, int_arg, optional_tensor_arg, tensor_arg
from teleopt.detection.relations import ALL, DP, GD, D, G, P, Ref
from teleopt.detection.rules.context import OpRule, RuleContext

__all__ = ["RULES", "linear"]


def linear(ctx: RuleContext, x: Ref, w: Ref, b: Ref | None) -> None:
    """out = x W^T + b along the last axis of ``x``; other axes pass as in a batch."""
    out = ctx.output()
    ctx.unify(ALL, (out, -1), (w, 0))
    if b is not None:
        ctx.unify(ALL, (out, -1), (b, 0))
    ctx.unify(ALL, (x, -1), (w, 1), -1.0)
    for i in range(len(ctx.meta(x)) - 1):
        ctx.unify(P, (x, i), (out, i))
        if b is None:
            ctx.unify(GD, (x, i), (out, i))
        else:
            ctx.block(GD, (x, i), "a layer with a bias is affine along this axis")
            ctx.block(GD, (out, i), "a layer with a bias is affine along this axis")


def _linear(ctx: RuleContext) -> None:
    node = ctx.node
    if node.op == "call_module":
        m = ctx.module
        x = ctx.tensor(node.args[0])
        w = ctx.param(m, "weight", "weight")
        if w is None:
            raise TypeError(f"{type(m).__name__} has no weight")
        linear(ctx, x, w, ctx.param(m, "bias", "bias"))
        return
    x = ctx.tensor(node.args[0])
    w = ctx.tensor(tensor_arg(node, 1, "weight"), role="weight")
    b_arg = optional_tensor_arg(node, 2, "bias")
    b = ctx.tensor(b_arg, role="bias") if b_arg is not None else None
    linear(ctx, x, w, b)


def _addmm(ctx: RuleContext) -> None:
    """out = b + x @ W with W of shape (in, out) (transformers' ``Conv1D``, GPT-2): a linear layer with W transposed."""
    node = ctx.node
    if any(float_value not in (None, 1, 1.0) for float_value in (node.kwargs.get("beta"), node.kwargs.get("alpha"))):
        raise TypeError(f"{ctx.describe} with beta or alpha other than 1")
    b = ctx.tensor(tensor_arg(node, 0, "input"), role="bias")
    x = ctx.tensor(tensor_arg(node, 1, "mat1"))
    w = ctx.tensor(tensor_arg(node, 2, "mat2"), role="weight")
    out = ctx.output()
    if len(ctx.meta(b)) != 1 or len(ctx.meta(x)) != 2:
        raise TypeError(f"{ctx.describe} with a bias that is not a vector or an input that is not a matrix")
    ctx.unify(ALL, (out, 1), (w, 1))
    ctx.unify(ALL, (out, 1), (b, 0))
    ctx.unify(ALL, (x, 1), (w, 0), -1.0)
    ctx.unify(P, (x, 0), (out, 0))
    ctx.block(GD, (x, 0), "a layer with a bias is affine along this axis")
    ctx.block(GD, (out, 0), "a layer with a bias is affine along this axis")


def _matmul(ctx: RuleContext) -> None:
    node = ctx.node
    a, b = ctx.tensor(node.args[0], role="left"), ctx.tensor(node.args[1], role="right")
    out = ctx.output()
    sa, sb, so = ctx.meta(a), ctx.meta(b), ctx.meta(out)
    ctx.unify(ALL, (a, -1), (b, -2 if len(sb) >= 2 else 0), -1.0)
    k = 0
    if len(sb) >= 2:
        ctx.unify(ALL, (b, -1), (out, -1))
        k += 1
    if len(sa) >= 2:
        ctx.unify(ALL, (a, -2), (out, len(so) - 1 - k))
        k += 1
    nb = len(so) - k
    for j in range(nb):
        handles = []
        for t, s in ((a, sa), (b, sb)):
            i = j - (nb - (len(s) - 2))
            if len(s) >= 2 and i >= 0:
                handles.append(((t, i), s[i] == so[j]))
        full = [h for h, f in handles if f]
        for h, f in handles:
            if not f:
                ctx.block(ALL, h, "broadcast axis")
        for h in full:
            ctx.unify(P, h, (out, j))
        if len(full) == 1:
            ctx.unify(GD, full[0], (out, j))
        else:
            for h in full:
                ctx.block(GD, h, "both factors of a batched product vary along this axis")
            ctx.block(GD, (out, j), "both factors of a batched product vary along this axis")


def _conv_core(ctx: RuleContext, x: Ref, w_arg: Any, b: Ref | None, groups: int, pointwise: bool, transposed: bool, module: Any) -> None:
    """A convolution of ``x`` (weight from ``module`` or the node argument ``w_arg``): channels, positions, batch."""
    out = ctx.output()
    if module is not None:
        w_shape: tuple[int, ...] = tuple(module.weight.shape)
        param = ctx.rel.tensors.names.get(id(module.weight))
    else:
        w_shape = ctx.value(w_arg).shape
        view = ctx.view_of(w_arg)
        param = view.name if view is not None and view.axis_map == tuple(range(len(w_shape))) and view.kind == "parameter" else None
    xs = ctx.meta(x)
    batched = len(xs) == len(w_shape)  # (N, C, *spatial) against the weight's (C_out, C_in, *kernel)
    conv = _Conv(ctx, x, xs, out, b, w_arg, module, groups, transposed, w_shape, param, 1 if batched else 0)
    conv.channels()
    conv.positions(pointwise)


@dataclass(frozen=True)
class _Conv:
    """One convolution node as its rule sees it: input ``x`` (shape ``xs``), output ``out``, bias ``b``, and the weight.

    The weight is ``module.weight`` (a ``call_module`` node) or the node argument ``w_arg``;
    ``param`` names it when a site may move it as a whole; ``ch`` is the channel axis of ``x``
    and ``out`` (1 when batched).
    """

    ctx: RuleContext
    x: Ref
    xs: tuple[int, ...]  # the shape of x
    out: Ref
    b: Ref | None
    w_arg: Any
    module: Any
    groups: int
    transposed: bool
    w_shape: tuple[int, ...]
    param: str | None
    ch: int

    def weight(self, role: str) -> Ref:
        """The weight, as an occurrence in ``role``."""
        if self.module is not None:
            ref = self.ctx.param(self.module, "weight", role)
            assert ref is not None  # module.weight was read by _conv_core
            return ref
        return self.ctx.tensor(self.w_arg, role=role)

    def channels(self) -> None:
        """The channel axes: dense (a boundary), depthwise, grouped, or grouped with a computed weight (fixed)."""
        c_in = self.xs[self.ch]
        c_out = self.w_shape[1] * self.groups if self.transposed else self.w_shape[0]
        depthwise = self.groups == c_in and c_out == c_in and (self.w_shape[1] == 1)
        if self.groups == 1:
            self._dense()
        elif depthwise and self.param is not None:
            self._depthwise()
        elif self.param is not None:
            self._grouped(self.param)
        else:
            self.weight("weight")
            self.ctx.block(ALL, (self.x, self.ch), "a grouped convolution with a computed weight")
            self.ctx.block(ALL, (self.out, self.ch), "a grouped convolution with a computed weight")

    def _dense(self) -> None:
        """Output channels are the weight's rows (and the bias), input channels its columns (Zhao 2026, Prop. 1.2.3)."""
        ctx, ch = self.ctx, self.ch
        out_axis, in_axis = (1, 0) if self.transposed else (0, 1)
        w = self.weight("weight")
        ctx.unify(ALL, (self.out, ch), (w, out_axis))
        if self.b is not None:
            ctx.unify(ALL, (self.out, ch), (self.b, 0))
        ctx.unify(ALL, (self.x, ch), (w, in_axis), -1.0)

    def _depthwise(self) -> None:
        """Channel c in -> channel c out through weight row c: its filter absorbs and writes the scaling."""
        ctx, x, out, ch = self.ctx, self.x, self.out, self.ch
        w_val, w_in, w_out = self.weight("weight"), self.weight("absorbs"), self.weight("writes")
        ctx.unify(P, (x, ch), (out, ch))
        ctx.unify(P, (out, ch), (w_val, 0))
        ctx.unify(D, (x, ch), (w_in, 0), -1.0)
        ctx.unify(D, (out, ch), (w_out, 0))
        if self.b is not None:
            ctx.unify(DP, (out, ch), (self.b, 0))
        ctx.block(G, (x, ch), "a depthwise convolution is not GL-equivariant")
        ctx.block(G, (out, ch), "a depthwise convolution is not GL-equivariant")

    def _grouped(self, param: str) -> None:
        """Positive scaling of the channels through the grouped weight layout (a virtual axis); no GL or permutations."""
        ctx, x, out, ch, groups = self.ctx, self.x, self.out, self.ch, self.groups
        w = self.weight("weight")
        if self.transposed:
            ctx.unify(D, (x, ch), (w, 0), -1.0)
            virtual = ctx.virtual_axis(param, 1, groups, "writes", self.w_shape[1] * groups)
            ctx.unify(D, (out, ch), virtual)
        else:
            ctx.unify(D, (out, ch), (w, 0))
            virtual = ctx.virtual_axis(param, 1, groups, "absorbs", self.w_shape[1] * groups)
            ctx.unify(D, (x, ch), virtual, -1.0)
        if self.b is not None:
            ctx.unify(D, (out, ch), (self.b, 0))
        why = f"a grouped convolution ({groups} groups) only allows permutations within groups"
        ctx.block(("general", "permutation"), (x, ch), why)
        ctx.block(("general", "permutation"), (out, ch), why)

    def positions(self, pointwise: bool) -> None:
        """Spatial axes pass (as a batch) only through a pointwise convolution; the batch axis always passes."""
        ctx, x, out, b = self.ctx, self.x, self.out, self.b
        for i in range(self.ch + 1, len(self.xs)):
            if pointwise:
                ctx.unify(P, (x, i), (out, i))
                if b is None:
                    ctx.unify(GD, (x, i), (out, i))
            else:
                ctx.block(ALL, (x, i), "a convolution mixes positions")
                ctx.block(ALL, (out, i), "a convolution mixes positions")
        if self.ch == 1:
            ctx.unify(P, (x, 0), (out, 0))
            if b is None:
                ctx.unify(GD, (x, 0), (out, 0))


def _all_equal(v: Any, x: int) -> bool:
    return all(e == x for e in v) if isinstance(v, (tuple, list)) else bool(v == x)


def _conv(ctx: RuleContext, transposed: bool) -> None:
    node = ctx.node
    x = ctx.tensor(node.args[0])
    if node.op == "call_module":
        m: Any = ctx.module  # an exact torch.nn conv type, or a user type with the same attributes
        pointwise = (
            all(k == 1 for k in m.kernel_size)
            and all(s == 1 for s in m.stride)
            and (m.padding in ("valid", "same") or all(p == 0 for p in m.padding))
            and all(p == 0 for p in getattr(m, "output_padding", (0,)))
        )
        b = ctx.param(m, "bias", "bias")
        _conv_core(ctx, x, None, b, m.groups, pointwise, transposed, m)
        return
    w_arg = arg(node, 1, "weight")
    b_arg = optional_tensor_arg(node, 2, "bias")
    b = ctx.tensor(b_arg, role="bias") if b_arg is not None else None
    # conv(input, weight, bias, stride, padding, dilation, groups);
    # conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation)
    groups = int_arg(node, 6, "groups", 1)
    pad = arg(node, 4, "padding", 0)
    if transposed and not _all_equal(arg(node, 5, "output_padding", 0), 0):
        pad = 1
    stride = arg(node, 3, "stride", 1)
    w_shape = ctx.value(w_arg).shape
    pointwise = all(k == 1 for k in w_shape[2:]) and _all_equal(stride, 1) and (pad in ("valid", "same") or _all_equal(pad, 0))
    _conv_core(ctx, x, w_arg, b, groups, pointwise, transposed, None)


def _conv_forward(ctx: RuleContext) -> None:
    _conv(ctx, transposed=False)


def _conv_transpose(ctx: RuleContext) -> None:
    _conv(ctx, transposed=True)


def _embedding(ctx: RuleContext) -> None:
    node = ctx.node
    module: Any = ctx.module if node.op == "call_module" else None
    max_norm = module.max_norm if module is not None else arg(node, 3, "max_norm")
    if max_norm is not None:  # renormalises the looked-up rows in place: not scale-equivariant
        ctx.fail_closed("an embedding with max_norm")
        return
    w = ctx.param(module, "weight", "table") if module is not None else ctx.tensor(arg(node, 1, "weight"), role="table")
    if w is None:
        raise TypeError(f"{type(module).__name__} has no weight")
    out = ctx.output()
    ctx.unify(ALL, (out, -1), (w, 1))


RULES: dict[str, OpRule] = {
    "linear": _linear,
    "matmul": _matmul,
    "addmm": _addmm,
    "conv": _conv_forward,
    "conv_transpose": _conv_transpose,
    "embedding": _embedding,
}
