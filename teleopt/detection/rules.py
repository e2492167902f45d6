"""Op rules: how each op of a traced graph ties, blocks or reshapes the axes it touches.

For every node, the rule of its op (``teleopt.detection.ops`` names it) states,
per group kind, the relations between the axes of its inputs, outputs and
parameters (see ``teleopt.detection.relations``).  The facts used are those of
papers/001 Sec. 1.2:

* a layer y = W x + b is a boundary: its output axis is written by the rows of W
  and by b (g), its input axis read by the columns of W (g^{-T}), Prop. 1.2.3;
* pointwise maps pass permutations (Ex. 1.2.9), positively homogeneous ones of
  degree alpha pass positive scaling with power alpha (Ex. 1.2.4), linear ones
  pass GL (Ex. 1.2.2);
* BatchNorm's output scaling is written by its affine weight and bias (exact);
  scaling its input is invariant up to eps with the running mean times c and
  the running variance times c^2 (Ex. 1.2.7, declared approximate);
* LayerNorm/RMSNorm/GroupNorm normalise: they block scaling of their input,
  permutations pass with their affine parameters permuted;
* attention contracts queries with keys: their channels carry g and g^{-T}
  (Ex. 1.2.11); values pass to the output linearly (Ex. 1.2.12);
* reshapes merge or split axes into row-major products (``kron``), concatenation
  and chunking cut axes into segments; everything else fails closed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from teleopt.detection.ops import METADATA_ATTRIBUTES, POINTWISE, function_op, method_op, module_op
from teleopt.detection.relations import ALL, DP, GD, D, DirectSite, G, NodeContext, P, ParamView, Ref, Relations
from teleopt.detection.tracing import TensorMeta, TracedGraph

__all__ = ["run_rules", "reshape_groups", "identify_node"]

_VIEW_OPS = {"reshape", "permute", "expand", "identity_like", "identity", "getitem_view"}


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _nodes_in(x: Any) -> Iterator[fx.Node]:
    if isinstance(x, fx.Node):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _nodes_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _nodes_in(v)


def _tensor_paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, TensorMeta]]:
    if isinstance(value, TensorMeta):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensor_paths(v, path + (i,))


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair the non-unit axes of two shapes into groups of equal product (row-major reshape).

    Returns ``[(src_axes, dst_axes), ...]`` or ``None`` if the shapes have different sizes.
    """
    a = [(i, n) for i, n in enumerate(src) if n != 1]
    b = [(j, n) for j, n in enumerate(dst) if n != 1]
    if math.prod(src) != math.prod(dst):
        return None
    groups = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i][0]], [b[j][0]]
        pa, pb = a[i][1], b[j][1]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(a[i][0])
                pa *= a[i][1]
                i += 1
            else:
                gb.append(b[j][0])
                pb *= b[j][1]
                j += 1
        groups.append((ga, gb))
    return groups


