"""Closed-form gradient transport of language models' sites: the fast path's transported gradients are autograd's.

The fast path (:mod:`teleopt.teleport.fast_path`) moves ``.grad`` and first moments with
:func:`~teleopt.teleport.transport.transport` (kind ``"covector"``) instead of a forward and a
backward pass at the moved point.  For the residual stream's rotation behind trainable norm
gains (:class:`~teleopt.actions.residual.GainedResidualRotation`) that rule reads the point
(the gains conjugate the rotation), so it is checked here on every site ``"auto"`` keeps, all
moved at once by random elements in list order, on tiny float64 language models with random
gains (and LayerNorm biases): the gradients computed by autograd at the moved point must match
to 1e-10 relative (round-off of a 64-wide forward and backward is about 1e-15).
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

from test_residual_gains import VOCAB, _call, _ids, causal, gpt2  # noqa: E402

import teleopt  # noqa: E402
from teleopt.actions.residual import GainedResidualRotation  # noqa: E402
from teleopt.detection.float64 import keep_float64  # noqa: E402
from teleopt.numerics import relative_error  # noqa: E402
from teleopt.site import Site  # noqa: E402
from teleopt.teleport import Schedule, SearchConfig  # noqa: E402
from teleopt.teleport.fast_path import fast_path_eligible  # noqa: E402
from teleopt.teleport.sites import detect_sites  # noqa: E402
from teleopt.teleport.transport import transport  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10
FEW_STEPS = SearchConfig(steps=5)  # the search's length is not under test: the moved point is


def phi_partial_rotary() -> nn.Module:
    """Phi with half of each head rotated: (Q, K) pair scalings on 8 dimensions, GL on the other 8."""
    cfg = transformers.PhiConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=32,
        partial_rotary_factor=0.5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.PhiForCausalLM(cfg).eval()


def tied_llama() -> nn.Module:
    """A tied head behind a frozen scalar final gain (one member that writes and reads the stream)."""
    model = causal("llama", tie_word_embeddings=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.7)
    model.model.norm.weight.requires_grad_(False)
    return model


BUILDS = {
    "llama (GQA, rotary)": lambda: causal("llama"),
    "gpt2 (LayerNorm)": gpt2,
    "phi (partial rotary)": phi_partial_rotary,
    "gemma (1 + w gains)": lambda: causal("gemma"),
    "llama (tied head)": tied_llama,
}


def _gradients(model: nn.Module, train: bool) -> dict[str, torch.Tensor]:
    model.train(train)
    model.zero_grad()
    with keep_float64():
        loss = model(**_call(model), labels=_ids()).loss
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _sites(model: nn.Module) -> list[Site]:
    sites, _ = detect_sites(model, [{"params": list(model.parameters())}], None, _call(model))
    return sites


def _random_elements(model: nn.Module, sites: list[Site]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [s.action.random_element(s.tensors(model), gen, scale=1.0) for s in sites]


def _moved(model: nn.Module, sites: list[Site], elements: list[torch.Tensor]) -> nn.Module:
    live = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()}
    params, _ = transport(sites, elements, live, live, "params")
    moved = copy.deepcopy(model)
    with torch.no_grad():  # only the members: a tied head's second name holds the value before the move
        for n in {n for s in sites for n in s.tensor_names}:
            moved.get_parameter(n).copy_(params[n])
    return moved


def _assert_transport_is_autograd(model: nn.Module, sites: list[Site], train: bool) -> float:
    elements = _random_elements(model, sites)
    here = _gradients(model, train)
    live = {n: t.detach() for n, t in model.state_dict(keep_vars=True).items()}
    names = {n for s in sites for n in s.tensor_names if n in here}
    moved, no_rule = transport(sites, elements, {n: here[n] for n in names}, live, "covector")
    assert not no_rule
    there = _gradients(_moved(model, sites, elements), train)
    worst = max(relative_error(moved[n], there[n]) for n in names)
    assert worst <= RTOL, worst
    return worst


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(BUILDS))
def test_every_auto_site_is_on_the_fast_path_and_transports_gradients_as_autograd(name, train):
    model = BUILDS[name]().double()
    sites = _sites(model)
    kinds = {s.action.name for s in sites}
    assert all(fast_path_eligible(s) for s in sites)
    if name.startswith("llama"):
        assert {"residual_rotation", "attention_qk_rotary_scaling", "attention_vo_gl"} <= kinds
        (site,) = [s for s in sites if s.action.name == "residual_rotation"]
        assert isinstance(site.action, GainedResidualRotation) and site.action.gains  # trainable gains, read
        gqa = [s for s in sites if s.action.name == "attention_vo_gl"]
        assert len(gqa) == 4  # one V/O site per KV head (2 per layer), each on the o columns of 2 query heads
    elif name.startswith("gpt2"):
        assert "residual_rotation" in kinds and "attention_qk_gl" in kinds
    elif name.startswith("phi"):  # the rotated dimensions keep the pair scalings, the unrotated ones GL
        rotary = [s for s in sites if s.action.name in ("attention_qk_rotary_scaling", "attention_qk_gl")]
        assert {s.action.name for s in rotary} == {"attention_qk_rotary_scaling", "attention_qk_gl"}
        assert all(s.info["rotary_dims"] == 8 for s in rotary)
    else:
        assert "residual_rotation" in kinds
    _assert_transport_is_autograd(model, sites, train)


def test_a_site_moving_the_gains_before_the_rotation_is_read_at_the_point_it_left():
    """Composition in list order: the norm-gain rescalings first, then the rotation conjugated by the new gains."""
    model = causal("llama").double()
    sites = _sites(model)
    rotation = [s for s in sites if s.action.name == "residual_rotation"]
    gains = [s for s in sites if "layernorm" in s.name or s.name.endswith(".norm")]
    assert rotation and gains
    _assert_transport_is_autograd(model, gains + rotation, train=False)


def test_the_rule_needs_the_point():
    model = causal("llama").double()
    (site,) = [s for s in _sites(model) if s.action.name == "residual_rotation"]
    g = site.action.random_element(site.tensors(model), torch.Generator().manual_seed(4))
    with pytest.raises(TypeError, match="transport_gradient_at"):
        site.action.transport_gradient(g, site.tensors(model))


def _auto_with_rotation(model: nn.Module) -> list:
    """The sites ``"auto"`` keeps under the closed-form balance, the rotation among them; a searched objective
    (``grad_norm``) keeps it only when it is passed explicitly (its transport reads the point)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sites = teleopt.Teleport(torch.optim.SGD(model.parameters(), lr=0.0), model, "auto", example_kwargs=_call(model)).sites
    assert any(s.action.name == "residual_rotation" for s in sites)
    return list(sites)


