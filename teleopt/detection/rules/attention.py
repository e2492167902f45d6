"""Rules of softmax and attention: softmax, ``scaled_dot_product_attention``, ``nn.MultiheadAttention``.

Attention contracts queries with keys: their channels carry g and g^{-T}
(Zhao 2026, Ex. 1.2.11); values pass to the output linearly (Ex. 1.2.12); tokens
are mixed, so scaling and GL are blocked along them and a causal mask fixes their
order.  ``nn.MultiheadAttention`` states its per-head GL sites on (Q, K) and
(V, O) and its head permutations directly; the head structure of attention built
from linear layers is found by ``teleopt.detection.attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from teleopt.detection.fx_args import arg, tensor_arg
from teleopt.detection.relations import ALL, GD, DirectSite, P, Ref
from teleopt.detection.rules.context import OpRule, RuleContext, tensor_paths
from teleopt.detection.tracing import TensorMeta

__all__ = ["RULES"]

_Rows = list[tuple[str | None, dict[str, Any]]]  # members of a direct site: (tensor name, Member fields)


def _softmax(ctx: RuleContext) -> None:
    x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
    for i in range(len(ctx.meta(x))):
        ctx.unify(P, (x, i), (out, i))
        ctx.block(GD, (x, i), "softmax is not scale-equivariant")


def _sdpa(ctx: RuleContext) -> None:
    node = ctx.node
    if node.kwargs.get("enable_gqa"):
        ctx.fail_closed("grouped-query attention")
        return
    q, k, v = (ctx.tensor(tensor_arg(node, i, name), role=name) for i, name in enumerate(("query", "key", "value")))
    mask_arg = arg(node, 3, "attn_mask")
    dropout = ctx.value(arg(node, 4, "dropout_p", 0.0)) or 0.0
    causal = ctx.value(arg(node, 5, "is_causal", False))
    out = ctx.output()
    _attention_core(ctx, q, k, v, out, dropout, bool(causal), mask_arg)


def _attention_core(ctx: RuleContext, q: Ref, k: Ref, v: Ref, out: Ref, dropout: float, causal: bool, mask_arg: Any) -> None:
    ctx.unify(ALL, (q, -1), (k, -1), -1.0)  # scores q . k are kept by (A q, A^-T k)
    ctx.unify(ALL, (v, -1), (out, -1))
    ctx.unify(P, (q, -2), (out, -2))
    ctx.unify(P, (k, -2), (v, -2))
    for h in ((q, -2), (k, -2), (v, -2), (out, -2)):
        ctx.block(GD, h, "attention mixes tokens")
        if causal:
            ctx.block(P, h, "a causal mask fixes the order of tokens")
    _attention_batch_axes(ctx, (q, k, v), out, dropout)
    if isinstance(mask_arg, fx.Node) and isinstance(ctx.value(mask_arg), TensorMeta):
        _attention_mask(ctx, ctx.tensor(mask_arg, role="mask"), k, out)


def _attention_batch_axes(ctx: RuleContext, qkv: tuple[Ref, Ref, Ref], out: Ref, dropout: float) -> None:
    """The leading (batch, head) axes of q, k, v pass permutations to the output's, right-aligned.

    A broadcast axis is fixed; scaling and GL are blocked (attention is not linear in queries
    and keys), and permutations too under dropout (its masks are drawn per head).
    """
    so = ctx.meta(out)
    nb = len(so) - 2
    for j in range(nb):
        for t in qkv:
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


def _attention_mask(ctx: RuleContext, mask: Ref, k: Ref, out: Ref) -> None:
    """A mask's non-unit axes, right-aligned with the scores, permute with the output's (its last with the keys')."""
    so, ms = ctx.meta(out), ctx.meta(mask)
    for j in range(len(ms)):
        oj = j - (len(ms) - len(so))
        if oj < 0 or ms[j] == 1:
            continue
        if oj == len(so) - 1:
            ctx.unify(P, (mask, j), (k, -2))
        else:
            ctx.unify(P, (mask, j), (out, oj))


def _mha(ctx: RuleContext) -> None:
    node = ctx.node
    m = ctx.module
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"the multi-head attention rule needs nn.MultiheadAttention, got {type(m).__name__}")
    query, key, value = (ctx.tensor(tensor_arg(node, i, name), role=name) for i, name in enumerate(("query", "key", "value")))
    out = ctx.output((0,))
    for path, meta in tensor_paths(ctx.value(node)):
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
    attn_mask = arg(node, 5, "attn_mask")
    if node.kwargs.get("is_causal") or (isinstance(attn_mask, fx.Node)):
        ctx.block(P, (query, tok), "an attention mask fixes the order of tokens")
    per_head_weights = arg(node, 4, "need_weights", True) and not arg(node, 6, "average_attn_weights", True)
    weights_used = any(u.args[1] == 1 and u.users for u in node.users if ctx.op_of(u) == "getitem_tuple")
    _mha_sites(ctx, m, heads_permutable=not (per_head_weights and weights_used))