def _perm_of(node: fx.Node, op_name: str, ndim: int) -> list[int] | None:
    """Output axis k comes from input axis perm[k] (permute, transpose, t, movedim, .T)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.op == "call_function" and node.target is getattr:
        name = node.args[1]
    rest = list(node.args[1:])
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if not dims and "dims" in node.kwargs:
            dims = node.kwargs["dims"]
        return [d % ndim for d in dims]
    perm = list(range(ndim))
    if name in ("transpose", "swapaxes"):
        d0, d1 = _arg(node, 1, "dim0"), _arg(node, 2, "dim1")
        d0, d1 = d0 % ndim, d1 % ndim
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if name in ("t", "T"):
        return perm[::-1] if ndim == 2 or name == "T" else perm
    if name == "mT":
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return perm
    if name == "movedim":
        src, dst = _arg(node, 1, "source"), _arg(node, 2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [s % ndim for s in src], [d % ndim for d in dst]
        out: list[int | None] = [None] * ndim
        for s, d in zip(src, dst):
            out[d] = s
        rest_in = [i for i in range(ndim) if i not in src]
        it = iter(rest_in)
        return [o if o is not None else next(it) for o in out]
    return None


class _Rules:
    """Applies the op rules of one traced graph to a :class:`Relations`."""

    def __init__(self, model: nn.Module, rel: Relations, traced: TracedGraph, gi: int) -> None:
        self.model = model
        self.rel = rel
        self.traced = traced
        self.gi = gi

    # -- driver -------------------------------------------------------------------
    def run(self) -> None:
        for node in self.traced.graph.nodes:
            self.node(node)

    def node(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            ctx = NodeContext(self.rel, self.traced, self.gi, node, "the model input")
            for path, meta in _tensor_paths(self.traced.values.get(node.name)):
                if meta.is_float:
                    ctx.block_tensor(ALL, ctx.output(path), "the model input is fixed")
            return
        if node.op == "get_attr":
            self._get_attr(node)
            return
        if node.op == "output":
            ctx = NodeContext(self.rel, self.traced, self.gi, node, "the model output")
            for arg in _nodes_in(node.args):
                if ctx.is_tensor(arg):
                    ctx.block_tensor(ALL, ctx.tensor(arg, role="output"), "the model output is fixed")
            ctx.finish()
            return
        op, describe = self.identify(node)
        ctx = NodeContext(self.rel, self.traced, self.gi, node, describe)
        if op in _VIEW_OPS and self._propagate_view(ctx, op):
            return
        if op == "metadata":
            return
        handler = getattr(self, f"op_{op}", None) if op is not None else None
        if handler is None:
            if any(ctx.is_tensor(a) or ctx.view_of(a) for a in _nodes_in((node.args, node.kwargs))):
                self._unknown(ctx, describe)
            else:
                self._constant(ctx)
        else:
            try:
                handler(ctx)
            except Exception as e:  # a call the rule does not understand: fail closed (relations
                # it stated before failing are true of the op; blocking everything it touches dominates them)
                ctx.finish()
                ctx = NodeContext(self.rel, self.traced, self.gi, node, describe)
                self._unknown(ctx, f"{describe} (its rule failed: {type(e).__name__}: {e})")
        self._dead(ctx)
        ctx.finish()

    def identify(self, node: fx.Node) -> tuple[str | None, str]:
        """Canonical op name and a readable description of a node."""
        return identify_node(node, self.traced)

    # -- parameters ---------------------------------------------------------------------
    def _get_attr(self, node: fx.Node) -> None:
        target = str(node.target)
        meta = self.traced.values.get(node.name)
        if not isinstance(meta, TensorMeta):
            return
        obj: Any = None
        for getter in (self.model.get_parameter, self.model.get_buffer):
            try:
                obj = getter(target)
                break
            except AttributeError:
                continue
        name = self.rel.tensors.names.get(id(obj)) if obj is not None else None
        kind = self.rel.tensors.kinds.get(name, "constant") if name else "constant"  # tensors fx made constants of
        n = len(meta.shape)
        self.rel.views[("t", self.gi, node.name, ())] = ParamView(name or target, kind, tuple(range(n)), meta.shape, (False,) * n)

    def _propagate_view(self, ctx: NodeContext, op: str) -> bool:
        """A view op on a parameter view gives another view (no relations yet)."""
        node = ctx.node
        src = node.args[0] if node.args else None
        view = ctx.view_of(src)
        if view is None:
            return False
        out = ctx.value(node)
        if not isinstance(out, TensorMeta):
            return False
        new = _view_through(node, op, view, out.shape)
        if new is None:
            return False
        self.rel.views[("t", self.gi, node.name, ())] = new
        return True

    # -- generic fallbacks ----------------------------------------------------------------
    def _outputs(self, ctx: NodeContext) -> list[Ref]:
        return [ctx.output(path) for path, meta in _tensor_paths(ctx.value(ctx.node)) if meta.is_float]

    def _constant(self, ctx: NodeContext) -> None:
        for ref in self._outputs(ctx):
            ctx.block_tensor(ALL, ref, "a constant tensor built in forward")

    def _unknown(self, ctx: NodeContext, describe: str) -> None:
        node = ctx.node
        for arg in _nodes_in((node.args, node.kwargs)):
            if ctx.is_tensor(arg) or ctx.view_of(arg):
                ctx.tensor(arg, role="opaque")
        if node.op == "call_module":
            module = self.traced.modules.get(str(node.target))
            if module is not None:
                for pname, p in module.named_parameters(recurse=True):
                    ctx.param(_owner(module, pname), pname.rsplit(".", 1)[-1], role="opaque")
        self._outputs(ctx)
        self.rel.skipped.append(("op", ctx.where, f"{describe} has no detection rule: the axes it touches are frozen"))

    def _dead(self, ctx: NodeContext) -> None:
        users = [u for u in ctx.node.users if self.identify(u)[0] != "metadata"]
        if not users:
            for ref in self._outputs(ctx):
                ctx.block_tensor(ALL, ref, "this value is not used")

    # -- pointwise -------------------------------------------------------------------------
    def _pointwise(self, ctx: NodeContext, name: str, x_arg: Any) -> None:
        pw = POINTWISE[name]
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

    def _same(self, ctx: NodeContext, x_arg: Any) -> None:
        x, out = ctx.tensor(x_arg), ctx.output()
        for i in range(len(ctx.meta(out))):
            ctx.unify(ALL, (x, i), (out, i))

    def op_identity(self, ctx: NodeContext) -> None:
        self._same(ctx, ctx.node.args[0])

    def op_identity_like(self, ctx: NodeContext) -> None:
        self._same(ctx, ctx.node.args[0])

    def _activation(self, ctx: NodeContext) -> None:
        self._pointwise(ctx, self.identify(ctx.node)[0], ctx.node.args[0])  # type: ignore[arg-type]

    op_relu = op_leaky_relu = op_abs = op_neg = op_relu6 = op_hardtanh = op_gelu = op_silu = _activation
    op_sigmoid = op_tanh = op_hardswish = op_hardsigmoid = op_mish = op_elu = op_selu = op_celu = _activation
    op_softplus = op_softsign = op_exp = op_log = op_sqrt = op_rsqrt = op_erf = op_sin = op_cos = _activation

    def op_dropout(self, ctx: NodeContext) -> None:
        node = ctx.node
        if node.op == "call_module":
            p = self.traced.modules[str(node.target)].p
        else:
            p = _arg(node, 1, "p", 0.5)
        if not p:
            self._same(ctx, node.args[0])
            return
        x, out = ctx.tensor(node.args[0]), ctx.output()
        for i in range(len(ctx.meta(out))):
            ctx.unify(D, (x, i), (out, i))
            why = f"dropout (p={p}) draws independent random masks in training"
            ctx.block(("general", "permutation"), (x, i), why)
            ctx.block(("general", "permutation"), (out, i), why)

    def op_clamp(self, ctx: NodeContext) -> None:
        node = ctx.node
        lo, hi = _arg(node, 1, "min"), _arg(node, 2, "max")
        if lo == 0 and hi is None:
            self._pointwise(ctx, "relu", node.args[0])
        else:
            self._pointwise(ctx, "hardtanh", node.args[0])

    def op_pow(self, ctx: NodeContext) -> None:
        node = ctx.node
        e = ctx.value(node.args[1]) if len(node.args) > 1 else node.kwargs.get("exponent")
        if not isinstance(e, (int, float)) or isinstance(e, bool) or not ctx.is_tensor(node.args[0]) and not ctx.view_of(node.args[0]):
            self._unknown(ctx, ctx.describe)
            return
        self._power(ctx, node.args[0], float(e))

    def op_square(self, ctx: NodeContext) -> None:
        self._power(ctx, ctx.node.args[0], 2.0)

    def _power(self, ctx: NodeContext, x_arg: Any, e: float) -> None:
        x, out = ctx.tensor(x_arg), ctx.output()
        for i in range(len(ctx.meta(out))):
            ctx.unify(P, (x, i), (out, i))
            if e != 0:
                ctx.unify(D, (x, i), (out, i), e)
            if e == 1:
                ctx.unify(G, (x, i), (out, i))

    def op_prelu(self, ctx: NodeContext) -> None:
        node = ctx.node
        if node.op == "call_module":
            x = ctx.tensor(node.args[0])
            w = ctx.param(self.traced.modules[str(node.target)], "weight", "slope")
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

    # -- elementwise binary -------------------------------------------------------------------
    def _operand(self, ctx: NodeContext, arg: Any) -> tuple[str, Any]:
        if isinstance(arg, fx.Node):
            view = ctx.view_of(arg)
            if view is not None:
                return "view", arg
            value = ctx.value(arg)
            if isinstance(value, TensorMeta):
                if value.is_float:
                    return "tensor", ctx.tensor(arg)
                ref = ctx.node_ref(arg)
                self.rel.declare(ref, value.shape)
                ctx._involved.append(ref)
                ctx.block_tensor(ALL, ref, "a non-floating-point tensor is a fixed operand")
                return "tensor", ref
            return "scalar", value
        return "scalar", arg

    def _binary(self, ctx: NodeContext, op: str) -> None:
        node = ctx.node
        a_arg = node.args[0]
        b_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
        ka, a = self._operand(ctx, a_arg)
        kb, b = self._operand(ctx, b_arg)
        out = ctx.output()
        oshape = ctx.meta(out)
        if ka == "scalar" and kb == "scalar":
            ctx.block_tensor(ALL, out, "arithmetic on constants")
            return
        if ka == "scalar" or kb == "scalar":
            scalar, tensor_kind, t_arg = (a, kb, b) if ka == "scalar" else (b, ka, a)
            t = ctx.tensor(t_arg) if tensor_kind == "view" else t_arg
            self._scalar_binary(ctx, op, t, scalar, out, scalar_first=(ka == "scalar"))
            return
        if op in ("add", "sub"):
            ta = ctx.tensor(a) if ka == "view" else a
            tb = ctx.tensor(b) if kb == "view" else b
            self._add(ctx, ta, tb, out, oshape)
            return
        ea, eb = (1.0, 1.0) if op == "mul" else (1.0, -1.0)
        if (ka == "view") != (kb == "view") and self._movable(ctx.view_of(a if ka == "view" else b)):
            self._scale_by_parameter(ctx, a, b, ka, kb, ea, eb, out, oshape)
            return
        ta = ctx.tensor(a) if ka == "view" else a
        tb = ctx.tensor(b) if kb == "view" else b
        self._product(ctx, ta, tb, ea, eb, out, oshape)

    def op_add(self, ctx: NodeContext) -> None:
        self._binary(ctx, "add")

    def op_sub(self, ctx: NodeContext) -> None:
        self._binary(ctx, "sub")

    def op_mul(self, ctx: NodeContext) -> None:
        self._binary(ctx, "mul")

    def op_div(self, ctx: NodeContext) -> None:
        self._binary(ctx, "div")

    def _movable(self, view: ParamView | None) -> bool:
        """A parameter a site may move (fixed buffers and constants are plain fixed operands)."""
        return view is not None and view.kind == "parameter" and view.name in self.rel.tensors.movable

    def _scalar_binary(self, ctx: NodeContext, op: str, t: Ref, scalar: Any, out: Ref, scalar_first: bool) -> None:
        n = len(ctx.meta(out))
        handles = [(_align(ctx, t, out, i), i) for i in range(n)]
        if op in ("add", "sub"):
            shift = isinstance(scalar, (int, float)) and scalar == 0
            for h, i in handles:
                if h is None:
                    continue
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
                if h is not None:
                    ctx.unify(ALL, h, (out, i))
            return
        for h, i in handles:  # scalar / tensor: homogeneous of degree -1
            if h is not None:
                ctx.unify(P, h, (out, i))
                ctx.unify(D, h, (out, i), -1.0)
                ctx.block(G, h, "a reciprocal is not linear")

    def _add(self, ctx: NodeContext, ta: Ref, tb: Ref, out: Ref, oshape: tuple[int, ...]) -> None:
        for j in range(len(oshape)):
            full = []
            for t in (ta, tb):
                h = _align(ctx, t, out, j)
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

    def _product(self, ctx: NodeContext, ta: Ref, tb: Ref, ea: float, eb: float, out: Ref, oshape: tuple[int, ...]) -> None:
        for j in range(len(oshape)):
            ha, hb = _align(ctx, ta, out, j), _align(ctx, tb, out, j)
            fa = ha is not None and ctx.meta(ta)[ha[1]] == oshape[j]
            fb = hb is not None and ctx.meta(tb)[hb[1]] == oshape[j]
            if oshape[j] == 1:
                for h in (ha, hb):
                    if h is not None:
                        ctx.unify(ALL, h, (out, j))
                continue
            if fa and fb:
                ctx.unify(P, ha, (out, j))
                ctx.unify(P, hb, (out, j))
                for h in (ha, hb, (out, j)):
                    ctx.block(G, h, "an elementwise product of two tensors varying along this axis is not linear")
                ctx.product(ha, hb, (out, j), ea, eb)
                continue
            (hf, ef), hs = ((ha, ea), hb) if fa else ((hb, eb), ha)
            if hs is not None:
                ctx.block(ALL, hs, "broadcast axis")
            ctx.unify(P, hf, (out, j))
            ctx.unify(D, hf, (out, j), ef)
            if ef == 1:
                ctx.unify(G, hf, (out, j))

    def _scale_by_parameter(self, ctx: NodeContext, a: Any, b: Any, ka: str, kb: str, ea: float, eb: float, out: Ref, oshape: tuple[int, ...]) -> None:
        """out = x^ex * v^ev with v a parameter: v absorbs the scaling of x and writes the scaling of out."""
        if ka == "view":
            v_arg, x, ev, ex = a, b, ea, eb
        else:
            v_arg, x, ev, ex = b, a, eb, ea
        v_val = ctx.tensor(v_arg, role="value")
        v_in = ctx.tensor(v_arg, role="absorbs")
        v_out = ctx.tensor(v_arg, role="writes")
        for j in range(len(oshape)):
            hx, hv = _align(ctx, x, out, j), _align(ctx, v_val, out, j)
            fx_ = hx is not None and ctx.meta(x)[hx[1]] == oshape[j]
            fv = hv is not None and ctx.meta(v_val)[hv[1]] == oshape[j]
            if oshape[j] == 1:
                for h in (hx, hv):
                    if h is not None:
                        ctx.unify(ALL, h, (out, j))
                continue
            if fx_ and fv:
                ctx.unify(P, hx, (out, j))
                ctx.unify(P, hv, (out, j))
                for h in (hx, hv, (out, j)):
                    ctx.block(G, h, "multiplies by a per-channel parameter (not GL-equivariant)")
                ctx.unify(D, hx, (v_in, hv[1]), -ex / ev)
                ctx.unify(D, (out, j), (v_out, hv[1]), 1.0 / ev)
            elif fx_:
                if hv is not None:
                    ctx.block(ALL, hv, "broadcast axis")
                ctx.unify(P, hx, (out, j))
                ctx.unify(D, hx, (out, j), ex)
                if ex == 1:
                    ctx.unify(G, hx, (out, j))
            else:
                if hx is not None:
                    ctx.block(ALL, hx, "broadcast axis")
                ctx.unify(P, hv, (out, j))
                ctx.unify(D, (out, j), (v_out, hv[1]), 1.0 / ev)
                ctx.block(G, (out, j), "multiplies by a per-channel parameter (not GL-equivariant)")

    def op_maybe_add_mask(self, ctx: NodeContext) -> None:
        node = ctx.node
        mask = _arg(node, 1, "attn_mask")
        if mask is None or ctx.value(mask) is None:
            self._same(ctx, node.args[0])
        else:
            self._binary(ctx, "add")

    # -- reductions and pooling -------------------------------------------------------------------
    def _reduce(self, ctx: NodeContext, linear: bool) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        xshape = ctx.meta(x)
        dim = _arg(node, 1, "dim", None)
        keepdim = bool(_arg(node, 2, "keepdim", False))
        value = ctx.value(node)
        path = (0,) if isinstance(value, tuple) else ()
        out = ctx.output(path)
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            dims = set(range(len(xshape)))
        else:
            dims = {d % len(xshape) for d in ((dim,) if isinstance(dim, int) else dim)}
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

    def op_mean(self, ctx: NodeContext) -> None:
        self._reduce(ctx, linear=True)

    def op_sum(self, ctx: NodeContext) -> None:
        self._reduce(ctx, linear=True)

    def op_amax(self, ctx: NodeContext) -> None:
        self._reduce(ctx, linear=False)

    def op_max(self, ctx: NodeContext) -> None:
        node = ctx.node
        second = node.args[1] if len(node.args) > 1 else node.kwargs.get("other", node.kwargs.get("dim"))
        if isinstance(second, fx.Node) and isinstance(ctx.value(second), TensorMeta):
            self._unknown(ctx, ctx.describe)
            return
        self._reduce(ctx, linear=False)

    def _pool(self, ctx: NodeContext, linear: bool) -> None:
        node = ctx.node
        if node.op == "call_module":
            k = _SPATIAL_DIMS.get(type(self.traced.modules[str(node.target)]), 0)
        else:
            k = _SPATIAL_DIMS.get(node.target, 0)
        value = ctx.value(node)
        if not isinstance(value, TensorMeta):
            self._unknown(ctx, ctx.describe)
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

    def op_avg_pool(self, ctx: NodeContext) -> None:
        self._pool(ctx, linear=True)

    def op_max_pool(self, ctx: NodeContext) -> None:
        self._pool(ctx, linear=False)

    def op_interpolate(self, ctx: NodeContext) -> None:
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        n = len(ctx.meta(x))
        for i in range(min(2, n)):
            ctx.unify(ALL, (x, i), (out, i))
        for i in range(2, n):
            ctx.block(ALL, (x, i), "resampling mixes positions")
            ctx.block(ALL, (out, i), "resampling mixes positions")

    def op_pad(self, ctx: NodeContext) -> None:
        node = ctx.node
        pad = _arg(node, 1, "pad")
        mode = _arg(node, 2, "mode", "constant")
        value = _arg(node, 3, "value", None)
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

    # -- shapes ----------------------------------------------------------------------------------
    def op_reshape(self, ctx: NodeContext) -> None:
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        self._reshape(ctx, x, out)

    def _reshape(self, ctx: NodeContext, x: Ref, out: Ref) -> None:
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

    def op_permute(self, ctx: NodeContext) -> None:
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        perm = _perm_of(ctx.node, "permute", len(ctx.meta(x)))
        if perm is None:
            return
        for k, i in enumerate(perm):
            ctx.unify(ALL, (x, i), (out, k))

    def op_expand(self, ctx: NodeContext) -> None:
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

    def op_getitem_view(self, ctx: NodeContext) -> None:
        node = ctx.node
        x, out = ctx.tensor(node.args[0]), ctx.output()
        items = _index_items(node.args[1], len(ctx.meta(x)))
        if items is None:
            self._unknown(ctx, "advanced indexing")
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

    def op_getitem_tuple(self, ctx: NodeContext) -> None:
        node = ctx.node
        parent, index = node.args
        if isinstance(parent, fx.Node) and isinstance(index, int):
            src = ctx.node_ref(parent, (index,))
            if src in self.rel.axes:
                self.rel.aliases[("t", self.gi, node.name, ())] = src
                return
        value = ctx.value(node)
        if isinstance(value, TensorMeta) and value.is_float:
            self._unknown(ctx, "getitem")

    def op_select(self, ctx: NodeContext) -> None:
        node = ctx.node
        x, out = ctx.tensor(node.args[0]), ctx.output()
        dim = _arg(node, 1, "dim") % len(ctx.meta(x))
        ctx.block(ALL, (x, dim), "indexing picks single entries of this axis")
        k = 0
        for i in range(len(ctx.meta(x))):
            if i != dim:
                ctx.unify(ALL, (x, i), (out, k))
                k += 1

    def op_narrow(self, ctx: NodeContext) -> None:
        node = ctx.node
        x, out = ctx.tensor(node.args[0]), ctx.output()
        dim = _arg(node, 1, "dim") % len(ctx.meta(x))
        start = ctx.value(_arg(node, 2, "start"))
        length = ctx.value(_arg(node, 3, "length"))
        start %= ctx.meta(x)[dim]
        for i in range(len(ctx.meta(x))):
            if i == dim:
                ctx.unify(ALL, (x, i), (out, i), a_range=(start, start + length))
            else:
                ctx.unify(ALL, (x, i), (out, i))

    def op_cat(self, ctx: NodeContext) -> None:
        node = ctx.node
        tensors = _arg(node, 0, "tensors")
        out = ctx.output()
        oshape = ctx.meta(out)
        dim = _arg(node, 1, "dim", 0) % len(oshape)
        offset = 0
        for arg in tensors:
            if not (ctx.is_tensor(arg) or ctx.view_of(arg)):
                self._unknown(ctx, "concatenation of non-float tensors")
                return
            t = ctx.tensor(arg)
            shape = ctx.meta(t)
            if len(shape) != len(oshape):
                self._unknown(ctx, "concatenation of 1-d empty tensors")
                return
            for i in range(len(oshape)):
                if i == dim:
                    if shape[i]:
                        ctx.unify(ALL, (out, i), (t, i), a_range=(offset, offset + shape[i]))
                else:
                    ctx.unify(ALL, (out, i), (t, i))
            offset += shape[dim]

    def op_stack(self, ctx: NodeContext) -> None:
        node = ctx.node
        tensors = _arg(node, 0, "tensors")
        out = ctx.output()
        oshape = ctx.meta(out)
        dim = _arg(node, 1, "dim", 0) % len(oshape)
        ctx.block(ALL, (out, dim), "stacking makes an axis of distinct tensors")
        for arg in tensors:
            if not (ctx.is_tensor(arg) or ctx.view_of(arg)):
                self._unknown(ctx, "stacking non-float tensors")
                return
            t = ctx.tensor(arg)
            for i in range(len(ctx.meta(t))):
                ctx.unify(ALL, (t, i), (out, i if i < dim else i + 1))

    def op_split(self, ctx: NodeContext) -> None:
        node = ctx.node
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        x = ctx.tensor(node.args[0])
        xs = ctx.meta(x)
        value = ctx.value(node)
        if not isinstance(value, (tuple, list)):
            self._unknown(ctx, ctx.describe)
            return
        if name == "unbind":
            dim = _arg(node, 1, "dim", 0) % len(xs)
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
        dim = _arg(node, dim_index, "dim", 0) % len(xs)
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

    def op_constant(self, ctx: NodeContext) -> None:
        self._constant(ctx)

    def op_constant_like(self, ctx: NodeContext) -> None:
        self._constant(ctx)

    def op_random_fill(self, ctx: NodeContext) -> None:
        for arg in _nodes_in(ctx.node.args):
            if ctx.is_tensor(arg) or ctx.view_of(arg):
                ctx.block_tensor(ALL, ctx.tensor(arg), "filled with constants or random numbers")
        self._constant(ctx)

    # -- linear layers ---------------------------------------------------------------------------
    def _linear(self, ctx: NodeContext, x: Ref, w: Ref, b: Ref | None) -> None:
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

    def op_linear(self, ctx: NodeContext) -> None:
        node = ctx.node
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            x = ctx.tensor(node.args[0])
            self._linear(ctx, x, ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias"))
            return
        x = ctx.tensor(node.args[0])
        w = ctx.tensor(_arg(node, 1, "weight"), role="weight")
        b_arg = _arg(node, 2, "bias")
        b = ctx.tensor(b_arg, role="bias") if b_arg is not None else None
        self._linear(ctx, x, w, b)

    def op_matmul(self, ctx: NodeContext) -> None:
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

    def _conv(self, ctx: NodeContext, x: Ref, w_arg: Any, b: Ref | None, groups: int, pointwise: bool, transposed: bool, module: nn.Module | None) -> None:
        out = ctx.output()
        xs = ctx.meta(x)
        if module is not None:
            w_shape = tuple(module.weight.shape)
            param = ctx.rel.tensors.names.get(id(module.weight))
        else:
            w_meta = ctx.value(w_arg)
            w_shape = w_meta.shape
            view = ctx.view_of(w_arg)
            param = view.name if view is not None and view.axis_map == tuple(range(len(w_shape))) and view.kind == "parameter" else None
        n_spatial = len(w_shape) - 2
        batched = len(xs) == n_spatial + 2
        ch = 1 if batched else 0

        def weight(role: str) -> Ref:
            if module is not None:
                return ctx.param(module, "weight", role)
            return ctx.tensor(w_arg, role=role)

        c_in = xs[ch]
        out_axis, in_axis = (1, 0) if transposed else (0, 1)
        c_out = w_shape[1] * groups if transposed else w_shape[0]
        depthwise = groups == c_in and c_out == c_in and (w_shape[1] == 1)
        if groups == 1:
            w = weight("weight")
            ctx.unify(ALL, (out, ch), (w, out_axis))
            if b is not None:
                ctx.unify(ALL, (out, ch), (b, 0))
            ctx.unify(ALL, (x, ch), (w, in_axis), -1.0)
        elif depthwise and param is not None:
            # depthwise: channel c in -> channel c out, weight row c (axis 0)
            w_val, w_in, w_out = weight("weight"), weight("absorbs"), weight("writes")
            ctx.unify(P, (x, ch), (out, ch))
            ctx.unify(P, (out, ch), (w_val, 0))
            ctx.unify(D, (x, ch), (w_in, 0), -1.0)
            ctx.unify(D, (out, ch), (w_out, 0))
            if b is not None:
                ctx.unify(DP, (out, ch), (b, 0))
            ctx.block(G, (x, ch), "a depthwise convolution is not GL-equivariant")
            ctx.block(G, (out, ch), "a depthwise convolution is not GL-equivariant")
        elif param is not None:
            # grouped: positive scaling of input channels through the grouped weight layout
            w = weight("weight")
            if transposed:
                ctx.unify(D, (x, ch), (w, 0), -1.0)
                virtual = ctx.virtual_axis(param, 1, groups, "writes", w_shape[1] * groups)
                ctx.unify(D, (out, ch), virtual)
            else:
                ctx.unify(D, (out, ch), (w, 0))
                virtual = ctx.virtual_axis(param, 1, groups, "absorbs", w_shape[1] * groups)
                ctx.unify(D, (x, ch), virtual, -1.0)
            if b is not None:
                ctx.unify(D, (out, ch), (b, 0))
            why = f"a grouped convolution ({groups} groups) only allows permutations within groups"
            ctx.block(("general", "permutation"), (x, ch), why)
            ctx.block(("general", "permutation"), (out, ch), why)
        else:
            weight("weight")
            ctx.block(ALL, (x, ch), "a grouped convolution with a computed weight")
            ctx.block(ALL, (out, ch), "a grouped convolution with a computed weight")
        spatial = range(ch + 1, len(xs))
        for i in spatial:
            if pointwise:
                ctx.unify(P, (x, i), (out, i))
                if b is None:
                    ctx.unify(GD, (x, i), (out, i))
            else:
                ctx.block(ALL, (x, i), "a convolution mixes positions")
                ctx.block(ALL, (out, i), "a convolution mixes positions")
        if batched:
            ctx.unify(P, (x, 0), (out, 0))
            if b is None:
                ctx.unify(GD, (x, 0), (out, 0))

    def op_conv(self, ctx: NodeContext, transposed: bool = False) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            pointwise = (
                all(k == 1 for k in m.kernel_size)
                and all(s == 1 for s in m.stride)
                and (m.padding in ("valid", "same") or all(p == 0 for p in m.padding))
                and all(p == 0 for p in getattr(m, "output_padding", (0,)))
            )
            b = ctx.param(m, "bias", "bias")
            self._conv(ctx, x, None, b, m.groups, pointwise, transposed, m)
            return
        w_arg = _arg(node, 1, "weight")
        b_arg = _arg(node, 2, "bias")
        b = ctx.tensor(b_arg, role="bias") if b_arg is not None else None
        # conv(input, weight, bias, stride, padding, dilation, groups);
        # conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation)
        groups = _arg(node, 6, "groups", 1)
        pad = _arg(node, 4, "padding", 0)
        if transposed and not _all_equal(_arg(node, 5, "output_padding", 0), 0):
            pad = 1
        stride = _arg(node, 3, "stride", 1)
        w_shape = ctx.value(w_arg).shape
        pointwise = all(k == 1 for k in w_shape[2:]) and _all_equal(stride, 1) and (pad in ("valid", "same") or _all_equal(pad, 0))
        self._conv(ctx, x, w_arg, b, groups, pointwise, transposed, None)

    def op_conv_transpose(self, ctx: NodeContext) -> None:
        self.op_conv(ctx, transposed=True)

    def op_embedding(self, ctx: NodeContext) -> None:
        node = ctx.node
        module = self.traced.modules[str(node.target)] if node.op == "call_module" else None
        max_norm = module.max_norm if module is not None else _arg(node, 3, "max_norm")
        if max_norm is not None:  # renormalises the looked-up rows in place: not scale-equivariant
            self._unknown(ctx, "an embedding with max_norm")
            return
        if module is not None:
            w = ctx.param(module, "weight", "table")
        else:
            w = ctx.tensor(_arg(node, 1, "weight"), role="table")
        out = ctx.output()
        ctx.unify(ALL, (out, -1), (w, 1))

    # -- normalisation -------------------------------------------------------------------------
    def op_batch_norm(self, ctx: NodeContext) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            rm = ctx.param(m, "running_mean", "running_mean", movable=True)
            rv = ctx.param(m, "running_var", "running_var", movable=True)
            w, b, eps = ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias"), m.eps
        else:
            def opt(i: int, name: str, role: str, movable: bool = False) -> Ref | None:
                a = _arg(node, i, name)
                return ctx.tensor(a, role=role, movable=movable) if isinstance(a, fx.Node) else None

            rm = opt(1, "running_mean", "running_mean", True)
            rv = opt(2, "running_var", "running_var", True)
            w, b = opt(3, "weight", "weight"), opt(4, "bias", "bias")
            eps = _arg(node, 7, "eps", 1e-5)
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

    def _normalise(self, ctx: NodeContext, x: Ref, w: Ref | None, b: Ref | None, axes: list[int], what: str) -> None:
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

    def op_layer_norm(self, ctx: NodeContext) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        n = len(ctx.meta(x))
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            k = len(m.normalized_shape)
            w, b = ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias")
        else:
            k = len(_arg(node, 1, "normalized_shape"))
            wa, ba = _arg(node, 2, "weight"), _arg(node, 3, "bias")
            w = ctx.tensor(wa, role="weight") if isinstance(wa, fx.Node) else None
            b = ctx.tensor(ba, role="bias") if isinstance(ba, fx.Node) else None
        self._normalise(ctx, x, w, b, list(range(n - k, n)), "LayerNorm")

    def op_rms_norm(self, ctx: NodeContext) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        n = len(ctx.meta(x))
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            k = len(m.normalized_shape)
            w = ctx.param(m, "weight", "weight")
        else:
            k = len(_arg(node, 1, "normalized_shape"))
            wa = _arg(node, 2, "weight")
            w = ctx.tensor(wa, role="weight") if isinstance(wa, fx.Node) else None
        self._normalise(ctx, x, w, None, list(range(n - k, n)), "RMSNorm")

    def op_group_norm(self, ctx: NodeContext) -> None:
        node = ctx.node
        x = ctx.tensor(node.args[0])
        if node.op == "call_module":
            m = self.traced.modules[str(node.target)]
            groups, w, b = m.num_groups, ctx.param(m, "weight", "weight"), ctx.param(m, "bias", "bias")
        else:
            groups = _arg(node, 1, "num_groups")
            wa, ba = _arg(node, 2, "weight"), _arg(node, 3, "bias")
            w = ctx.tensor(wa, role="weight") if isinstance(wa, fx.Node) else None
            b = ctx.tensor(ba, role="bias") if isinstance(ba, fx.Node) else None
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

    # -- attention and softmax ------------------------------------------------------------------
    def _softmax(self, ctx: NodeContext) -> None:
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        for i in range(len(ctx.meta(x))):
            ctx.unify(P, (x, i), (out, i))
            ctx.block(GD, (x, i), "softmax is not scale-equivariant")

    op_softmax = op_log_softmax = _softmax

    def op_sdpa(self, ctx: NodeContext) -> None:
        node = ctx.node
        if node.kwargs.get("enable_gqa"):
            self._unknown(ctx, "grouped-query attention")
            return
        q, k, v = (ctx.tensor(_arg(node, i, name), role=name) for i, name in enumerate(("query", "key", "value")))
        mask_arg = _arg(node, 3, "attn_mask")
        dropout = ctx.value(_arg(node, 4, "dropout_p", 0.0)) or 0.0
        causal = ctx.value(_arg(node, 5, "is_causal", False))
        out = ctx.output()
        self._attention_core(ctx, q, k, v, out, dropout, bool(causal), mask_arg)

    def _attention_core(self, ctx: NodeContext, q: Ref, k: Ref, v: Ref, out: Ref, dropout: float, causal: bool, mask_arg: Any) -> None:
        ctx.unify(ALL, (q, -1), (k, -1), -1.0)  # scores q . k are kept by (A q, A^-T k)
        ctx.unify(ALL, (v, -1), (out, -1))
        ctx.unify(P, (q, -2), (out, -2))
        ctx.unify(P, (k, -2), (v, -2))
        for h in ((q, -2), (k, -2), (v, -2), (out, -2)):
            ctx.block(GD, h, "attention mixes tokens")
            if causal:
                ctx.block(P, h, "a causal mask fixes the order of tokens")
        so = ctx.meta(out)
        nb = len(so) - 2
        for j in range(nb):
            for t in (q, k, v):
                s = ctx.meta(t)
                i = j - (nb - (len(s) - 2))
                if i < 0:
                    continue
                if s[i] == so[j]:
                    ctx.unify(P, (t, i), (out, j))
                    if dropout:
                        ctx.block(P, (t, i), "attention dropout draws masks per head in training")
                else:
                    ctx.block(ALL, (t, i), "broadcast axis")
                ctx.block(GD, (t, i), "attention is not linear in queries and keys")
            ctx.block(GD, (out, j), "attention is not linear in queries and keys")
        if isinstance(mask_arg, fx.Node) and isinstance(ctx.value(mask_arg), TensorMeta):
            mask = ctx.tensor(mask_arg, role="mask")
            ms = ctx.meta(mask)
            for j in range(len(ms)):
                oj = j - (len(ms) - len(so))
                if oj < 0 or ms[j] == 1:
                    continue
                if oj == len(so) - 1:
                    ctx.unify(P, (mask, j), (k, -2))
                else:
                    ctx.unify(P, (mask, j), (out, oj))

    def op_mha(self, ctx: NodeContext) -> None:
        node = ctx.node
        m: nn.MultiheadAttention = self.traced.modules[str(node.target)]  # type: ignore[assignment]
        query, key, value = (ctx.tensor(_arg(node, i, name), role=name) for i, name in enumerate(("query", "key", "value")))
        outs = ctx.value(node)
        out = ctx.output((0,))
        for path, meta in _tensor_paths(outs):
            if path != (0,) and meta.is_float:
                ctx.output(path)
        if m._qkv_same_embed_dim:
            w_in = ctx.param(m, "in_proj_weight", "in_proj")
            for t in (query, key, value):
                ctx.unify(ALL, (t, -1), (w_in, 1), -1.0)
        else:
            for t, attr in ((query, "q_proj_weight"), (key, "k_proj_weight"), (value, "v_proj_weight")):
                ctx.unify(ALL, (t, -1), (ctx.param(m, attr, "in_proj"), 1), -1.0)
        for attr in ("in_proj_bias", "bias_k", "bias_v"):
            ctx.param(m, attr, "internal")
        w_o, b_o = ctx.param(m.out_proj, "weight", "out_proj"), ctx.param(m.out_proj, "bias", "out_proj_bias")
        ctx.unify(ALL, (out, -1), (w_o, 0))
        if b_o is not None:
            ctx.unify(ALL, (out, -1), (b_o, 0))
        batched = len(ctx.meta(query)) == 3
        tok = (1 if m.batch_first else 0) if batched else 0
        ctx.unify(P, (query, tok), (out, tok))
        ctx.unify(P, (key, tok), (value, tok))
        if batched:
            b_ax = 0 if m.batch_first else 1
            for t in (key, value, query):
                ctx.unify(P, (t, b_ax), (out, b_ax))
        attn_mask = _arg(node, 5, "attn_mask")
        if node.kwargs.get("is_causal") or (isinstance(attn_mask, fx.Node)):
            ctx.block(P, (query, tok), "an attention mask fixes the order of tokens")
        per_head_weights = _arg(node, 4, "need_weights", True) and not _arg(node, 6, "average_attn_weights", True)
        weights_used = any(u.args[1] == 1 and u.users for u in node.users if self.identify(u)[0] == "getitem_tuple")
        self._mha_sites(ctx, m, heads_permutable=not (per_head_weights and weights_used))

    def _mha_sites(self, ctx: NodeContext, m: nn.MultiheadAttention, heads_permutable: bool) -> None:
        names = self.rel.tensors.names
        E, H = m.embed_dim, m.num_heads
        d = E // H
        where = ctx.where

        def name(t: torch.Tensor | None) -> str | None:
            return None if t is None else names.get(id(t))

        if m._qkv_same_embed_dim:
            w = name(m.in_proj_weight)
            q_rows = [(w, dict(axis=0, power=1, start=0, stop=E))]
            k_rows = [(w, dict(axis=0, power=-1, start=E, stop=2 * E))]
            v_rows = [(w, dict(axis=0, power=1, start=2 * E, stop=3 * E))]
            perm_rows = [(w, dict(axis=0, outer=3))]
        else:
            q_rows = [(name(m.q_proj_weight), dict(axis=0, power=1))]
            k_rows = [(name(m.k_proj_weight), dict(axis=0, power=-1))]
            v_rows = [(name(m.v_proj_weight), dict(axis=0, power=1))]
            perm_rows = [(name(getattr(m, a)), dict(axis=0)) for a in ("q_proj_weight", "k_proj_weight", "v_proj_weight")]
        b_in = name(m.in_proj_bias)
        if b_in is not None:
            q_rows.append((b_in, dict(axis=0, power=1, start=0, stop=E)))
            v_rows.append((b_in, dict(axis=0, power=1, start=2 * E, stop=3 * E)))
            perm_rows.append((b_in, dict(axis=0, outer=3)))
        if m.bias_k is not None:
            k_rows.append((name(m.bias_k), dict(axis=2, power=-1)))
            v_rows.append((name(m.bias_v), dict(axis=2, power=1)))
            perm_rows += [(name(m.bias_k), dict(axis=2)), (name(m.bias_v), dict(axis=2))]
        w_o = name(m.out_proj.weight)
        info = {"heads": H, "head_dim": d, "module": where}
        ref = "papers/001 Ex. 1.2.11-1.2.12"
        self.rel.direct_sites.append(
            DirectSite("attention_qk_gl", "general", q_rows + k_rows, H if H > 1 else None, 1, ref, where, dict(info), "exact", self.gi)
        )
        self.rel.direct_sites.append(
            DirectSite("attention_vo_gl", "general", v_rows + [(w_o, dict(axis=1, power=-1))], H if H > 1 else None, 1, "papers/001 Ex. 1.2.12", where, dict(info), "exact", self.gi)
        )
        if H > 1 and not heads_permutable:
            self.rel.skipped.append(("attention", where, "head permutations skipped: the per-head attention weights are returned and used"))
        elif H > 1 and not m.dropout:
            self.rel.direct_sites.append(
                DirectSite("attention_head_permutation", "permutation", perm_rows + [(w_o, dict(axis=1))], None, d, "papers/001 Ex. 1.2.12", where, dict(info), "exact", self.gi)
            )
        elif H > 1:
            self.rel.skipped.append(("attention", where, f"head permutations skipped: attention dropout (p={m.dropout}) draws masks per head in training"))


_SPATIAL_DIMS: dict[Any, int] = {
    **{f: k for k, fs in ((1, (F.avg_pool1d, F.max_pool1d, F.adaptive_avg_pool1d, F.adaptive_max_pool1d)),
                          (2, (F.avg_pool2d, F.max_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d)),
                          (3, (F.avg_pool3d, F.max_pool3d, F.adaptive_avg_pool3d, F.adaptive_max_pool3d))) for f in fs},
    **{m: k for k, ms in ((1, (nn.AvgPool1d, nn.MaxPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)),
                          (2, (nn.AvgPool2d, nn.MaxPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)),
                          (3, (nn.AvgPool3d, nn.MaxPool3d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool3d))) for m in ms},
}


def identify_node(node: fx.Node, traced: TracedGraph) -> tuple[str | None, str]:
    """Canonical op name (``teleopt.detection.ops``) and a readable description of a traced node."""
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
    target = node.target
    op = function_op(target)
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
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", str(target))
    module_name = getattr(target, "__module__", None) or ""
    return op, f"{module_name + '.' if module_name else ''}{name}"


def _all_equal(v: Any, x: int) -> bool:
    return all(e == x for e in v) if isinstance(v, (tuple, list)) else v == x


def _align(ctx: NodeContext, t: Ref, out: Ref, j: int) -> tuple[Ref, int] | None:
    """The axis of operand ``t`` that broadcasting aligns with output axis ``j`` (right-aligned)."""
    i = j - (len(ctx.meta(out)) - len(ctx.meta(t)))
    return (t, i) if i >= 0 else None


def _index_items(index: Any, ndim: int) -> list | None:
    """Normalise a basic index (ints, slices, None, Ellipsis) to one item per input axis (plus Nones)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in items):
        return None
    for it in items:
        if isinstance(it, slice) and any(isinstance(v, fx.Node) for v in (it.start, it.stop, it.step)):
            return None
    n_real = sum(1 for i in items if i is not None and i is not Ellipsis)
    if items.count(Ellipsis) > 1 or n_real > ndim:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (ndim - n_real) + items[k + 1 :]
    else:
        items = items + [slice(None)] * (ndim - n_real)
    return items


