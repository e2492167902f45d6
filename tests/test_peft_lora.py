"""peft LoRA adapters as ``lora_gl`` sites (``teleopt.integrations.peft``) and the balance teleport on them.

Models are built from tiny transformers configs (never downloaded).  What is
checked: the pairs are found by module structure (several adapters, inactive,
merged, DoRA, Linear/Conv/Embedding layers), ``find_symmetries`` adds and
certifies them on a ``PeftModel`` called with keyword inputs, and a forced
balance teleport (``objective="balance"`` with no trust region) leaves the logits unchanged
(float64 <= 1e-10, float32 <= 1e-5, relative), balances every pair
(A A^T = B^T B to 1e-10) and moves Adam's first moments by the covector rule.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import teleopt  # noqa: E402
from teleopt.integrations.peft import lora_sites  # noqa: E402
from teleopt.teleport import SafetyConfig, SearchConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(seed))


def llama(**lora) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1, **lora})
    return peft.get_peft_model(transformers.LlamaForCausalLM(cfg), config)


def gpt2(dtype: torch.dtype = torch.float64) -> nn.Module:
    """GPT-2 keeps LayerNorm in the model dtype (Llama's RMSNorm computes in float32 even in a float64 model)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.1, fan_in_fan_out=True)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), config).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_lora_pairs_are_found_by_structure():
    model = llama()
    found = lora_sites(model)
    layers = [f"base_model.model.model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert [s.name for s in found.sites] == [f"lora_gl@{layer}[default]" for layer in layers]
    site = found.sites[0]
    assert site.members == (f"{layers[0]}.lora_B.default.weight", f"{layers[0]}.lora_A.default.weight")
    assert site.action.name == "lora_gl" and site.action.group_name == "GL_4(R)" and site.action.exactness == "exact"
    assert site.info == {"module": layers[0], "adapter": "default", "kind": "linear", "rank": 4, "scaling": 2.0}
    assert not found.skipped
    # every site is a symmetry: a random element leaves the output unchanged (eval mode, float64)
    model.double().eval()
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for s in found.sites:
            s.apply_(model, s.action.random_element(s.tensors(model), torch.Generator().manual_seed(1)))
        assert _rel(model(input_ids=ids).logits, before) <= 1e-10


def test_several_adapters_each_their_own_site():
    model = llama()
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    found = lora_sites(model)
    assert all(s.info["adapter"] == "default" for s in found.sites)  # "second" is not active
    assert {w for w, why in found.skipped if "not an active adapter" in why} == {
        f"base_model.model.model.layers.{i}.self_attn.q_proj[second]" for i in range(2)
    }
    model.base_model.set_adapter(["default", "second"])  # both active (peft sums their deltas)
    found = lora_sites(model)
    assert sorted(s.info["adapter"] for s in found.sites) == ["default"] * 4 + ["second"] * 2
    assert {s.action.group_name for s in found.sites if s.info["adapter"] == "second"} == {"GL_2(R)"}


def test_merged_adapters_are_skipped_with_a_reason():
    model = llama(init_lora_weights=False)
    model.merge_adapter()
    found = lora_sites(model)
    assert not found.sites and len(found.skipped) == 4
    assert all("merged into the base weight" in why for _, why in found.skipped)
    report = teleopt.find_symmetries(model, example_kwargs={"input_ids": _ids(), "use_cache": False})
    assert not [s for s in report.sites if s.action.name == "lora_gl"]
    assert any("merged" in e.reason for e in report.skipped if e.kind == "site")
    model.unmerge_adapter()
    assert len(lora_sites(model).sites) == 4


def test_variants_and_frozen_pairs_fail_closed():
    dora = llama(use_dora=True)
    found = lora_sites(dora)
    assert not found.sites and all("Dora" in why or "DoRA" in why for _, why in found.skipped)
    model = llama()
    for p in model.parameters():
        p.requires_grad_(False)
    assert not lora_sites(model).sites
    assert all(why == "frozen (requires_grad=False)" for _, why in lora_sites(model).skipped)
    assert len(lora_sites(model, include_frozen=True).sites) == 4


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.conv = nn.Conv1d(6, 5, 3)
        self.out = nn.Linear(5, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(ids).transpose(1, 2))
        return self.out(torch.relu(h).mean(-1))


def test_embedding_and_conv_adapters():
    torch.manual_seed(0)
    config = peft.LoraConfig(r=3, target_modules=["emb", "conv", "out"], init_lora_weights=False)
    model = peft.get_peft_model(_Small(), config).double().eval()
    found = lora_sites(model)
    assert {s.info["kind"] for s in found.sites} == {"embedding", "conv", "linear"}
    emb = next(s for s in found.sites if s.info["kind"] == "embedding")
    assert emb.members == ("base_model.model.emb.lora_embedding_B.default", "base_model.model.emb.lora_embedding_A.default")
    ids = torch.randint(0, 20, (3, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids)
        for s in found.sites:
            s.apply_(model, s.action.random_element(s.tensors(model), torch.Generator().manual_seed(3)))
        assert _rel(model(ids), before) <= 1e-12


def test_find_symmetries_adds_certified_lora_sites():
    """A PeftModel's forward takes **kwargs: detection falls back to its submodules and adds the LoRA pairs."""
    model = llama(init_lora_weights=False)
    report = teleopt.find_symmetries(model, example_kwargs={"input_ids": _ids(), "use_cache": False})
    lora = [s for s in report.sites if s.action.name == "lora_gl"]
    assert [s.name for s in lora] == [s.name for s in lora_sites(model).sites]
    assert report.certified and not report.dropped
    assert {e.site for e in report.certification if e.status == "certified"} >= {s.name for s in lora}
    assert model.training  # restored


def _balance_teleport(model: nn.Module, sites, steps: int = 3):
    """AdamW for a few steps (B leaves 0), then one forced balance teleport; returns what it saw."""
    opt = teleopt.Teleport(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        model,
        sites,
        objective="balance",
        safety=SafetyConfig(max_predicted_decrease=None),
        search=SearchConfig(trust_region=None),
    )
    ids = _ids()
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    model.eval()  # no dropout: the logits before and after compare exactly
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    params = dict(model.named_parameters())
    moments = {n: {k: v.clone() for k, v in opt.state[params[n]].items()} for s in sites for n in s.members}
    report = opt.teleport()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    return opt, report, before, after, moments


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_forced_balance_teleport_is_exact(dtype, tol):
    model = gpt2(dtype)
    sites = lora_sites(model).sites
    assert len(sites) == 6  # c_attn, attn.c_proj, mlp.c_proj (Conv1D, fan_in_fan_out) in 2 blocks
    opt, report, before, after, moments = _balance_teleport(model, sites)
    assert report.accepted, report.reason
    assert report.state_decisions == {"transport": 12, "fallback:keep": 12, "keep": 12}  # exp_avg, exp_avg_sq, step
    assert _rel(after, before) <= tol
    params = dict(model.named_parameters())
    for s in sites:
        B, A = (params[n].detach().double() for n in s.members)
        assert _rel(A @ A.T, B.T @ B) <= (1e-10 if dtype == torch.float64 else 1e-5), s.name
        if dtype != torch.float64:
            continue
        # first moments moved like gradients: B -> B g^{-1} gives m_B -> m_B g^T, A -> g A gives m_A -> g^{-T} m_A
        g = report.elements[s.name]
        m_B, m_A = (moments[n]["exp_avg"] for n in s.members)
        assert _rel(opt.state[params[s.members[0]]]["exp_avg"], m_B @ g.T) <= 1e-12
        assert _rel(opt.state[params[s.members[1]]]["exp_avg"], torch.linalg.solve(g.T, m_A)) <= 1e-12
        assert torch.equal(opt.state[params[s.members[1]]]["exp_avg_sq"], moments[s.members[1]]["exp_avg_sq"])
    assert not opt.teleport().accepted  # balanced already: nothing left to do


def test_peft_init_b_zero_is_left_alone_then_balanced_every_k_steps():
    """At peft's initialisation (B = 0) no element of GL_r balances the pair; after steps it does."""
    model = gpt2(torch.float32)
    sites = lora_sites(model).sites
    opt = teleopt.Teleport(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
        model,
        sites,
        every=2,
        objective="balance",
        safety=SafetyConfig(max_predicted_decrease=None),
        search=SearchConfig(trust_region=None),
    )
    ids = _ids()
    for _ in range(6):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert [r.accepted for r in opt.reports] == [False, True, True]  # step 0: B = 0, declined
    assert opt.reports[0].reason == "declined: no improvement found"
