"""Attention head sites beyond one GL(d) per head: grouped-query heads and rotary embeddings.

Shared vocabulary of :mod:`teleopt.detection.attention`, which finds the heads.

* Grouped-query attention (Ainslie et al., GQA, EMNLP 2023; transformers'
  ``repeat_kv``): the k and v rows of key/value head g are read by the ``rep``
  query heads g * rep .. (g + 1) * rep - 1.  (V, O) is then GL(d) per key/value
  head: v rows of head g by B_g, the output projection's columns of every query
  head reading it by B_g^{-1} (Zhao 2026, Ex. 1.2.12, with the columns of the
  ``rep`` heads tied); (Q, K) is GL(d) per key/value head, q rows of the ``rep``
  heads by A_g and k rows by A_g^{-T} (Ex. 1.2.11).
* Rotary position embeddings in the rotate-half layout (Su et al., RoFormer, 2021,
  eq. 34; transformers' ``apply_rotary_pos_emb``): q_m -> R_m q_m rotates each pair
  of dimensions (i, i + d/2) by a position-dependent angle, so q_m^T k_n depends
  on A only through elements commuting with every rotation: per pair, a scaled
  rotation.  Its positive-scaling part, q pair i by c_i and k pair i by 1/c_i, is
  exact for any cos/sin tables (it scales both outputs of the pair); it is the site
  given here, with the k bias moved like the k rows (a rotated bias is not a
  per-query constant, so softmax does not ignore it).  The rotation part of each
  pair is left out (reported).  With partial rotary (Phi: only the first r
  dimensions of each head rotated) the other d - r dimensions keep GL(d - r).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.fx as fx

from teleopt.detection.attention_layout import Digits, Layout, NoMatch, Projection
from teleopt.detection.relations import DirectSite
from teleopt.detection.views import index_items

__all__ = ["Rotary", "head_layout", "rotary_input", "qk_group_sites", "vo_group_sites"]

Members = list[tuple[str | None, dict[str, Any]]]


class _Graph(Protocol):
    def op(self, node: fx.Node) -> tuple[str | None, str]: ...

    def shape(self, node: fx.Node) -> tuple[int, ...]: ...

    def _depends_on(self, node: fx.Node, targets: set[fx.Node]) -> bool: ...


class _Slicer(Protocol):
    def pick(self, layout: Layout, dim: int, index: int, what: str) -> Layout: ...

    def narrow(self, layout: Layout, dim: int, start: int, length: int, what: str) -> Layout: ...


class Rotary(tuple):
    """(input x, half width h, the nodes, rotated dimensions) of ``x * cos + rotate_half(x) * sin``.

    ``dims`` < the last axis: partial rotary, ``cat((rotary(x[..., :dims]), x[..., dims:]), -1)``.
    """

    x: fx.Node
    half: int
    nodes: list[fx.Node]
    dims: int

    def __new__(cls, x: fx.Node, half: int, nodes: list[fx.Node], dims: int = 0) -> Rotary:
        self = super().__new__(cls, (x, half, tuple(nodes), dims or 2 * half))
        self.x, self.half, self.nodes, self.dims = x, half, nodes, dims or 2 * half
        return self


def _half_of(g: _Graph, node: Any, x: fx.Node) -> tuple[int, int] | None:
    """(start, stop) of ``x[..., start:stop]`` on the last axis, else ``None``."""
    if not isinstance(node, fx.Node) or g.op(node)[0] != "getitem_view" or node.args[0] is not x:
        return None
    d = g.shape(x)[-1]
    items = index_items(node.args[1], len(g.shape(x)))
    if items is None or len(items) != len(g.shape(x)) or any(i != slice(None) for i in items[:-1]):
        return None
    last = items[-1]
    if not isinstance(last, slice):
        return None
    start, stop, step = last.indices(d)
    return (start, stop) if step == 1 else None


def _rotate_half(g: _Graph, node: Any) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """``cat((-x[..., h:], x[..., :h]), dim=-1)`` with 2h the last axis: (x, h, its nodes), else ``None``."""
    if not isinstance(node, fx.Node) or g.op(node)[0] != "cat":
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(parts[0], fx.Node):
        return None
    neg, first = parts
    if not isinstance(neg, fx.Node) or not isinstance(first, fx.Node) or g.op(neg)[0] != "neg":
        return None
    second, x = neg.args[0] if neg.args else None, first.args[0] if first.args else None
    if not isinstance(second, fx.Node) or not isinstance(x, fx.Node):
        return None
    if not isinstance(dim, int) or dim % len(g.shape(x)) != len(g.shape(x)) - 1:
        return None
    d = g.shape(x)[-1]
    if d % 2 or _half_of(g, first, x) != (0, d // 2) or _half_of(g, second, x) != (d // 2, d):
        return None
    return x, d // 2, [node, neg, second, first]


def _partial(g: _Graph, node: fx.Node) -> Rotary | None:
    """``cat((rotary(x[..., :r]), x[..., r:]), dim=-1)`` (Phi, StableLM, GPT-NeoX ``rotary_pct``), else ``None``."""
    parts = node.args[0] if node.args else None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2:
        return None
    rot_out, rest = parts
    if not isinstance(rot_out, fx.Node) or not isinstance(rest, fx.Node):
        return None
    inner = rotary_input(g, rot_out) if g.op(rot_out)[0] == "add" else None
    x = rest.args[0] if rest.args else None
    if inner is None or not isinstance(x, fx.Node) or not isinstance(dim, int) or dim % len(g.shape(x)) != len(g.shape(x)) - 1:
        return None
    r, d = 2 * inner.half, g.shape(x)[-1]
    if _half_of(g, inner.x, x) != (0, r) or _half_of(g, rest, x) != (r, d) or set(x.users) != {inner.x, rest}:
        return None
    if len(inner.x.users) and len(rot_out.users) == 1 and len(rest.users) == 1:
        return Rotary(x, inner.half, [*inner.nodes, inner.x, rest, node], r)
    return None


def rotary_input(g: _Graph, node: fx.Node) -> Rotary | None:
    """The rotate-half rotary embedding ``x * cos + rotate_half(x) * sin`` ending at ``node`` (an add), else ``None``.

    The cos and sin tables must not depend on x, and x must be read by the embedding only.
    A ``cat`` of a rotary embedding of x's first dimensions and x's other dimensions is a partial one.
    """
    if g.op(node)[0] == "cat":
        return _partial(g, node)
    if g.op(node)[0] != "add" or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    for m1, m2 in ((a, b), (b, a)):
        if not (isinstance(m1, fx.Node) and isinstance(m2, fx.Node) and g.op(m1)[0] == g.op(m2)[0] == "mul"):
            continue
        for r_arg, s_arg in ((m2.args[0], m2.args[1]), (m2.args[1], m2.args[0])):
            found = _rotate_half(g, r_arg)
            if found is None:
                continue
            x, half, nodes = found
            if x not in m1.args[:2]:
                continue
            c_arg = m1.args[1] if m1.args[0] is x else m1.args[0]
            tables = [t for t in (c_arg, s_arg) if isinstance(t, fx.Node)]
            if any(g._depends_on(t, {x}) for t in tables):
                continue
            inner = [m1, m2, *nodes]
            if set(x.users) != {m1, nodes[2], nodes[3]} or any(len(n.users) != 1 for n in inner):
                continue
            return Rotary(x, half, [*inner, node])
    return None


def head_layout(layout: Layout, feature_axis: int, what: str) -> tuple[int, int, int, int | None, int]:
    """(start row, heads H, head dim d, head axis, repeats) from the layout of q, k or v at the core.

    ``repeats`` > 1: grouped-query attention (transformers' ``repeat_kv``), the head
    axis holds H groups of rows, each read by ``repeats`` consecutive heads.
    """
    n = len(layout.axes)
    feature_axis %= n
    feat = [d for d in (layout.axes[feature_axis] or []) if d[0] > 1]
    if len(feat) != 1 or feat[0][1] != 1:
        raise NoMatch(f"the head dimension of {what} is not a contiguous block of projection rows")
    d = feat[0][0]
    head_axis, H, rep = None, 1, 1
    for i, ax in enumerate(layout.axes):
        if i == feature_axis or ax is None:
            continue
        digits = [x for x in ax if x[0] > 1]
        if not digits:
            continue
        if digits[-1][1] == 0 and len(digits) > 1:  # (groups, d), (repeats, 0)
            rep, digits = digits[-1][0], digits[:-1]
        elif digits[-1][1] == 0:
            rep, digits = digits[-1][0], [(1, d)]
        if head_axis is not None or len(digits) != 1 or digits[0][1] != d:
            raise NoMatch(f"the heads of {what} are not contiguous blocks of projection rows")
        head_axis, H = i - n, digits[0][0]
    return layout.offset, H, d, head_axis, rep


def qk_group_sites(
    q: tuple[Projection, int], k: tuple[Projection, int], shape: tuple[int, int, int], rotary: tuple[int, int] | None, where: str, gi: int
) -> list[DirectSite]:
    """(Q, K) sites of one attention, one per key head: ``shape`` is (key heads, query heads per key head, d).

    Without rotary embeddings GL(d) (q rows of the group by A, k rows by A^{-T}; the k
    bias is left out: softmax ignores it); with them (``half`` = d/2) the positive
    scaling of each rotary pair (see the module notes).
    """
    (pq, q0), (pk, k0) = q, k
    heads, rep, d = shape
    if rotary is not None and rotary[1] < d:
        return [s for g in range(heads) for s in _partial_sites(pq, q0 + g * rep * d, pk, k0 + g * d, (rep, d, rotary[1]), where, gi)]
    half = None if rotary is None else rotary[0]
    sites = []
    for g in range(heads):
        qs, ks = q0 + g * rep * d, k0 + g * d
        if half is None:
            members: Members = [(pq.weight, pq.rows(qs, rep * d, 1, rep))]
            members += pq.bias_rows(qs, rep * d, 1, rep)
            members.append((pk.weight, pk.rows(ks, d, -1)))
            info = {"heads": rep, "head_dim": d, "module": where, "kv_head": g, "key_bias": "left out: softmax ignores it"}
            sites.append(DirectSite("attention_qk_gl", "general", members, None, 1, "Zhao 2026, Ex. 1.2.11", where, info, "exact", gi))
            continue
        members = [(pq.weight, pq.rows(qs, rep * d, 1, 2 * rep))]
        members += pq.bias_rows(qs, rep * d, 1, 2 * rep)
        members.append((pk.weight, pk.rows(ks, d, -1, 2)))
        members += pk.bias_rows(ks, d, -1, 2)
        info = {
            "heads": rep,
            "head_dim": d,
            "module": where,
            "kv_head": g,
            "rotary": "positive scaling of each rotary pair (i, i + d/2); the pair rotations are left out",
        }
        ref = "Zhao 2026, Ex. 1.2.11; Su et al. 2021 (RoFormer), eq. 34"
        sites.append(DirectSite("attention_qk_rotary_scaling", "diagonal", members, None, 1, ref, where, info, "exact", gi))
    return sites


def _partial_sites(pq: Projection, qs: int, pk: Projection, ks: int, shape: tuple[int, int, int], where: str, gi: int) -> list[DirectSite]:
    """Partial rotary, one key head: the pair scalings of the r rotated dimensions and GL(d - r) on the others."""
    rep, d, r = shape
    scale: Members = []
    gl: Members = []
    for j in range(rep):  # each query head's rotated and unrotated rows
        h0 = qs + j * d
        scale += [(pq.weight, pq.rows(h0, r, 1, 2)), *pq.bias_rows(h0, r, 1, 2)]
        gl += [(pq.weight, pq.rows(h0 + r, d - r, 1)), *pq.bias_rows(h0 + r, d - r, 1)]
    scale += [(pk.weight, pk.rows(ks, r, -1, 2)), *pk.bias_rows(ks, r, -1, 2)]
    gl.append((pk.weight, pk.rows(ks + r, d - r, -1)))
    info = {"heads": rep, "head_dim": d, "module": where, "rotary_dims": r}
    ref = "Zhao 2026, Ex. 1.2.11; Su et al. 2021 (RoFormer), eq. 34"
    return [
        DirectSite("attention_qk_rotary_scaling", "diagonal", scale, None, 1, ref, where, {**info, "rotary": "pair scalings"}, "exact", gi),
        DirectSite(
            "attention_qk_gl", "general", gl, None, 1, ref, where, {**info, "key_bias": "left out: softmax ignores it"}, "exact", gi
        ),
    ]


def vo_group_sites(v: tuple[Projection, int], out: Projection, shape: tuple[int, int, int], where: str, gi: int) -> list[DirectSite]:
    """(V, O) GL(d) sites of grouped-query attention, one per value head: ``shape`` is (value heads, reading heads, d)."""
    (pv, v0), (heads, rep, d) = v, shape
    sites = []
    for g in range(heads):
        members: Members = [(pv.weight, pv.rows(v0 + g * d, d, 1))]
        members += pv.bias_rows(v0 + g * d, d, 1)
        members.append((out.weight, out.columns(-1, g * rep * d, rep * d, rep)))
        info = {"heads": rep, "head_dim": d, "module": where, "kv_head": g}
        sites.append(DirectSite("attention_vo_gl", "general", members, None, 1, "Zhao 2026, Ex. 1.2.12", where, info, "exact", gi))
    return sites


def view_item(finder: _Slicer, node: fx.Node, layout: Layout, in_shape: Any, what: str) -> Layout:
    """Basic indexing (ints, full or contiguous slices, None) of ``what``."""
    items = index_items(node.args[1], len(layout.axes))
    if items is None:
        raise NoMatch(f"advanced indexing on {what}")
    axes: list[Digits | None] = []
    offset = layout.offset
    k = 0
    for item in items:
        if item is None:
            axes.append([])
            continue
        ax = layout.axes[k]
        size = in_shape[k]
        if isinstance(item, int):
            out = finder.pick(Layout([ax], offset), 0, item % size, what)
            offset = out.offset
        else:
            start, stop, step = item.indices(size)
            if step != 1:
                raise NoMatch(f"strided slicing on {what}")
            if (start, stop) == (0, size):
                axes.append(ax)
            else:
                out = finder.narrow(Layout([ax], offset), 0, start, stop - start, what)
                axes.append(out.axes[0])
                offset = out.offset
        k += 1
    return Layout(axes, offset)
