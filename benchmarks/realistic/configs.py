"""The five configurations of the realistic suite: data, models and training recipes.

Everything is offline: scikit-learn's bundled digits through
:func:`teleopt.datasets.load_digits` (1097 train / 250 validation / 450 test, the
split fixed across seeds; the seed draws the initialisation and the batch order),
the same digits upsampled to 32x32 (CNN) or 16x16 (ViT), and a synthetic
teacher-student token task for the LoRA fine-tune.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Config", "Problem", "CONFIGS", "digits_split"]

N_VAL = 250


@dataclass
class Problem:
    """One configuration's data and a model factory for one seed."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    make_model: Callable[[int], nn.Module]
    features: Callable[[nn.Module, Tensor], Tensor]
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy
    info: dict[str, Any] = field(default_factory=dict)

    def to(self, device: str) -> Problem:
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            setattr(self, name, getattr(self, name).to(device))
        return self


@dataclass
class Config:
    """A training recipe: sizes, optimizer family, lr (and weight-decay) grid, schedule, decay strengths.

    ``optimizer``: ``"sgd"`` (momentum 0.9), ``"adamw"`` or ``"adamw95"`` (AdamW with
    betas (0.9, 0.95), the language models' recipe).

    ``base_wd`` is the baseline's own (realistic) weight decay on >= 2-D tensors;
    ``decay`` is the stronger decay at which plain weight decay and Syre are compared.
    ``teleport_at`` is the step of ``teleport_once`` (after the lr warm-up).
    """

    name: str
    description: str
    build: Callable[[bool, bool], Problem]  # (quick, large) -> Problem
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    steps: int
    quick_steps: int
    batch: int
    eval_every: int
    lr_grid: tuple[float, ...]
    quick_lr_grid: tuple[float, ...]
    base_wd: float
    decay: float
    warmup: int = 0
    cosine: bool = False
    teleport_at: int = 20
    collapse: bool = False
    wd_grid: tuple[float, ...] = ()  # tuned jointly with the lr (AlgoPerf's protocol) when given
    quick_wd_grid: tuple[float, ...] = ()
    tuned_arms: tuple[str, ...] = ()  # arms that are baselines of their own, each tuned on the same grid
    val_ratio: float = 1.05  # "never worse": the default's median best validation loss at most this x the baseline's
    language_model: bool = False

    def lr_factor(self, step: int, steps: int) -> float:
        """Linear warm-up then cosine to 0 (or constant)."""
        warmup = min(self.warmup, max(1, steps // 10)) if self.warmup else 0
        if step < warmup:
            return (step + 1) / warmup
        if not self.cosine:
            return 1.0
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ----------------------------------------------------------------------------- digits
def digits_split(quick: bool) -> tuple[Tensor, ...]:
    """Digits as (x_train, y_train, x_val, y_val, x_test, y_test), flat standardised features."""
    from teleopt.datasets import load_digits

    d = load_digits(seed=0, n_test=450)
    n = len(d.x_train) - N_VAL
    parts = (d.x_train[:n], d.y_train[:n], d.x_train[n:], d.y_train[n:], d.x_test, d.y_test)
    if quick:  # smoke run: smaller evaluation sets
        parts = tuple(t[:200] for t in parts)
    return parts


def _images(x: Tensor, size: int) -> Tensor:
    return F.interpolate(x.view(-1, 1, 8, 8), size=(size, size), mode="bilinear", align_corners=False).contiguous()


def _seeded(fn: Callable[[], nn.Module], seed: int) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return fn()
    finally:
        torch.random.set_rng_state(state)


def _mlp_problem(quick: bool, large: bool) -> Problem:
    width = 1024 if large else 256

    def make(seed: int) -> nn.Module:
        return _seeded(
            lambda: nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)), seed
        )

    def features(model: nn.Module, x: Tensor) -> Tensor:
        return model[:4](x)

    return Problem(*digits_split(quick), make_model=make, features=features, info={"model": f"MLP 64-{width}-{width}-10 ReLU"})


def _timm_features(model: nn.Module, x: Tensor) -> Tensor:
    return model.forward_head(model.forward_features(x), pre_logits=True)


def _cnn_problem(quick: bool, large: bool) -> Problem:
    import timm

    channels = (64, 128, 256, 512) if large else (16, 32, 64, 128)
    x_tr, y_tr, x_va, y_va, x_te, y_te = digits_split(quick)

    def make(seed: int) -> nn.Module:
        return _seeded(lambda: timm.create_model("resnet18", pretrained=False, num_classes=10, in_chans=1, channels=channels), seed)

    return Problem(
        _images(x_tr, 32),
        y_tr,
        _images(x_va, 32),
        y_va,
        _images(x_te, 32),
        y_te,
        make,
        _timm_features,
        info={"model": f"timm resnet18 channels={channels}, 32x32 upsampled digits"},
    )


