"""The residual stream's rotation (SliceGPT's computational invariance) on tiny language models.

Tiny configurations built offline (hidden 64, 2 layers, 4 heads, 2 KV heads) of
transformers' Llama, Qwen2 and Mistral, and hand-written GPTs.  Invariance is checked on
float64 copies under ``keep_float64`` (transformers' RMSNorm casts to float32, which in a
float64 copy would round every check to about 1e-7) at 1e-10 relative: the rotation is
exact, so only round-off of a 64-wide forward (about 1e-15) remains.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import teleopt  # noqa: E402
from teleopt.actions.axis import AxisAction, Member  # noqa: E402
from teleopt.actions.residual import GainedResidualRotation  # noqa: E402
from teleopt.detection.float64 import keep_float64  # noqa: E402
from teleopt.detection.residual import find_residual_sites, fold_norm_gains  # noqa: E402
from teleopt.numerics import relative_error  # noqa: E402
from teleopt.site import Site  # noqa: E402
from teleopt.teleport.fast_path import fast_path_eligible  # noqa: E402
from teleopt.teleport.objectives import get_objective  # noqa: E402
from teleopt.teleport.search import SearchProblem  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
VOCAB = 64
ARCHS = ("llama", "qwen2", "mistral")


def _ids(batch: int = 2, tokens: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))


def _call() -> dict:
    return {"input_ids": _ids(), "use_cache": False}


def build(arch: str, head: bool = True) -> nn.Module:
    """A tiny causal LM of ``arch`` with random, non-unit norm gains (so folding is not a no-op)."""
    T = transformers
    config_cls = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig}[arch]
    cfg = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = (T.AutoModelForCausalLM if head else T.AutoModel).from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _logits(model: nn.Module, train: bool = False) -> torch.Tensor:
    model.train(train)
    with torch.no_grad(), keep_float64():
        return model(**{k: v for k, v in _call().items()}).logits


def _stream_site(model: nn.Module) -> Site:
    found = find_residual_sites(model, (), _call())
    assert not found.skipped, found.skipped
    (site,) = found.sites
    return site


@pytest.fixture(scope="module")
def folded() -> dict[str, nn.Module]:
    models = {}
    for arch in ARCHS:
        model = build(arch)
        fold_norm_gains(model, example_kwargs=_call())
        models[arch] = model
    return models


@pytest.mark.parametrize("arch", ARCHS)
def test_detection_finds_one_certified_site_on_every_writer_and_reader(arch, folded):
    model = folded[arch]
    report = teleopt.find_symmetries(model, example_kwargs=_call())
    (site,) = [s for s in report.sites if s.action.name == "residual_rotation"]
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(site.tensor_names) == linears | {"model.embed_tokens.weight"}
    entry = next(e for e in report.certification if e.site == site.name)
    assert entry.status == "certified" and entry.error <= RTOL
    assert len(site.info["assumes"]) == 5  # 2 norms per layer and the final one, frozen at one
    assert report.coverage_exact >= 0.99  # everything but the five frozen gains


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_random_rotation_leaves_float64_logits_unchanged(arch, train, folded):
    model = copy.deepcopy(folded[arch]).double()
    site = _stream_site(model)
    before = _logits(model, train)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(2), scale=3.0)
    assert float((g - torch.eye(64, dtype=g.dtype)).norm()) > 1.0  # far from the identity
    site.apply_(model, g)
    assert relative_error(_logits(model, train), before) <= RTOL


def test_fold_norm_gains_keeps_the_function_and_freezes_the_gains():
    model = build("llama").double()
    before = _logits(model)
    folded = fold_norm_gains(model, example_kwargs=_call())
    assert len(folded) == 5
    assert relative_error(_logits(model), before) <= RTOL
    for name in folded:
        gain = model.get_parameter(name)
        assert not gain.requires_grad and bool((gain == 1).all())


def test_every_member_is_needed(folded):
    """Minimality: the element applied to all members but one changes the logits."""
    model = copy.deepcopy(folded["llama"]).double()
    site = _stream_site(model)
    before = _logits(model)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(3), scale=3.0)
    live = site.tensors(model)
    moved = site.act(model, g)
    for skip, name in enumerate(site.members):
        with torch.no_grad():
            for i, (t, v) in enumerate(zip(live, moved)):
                if i != skip and t is not None and v is not None:
                    t.copy_(v)
        assert relative_error(_logits(model), before) > 1e-3, f"{name} is not needed"
        with torch.no_grad():
            for t, v in zip(live, site.tensors(folded["llama"])):
                if t is not None and v is not None:
                    t.copy_(v.double())


def test_gradient_transport_equals_autograd_at_the_moved_point(folded):
    model = copy.deepcopy(folded["llama"]).double()
    site = _stream_site(model)
    ids = _ids()

    def grads() -> tuple[torch.Tensor, ...]:
        model.zero_grad()
        with keep_float64():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return tuple(t.grad.detach().clone() for t in site.tensors(model))

    here = grads()
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(4), scale=3.0)
    site.apply_(model, g)
    there = grads()
    for name, a, b in zip(site.members, site.action.transport_gradient(g, here), there):
        assert relative_error(a, b) <= RTOL, name


def test_trainable_gains_are_read_not_folded():
    """As built (no folding) the stream gets the gained rotation, on the fast path (its gradient rule reads the gains)."""
    model = build("llama")
    (site,) = find_residual_sites(model, (), _call()).sites
    assert isinstance(site.action, GainedResidualRotation)
    assert len(site.action.gains) == 2 * 5 + 1  # q, k, v, gate, up per layer and the head
    assert fast_path_eligible(site)


def test_frozen_gains_other_than_one_are_read_too():
    model = build("llama")
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    (site,) = find_residual_sites(model, (), _call()).sites
    assert isinstance(site.action, GainedResidualRotation)


def test_tied_embeddings_are_one_member_and_refuse_folding_the_final_gain():
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        )
    )
    with pytest.raises(ValueError, match="model.norm.weight cannot be folded into model.embed_tokens.weight: that tensor is tied"):
        fold_norm_gains(model, example_kwargs=_call())
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    site = _stream_site(model)
    assert site.tensor_names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in site.tensor_names


def test_a_model_returning_the_stream_is_left_out():
    model = build("llama", head=False)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            p.requires_grad_(False)
    (entry,) = find_residual_sites(model, (), _call()).skipped
    assert "output of the model" in entry[2]
    with pytest.raises(ValueError, match="output of the model"):
        fold_norm_gains(model, example_kwargs=_call())


class _Block(nn.Module):
    def __init__(self, d: int, norm: type[nn.Module], t: int) -> None:
        super().__init__()
        self.n1, self.n2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(t, t)).bool())  # nanoGPT's sliced causal mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / (d // 2) ** 0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.n2(x))))


class TinyGPT(nn.Module):
    """Pre-norm GPT with tied embeddings, learned positions and nanoGPT's mask buffer."""

    def __init__(self, norm: type[nn.Module], d: int = 32, t: int = 8) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(t, d)
        self.blocks = nn.ModuleList([_Block(d, norm, t) for _ in range(2)])
        self.norm = norm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _unit_rmsnorm(d: int) -> nn.Module:
    return nn.RMSNorm(d, elementwise_affine=False)


