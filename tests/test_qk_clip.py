"""QK-clip's invariant half (``teleopt.integrations.qk_clip``): per-head query/key rescalings of Llama attention.

Models are tiny ``transformers.LlamaConfig`` ones (hidden 64, 2 layers, 4 query heads,
2 key/value heads: grouped-query attention with rotary embeddings), in float64 with
q/k biases and weights drawn large enough that attention is far from uniform.  What is
checked: the logits are unchanged under random per-group scales in [1/4, 4] (train and
eval mode), scaling the queries alone changes them (the key side is needed), the
``"balance"`` teleport sets each group's query norm equal to its key norm, and modules
that are not query/key attention are refused with the reason.

Tolerance: the symmetry is exact, so only rounding separates the two forwards; Llama's
RMSNorm computes in float32 even in a float64 model, so a last-bit difference of a
logit can cross a float32 rounding boundary in the next layer: 1e-6 relative bounds
that (a broken grouping moves the logits by ~1e-2, see the minimality test).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from teleopt import Teleport  # noqa: E402
from teleopt.actions.axis import AxisAction  # noqa: E402
from teleopt.integrations.qk_clip import qk_head_scalings  # noqa: E402
from teleopt.site import Site  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-6


def llama(kv_heads: int = 2, bias: bool = True, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        attention_bias=bias,
        attention_dropout=dropout,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # nonzero biases and norm gains: a zero bias hides a wrong bias power
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(2)  # the same dropout masks before and after
    return model(input_ids=ids).logits.detach()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _scales(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-1.386, 1.386, generator=gen))  # log-uniform in [1/4, 4]


def _group_norms(model: nn.Module, layer: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared Frobenius norms of each key/value group's query rows (weight and bias) and of its key rows."""
    attn = model.model.layers[layer].self_attn
    q = torch.cat([attn.q_proj.weight, attn.q_proj.bias[:, None]], 1).reshape(kv_heads, -1)
    k = torch.cat([attn.k_proj.weight, attn.k_proj.bias[:, None]], 1).reshape(kv_heads, -1)
    return q.detach().square().sum(1), k.detach().square().sum(1)


def test_one_site_per_attention_with_a_scale_per_key_value_group() -> None:
    sites = qk_head_scalings(llama())
    assert [s.name for s in sites] == [f"qk_head_scaling@model.layers.{i}.self_attn" for i in range(2)]
    site = sites[0]
    assert site.members == tuple(
        f"model.layers.0.self_attn.{p}_proj.{t}" for p, t in (("q", "weight"), ("k", "weight"), ("q", "bias"), ("k", "bias"))
    )
    assert [m.power for m in site.action.members] == [1, -1, 1, -1]
    assert site.info == {"module": "model.layers.0.self_attn", "heads": 4, "kv_heads": 2, "head_dim": 16}
    assert site.action.exactness == "exact" and site.action.linear


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
@pytest.mark.parametrize("train", [False, True])
def test_random_per_group_scales_leave_the_logits_unchanged(kv_heads: int, train: bool) -> None:
    model = llama(kv_heads, dropout=0.1).train(train)
    ids = _ids()
    before = _logits(model, ids)
    for i, site in enumerate(qk_head_scalings(model)):
        site.apply_(model, _scales(kv_heads, seed=10 + i))
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, llama(kv_heads).model.layers[0].self_attn.q_proj.weight)
    assert _rel(_logits(model, ids), before) <= TOL


def test_scaling_the_queries_alone_changes_the_logits() -> None:
    model = llama()
    ids = _ids()
    before = _logits(model, ids)
    site = qk_head_scalings(model)[0]
    queries = tuple(m for m in site.action.members if m.power > 0)
    Site(AxisAction("queries_only", "diagonal", queries), tuple(m.name for m in queries)).apply_(model, _scales(2, seed=3))
    assert _rel(_logits(model, ids), before) > 1e-3


def test_balance_teleport_equalises_query_and_key_norms_per_group() -> None:
    model = llama()
    ids = _ids()
    sites = qk_head_scalings(model)
    for site in sites:  # far from balanced: one group's queries 4x larger, the other's 4x smaller
        site.apply_(model, torch.tensor([4.0, 0.25], dtype=torch.float64))
    q, k = _group_norms(model, 0, 2)
    assert float((q / k).max()) > 10 and float((q / k).min()) < 0.1
    before = _logits(model, ids)
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.0), model, sites, objective="balance", every=1, example_inputs=(ids,))
    for _ in range(2):  # the default trust region bounds one teleport's log-scales: the first gets 2x off, the second finishes
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert [r.accepted for r in opt.reports] == [True, True]
    for layer in range(2):
        q, k = _group_norms(model, layer, 2)
        torch.testing.assert_close(q, k, rtol=1e-10, atol=0.0)
    assert _rel(_logits(model, ids), before) <= TOL


class _NoKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)


def test_a_model_without_query_and_key_projections_is_refused() -> None:
    with pytest.raises(ValueError, match="model: .*no submodule has both q_proj and k_proj"):
        qk_head_scalings(nn.Sequential(nn.Linear(4, 4), _NoKeys()))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        qk_head_scalings("llama")  # type: ignore[arg-type]


def test_per_head_normalised_queries_and_keys_are_refused_with_the_reason() -> None:
    model = llama()
    for layer in model.model.layers:
        layer.self_attn.q_norm = nn.Identity()  # Qwen3 / OLMo 2 normalise q and k per head
    with pytest.raises(ValueError, match="q_norm/k_norm"):
        qk_head_scalings(model)