def _vit_problem(quick: bool, large: bool) -> Problem:
    import timm

    kw = dict(img_size=16, patch_size=4, depth=12 if large else 6, embed_dim=192 if large else 96, num_heads=3)
    x_tr, y_tr, x_va, y_va, x_te, y_te = digits_split(quick)

    def make(seed: int) -> nn.Module:
        return _seeded(lambda: timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, in_chans=1, **kw), seed)

    return Problem(
        _images(x_tr, 16),
        y_tr,
        _images(x_va, 16),
        y_va,
        _images(x_te, 16),
        y_te,
        make,
        _timm_features,
        info={"model": f"timm vit_tiny {kw}, 16x16 upsampled digits"},
    )


# ----------------------------------------------------------------------------- LoRA
VOCAB, SEQ, CLASSES = 16, 16, 8


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``scale * B A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


class Block(nn.Module):
    """Pre-norm transformer block: hand-written multi-head attention and a ReLU MLP."""

    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.o((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.relu(self.fc1(self.n2(x))))


class TinyTransformer(nn.Module):
    """Token classifier: embedding + learned positions, pre-norm blocks, mean pooling, linear head."""

    def __init__(self, d: int = 48, heads: int = 4, hidden: int = 96, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, d))
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def pooled(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(1)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.pooled(tokens))


def _teacher_features(tokens: Tensor) -> Tensor:
    """Token counts and hashed adjacent-bigram counts, standardised per batch of the whole set."""
    counts = F.one_hot(tokens, VOCAB).float().mean(1)
    bigram = (tokens[:, :-1] * VOCAB + tokens[:, 1:]) % 32
    bigrams = F.one_hot(bigram, 32).float().mean(1)
    return torch.cat([counts, bigrams], 1)


def _lora_problem(quick: bool, large: bool) -> Problem:
    g = torch.Generator().manual_seed(1234)
    n_pre, n_tr, n_va, n_te = (400, 200, 100, 200) if quick else (4000, 1000, 250, 1000)
    tokens = torch.randint(VOCAB, (n_pre + n_tr + n_va + n_te, SEQ), generator=g)
    phi = _teacher_features(tokens)
    phi = (phi - phi.mean(0)) / (phi.std(0) + 1e-6)
    w_a = torch.randn(phi.shape[1], CLASSES, generator=g)
    # task B: the teacher changed by a rank-2 update of comparable size
    delta = torch.randn(phi.shape[1], 2, generator=g) @ torch.randn(2, CLASSES, generator=g)
    w_b = w_a + 1.2 * delta * (w_a.norm() / delta.norm())
    y_a, y_b = (phi @ w_a).argmax(1), (phi @ w_b).argmax(1)
    pre_x, pre_y = tokens[:n_pre], y_a[:n_pre]
    s = [n_pre, n_pre + n_tr, n_pre + n_tr + n_va, len(tokens)]
    size = dict(d=96, heads=4, hidden=192, depth=4) if large else dict(d=48, heads=4, hidden=96, depth=2)
    pre_steps = 20 if quick else 600
    cache: dict[int, dict[str, Tensor]] = {}

    def pretrained(seed: int) -> dict[str, Tensor]:
        # brief pre-training on task A, once per seed (not timed: it is the checkpoint being fine-tuned)
        if seed not in cache:
            model = _seeded(lambda: TinyTransformer(**size), 50_000 + seed)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
            gen = torch.Generator().manual_seed(60_000 + seed)
            for step in range(pre_steps):
                rows = torch.randint(n_pre, (64,), generator=gen)
                for group in opt.param_groups:
                    group["lr"] = 3e-3 * 0.5 * (1 + math.cos(math.pi * step / pre_steps))
                opt.zero_grad()
                F.cross_entropy(model(pre_x[rows]), pre_y[rows]).backward()
                opt.step()
            cache[seed] = copy.deepcopy(model.state_dict())
        return cache[seed]

    def make(seed: int) -> nn.Module:
        state = pretrained(seed)

        def build() -> nn.Module:
            model = TinyTransformer(**size)
            model.load_state_dict(state)
            model.requires_grad_(False)
            for block in model.blocks:
                for name in ("q", "v", "fc1", "fc2"):
                    setattr(block, name, LoRALinear(getattr(block, name), rank=4))
            model.head.requires_grad_(True)  # a new task: the classifier head trains too
            return model

        return _seeded(build, seed)

    def features(model: nn.Module, x: Tensor) -> Tensor:
        return model.pooled(x)

    return Problem(
        tokens[s[0] : s[1]],
        y_b[s[0] : s[1]],
        tokens[s[1] : s[2]],
        y_b[s[1] : s[2]],
        tokens[s[2] : s[3]],
        y_b[s[2] : s[3]],
        make,
        features,
        info={"model": f"TinyTransformer {size} pre-trained {pre_steps} steps on task A, LoRA rank 4 on q,v,fc1,fc2 + head, task B"},
    )


