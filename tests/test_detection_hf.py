"""find_symmetries on transformers root models built from tiny configs (never downloaded).

The roots (BertModel, GPT2Model, LlamaModel, ViTModel) take keyword/dict inputs
(``input_ids``, ``attention_mask``, ``pixel_values``) through ``example_kwargs``.
Their root ``forward`` is not torch.fx-traceable in transformers 5 (and
``transformers.utils.fx`` is gone), so detection falls back to tracing each called
submodule with the arguments it was called with; certification then checks every
site on the whole model as it is called.  Which sites are found is recorded below
(the language models users train are covered in ``test_detection_transformers.py``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import teleopt  # noqa: E402
from teleopt.detection.certify import edge_element, output_leaves  # noqa: E402
from teleopt.numerics import default_rtol, relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return ids, mask


def build(name):
    T = transformers
    ids, mask = _inputs()
    if name == "bert":
        cfg = T.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=16
        )
        return T.BertModel(cfg), {"input_ids": ids, "attention_mask": mask}
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
        return T.GPT2Model(cfg), {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    if name == "llama":
        cfg = T.LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=32,
            max_position_embeddings=16,
        )
        return T.LlamaModel(cfg), {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    cfg = T.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    return T.ViTModel(cfg), {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


# sites found today (a floor: new rules may add sites, never remove these)
FOUND = {
    "bert": {"hidden_permutation", "attention_qk_gl", "attention_vo_gl"},
    "gpt2": {"attention_qk_gl", "attention_vo_gl", "positive_rescaling"},
    "llama": {"hidden_permutation", "positive_rescaling", "attention_qk_rotary_scaling", "attention_vo_gl"},
    "vit": {"hidden_permutation", "positive_rescaling"},
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_hf_root_with_keyword_inputs(name):
    torch.manual_seed(0)
    model, kwargs = build(name)
    model.train()
    report = teleopt.find_symmetries(model, example_kwargs=kwargs)
    assert model.training  # restored
    assert report.certified and not report.dropped
    assert {s.action.name for s in report.sites} >= FOUND[name]
    names = dict(model.named_parameters())
    assert all(n in names or n in dict(model.named_buffers()) for s in report.sites for n in s.tensor_names)
    # every site is a symmetry of a float64 copy, called as in training, in eval mode
    moved = copy.deepcopy(model).double().eval()
    kw = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    with torch.no_grad():
        before = output_leaves(moved(**kw))
        for s in report.sites:
            if s.action.exactness != "exact":
                continue
            state = {k: v.clone() for k, v in moved.state_dict().items()}
            s.apply_(moved, edge_element(s, moved, torch.Generator().manual_seed(5)))
            after = output_leaves(moved(**kw))
            moved.load_state_dict(state)
            err = max(relative_error(a, b) for a, b in zip(after, before) if b.is_floating_point())
            assert err <= default_rtol(torch.float64), (s.name, err)


def test_hf_dict_inputs_as_kwargs():
    """A tokenizer's dict (BatchEncoding-like) is passed as example_kwargs."""
    model, kwargs = build("bert")
    report = teleopt.find_symmetries(model, example_kwargs=dict(kwargs))
    assert report.certified and report.sites
