"""Language-model workloads of the realistic suite: byte-level Llama pre-training and a LoRA fine-tune.

Everything is offline and deterministic on one Python installation:

* the English corpus is the text of Python's own documentation topics
  (``pydoc_data.topics``, the help pages ``help("with")`` prints; about 0.47 MB), keys
  in sorted order;
* the second domain, for the fine-tune, is Python source code: the standard library's
  top-level modules in sorted order (about 1 MB taken).

Text is read as bytes (vocabulary 256) and cut into non-overlapping windows of
``context + 1`` bytes; each window is an input (``context`` bytes) and its next-byte
targets.  The split is by position (train, then validation, then test), fixed across
seeds; the seed draws the initialisation and the batch order.

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (RMSNorm,
rotary embeddings, SwiGLU, grouped-query attention), never fetched.  :class:`CausalLM`
returns the logits as ``(batch, vocab, time)`` so that ``F.cross_entropy(out, y)`` is
the mean next-byte loss and ``out.argmax(1) == y`` the next-byte accuracy, the shapes
the classification harness in :mod:`benchmarks.realistic.core` already handles.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CausalLM", "english_bytes", "code_bytes", "windows", "llama_lm_problem", "llama_lora_problem", "balanced_lora_projection"]

CONTEXT = 64
QUICK_CONTEXT = 32
# sizes: (hidden, intermediate, layers, heads, kv heads): "small" (0.21M parameters) trains on a CPU core,
# "large" (5.9M, ``--large``) is meant for a GPU
SIZES = {"quick": (64, 172, 2, 4, 2), "small": (64, 172, 4, 4, 2), "large": (256, 688, 8, 4, 2)}


def _size(quick: bool, large: bool) -> str:
    return "quick" if quick else "large" if large else "small"


class CausalLM(nn.Module):
    """A causal LM as a classifier of every position: ``forward(ids) -> logits (batch, vocab, time)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(input_ids=ids).logits.transpose(1, 2)

    def features(self, ids: Tensor) -> Tensor:
        """The last hidden states, mean-pooled over time (dead units and feature rank)."""
        return self.lm(input_ids=ids, output_hidden_states=True).hidden_states[-1].mean(1)