def _view_through(node: fx.Node, op: str, view: ParamView, out_shape: tuple[int, ...]) -> ParamView | None:
    """The parameter view after a view op, or ``None`` if the op does more than relabel axes."""
    if op in ("identity_like", "identity"):
        if op == "identity_like" and node.op == "call_method" and node.target == "to" and any(isinstance(a, fx.Node) for a in node.args[1:]):
            return view
        return view
    if op == "permute":
        perm = _perm_of(node, op, len(view.shape))
        if perm is None:
            return None
        return ParamView(view.name, view.kind, tuple(view.axis_map[i] for i in perm), out_shape, tuple(view.expanded[i] for i in perm))
    if op == "expand":
        off = len(out_shape) - len(view.shape)
        axis_map, expanded = [], []
        for j, n in enumerate(out_shape):
            i = j - off
            if i >= 0 and view.shape[i] == n:
                axis_map.append(view.axis_map[i])
                expanded.append(view.expanded[i])
            else:
                axis_map.append(None)
                expanded.append(n > 1)
        return ParamView(view.name, view.kind, tuple(axis_map), out_shape, tuple(expanded))
    if op == "reshape":
        groups = reshape_groups(view.shape, out_shape)
        if groups is None or any(len(s) != 1 or len(d) != 1 for s, d in groups):
            return None
        axis_map: list[int | None] = [None] * len(out_shape)
        expanded = [False] * len(out_shape)
        for (s,), (d,) in groups:
            axis_map[d] = view.axis_map[s]
            expanded[d] = view.expanded[s]
        return ParamView(view.name, view.kind, tuple(axis_map), out_shape, tuple(expanded))
    if op == "getitem_view":
        items = _index_items(node.args[1], len(view.shape))
        if items is None or any(isinstance(i, int) or (isinstance(i, slice) and i != slice(None)) for i in items):
            return None
        axis_map, expanded = [], []
        k = 0
        for it in items:
            if it is None:
                axis_map.append(None)
                expanded.append(False)
            else:
                axis_map.append(view.axis_map[k])
                expanded.append(view.expanded[k])
                k += 1
        return ParamView(view.name, view.kind, tuple(axis_map), out_shape, tuple(expanded))
    return None


def _owner(module: nn.Module, qualified: str) -> nn.Module:
    parts = qualified.split(".")[:-1]
    for p in parts:
        module = getattr(module, p)
    return module


def run_rules(model: nn.Module, rel: Relations, graphs: list[TracedGraph]) -> None:
    """Apply the op rules of every traced graph (train and eval) to one set of relations."""
    for gi, traced in enumerate(graphs):
        _Rules(model, rel, traced, gi).run()
