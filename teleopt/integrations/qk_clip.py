"""Per-head query/key rescalings of attention: the invariant half of QK-clip.

QK-clip (Kimi Team 2025, *Kimi K2: Open Agentic Intelligence*, arXiv:2507.20534,
MuonClip) rescales each head's query and key projections, W_Q^h -> c_h W_Q^h and
W_K^h -> W_K^h / c_h, when the head's largest attention logit grows.  Any c_h > 0
leaves every logit q^h . k^h unchanged, so the rescaling is an exact symmetry (QK-clip
itself clips: it shrinks both sides, which is not); rotary embeddings rotate q and k
per position linearly, so they commute with a scalar per head.  Under grouped-query
attention a key head is read by ``num_key_value_groups`` query heads, so one scale
per key/value group multiplies the rows of every query head of the group and divides
the rows of the shared key head.

As an :class:`~teleopt.actions.axis.AxisAction` this is the positive scaling group
R_{>0}^{n_kv} acting on axis 0 of ``q_proj.weight`` (power +1, each entry spanning
``groups * head_dim`` rows) and of ``k_proj.weight`` (power -1, ``head_dim`` rows),
biases likewise: Zhao 2026, Prop. 1.2.3 with the hidden axis being the heads.  The
``"balance"`` objective then sets sum_{h in group} ||W_Q^h||_F^2 = ||W_K^group||_F^2.

A module is a query/key attention if it has ``q_proj`` and ``k_proj`` Linear children
and ``head_dim``, with the head counts in ``config.num_attention_heads`` /
``config.num_key_value_heads`` (Hugging Face Llama, Mistral, Qwen2, ...).  Nothing here
imports transformers.  A module whose forward normalises q or k per head (``q_norm``,
``k_norm``: Qwen3, OLMo 2) is refused: the norm absorbs the scale of each side alone.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from teleopt.actions.axis import AxisAction, Member
from teleopt.site import Site

__all__ = ["qk_head_scalings"]

_REFERENCE = "QK-clip: Kimi Team 2025, arXiv:2507.20534; Zhao 2026, Prop. 1.2.3"


def _heads(module: nn.Module) -> tuple[int, int, int] | str:
    """(query heads, key/value heads, head_dim) of a q/k attention module, or why it is not one."""
    q, k = module.q_proj, module.k_proj
    if not isinstance(q, nn.Linear) or not isinstance(k, nn.Linear):
        return f"q_proj/k_proj are {type(q).__name__}/{type(k).__name__}, not nn.Linear"
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        return "q or k is normalised per head (q_norm/k_norm): the norm absorbs the scale of each side"
    config = getattr(module, "config", None)
    head_dim = getattr(module, "head_dim", None)
    n_q = getattr(config, "num_attention_heads", None)
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    if not isinstance(head_dim, int) or not isinstance(n_q, int) or not isinstance(n_kv, int) or n_kv < 1 or n_q % n_kv:
        return "no head_dim and config.num_attention_heads / num_key_value_heads that divide each other"
    if q.out_features != n_q * head_dim or k.out_features != n_kv * head_dim:
        return f"q_proj/k_proj have {q.out_features}/{k.out_features} outputs, not heads x head_dim = {n_q * head_dim}/{n_kv * head_dim}"
    return n_q, n_kv, head_dim


def _site(path: str, q: nn.Linear, k: nn.Linear, n_q: int, n_kv: int, head_dim: int) -> Site:
    prefix = f"{path}." if path else ""
    rows = (n_q // n_kv) * head_dim  # the rows of one key/value group's query heads
    members = [Member(f"{prefix}q_proj.weight", 0, 1, inner=rows), Member(f"{prefix}k_proj.weight", 0, -1, inner=head_dim)]
    if q.bias is not None:
        members.append(Member(f"{prefix}q_proj.bias", 0, 1, inner=rows))
    if k.bias is not None:
        members.append(Member(f"{prefix}k_proj.bias", 0, -1, inner=head_dim))
    action = AxisAction("qk_head_scaling", "diagonal", members, reference=_REFERENCE, group_name=f"R_{{>0}}^{n_kv}")
    info: dict[str, Any] = {"module": path, "heads": n_q, "kv_heads": n_kv, "head_dim": head_dim}
    return Site(action, tuple(m.name for m in members), f"qk_head_scaling@{path}", None, info)


def qk_head_scalings(model: nn.Module) -> list[Site]:
    """One ``qk_head_scaling`` site per attention module of ``model`` (QK-clip's invariant half; see module docs).

    Each site scales the query rows of key/value group j by c_j and the key rows of
    head j by 1/c_j (c in R_{>0}^{num_key_value_heads}); ``site.info`` holds the
    module path, head counts and ``head_dim``.  ``model`` may be one attention module.
    Raises ``ValueError`` when no module of ``model`` has ``q_proj`` and ``k_proj``, or
    when none of those qualifies (the message says why for each).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    sites: list[Site] = []
    skipped: list[str] = []
    for path, module in model.named_modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
            continue
        heads = _heads(module)
        if isinstance(heads, str):
            skipped.append(f"{path or type(module).__name__}: {heads}")
            continue
        sites.append(_site(path, module.q_proj, module.k_proj, *heads))
    if not sites:
        why = "; ".join(skipped) if skipped else "no submodule has both q_proj and k_proj"
        raise ValueError(f"model: no query/key attention module to rescale per head ({why})")
    return sites