def _mha_sites(ctx: RuleContext, m: nn.MultiheadAttention, heads_permutable: bool) -> None:
    """The per-head GL sites on (Q, K) and (V, O) and the head permutations of ``nn.MultiheadAttention``."""
    rel, where = ctx.rel, ctx.where
    names = rel.tensors.names
    q_rows, k_rows, v_rows, perm_rows = _mha_rows(m, lambda t: None if t is None else names.get(id(t)))
    H = m.num_heads
    w_o = names.get(id(m.out_proj.weight))
    info = {"heads": H, "head_dim": m.embed_dim // H, "module": where}
    blocks = H if H > 1 else None
    rel.direct_sites.append(
        DirectSite(
            "attention_qk_gl", "general", q_rows + k_rows, blocks, 1, "Zhao 2026, Ex. 1.2.11-1.2.12", where, dict(info), "exact", ctx.gi
        )
    )
    vo_rows = v_rows + [(w_o, dict(axis=1, power=-1))]
    rel.direct_sites.append(
        DirectSite("attention_vo_gl", "general", vo_rows, blocks, 1, "Zhao 2026, Ex. 1.2.12", where, dict(info), "exact", ctx.gi)
    )
    if H > 1:
        _mha_head_permutation(ctx, m, perm_rows + [(w_o, dict(axis=1))], info, heads_permutable)


def _mha_rows(m: nn.MultiheadAttention, name: Callable[[torch.Tensor | None], str | None]) -> tuple[_Rows, _Rows, _Rows, _Rows]:
    """The members of the (Q, K) rows, the V rows and the head-permuted rows of an ``nn.MultiheadAttention``.

    The key bias moves only when there is an appended key (``bias_k``) or zero key: then it adds
    q . b_k to the scores of the projected keys only, no longer a per-query constant that softmax
    ignores.
    """
    E = m.embed_dim
    q_rows, k_rows, v_rows, perm_rows = _mha_weight_rows(m, name)
    b_in = name(m.in_proj_bias)
    if b_in is not None:
        q_rows.append((b_in, dict(axis=0, power=1, start=0, stop=E)))
        if m.bias_k is not None or m.add_zero_attn:
            k_rows.append((b_in, dict(axis=0, power=-1, start=E, stop=2 * E)))
        v_rows.append((b_in, dict(axis=0, power=1, start=2 * E, stop=3 * E)))
        perm_rows.append((b_in, dict(axis=0, outer=3)))
    if m.bias_k is not None:
        k_rows.append((name(m.bias_k), dict(axis=2, power=-1)))
        v_rows.append((name(m.bias_v), dict(axis=2, power=1)))
        perm_rows += [(name(m.bias_k), dict(axis=2)), (name(m.bias_v), dict(axis=2))]
    return q_rows, k_rows, v_rows, perm_rows


def _mha_weight_rows(m: nn.MultiheadAttention, name: Callable[[torch.Tensor | None], str | None]) -> tuple[_Rows, _Rows, _Rows, _Rows]:
    """The q, k, v and head-permuted rows of the input projection: one packed weight or three."""
    E = m.embed_dim
    if m._qkv_same_embed_dim:
        w = name(m.in_proj_weight)
        return (
            [(w, dict(axis=0, power=1, start=0, stop=E))],
            [(w, dict(axis=0, power=-1, start=E, stop=2 * E))],
            [(w, dict(axis=0, power=1, start=2 * E, stop=3 * E))],
            [(w, dict(axis=0, outer=3))],
        )
    return (
        [(name(m.q_proj_weight), dict(axis=0, power=1))],
        [(name(m.k_proj_weight), dict(axis=0, power=-1))],
        [(name(m.v_proj_weight), dict(axis=0, power=1))],
        [(name(getattr(m, a)), dict(axis=0)) for a in ("q_proj_weight", "k_proj_weight", "v_proj_weight")],
    )


def _mha_head_permutation(ctx: RuleContext, m: nn.MultiheadAttention, rows: _Rows, info: dict[str, Any], heads_permutable: bool) -> None:
    """The head permutation site, or why it is skipped (per-head weights used, attention dropout)."""
    rel, where = ctx.rel, ctx.where
    if not heads_permutable:
        rel.skipped.append(("attention", where, "head permutations skipped: the per-head attention weights are returned and used"))
    elif not m.dropout:
        rel.direct_sites.append(
            DirectSite(
                "attention_head_permutation",
                "permutation",
                rows,
                None,
                info["head_dim"],
                "Zhao 2026, Ex. 1.2.12",
                where,
                dict(info),
                "exact",
                ctx.gi,
            )
        )
    else:
        rel.skipped.append(
            ("attention", where, f"head permutations skipped: attention dropout (p={m.dropout}) draws masks per head in training")
        )


RULES: dict[str, OpRule] = {
    "softmax": _softmax,
    "log_softmax": _softmax,
    "sdpa": _sdpa,
    "mha": _mha,
}
