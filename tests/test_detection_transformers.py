"""The symmetries of transformers' language models, found and exact (tiny configurations, never downloaded).

Configurations: hidden 64, 2 layers, 4 heads (2 key/value heads where the
architecture has grouped-query attention), called as users call them,
``model(input_ids=ids)``.  Every exact continuous site is applied with a random
element at the edge of the range to the float64 model and must leave the outputs
unchanged to 1e-10 relative (float64 round-off is about 1e-16 per op), in train
mode (same dropout masks) and in eval mode.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from teleopt.detection import find_symmetries  # noqa: E402
from teleopt.detection.certify import edge_element, output_leaves  # noqa: E402
from teleopt.detection.float64 import keep_float64  # noqa: E402
from teleopt.numerics import relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
COMMON = {"vocab_size": 100, "max_position_embeddings": 64, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def build(name: str, attn: str = "eager", **extra) -> torch.nn.Module:
    """A tiny float64 model of architecture ``name`` with the given attention implementation."""
    T = transformers
    gqa = {"num_key_value_heads": 2, "intermediate_size": 128}
    configs = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {**COMMON, **gqa}),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {**COMMON, **gqa}),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, {**COMMON, **gqa}),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, {"vocab_size": 100, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}),
        "bert": (T.BertConfig, T.BertModel, {**COMMON, "intermediate_size": 128}),
    }
    config_cls, model_cls, kwargs = configs[name]
    config = config_cls(**kwargs, **extra)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).double()


def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))


def outputs(model: torch.nn.Module, kwargs: dict, mode: str) -> list[torch.Tensor]:
    model.train(mode == "train")
    with torch.no_grad(), torch.random.fork_rng(devices=[]), keep_float64():  # RMSNorm's float32 cast stays float64
        torch.manual_seed(1)  # the same dropout masks before and after
        return [t for t in output_leaves(model(**kwargs)) if t.is_floating_point()]


def non_invariant_sites(model: torch.nn.Module, report, kwargs: dict) -> list[tuple[str, float]]:
    """(site, relative change) of every exact continuous site that changes the outputs (train or eval mode)."""
    gen = torch.Generator().manual_seed(5)
    ref = {mode: outputs(model, kwargs, mode) for mode in ("train", "eval")}
    bad = []
    for s in report.sites:
        if s.action.exactness != "exact" or not s.action.continuous:
            continue
        state = {k: v.clone() for k, v in model.state_dict().items()}
        s.apply_(model, edge_element(s, model, gen))
        err = max(relative_error(a, b) for mode in ref for a, b in zip(outputs(model, kwargs, mode), ref[mode]))
        model.load_state_dict(state)
        if not err <= RTOL:
            bad.append((s.name, float(err)))
    return bad


#: (architecture, attention implementation) -> sites per action, the least exact coverage
EXPECTED = {
    ("llama", "eager"): ({"attention_qk_rotary_scaling": 4, "attention_vo_gl": 4}, 0.85),
    ("llama", "sdpa"): ({"attention_qk_rotary_scaling": 4, "attention_vo_gl": 4}, 0.85),
    ("qwen2", "sdpa"): ({"attention_qk_rotary_scaling": 4, "attention_vo_gl": 4}, 0.85),
    ("mistral", "eager"): ({"attention_qk_rotary_scaling": 4, "attention_vo_gl": 4}, 0.85),
    ("gpt2", "eager"): ({"attention_qk_gl": 2, "attention_vo_gl": 2}, 0.60),
    ("bert", "sdpa"): ({"attention_qk_gl": 2, "attention_vo_gl": 2}, 0.40),
}


@pytest.mark.parametrize("name, attn", sorted(EXPECTED), ids=[f"{n}-{a}" for n, a in sorted(EXPECTED)])
def test_attention_heads_and_norm_gains_are_found_and_exact(name, attn):
    model = build(name, attn)
    kwargs = {"input_ids": ids()}
    report = find_symmetries(model, example_kwargs=kwargs)
    counts = Counter(s.action.name for s in report.sites)
    expected, coverage = EXPECTED[(name, attn)]
    for action, n in expected.items():
        assert counts[action] == n, (action, counts)
    assert report.coverage_exact >= coverage
    assert not report.dropped, report.dropped  # the rules proposed no false site
    assert not [e for e in report.skipped if e.kind == "internal_error"]
    assert not non_invariant_sites(model, report, kwargs)


def _gain_sites(report) -> dict[str, set[str]]:
    """Continuous sites that move a norm's gain: site name -> the tensors it moves."""
    moved = {
        s.name: {n for m, n in zip(getattr(s.action, "members", s.members), s.members) if n is not None and getattr(m, "power", 1) != 0}
        for s in report.sites
        if s.action.continuous
    }
    return {n: t for n, t in moved.items() if any("norm" in x or "ln_" in x for x in t)}  # the residual rotation reads gains


