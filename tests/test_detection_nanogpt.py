"""A hand-written GPT in nanoGPT's style gets its attention sites.

nanoGPT's non-flash attention reads its shapes as python values (``B, T, C =
x.size()``) and masks the scores with a registered causal buffer sliced
``[:, :, :T, :T]``; plain torch.fx cannot trace either.  Both the fused ``c_attn``
projection and separate q/k/v layers must give per-head (Q, K) and (V, O) GL sites,
exact to 1e-10 relative in float64 in train mode (same dropout masks) and eval mode.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from teleopt.detection import find_symmetries
from teleopt.detection.certify import edge_element
from teleopt.detection.verify import model_outputs
from teleopt.numerics import relative_error

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-10


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, separate: bool) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.separate = n_head, n_embd, separate
        if separate:
            self.q, self.k, self.v = nn.Linear(n_embd, n_embd), nn.Linear(n_embd, n_embd), nn.Linear(n_embd, n_embd)
        else:
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        if self.separate:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, separate: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, separate)
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's model, small: tied embeddings, learned positions, pre-norm blocks."""

    def __init__(self, separate: bool, vocab: int = 50, n_embd: int = 32, n_head: int = 4, n_layer: int = 2, block_size: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, separate) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("separate", [False, True], ids=["fused_c_attn", "separate_qkv"])
def test_nanogpt_attention_with_a_sliced_mask_buffer_gets_its_head_sites(separate):
    torch.manual_seed(0)
    model = GPT(separate).double()
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    report = find_symmetries(model, idx)
    counts = Counter(s.action.name for s in report.sites)
    assert counts["attention_qk_gl"] == 2 and counts["attention_vo_gl"] == 2, counts
    assert not any(e.kind == "module" and "could not be traced" in e.reason for e in report.skipped)
    assert not report.dropped
    gen = torch.Generator().manual_seed(5)
    ref = model_outputs(model, idx)
    for s in report.sites:
        if s.action.continuous and s.action.exactness == "exact":
            state = {k: v.clone() for k, v in model.state_dict().items()}
            s.apply_(model, edge_element(s, model, gen))
            err = relative_error(model_outputs(model, idx), ref)
            model.load_state_dict(state)
            assert err <= RTOL, (s.name, err)
