"""Per-head GL symmetries of multi-head attention found in a traced graph (Zhao 2026, Ex. 1.2.11-1.2.12).

For every attention core (``F.scaled_dot_product_attention``, or the explicit
``softmax(q @ k^T * s + bias) @ v``) we walk from q, k and v back to the linear
projections that produce them, and from the output forward to the projection
that reads it, following the head split exactly: every reshape, permute, unbind
or chunk is replayed on the *feature digits* of the projection's output index, so
we know which rows of the (possibly fused qkv) weight feed head h, channel j of
q.  Then

* (GL_{d})^H on (Q, K): q rows of head h by A_h, k rows by A_h^{-T} (the q bias by
  A_h; the k bias only adds a per-query constant that softmax ignores, so it is
  left out and the site stays minimal);
* (GL_{d_v})^H on (V, O): v rows and bias by B_h, the output projection's columns
  of head h by B_h^{-1}.

A bias concatenated in forward (timm BEiT, EVA-02, SwinV2:
``F.linear(x, qkv.weight, torch.cat((q_bias, k_bias, v_bias)))``) is read piece by
piece: a parameter piece moves with its rows, a zero built in forward stays zero,
and a fixed piece (a buffer, a constant) under the q or v rows drops the site.

Anything else on the way (qk-norm, rotary embeddings, a gate, a norm before the
output projection, a tensor that also leaves the attention) removes the
corresponding site and is reported; head permutations are found by the generic
axis analysis (``teleopt.detection.rules``), which also follows the head split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.fx as fx

from teleopt.detection.attention_heads import Rotary, head_layout, qk_group_sites, rotary_input, view_item, vo_group_sites
from teleopt.detection.attention_layout import (
    BiasPiece,
    Digits,
    Layout,
    NoMatch,
    Projection,
    as_node,
    merge,
    reads_dtype_only,
    split_digits,
)
from teleopt.detection.fx_args import Argument, arg, float_arg, int_arg, tensor_arg
from teleopt.detection.ops import identify_node
from teleopt.detection.relations import DirectSite, Relations
from teleopt.detection.rules.masks import is_zeros
from teleopt.detection.tracing import TensorMeta, TracedGraph, module_path
from teleopt.detection.views import perm_of, reshape_groups

__all__ = ["find_attention_sites"]

#: (q, k, v, output, inner nodes, key feature axis) of one attention core
Core = tuple[Argument, Argument, Argument, fx.Node, list[fx.Node], int]

_PLUMBING = {"reshape", "permute", "expand", "identity_like", "identity", "getitem_tuple", "getitem_view", "split", "dropout", "mul", "div"}


class _Finder:
    def __init__(self, traced: TracedGraph, rel: Relations) -> None:
        self.traced = traced
        self.rel = rel
        self.values = traced.values
        self.rotary: dict[str, Rotary] = {}  # what ("q", "k") -> its rotary embedding, for the core at hand
        self.rotary_at: dict[fx.Node, fx.Node] = {}  # the input of a rotary embedding -> its output
        self.gqa: set[fx.Node] = set()  # sdpa calls with enable_gqa=True

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        v = self.values.get(node.name)
        if not isinstance(v, TensorMeta):
            raise NoMatch(f"{node.name} is not a tensor")
        return v.shape

    def op(self, node: fx.Node) -> tuple[str | None, str]:
        return identify_node(node, self.traced)

    def users(self, node: fx.Node) -> list[fx.Node]:
        """Users that read the values of ``node`` (not only its shape, dtype or device)."""
        return [u for u in node.users if self.op(u)[0] not in ("metadata", "constant", "constant_like") and not reads_dtype_only(u, node)]

    # -- projections ------------------------------------------------------------------
    def projection(self, node: fx.Node) -> Projection | None:
        op, _ = self.op(node)
        if op == "add":
            return self.projection_plus_bias(node)
        if op == "addmm":
            return self.addmm_projection(node)
        if op != "linear":
            return None
        names = self.rel.tensors.names
        if node.op == "call_module":
            m: Any = self.traced.modules[str(node.target)]  # nn.Linear, or a user type given its rule
            w, b = names.get(id(m.weight)), (names.get(id(m.bias)) if m.bias is not None else None)
            if w is None or (m.bias is not None and b is None):
                return None
            own: tuple[BiasPiece, ...] = (BiasPiece(0, m.out_features, "parameter", b),) if b is not None else ()
            return Projection(node, w, b, m.in_features, m.out_features, own)
        w_arg, b_arg = arg(node, 1, "weight"), arg(node, 2, "bias")
        w_view = self.rel.views.get(("t", self._gi, w_arg.name, ())) if isinstance(w_arg, fx.Node) else None
        if w_view is None or w_view.kind != "parameter" or w_view.axis_map != (0, 1):
            return None
        b_name = None
        pieces: tuple[BiasPiece, ...] = ()
        if b_arg is not None:
            b_view = self.rel.views.get(("t", self._gi, b_arg.name, ())) if isinstance(b_arg, fx.Node) else None
            if b_view is not None and b_view.kind == "parameter" and b_view.axis_map == (0,):
                b_name = b_view.name
                pieces = (BiasPiece(0, w_view.shape[0], "parameter", b_name),)
            else:
                found = self.concatenated_bias(b_arg, node, w_view.shape[0])
                if found is None:
                    return None
                pieces = found
                b_name = next((p.name for p in pieces if p.kind == "parameter"), None)
        return Projection(node, w_view.name, b_name, w_view.shape[1], w_view.shape[0], pieces)

    def addmm_projection(self, node: fx.Node) -> Projection | None:
        """``addmm(b, x, W)`` with W of shape (in, out) (transformers' ``Conv1D``), else ``None``."""
        if node.kwargs or len(node.args) != 3:
            return None
        views = [self.rel.views.get(("t", self._gi, a.name, ())) if isinstance(a, fx.Node) else None for a in (node.args[0], node.args[2])]
        b_view, w_view = views
        if w_view is None or w_view.kind != "parameter" or w_view.axis_map != (0, 1):
            return None
        if b_view is None or b_view.kind != "parameter" or b_view.axis_map != (0,):
            return None
        out = w_view.shape[1]
        return Projection(node, w_view.name, b_view.name, w_view.shape[0], out, (BiasPiece(0, out, "parameter", b_view.name),), 1, 1)

    def projection_plus_bias(self, node: fx.Node) -> Projection | None:
        """``qkv = self.qkv(x); qkv += torch.cat((q_bias, k_bias, v_bias))`` (timm ``qkv_bias_separate``), else ``None``."""
        base, b_arg = node.args[0], (node.args[1] if len(node.args) > 1 else None)
        if len(node.args) != 2 or node.kwargs or not isinstance(base, fx.Node) or self.op(base)[0] != "linear":
            return None
        inner = self.projection(base)
        if inner is None or inner.bias_pieces or self.users(base) != [node]:
            return None
        pieces = self.concatenated_bias(b_arg, node, inner.out_features)
        if pieces is None:
            return None
        name = next((p.name for p in pieces if p.kind == "parameter"), None)
        return Projection(node, inner.weight, name, inner.in_features, inner.out_features, pieces)

    def concatenated_bias(self, b_arg: Argument, linear: fx.Node, rows: int) -> tuple[BiasPiece, ...] | None:
        """The pieces of a bias ``torch.cat((q_bias, k_bias, v_bias))`` read by this projection only, else ``None``."""
        if not isinstance(b_arg, fx.Node) or self.op(b_arg)[0] != "cat" or self.users(b_arg) != [linear]:
            return None
        tensors = arg(b_arg, 0, "tensors")
        dim = arg(b_arg, 1, "dim", 0)
        if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or dim not in (0, -1):
            return None
        pieces, offset = [], 0
        for t in tensors:
            if not isinstance(t, fx.Node):
                return None
            value = self.values.get(t.name)
            if not isinstance(value, TensorMeta) or len(value.shape) != 1:
                return None
            n = value.shape[0]
            view = self.rel.views.get(("t", self._gi, t.name, ()))
            if view is not None and view.axis_map == (0,) and view.kind == "parameter":
                pieces.append(BiasPiece(offset, offset + n, "parameter", view.name))
            elif view is None and is_zeros(t):
                pieces.append(BiasPiece(offset, offset + n, "zero"))
            else:
                pieces.append(BiasPiece(offset, offset + n, "fixed"))
            offset += n
        return tuple(pieces) if offset == rows else None

    def is_scalar_op(self, node: fx.Node) -> bool:
        """mul/div of a tensor by a python number (the attention scale)."""
        others = [a for a in node.args[1:]]
        return len(node.args) == 2 and not isinstance(node.args[1], fx.Node) and isinstance(others[0], (int, float))

    def back_to_projection(self, node: fx.Node, what: str) -> tuple[Projection, list[fx.Node]]:
        """Walk from ``node`` back to the linear projection producing it; returns the chain in forward order."""
        chain: list[fx.Node] = []
        cur = node
        while True:
            proj = self.projection(cur)
            if proj is not None:
                return proj, list(reversed(chain))
            op, describe = self.op(cur)
            rotary = rotary_input(self, cur) if op in ("add", "cat") and what not in self.rotary else None
            if rotary is not None:
                self.rotary[what] = rotary
                self.rotary_at[rotary.x] = cur
                cur = rotary.x
                continue
            if op not in _PLUMBING and op is not None:
                raise NoMatch(f"{what} passes through {describe} ({module_path(cur) or cur.name}) between its projection and the attention")
            if op is None or (op in ("mul", "div") and not self.is_scalar_op(cur)) or (op == "dropout" and self.dropout_p(cur)):
                raise NoMatch(f"{what} passes through {describe} ({module_path(cur) or cur.name}) between its projection and the attention")
            chain.append(cur)
            parent = cur.args[0]
            if not isinstance(parent, fx.Node):
                raise NoMatch(f"{what} does not come from a linear projection")
            cur = parent

    def dropout_p(self, node: fx.Node) -> float:
        if node.op == "call_module":
            module: Any = self.traced.modules[str(node.target)]
            return float(module.p)
        return float(float_arg(node, 1, "p", 0.5))

    # -- digit propagation ----------------------------------------------------------------
    def propagate(self, proj: Projection, chain: list[fx.Node], what: str) -> Layout:
        shape = self.shape(proj.node)
        layout = Layout([None] * (len(shape) - 1) + [[(shape[-1], 1)]])
        prev = proj.node
        for node in chain:
            layout = self.step(node, prev, layout, what)
            prev = node
        return layout

    def step(self, node: fx.Node, prev: fx.Node, layout: Layout, what: str) -> Layout:
        op, describe = self.op(node)
        if op in ("identity_like", "identity", "dropout", "mul", "div"):
            return layout
        if op == "split":
            return layout  # resolved by the getitem that picks one output
        in_shape = self.shape(prev) if isinstance(self.values.get(prev.name), TensorMeta) else None
        if op == "permute":
            perm = perm_of(node, len(layout.axes))
            if perm is None:
                raise NoMatch(f"cannot follow {describe} on {what}")
            return Layout([layout.axes[i] for i in perm], layout.offset)
        if op == "reshape":
            return Layout(self.reshape(layout, in_shape, self.shape(node), what), layout.offset)  # type: ignore[arg-type]
        if op == "expand":  # repeat_kv: a new axis of size 1 repeated n times reads the same rows (stride 0)
            out_shape = self.shape(node)
            if in_shape is None or len(in_shape) != len(out_shape):
                raise NoMatch(f"cannot follow {describe} on {what}")
            if any(a != b and ax not in ([], None) for ax, a, b in zip(layout.axes, in_shape, out_shape)):
                raise NoMatch(f"{describe} repeats a feature, batch or token axis of {what}")
            return Layout([ax if a == b or ax is None else [(b, 0)] for ax, a, b in zip(layout.axes, in_shape, out_shape)], layout.offset)
        if op == "getitem_tuple":
            return self._tuple_item(node, layout, describe, what)
        if op == "getitem_view":
            return view_item(self, node, layout, in_shape, what)
        raise NoMatch(f"cannot follow {describe} on {what}")

    def _tuple_item(self, node: fx.Node, layout: Layout, describe: str, what: str) -> Layout:
        """One part of a split, chunk or unbind of ``what``."""
        parent, index = as_node(node.args[0], what), node.args[1]
        if not isinstance(index, int):
            raise NoMatch(f"cannot follow {describe} on {what}")
        src_shape = self.shape(tensor_arg(parent, 0, "input"))
        pieces = self.values[parent.name]
        if not isinstance(pieces, (tuple, list)) or not -len(pieces) <= index < len(pieces):
            raise NoMatch(f"cannot follow {describe} on {what}")
        index %= len(pieces)  # parts[-1]
        name = str(parent.target) if parent.op == "call_method" else getattr(parent.target, "__name__", "")
        if name == "unbind":
            dim = int_arg(parent, 1, "dim", 0) % len(src_shape)
            return self.pick(layout, dim, index, what)
        dim_index = 2 if name in ("split", "chunk", "tensor_split") else 1
        dim = int_arg(parent, dim_index, "dim", 0) % len(src_shape)
        start = sum(p.shape[dim] for p in pieces[:index])
        return self.narrow(layout, dim, start, pieces[index].shape[dim], what)

    def reshape(self, layout: Layout, src: tuple[int, ...], dst: tuple[int, ...], what: str) -> list[Digits | None]:
        groups = reshape_groups(src, dst)
        if groups is None:
            raise NoMatch(f"inconsistent reshape of {what}")
        axes: list[Digits | None] = [[] if n == 1 else None for n in dst]
        for g_src, g_dst in groups:
            parts = [layout.axes[i] for i in g_src]
            if all(p is None for p in parts):
                for j in g_dst:
                    axes[j] = None
                continue
            if any(p is None for p in parts):
                raise NoMatch(f"a reshape mixes the feature axis of {what} with batch or token axes")
            digits = [d for p in parts for d in p if d[0] > 1]  # type: ignore[union-attr]
            for j, dig in zip(g_dst, split_digits(digits, [dst[j] for j in g_dst], what)):
                axes[j] = dig
        for i, n in enumerate(src):
            if n == 1 and layout.axes[i]:
                raise NoMatch(f"cannot follow a reshape of {what}")
        return axes

    def pick(self, layout: Layout, dim: int, index: int, what: str) -> Layout:
        ax = layout.axes[dim]
        if ax is None:
            raise NoMatch(f"{what} indexes a batch or token axis")
        offset = layout.offset
        rest = index
        for size, stride in reversed(ax):
            offset += (rest % size) * stride
            rest //= size
        return Layout(layout.axes[:dim] + layout.axes[dim + 1 :], offset)

    def narrow(self, layout: Layout, dim: int, start: int, length: int, what: str) -> Layout:
        ax = layout.axes[dim]
        if ax is None:
            return layout
        digits = [d for d in ax if d[0] > 1]
        if len(digits) != 1:
            raise NoMatch(f"{what} slices a composite feature axis")
        size, stride = digits[0]
        axes = list(layout.axes)
        axes[dim] = [(length, stride)]
        return Layout(axes, layout.offset + start * stride)

    # -- the head structure at the attention core ------------------------------------------
    def heads(self, layout: Layout, feature_axis: int, what: str) -> tuple[int, int, int, int | None, int]:
        return head_layout(layout, feature_axis, what)

    # -- cores --------------------------------------------------------------------------------
    def cores(self) -> Iterable[Core]:
        """(q, k, v, output, inner nodes, key feature axis) for every attention core."""
        for node in self.traced.graph.nodes:
            op, _ = self.op(node)
            if op == "sdpa":
                args = list(node.args) + [node.kwargs.get(k) for k in ("query", "key", "value")[len(node.args) :]]
                q, k, v = args[:3]
                if node.kwargs.get("enable_gqa"):
                    self.gqa.add(node)
                yield q, k, v, node, [node], -1
            elif op in ("softmax",):
                core = self.explicit_core(node)
                if core is not None:
                    yield core

    def explicit_core(self, softmax: fx.Node) -> Core | None:
        """``softmax(q @ k^T * s + bias) @ v`` ending at this softmax over the last axis, or ``None``."""
        shape = self.shape(softmax)
        dim: Any = arg(softmax, 1, "dim")
        if softmax.op == "call_module":
            dim = getattr(self.traced.modules[str(softmax.target)], "dim", None)
        if not isinstance(dim, int) or dim % len(shape) != len(shape) - 1:
            return None
        inner = [softmax]
        cur = softmax.args[0]
        while isinstance(cur, fx.Node):  # backwards over scale, additive bias and mask
            op, _ = self.op(cur)
            if not (op in ("mul", "div") and self.is_scalar_op(cur)) and op not in ("add", "maybe_add_mask", "masked_fill"):
                break
            inner.append(cur)
            cur = cur.args[0]
        if not isinstance(cur, fx.Node) or self.op(cur)[0] != "matmul":
            return None
        scores = cur
        inner.append(scores)
        q, kt = scores.args[0], scores.args[1]
        out = softmax
        while True:  # forwards over dropout to the product with v
            users = self.users(out)
            if len(users) != 1:
                return None
            nxt = users[0]
            op, _ = self.op(nxt)
            if op in ("dropout", "identity", "identity_like"):
                inner.append(nxt)
                out = nxt
                continue
            if op == "matmul" and nxt.args[0] is out:
                inner.append(nxt)
                return q, kt, nxt.args[1], nxt, inner, -2
            return None

    # -- sites --------------------------------------------------------------------------------
    def run(self, gi: int) -> tuple[list[DirectSite], list[tuple[str, str, str]]]:
        self._gi = gi
        sites: list[DirectSite] = []
        skipped: list[tuple[str, str, str]] = []
        for q, k, v, out, inner, k_feature in self.cores():
            where = module_path(out) or out.name
            self.rotary, self.rotary_at = {}, {}
            try:
                qk, vo = self.qk_site(q, k, inner, k_feature, where), self.vo_site(v, out, where)
            except Exception as e:  # an unexpected layout: no attention site (fail closed)
                skipped.append(("attention", where, f"could not follow the heads ({type(e).__name__}: {e})"))
                continue
            for result in (qk, vo):
                if isinstance(result, str):
                    skipped.append(("attention", where, result))
                else:
                    sites.extend(result)
            if "q" in self.rotary and isinstance(qk, list):
                skipped.append(("attention", where, "rotary embeddings: the rotation of each pair (i, i + d/2) is left out of (Q, K)"))
        return sites, skipped

    def _chain(self, node: fx.Node, what: str) -> tuple[Projection, list[fx.Node], Layout]:
        proj, chain = self.back_to_projection(node, what)
        return proj, chain, self.propagate(proj, chain, what)

    def _check_private(self, nodes: Iterable[fx.Node], allowed: set[fx.Node], what: str) -> None:
        for n in nodes:
            for u in self.users(n):
                if u not in allowed:
                    raise NoMatch(f"{what}: {n.name} is also used by {u.name} ({module_path(u) or u.op}) outside the attention")

    @staticmethod
    def _rows(layout: Layout) -> set[int]:
        rows = {layout.offset}
        for ax in layout.axes:
            for size, stride in ax or ():
                rows = {r + i * stride for r in rows for i in range(size)}
        return rows

    def _flow_check(self, proj: Projection, rows: set[int], terminals: set[fx.Node], inner: set[fx.Node], what: str) -> None:
        """The transformed projection rows reach the attention only through ``terminals`` (nowhere else)."""
        shape = self.shape(proj.node)
        stack = [(proj.node, Layout([None] * (len(shape) - 1) + [[(shape[-1], 1)]]))]
        while stack:
            node, layout = stack.pop()
            if node in terminals:
                self._check_private([node], inner, what)
                continue
            if node in self.rotary_at:  # a rotary embedding keeps the layout (pairs are checked by the site)
                stack.append((self.rotary_at[node], layout))
                continue
            for u in self.users(node):
                op, describe = self.op(u)
                follow = (
                    op in _PLUMBING
                    and u.args
                    and u.args[0] is node
                    and (op not in ("mul", "div") or self.is_scalar_op(u))
                    and not (op == "dropout" and self.dropout_p(u))
                )
                if not follow:
                    raise NoMatch(f"the {what} rows of {proj.weight} also flow into {describe} ({module_path(u) or u.name})")
                try:
                    nxt = self.step(u, node, layout, what)
                except NoMatch:
                    raise NoMatch(f"cannot follow the {what} rows of {proj.weight} through {describe}") from None
                if self._rows(nxt) & rows:
                    stack.append((u, nxt))

    def _depends_on(self, node: fx.Node, targets: set[fx.Node]) -> bool:
        """Whether the *value* of ``node`` depends on ``targets`` (shape and dtype queries do not count)."""
        if not isinstance(self.values.get(node.name), TensorMeta):
            return False  # None (no mask) or a python value
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in targets:
                return True
            if n in seen or self.op(n)[0] in ("constant", "constant_like", "metadata"):
                continue
            seen.add(n)
            stack.extend(n.all_input_nodes)
        return False

    def qk_site(self, q_arg: Argument, k_arg: Argument, inner: list[fx.Node], k_feature: int, where: str) -> list[DirectSite] | str:
        try:
            q, k = as_node(q_arg, "q"), as_node(k_arg, "k")
            pq, cq, lq = self._chain(q, "q")
            pk, ck, lk = self._chain(k, "k")
            q0, H, d, hq, rq = self.heads(lq, -1, "q")
            k0, Hk, dk, hk, rk = self.heads(lk, k_feature, "k")
            if rk == 1 and inner[0] in self.gqa and Hk and H % Hk == 0:
                rk = H // Hk
            if rq != 1 or (H, d) != (Hk * rk, dk):
                raise NoMatch(f"q has {H} heads of size {d} but k has {Hk} of size {dk} read {rk} times")
            if H > 1 and hq != hk:
                raise NoMatch("q and k heads are not aligned")
            half = self._rotary_half(d)
            plumbing = set(cq) | set(ck) | {pq.node, pk.node}
            targets: dict[fx.Node, set[int]] = {pq.node: set(), pk.node: set()}
            targets[pq.node] |= set(range(q0, q0 + H * d))
            targets[pk.node] |= set(range(k0, k0 + Hk * d))
            if pq.node is pk.node and q0 < k0 + Hk * d and k0 < q0 + H * d:
                raise NoMatch("q and k use overlapping rows of one projection")
            for proj in {pq, pk}:
                self._flow_check(proj, targets[proj.node], {q, k}, set(inner), "q/k")
            self._check_score_addends(inner, plumbing)
            self._check_private(inner[:-1], set(inner), "scores")
            q_bias = pq.bias_members(q0, H * d, 1, "q")
            pk.bias_members(k0, Hk * d, -1, "k", fixed_ok=half is None)  # left out (see below), but it must be a known bias
            if rk > 1 or half is not None:
                return qk_group_sites((pq, q0), (pk, k0), (Hk, rk, d), half, where, self._gi)
        except NoMatch as e:
            return f"no (GL)^h site on (Q, K): {e}"
        members: list[tuple[str | None, dict[str, Any]]] = [(pq.weight, pq.rows(q0, H * d, 1))]
        members += q_bias
        members.append((pk.weight, pk.rows(k0, H * d, -1)))
        info = {"heads": H, "head_dim": d, "module": where, "key_bias": "left out: softmax ignores it"}
        return [
            DirectSite(
                "attention_qk_gl",
                "general",
                members,
                H if H > 1 else None,
                1,
                "Zhao 2026, Ex. 1.2.11-1.2.12",
                where,
                info,
                "exact",
                self._gi,
            )
        ]

    def _check_score_addends(self, inner: list[fx.Node], plumbing: set[fx.Node]) -> None:
        """``NoMatch`` if a bias or mask on the scores (an sdpa mask, nanoGPT's sliced buffer) depends on q or k."""
        for n in inner:
            op = self.op(n)[0]
            if op == "sdpa":
                extra = list(n.args[3:]) + [n.kwargs.get("attn_mask")]
            elif op in ("add", "maybe_add_mask", "masked_fill"):
                extra = list(n.args[1:]) + list(n.kwargs.values())
            else:
                continue
            for other in extra:
                if isinstance(other, fx.Node) and self._depends_on(other, plumbing):
                    raise NoMatch("a tensor added to the attention scores depends on q or k")

    def _rotary_half(self, d: int) -> tuple[int, int] | None:
        """(half, rotated dims) when q and k pass the same rotate-half embedding, ``None`` when neither does."""
        rq, rk = self.rotary.get("q"), self.rotary.get("k")
        if rq is None and rk is None:
            return None
        if rq is None or rk is None:
            raise NoMatch("only one of q and k passes a rotary embedding")
        if (rq.half, rq.dims) != (rk.half, rk.dims) or rq.dims > d:
            raise NoMatch("q and k are rotated differently")
        return rq.half, rq.dims

    def vo_site(self, v_arg: Argument, out: fx.Node, where: str) -> list[DirectSite] | str:
        try:
            v = as_node(v_arg, "v")
            pv, cv, lv = self._chain(v, "v")
            v0, Hv, dv, hv, rv = self.heads(lv, -1, "v")
            H = self.shape(out)[hv] if hv is not None else Hv * rv  # heads reading the values
            if H % Hv or rv not in (1, H // Hv) or (rv == 1 and H != Hv and out not in self.gqa):
                raise NoMatch(f"{H} heads read {Hv} value heads")
            # forward from the core output to the output projection
            layout = Layout([None] * len(self.shape(out)))
            layout.axes[-1] = [(dv, 1)]
            if H > 1:
                layout.axes[hv] = [(H, dv)]  # type: ignore[index]
            chain: list[fx.Node] = []
            cur = out
            while True:
                users = self.users(cur)
                if len(users) != 1:
                    raise NoMatch("the attention output is used more than once")
                nxt = users[0]
                proj = self.projection(nxt)
                if proj is not None and proj.input() is cur:
                    break
                op, describe = self.op(nxt)
                if (
                    op not in _PLUMBING
                    or op in ("getitem_tuple", "split")
                    or (op in ("mul", "div") and not self.is_scalar_op(nxt))
                    or (op == "dropout" and self.dropout_p(nxt))
                ):
                    raise NoMatch(f"the attention output passes through {describe} ({module_path(nxt) or nxt.name}) before its projection")
                layout = self.step(nxt, cur, layout, "the attention output")
                chain.append(nxt)
                cur = nxt
            feat = merge([x for x in (layout.axes[-1] or []) if x[0] > 1])
            if any(ax for ax in layout.axes[:-1]) or feat != [(H * dv, 1)] or layout.offset or proj.in_features != H * dv:
                raise NoMatch("the output projection does not read the heads as contiguous column blocks")
            self._flow_check(pv, set(range(v0, v0 + Hv * dv)), {v}, {out}, "v")
            v_bias = pv.bias_members(v0, Hv * dv, 1, "v")
            if H != Hv:
                return vo_group_sites((pv, v0), proj, (Hv, H // Hv, dv), where, self._gi)
        except NoMatch as e:
            return f"no (GL)^h site on (V, O): {e}"
        members: list[tuple[str | None, dict[str, Any]]] = [(pv.weight, pv.rows(v0, H * dv, 1))]
        members += v_bias
        members.append((proj.weight, proj.columns(-1)))
        info = {"heads": H, "head_dim": dv, "module": where}
        return [
            DirectSite(
                "attention_vo_gl", "general", members, H if H > 1 else None, 1, "Zhao 2026, Ex. 1.2.12", where, info, "exact", self._gi
            )
        ]


def find_attention_sites(traced: TracedGraph, gi: int, rel: Relations) -> tuple[list[DirectSite], list[tuple[str, str, str]]]:
    """Per-head (Q, K) and (V, O) GL sites of every attention core in one traced graph."""
    return _Finder(traced, rel).run(gi)