def _llama_lm(quick: bool, large: bool) -> Problem:
    from benchmarks.realistic.lm import llama_lm_problem

    return llama_lm_problem(quick, large)


def _llama_lora(quick: bool, large: bool) -> Problem:
    from benchmarks.realistic.lm import llama_lora_problem

    return llama_lora_problem(quick, large)


# ----------------------------------------------------------------------------- the table
CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config(
            "mlp_sgd",
            "MLP 64-256-256-10 ReLU on digits, SGD momentum 0.9, batch 64",
            _mlp_problem,
            "sgd",
            steps=2000,
            quick_steps=40,
            batch=64,
            eval_every=25,
            lr_grid=(0.01, 0.03, 0.1, 0.3),
            quick_lr_grid=(0.03, 0.1),
            base_wd=5e-4,
            decay=1e-2,
            teleport_at=20,
            collapse=True,
        ),
        Config(
            "mlp_adamw",
            "MLP 64-256-256-10 ReLU on digits, AdamW, batch 64",
            _mlp_problem,
            "adamw",
            steps=2000,
            quick_steps=40,
            batch=64,
            eval_every=25,
            lr_grid=(3e-4, 1e-3, 3e-3),
            quick_lr_grid=(1e-3, 3e-3),
            base_wd=0.05,
            decay=0.5,
            teleport_at=20,
            collapse=True,
        ),
        Config(
            "cnn_adamw",
            "timm resnet18 quarter width on 32x32 digits, AdamW, warm-up 20 + cosine, batch 64",
            _cnn_problem,
            "adamw",
            steps=300,
            quick_steps=6,
            batch=64,
            eval_every=20,
            lr_grid=(1e-3, 3e-3, 1e-2),
            quick_lr_grid=(3e-3,),
            base_wd=0.05,
            decay=1.0,
            warmup=20,
            cosine=True,
            teleport_at=20,
            collapse=True,
        ),
        Config(
            "vit_adamw",
            "timm vit_tiny narrowed (16x16, patch 4, depth 6, dim 96), AdamW, warm-up 20 + cosine, batch 64",
            _vit_problem,
            "adamw",
            steps=300,
            quick_steps=6,
            batch=64,
            eval_every=20,
            lr_grid=(3e-4, 1e-3, 3e-3),
            quick_lr_grid=(1e-3,),
            base_wd=0.05,
            decay=1.0,
            warmup=20,
            cosine=True,
            teleport_at=20,
        ),
        Config(
            "lora_adamw",
            "hand-written transformer, LoRA r=4 fine-tune on a shifted teacher, AdamW, warm-up 20 + cosine",
            _lora_problem,
            "adamw",
            steps=400,
            quick_steps=20,
            batch=64,
            eval_every=20,
            lr_grid=(1e-3, 3e-3, 1e-2),
            quick_lr_grid=(3e-3,),
            base_wd=0.01,
            decay=0.5,
            warmup=20,
            cosine=True,
            teleport_at=20,
        ),
        Config(
            "llama_lm",
            "byte-level Llama (RMSNorm, rotary, SwiGLU, GQA; 0.21M, --large 5.9M) from scratch on Python's documentation text, "
            "AdamW (0.9, 0.95), warm-up 100 + cosine, batch 32 x 64 bytes",
            _llama_lm,
            "adamw95",
            steps=1500,
            quick_steps=8,
            batch=32,
            eval_every=50,
            lr_grid=(1e-3, 3e-3, 1e-2),
            quick_lr_grid=(3e-3,),
            wd_grid=(0.0, 0.1, 0.3),
            quick_wd_grid=(0.1,),
            base_wd=0.1,
            decay=0.1,
            warmup=100,
            cosine=True,
            teleport_at=150,
            val_ratio=1.01,
            language_model=True,
        ),
        Config(
            "llama_lora",
            "the English Llama, LoRA r=8 on every projection (peft), fine-tuned on Python source, "
            "AdamW (0.9, 0.95), warm-up 30 + cosine, batch 32 x 64 bytes",
            _llama_lora,
            "adamw95",
            steps=600,
            quick_steps=6,
            batch=32,
            eval_every=25,
            lr_grid=(1e-3, 3e-3, 1e-2),
            quick_lr_grid=(3e-3,),
            wd_grid=(0.0, 0.01, 0.1),
            quick_wd_grid=(0.0,),
            base_wd=0.0,
            decay=0.1,
            warmup=30,
            cosine=True,
            teleport_at=50,
            tuned_arms=("balora",),
            val_ratio=1.01,
            language_model=True,
        ),
    )
}
