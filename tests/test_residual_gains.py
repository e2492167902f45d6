"""The residual stream's rotation on language models as built: trainable gains, LayerNorm, tied heads.

Tiny configurations built offline (hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary
100) with random gains (and LayerNorm biases), so that no check passes because a gain is
one.  Invariance is checked on float64 copies under ``keep_float64`` at 1e-10 relative:
the rotation (conjugated by each norm's gain, D Q D^-1) is exact, so only the round-off of
a 64-wide forward remains (about 1e-15).
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
from teleopt.actions.residual import GainedResidualRotation, _low_rank  # noqa: E402
from teleopt.detection.float64 import keep_float64  # noqa: E402
from teleopt.detection.residual import find_residual_sites  # noqa: E402
from teleopt.groups import Orthogonal, OrthogonalFixingOnes  # noqa: E402
from teleopt.numerics import relative_error  # noqa: E402
from teleopt.site import Site  # noqa: E402
from teleopt.teleport import Schedule, SearchConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
VOCAB = 100
_TINY = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32}
_GQA = {**_TINY, "num_key_value_heads": 2, "intermediate_size": 128}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _call(model: nn.Module) -> dict:
    call = {"input_ids": _ids()}
    if not isinstance(model, (transformers.GPT2LMHeadModel, transformers.BertModel)):
        call["use_cache"] = False
    return call


def causal(arch: str, **extra) -> nn.Module:
    """A tiny causal LM with random gains: (0.5, 1.5), or for Gemma's (1 + w) gains w ~ N(0, 0.3)."""
    T = transformers
    config_cls, model_cls = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM),
    }[arch]
    config = {**_GQA, "head_dim": 16, "tie_word_embeddings": False} if arch == "gemma" else dict(_GQA)
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**config, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3) if arch == "gemma" else p.uniform_(0.5, 1.5)
    return model.eval()


def gpt2(tied: bool = False, dropout: float = 0.0) -> nn.Module:
    """A tiny GPT-2 with random LayerNorm gains in (0.5, 1.5) and biases ~ N(0, 0.3)."""
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = dropout
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0.0, 0.3)
    return model.eval()


BUILDS = {
    "llama": lambda: causal("llama"),
    "qwen2": lambda: causal("qwen2"),
    "mistral": lambda: causal("mistral"),
    "gemma (1 + w gains)": lambda: causal("gemma"),
    "gpt2 (LayerNorm)": lambda: gpt2(),
}


def _stream(model: nn.Module) -> Site:
    found = find_residual_sites(model, (), _call(model))
    assert not found.skipped, found.skipped
    (site,) = found.sites
    return site


def _skipped(model: nn.Module) -> str:
    found = find_residual_sites(model, (), _call(model))
    assert not found.sites
    (entry,) = found.skipped
    return entry[2]


def _logits(model: nn.Module, train: bool) -> torch.Tensor:
    model.train(train)
    with torch.no_grad(), keep_float64():
        return model(**_call(model)).logits


@pytest.mark.parametrize("name", list(BUILDS))
def test_default_detection_certifies_the_rotation_as_built(name):
    model = BUILDS[name]()
    report = teleopt.find_symmetries(model, example_kwargs=_call(model))
    (site,) = [s for s in report.sites if s.action.name == "residual_rotation"]
    entry = next(e for e in report.certification if e.site == site.name)
    assert entry.status == "certified" and entry.error <= RTOL
    assert isinstance(site.action, GainedResidualRotation) and site.action.gains  # the gains are read, not folded
    assert site.action.fixes_ones == name.startswith("gpt2")
    assert report.coverage_exact >= (0.90 if name.startswith("gpt2") else 0.95)
    gains = {n for n, p in model.named_parameters() if ("norm" in n or ".ln_" in n) and n.endswith("weight")}
    assert gains <= set(site.tensor_names)
    for gain in gains:  # read, never moved
        assert site.action.members[site.members.index(gain)].power == 0


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(BUILDS))
def test_a_random_rotation_leaves_float64_logits_unchanged(name, train):
    model = BUILDS[name]().double()
    site = _stream(model)
    before = _logits(model, train)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(2), scale=3.0)
    assert float((g - torch.eye(64, dtype=g.dtype)).norm()) > 1.0  # far from the identity
    gains = {n: model.get_parameter(n).detach().clone() for n in site.action.gains.values() for n in [n[0]]}
    site.apply_(model, g)
    assert relative_error(_logits(model, train), before) <= RTOL
    assert all(torch.equal(model.get_parameter(n), v) for n, v in gains.items())