def english_bytes() -> bytes:
    """The English text of Python's documentation topics, keys in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def code_bytes(limit: int = 1_000_000) -> bytes:
    """Python source code: the standard library's top-level modules in sorted order, the first ``limit`` bytes."""
    root = Path(copy.__file__).resolve().parent
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes() + b"\n"
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def windows(data: bytes, context: int) -> tuple[Tensor, Tensor]:
    """Non-overlapping windows of ``context + 1`` bytes as (inputs, next-byte targets), int64."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    n = (len(t) - 1) // context
    x = t[: n * context].view(n, context)
    y = t[1 : n * context + 1].view(n, context)
    return x, y


def _split(x: Tensor, y: Tensor, quick: bool) -> tuple[Tensor, ...]:
    """90 / 5 / 5 by position; the quick run keeps 600 / 100 / 100 windows."""
    n = len(x)
    a, b = int(0.9 * n), int(0.95 * n)
    parts = (x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:])
    if quick:
        parts = tuple(p[: (600 if i < 2 else 100)] for i, p in enumerate(parts))
    return parts


def _llama(size: str, context: int, seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return CausalLM(LlamaForCausalLM(cfg))
    finally:
        torch.random.set_rng_state(state)


def _features(model: nn.Module, x: Tensor) -> Tensor:
    assert isinstance(model, CausalLM)
    return model.features(x)


def llama_lm_problem(quick: bool, large: bool) -> Any:
    """Byte-level Llama (0.21M parameters; ``large``: 5.9M; ``quick``: 0.1M) trained from scratch on the English corpus."""
    from benchmarks.realistic.configs import Problem

    context = QUICK_CONTEXT if quick else CONTEXT
    size = _size(quick, large)
    parts = _split(*windows(english_bytes(), context), quick)
    n_params = sum(p.numel() for p in _llama(size, context, 0).parameters())
    return Problem(
        *parts,
        make_model=lambda seed: _llama(size, context, seed),
        features=_features,
        info={
            "model": f"LlamaForCausalLM {dict(zip(('hidden', 'intermediate', 'layers', 'heads', 'kv_heads'), SIZES[size]))}, "
            f"{n_params / 1e6:.2f}M parameters, byte-level, context {context}, Python documentation topics "
            f"(python {sys.version.split()[0]})",
            "train_eval_rows": 512,
        },
    )


def _pretrain(size: str, context: int, seed: int, x: Tensor, y: Tensor, steps: int, device: str) -> dict[str, Tensor]:
    """AdamW 3e-3, warm-up 10% + cosine, batch 32: the checkpoint being fine-tuned (not timed).

    With ``TELEOPT_BENCH_CACHE`` set, the checkpoint is kept there as a safetensors file and
    reused (parallel processes of one suite pre-train each seed once).
    """
    folder = os.environ.get("TELEOPT_BENCH_CACHE")
    path = Path(folder) / f"llama_{size}_{context}_{seed}_{steps}.safetensors" if folder else None
    if path is not None and path.is_file():
        from safetensors.torch import load_file

        return load_file(str(path))
    state = _pretrain_now(size, context, seed, x, y, steps, device)
    if path is not None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
    return state


def _pretrain_now(size: str, context: int, seed: int, x: Tensor, y: Tensor, steps: int, device: str) -> dict[str, Tensor]:
    model = _llama(size, context, 50_000 + seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(60_000 + seed)
    warm = max(1, steps // 10)
    for step in range(steps):
        rows = torch.randint(len(x), (32,), generator=gen)
        factor = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
        for group in opt.param_groups:
            group["lr"] = 3e-3 * factor
        opt.zero_grad()
        F.cross_entropy(model(x[rows].to(device)), y[rows].to(device)).backward()
        opt.step()
    return {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}


def llama_lora_problem(quick: bool, large: bool) -> Any:
    """The English Llama, pre-trained per seed, then LoRA (peft, rank 8 on q, k, v, o, gate, up, down) on Python code."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.realistic.configs import Problem

    context = QUICK_CONTEXT if quick else CONTEXT
    size = _size(quick, large)
    pre_x, pre_y, *_ = _split(*windows(english_bytes(), context), quick)
    parts = _split(*windows(code_bytes(), context), quick)
    pre_steps = 20 if quick else 1500
    device = "cuda" if torch.cuda.is_available() and not quick else "cpu"
    cache: dict[int, dict[str, Tensor]] = {}

    def make(seed: int) -> nn.Module:
        if seed not in cache:
            cache[seed] = _pretrain(size, context, seed, pre_x, pre_y, pre_steps, device)
        model = _llama(size, context, 50_000 + seed)
        model.load_state_dict(cache[seed])
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            lora = LoraConfig(
                r=8,
                lora_alpha=16,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )
            model.lm = get_peft_model(model.lm, lora)
        finally:
            torch.random.set_rng_state(state)
        return model

    return Problem(
        *parts,
        make_model=make,
        features=_features,
        info={
            "model": f"the llama_lm model pre-trained {pre_steps} steps on English, LoRA r=8 (alpha 16) on every "
            "projection, fine-tuned on Python standard-library source",
            "train_eval_rows": 512,
        },
    )


@torch.no_grad()
def balanced_lora_projection(model: nn.Module) -> None:
    """Project every LoRA pair onto the balanced set ``A A^T = B^T B`` keeping ``B A`` (an every-step baseline).

    For ``B`` (out x r) and ``A`` (r x in) with thin QR factors ``B = Q_B R_B`` and
    ``A^T = Q_A R_A``, the r x r SVD ``R_B R_A^T = U S V^T`` gives the balanced pair
    ``B' = Q_B U S^{1/2}``, ``A' = S^{1/2} V^T Q_A^T`` with ``B' A' = B A`` and
    ``A' A'^T = S = B'^T B'``: the constraint of BaLoRA (Castin et al., ICML 2026),
    re-implemented here from that statement; the optimizer state is left as it is.
    """
    for module in model.modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
            continue
        for name in lora_a.keys() & lora_b.keys():
            A, B = lora_a[name].weight, lora_b[name].weight
            qb, rb = torch.linalg.qr(B.double())
            qa, ra = torch.linalg.qr(A.double().T)
            u, s, vh = torch.linalg.svd(rb @ ra.T)
            root = s.sqrt()
            B.copy_((qb @ (u * root)).to(B.dtype))
            A.copy_(((root[:, None] * vh) @ qa.T).to(A.dtype))