def test_auto_leaves_the_rotation_out_under_a_searched_objective_and_says_why():
    model = causal("llama").double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tele = teleopt.Teleport(
            torch.optim.SGD(model.parameters(), lr=1e-2), model, "auto", example_kwargs=_call(model), objective="grad_norm"
        )
    assert not [s for s in tele.sites if s.action.name == "residual_rotation"]
    skipped = tele.teleport().skipped  # declined (no gradients yet); the report names the sites left out
    (reason,) = [r for n, r in skipped.items() if n.startswith("residual_rotation")]
    assert "reads the point" in reason and "objective='balance'" in reason


def _grad_norm_teleport(model: nn.Module, opt: torch.optim.Optimizer, batch: dict) -> tuple[teleopt.Teleport, Site]:
    """A manual grad-norm Teleport on the sites ``"auto"`` keeps under balance (the rotation passed explicitly),
    and its residual rotation site."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tele = teleopt.Teleport(
            opt,
            model,
            _auto_with_rotation(model),
            example_kwargs=_call(model),
            objective="grad_norm",
            batch_fn=lambda: batch,
            schedule=Schedule(),
            search=FEW_STEPS,
        )
    (site,) = [s for s in tele.sites if s.action.name == "residual_rotation"]
    return tele, site


def test_a_grad_norm_teleport_moves_the_rotation_and_leaves_autograds_gradients():
    """The fast path's apply: after a teleport, ``.grad`` is the gradient at the new point."""
    model = causal("llama").double()
    batch = {**_call(model), "labels": _ids()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tele, site = _grad_norm_teleport(model, opt, batch)
    with keep_float64():
        model(**batch).loss.backward()
        report = tele.teleport()
    assert report.accepted and report.path == "fast", report.reason
    element = report.elements[site.name]
    assert float((element - torch.eye(64, dtype=element.dtype)).norm()) > 1e-3  # the rotation moved
    moved = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    there = _gradients(model, model.training)
    assert max(relative_error(moved[n], there[n]) for n in there) <= RTOL


def test_first_moments_move_as_gradients_at_the_point():
    """SGD's momentum after one step with lr 0 is the gradient at w: the teleport moves it to autograd's at g . w;
    Adam-style elementwise second moments have no exact rule under a rotation (the state policy's fallback)."""
    model = causal("llama").double()
    batch = {**_call(model), "labels": _ids()}
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    tele, site = _grad_norm_teleport(model, opt, batch)
    with keep_float64():
        model(**batch).loss.backward()
        tele.step()
        report = tele.teleport()
    assert report.accepted and report.path == "fast", report.reason
    assert float((report.elements[site.name] - torch.eye(64, dtype=torch.float64)).norm()) > 1e-3
    there = _gradients(model, model.training)
    buffers = {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters() if n in there}
    assert max(relative_error(buffers[n], there[n]) for n in site.tensor_names if n in there) <= RTOL