def test_the_layernorm_group_fixes_the_all_ones_vector():
    model = gpt2().double()
    site = _stream(model)
    group = site.action.group(site.tensors(model))
    assert isinstance(group, OrthogonalFixingOnes)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(3), scale=3.0)
    ones = torch.ones(64, dtype=torch.float64)
    assert torch.allclose(g @ ones, ones, atol=1e-13) and torch.allclose(g.T @ g, torch.eye(64, dtype=torch.float64), atol=1e-13)
    with pytest.raises(ValueError, match="all-ones"):
        group.validate(Orthogonal(64).random(generator=torch.Generator().manual_seed(4), scale=3.0))


def test_every_member_is_needed():
    """Minimality: the element applied to all moved members but one changes the logits."""
    model = causal("llama").double()
    site = _stream(model)
    before = _logits(model, False)
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(5), scale=3.0)
    saved = [None if t is None else t.detach().clone() for t in site.tensors(model)]
    moved = site.act(model, g)
    for skip, member in enumerate(site.action.members):
        if member.power == 0:
            continue
        with torch.no_grad():
            for i, (t, v, s) in enumerate(zip(site.tensors(model), moved, saved)):
                if t is not None and v is not None and s is not None:
                    t.copy_(s if i == skip else v)
        assert relative_error(_logits(model, False), before) > 1e-3, f"{member.name} is not needed"


def test_the_site_round_trips_through_a_report():
    model = gpt2().double()
    site = _stream(model)
    again = Site.from_dict(site.to_dict())
    assert isinstance(again.action, GainedResidualRotation) and again.action.gains == site.action.gains and again.action.fixes_ones
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(6), scale=3.0)
    for a, b in zip(site.act(model, g), again.act(model, g)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_tied_head_behind_a_frozen_scalar_gain_is_one_member(arch):
    model = gpt2(tied=True) if arch == "gpt2" else causal("llama", tie_word_embeddings=True)
    final = model.transformer.ln_f.weight if arch == "gpt2" else model.model.norm.weight
    with torch.no_grad():
        final.fill_(1.7)
    final.requires_grad_(False)
    model = model.double()
    site = _stream(model)
    head = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    assert site.tensor_names.count(head) == 1 and "lm_head.weight" not in site.tensor_names
    for train in (False, True):
        before = _logits(model, train)
        g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(7), scale=3.0)
        moved = copy.deepcopy(model)
        site.apply_(moved, g)
        assert relative_error(_logits(moved, train), before) <= RTOL


def test_a_tied_head_behind_a_trainable_final_gain_is_left_out_with_the_reason():
    why = _skipped(gpt2(tied=True))
    assert "tied embeddings" in why and "transformer.ln_f.weight" in why and "not a multiple of ones" in why
    model = gpt2(tied=True)
    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(1.0)  # a multiple of ones now, but training moves it
    assert "is trainable" in _skipped(model)


def test_a_tied_head_behind_a_frozen_non_scalar_gain_is_left_out():
    model = causal("llama", tie_word_embeddings=True)
    model.model.norm.weight.requires_grad_(False)
    assert "not a multiple of ones" in _skipped(model)