def test_a_hand_written_gpt_with_tied_embeddings_gets_one_exact_site():
    torch.manual_seed(0)
    model = TinyGPT(_unit_rmsnorm).double()
    ids = _ids(tokens=8)
    found = find_residual_sites(model, (ids,))
    (site,) = found.sites
    assert "head.weight" not in site.tensor_names  # tied: one member, the embedding's
    assert {"wte.weight", "wpe.weight", "blocks.0.proj.bias", "blocks.1.out.bias"} <= set(site.tensor_names)
    before = model(ids)
    site.apply_(model, site.action.random_element(site.tensors(model), torch.Generator().manual_seed(5), scale=3.0))
    assert relative_error(model(ids), before) <= RTOL


def test_layernorm_with_a_tied_trainable_final_gain_is_left_out_with_the_reason():
    torch.manual_seed(0)
    model = TinyGPT(nn.LayerNorm)
    (entry,) = find_residual_sites(model, (_ids(tokens=8),)).skipped
    assert "tied embeddings" in entry[2] and "norm.weight" in entry[2] and "is trainable" in entry[2]
    model.norm.weight.requires_grad_(False)  # frozen at ones: the rotations fixing the all-ones vector
    (site,) = find_residual_sites(model, (_ids(tokens=8),)).sites
    assert site.action.fixes_ones


def test_dropout_on_the_stream_is_left_out():
    torch.manual_seed(0)
    model = TinyGPT(_unit_rmsnorm)
    model.blocks[0].proj = nn.Sequential(model.blocks[0].proj, nn.Dropout(0.1))
    (entry,) = find_residual_sites(model, (_ids(tokens=8),)).skipped
    assert "Dropout" in entry[2]


def test_teleport_auto_takes_the_fast_path_along_the_rotation(folded):
    model = copy.deepcopy(folded["llama"])
    ids = _ids()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = teleopt.Teleport(opt, model, "auto", example_kwargs=_call(), every=1)
    (site,) = [s for s in tp.sites if s.action.name == "residual_rotation"]
    assert fast_path_eligible(site)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    tp.step()
    report = tp.reports[-1]
    assert report.accepted and report.path == "fast" and site.name in report.site_gains
    # the gradient norm is the same all along the rotation's orbit: the search leaves it at the identity
    assert report.coordinate_norms[site.name] == 0.0 and report.site_gains[site.name] == pytest.approx(1.0, abs=1e-12)
    # ... and its identity element moves nothing: AdamW's second moments keep an exact rule (no fallback)
    assert not any(decision.startswith("fallback") for decision in report.state_decisions)


def _problem(sites: list[Site], objective: str) -> SearchProblem:
    return SearchProblem(sites, [], None, get_objective(objective), None, [], [])


def test_the_search_leaves_an_isometric_site_idle_only_where_the_objective_cannot_change(folded):
    site = _stream_site(folded["llama"])
    down = "model.layers.0.mlp.down_proj.weight"
    beside = Site(AxisAction("s", "diagonal", (Member("W", 1, -1),)), (down,))  # the columns: another axis
    across = Site(AxisAction("s", "diagonal", (Member("W", 0, -1),)), (down,))  # the rows: the stream's axis
    assert site.action.isometric and not beside.action.isometric
    assert _problem([site, beside], "grad_norm").idle() == [True, False]
    assert _problem([site, across], "grad_norm").idle() == [False, False]  # a scaling after the rotation
    assert _problem([site], "preconditioned_norm").idle() == [False]  # Adam's step sees the basis