def test_pre_norm_gains_rescale_against_every_consumer():
    report = find_symmetries(build("llama"), example_kwargs={"input_ids": ids()})
    gains = _gain_sites(report)
    attn = {"model.layers.0.input_layernorm.weight"} | {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    mlp = {"model.layers.0.post_attention_layernorm.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    assert attn in gains.values() and mlp in gains.values()
    assert not any("model.norm.weight" in t for t in gains.values())  # the final norm feeds lm_head in another part


def test_layer_norm_gain_and_bias_rescale_against_fused_qkv_and_fc():
    report = find_symmetries(build("gpt2"), example_kwargs={"input_ids": ids()})
    gains = _gain_sites(report).values()
    assert {"transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias", "transformer.h.0.attn.c_attn.weight"} in gains
    assert {"transformer.h.0.ln_2.weight", "transformer.h.0.ln_2.bias", "transformer.h.0.mlp.c_fc.weight"} in gains


def test_post_norm_gains_are_not_sites():
    """BERT's LayerNorm output is the residual stream: its gain cannot be pushed into one consumer."""
    report = find_symmetries(build("bert", "sdpa"), example_kwargs={"input_ids": ids()})
    assert not _gain_sites(report)


def test_grouped_query_heads_tie_the_output_columns_of_every_reading_head():
    report = find_symmetries(build("llama"), example_kwargs={"input_ids": ids()})
    vo = [s for s in report.sites if s.action.name == "attention_vo_gl" and "layers.0." in s.name]
    members = sorted((m.tensor_key, m.start, m.stop, m.outer) for s in vo for m in s.action.members)
    o, v = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    assert members == [(o, 0, 32, 2), (o, 32, 64, 2), (v, 0, 16, 1), (v, 16, 32, 1)]  # 2 KV heads of 16, 2 query heads each


def test_rotary_q_k_keeps_only_the_pair_scalings_and_says_so():
    report = find_symmetries(build("qwen2", "sdpa"), example_kwargs={"input_ids": ids()})
    qk = [s for s in report.sites if s.action.name == "attention_qk_rotary_scaling" and "layers.0." in s.name]
    assert {s.action.group_kind for s in qk} == {"diagonal"}
    keys = {m.tensor_key for s in qk for m in s.action.members}
    assert "model.layers.0.self_attn.k_proj.bias" in keys  # a rotated key bias is not a per-query constant: it moves
    assert not any(s.action.name == "attention_qk_gl" for s in report.sites)
    assert any("rotation of each pair" in e.reason for e in report.skipped)


def test_auto_teleport_on_a_causal_lm_moves_along_the_attention_sites():
    """``Teleport(opt, model, "auto", ...)`` on a Llama given labels: the new sites are used, checked and accepted."""
    import warnings

    from teleopt import Teleport
    from teleopt.teleport import Schedule

    model = build("llama").float()
    batch = {"input_ids": ids(), "labels": ids()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the norm-gain sites are left out under AdamW, with a warning
        tele = Teleport(opt, model, "auto", example_kwargs=batch, loss_fn=None, batch_fn=lambda: batch, schedule=Schedule())
    names = {s.action.name for s in tele.sites}
    assert {"attention_qk_rotary_scaling", "attention_vo_gl"} <= names
    model(**batch).loss.backward()
    result = tele.teleport()
    assert result.accepted and result.check is not None, result.reason