def test_a_zero_gain_is_left_out_with_the_reason():
    model = causal("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[3] = 0.0
    why = _skipped(model)
    assert "model.layers.0.input_layernorm.weight has a zero entry" in why
    report = teleopt.find_symmetries(model, example_kwargs=_call(model))
    assert not [s for s in report.sites if s.action.name == "residual_rotation"]


def test_post_norm_is_left_out_with_the_reason():
    cfg = transformers.BertConfig(**{**_TINY, "intermediate_size": 128, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    torch.manual_seed(0)
    assert "post-norm" in _skipped(transformers.BertModel(cfg).eval())


def test_dropout_on_the_stream_is_left_out_with_the_reason():
    assert "Dropout (transformer.drop)" in _skipped(gpt2(dropout=0.1))


def test_auto_teleport_on_a_llama_given_labels_keeps_the_rotation_and_is_accepted():
    """The rotation behind trainable gains transports gradients in closed form at the point
    (:meth:`GainedResidualRotation.transport_gradient_at`): ``"auto"`` keeps it on the fast path, with no
    warning about it, and the forced teleport is accepted, checked on the batch of ``batch_fn``.  The default
    objective (``"balance"``) leaves the rotation at the identity here; the other sites move."""
    model = causal("llama").float()
    batch = {"input_ids": _ids(), "labels": _ids(), "use_cache": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tele = teleopt.Teleport(opt, model, "auto", example_kwargs=batch, loss_fn=None, batch_fn=lambda: batch)
    (site,) = [s for s in tele.sites if s.action.name == "residual_rotation"]
    assert not any("residual_rotation" in str(w.message) for w in caught)
    before = _logits(model, False).float()
    model.train()
    model(**batch).loss.backward()
    report = tele.teleport()
    assert report.accepted and report.path == "fast" and report.check == "batch", report.reason
    assert site.name in report.elements and site.name not in report.skipped
    assert relative_error(_logits(model, False).float(), before) <= 1e-5


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable gains", "frozen gains"])
def test_an_explicit_teleport_along_the_rotation_is_accepted_on_either_path(frozen, path):
    model = causal("llama", attn_implementation="eager").float()
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen and "norm" in name))  # a frozen gain is read, never moved: the site stays usable
    site = _stream(model)
    batch = {"input_ids": _ids(), "labels": _ids(), "use_cache": False}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    search = SearchConfig(steps=2, path=path)
    tele = teleopt.Teleport(opt, model, [site], loss_fn=None, batch_fn=lambda: batch, search=search, schedule=Schedule())
    before = _logits(model, False).float()
    model.train()
    model(**batch).loss.backward()
    report = tele.teleport()
    assert report.accepted and report.path == path and report.check == "batch", report.reason
    assert relative_error(_logits(model, False).float(), before) <= 1e-5


def test_a_rotation_of_few_directions_moves_every_member_as_the_dense_product_does():
    """Certification's elements rotate a random 8-dim subspace; the action applies them as a low-rank update."""
    from teleopt.actions.axis import Member
    from teleopt.detection.certify import edge_element

    gen = torch.Generator().manual_seed(8)
    names = ("E", "W_in", "W_out", "b", "gain")
    shapes = ((10, 128), (32, 128), (128, 32), (128,), (128,))
    params = tuple(torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    members = (Member("E", 1, 1), Member("W_in", 1, -1), Member("W_out", 0, 1), Member("b", 0, 1))
    action = GainedResidualRotation(members, {"W_in": ("gain", 1.0), "b": ("gain", 1.0)}, fixes_ones=True)
    model = nn.Module()
    for name, p in zip(names, params):
        model.register_parameter(name, nn.Parameter(p))
    site = Site(action, names)
    g = edge_element(site, model, gen)
    assert int(torch.linalg.matrix_rank(g - torch.eye(128, dtype=g.dtype))) <= 8
    assert _low_rank(g) is not None and _low_rank(g.clone().requires_grad_()) is None
    low = action.act(g, params)
    dense = action.act(g.clone().requires_grad_(), params)  # under autograd: the dense product
    for a, b in zip(low, dense):
        assert relative_error(a, b.detach()) <= 1e-13


def test_the_rotations_fixing_the_all_ones_vector_form_a_group():
    group = OrthogonalFixingOnes(6)
    gen = torch.Generator().manual_seed(9)
    a, b = (group.random(generator=gen, scale=3.0) for _ in range(2))
    ones = torch.ones(6, dtype=torch.float64)
    for g in (group.identity(), group.compose(a, b), group.inverse(a)):
        group.validate(g)
        assert torch.allclose(g @ ones, ones, atol=1e-14)
    assert torch.allclose(group.compose(a, group.inverse(a)), group.identity(), atol=1e-14)
    # the algebra action is the derivative of exp at 0, projected onto {A skew, A 1 = 0}
    M = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    t = 1e-6
    numeric = (group.exp(t * M) - group.exp(-t * M)) / (2 * t)
    assert torch.allclose(group._algebra_matrix(M, 1), numeric, atol=1e-8)
    with pytest.raises(ValueError, match="at least 2"):
        OrthogonalFixingOnes(1)


def test_bad_members_and_gains_are_rejected_by_name():
    from teleopt.actions.axis import Member

    with pytest.raises(ValueError, match="power"):
        GainedResidualRotation([Member("W", 1, 2)], {})
    with pytest.raises(ValueError, match=r"gains\['X'\]"):
        GainedResidualRotation([Member("W", 1, -1)], {"X": ("g", 0.0)})
    action = GainedResidualRotation([Member("E", 1, 1), Member("W", 1, -1)], {"W": ("g", 0.0)})
    params = (torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="zero entry"):
        action.act(action.identity(params), params)
