"""Teleports exact in the precision a model trains in: float32, and bfloat16 autocast.

Two models (CPU, Adam lr 1e-3, the default ``Teleport`` with ``loss_fn`` and ``batch_fn``):

* ``vit``: timm ``vit_tiny_patch16_224`` (``pretrained=False``, img_size 32, patch 8, 10 classes),
  its sites from ``sites="auto"`` (the attention Q/K and V/O GL sites, GL(64) per head);
* ``llama``: transformers ``LlamaForCausalLM`` (hidden 64, 4 layers, 4 heads, no GQA, vocabulary 128,
  sequence 16), with what ``find_symmetries`` finds plus a V/O GL(16) site per layer built by hand with
  the registry's ``attention_vo_gl`` (v_proj rows, o_proj columns: exact whatever the rotary embedding).

Four runs per model:

1. ``float32 training`` and ``bf16 training`` (the forward under ``torch.autocast("cpu",
   torch.bfloat16)``, backward and ``step()`` outside it): a teleport every ``--every`` steps,
   ``--teleports`` teleports; counts teleports rolled back because the loss or the outputs changed
   (round-off: the sites are exact; under autocast the check compares the bf16 forward too) and
   float32 checks settled by the float64 re-run (inconclusive).
2. ``float32 back to back``: ``--teleports`` teleports from one point with no step between them (each
   compounds on the last: the worst case for conditioning), the same counts.
3. ``bf16 back to back``: the same after a forward under ``torch.autocast("cpu", torch.bfloat16)``
   (backward and ``teleport()`` outside it): the relative change of the autocast forward on a probe batch
   between the untouched model and the model after the teleports, against ``r0``, the untouched model's
   bf16-vs-float32 difference; the goal is ``drift <= 2 r0``.

Run: ``python benchmarks/teleport_precision.py [--quick] [--json PATH] [--models vit llama]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.registry import get_action
from teleopt.site import Site

Batch = tuple[torch.Tensor, torch.Tensor]


def vit(seed: int) -> tuple[nn.Module, Any, Callable[[int], Batch], Callable[..., torch.Tensor]]:
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8)
    g = torch.Generator().manual_seed(seed + 1)
    X, Y = torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)

    def batch(i: int) -> Batch:
        k = (8 * i) % 64
        return X[k : k + 8], Y[k : k + 8]

    return model, "auto", batch, F.cross_entropy


def _lm_loss(logits: Any, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class _Logits(nn.Module):
    """A LlamaForCausalLM returning its logits tensor (the check compares tensors)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


def llama(seed: int) -> tuple[nn.Module, Any, Callable[[int], Batch], Callable[..., torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    model = _Logits(LlamaForCausalLM(config))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (64, 17), generator=g)

    def batch(i: int) -> Batch:
        k = (8 * i) % 64
        return ids[k : k + 8, :-1], ids[k : k + 8, 1:]

    found = teleopt.find_symmetries(model, batch(0)[0])
    sites = [s for s in found.sites if s.action.continuous and s.action.exactness == "exact"]
    vo = get_action("attention_vo_gl", num_heads=4)
    for i in range(4):
        attn = f"lm.model.layers.{i}.self_attn"
        sites.append(Site(vo, (f"{attn}.v_proj.weight", None, f"{attn}.o_proj.weight"), name=f"vo_{i}"))
    return model, sites, batch, _lm_loss


MODELS = {"vit": vit, "llama": llama}


def _counts(reports: list[Any]) -> dict[str, int]:
    teleports = [r for r in reports if r.path != "watch"]
    roundoff = [r for r in teleports if r.reason.startswith("rolled back:") and "changed by" in r.reason]
    return {
        "teleports": len(teleports),
        "accepted": sum(r.accepted for r in teleports),
        "rolled_back_roundoff": len(roundoff),
        "inconclusive_f32": sum("inconclusive" in (r.check_detail or "") for r in teleports),
        "declined": sum(r.reason.startswith("declined") for r in teleports),
        "watch_rollbacks": sum(r.path == "watch" for r in reports),
    }


def _wrapper(model: nn.Module, sites: Any, batch: Callable[[int], Batch], loss_fn: Any, **kw: Any) -> teleopt.Teleport:
    calls = iter(range(1 << 30))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return teleopt.Teleport(
            torch.optim.Adam(model.parameters(), 1e-3),
            model,
            sites,
            objective="grad_norm",
            loss_fn=loss_fn,
            batch_fn=lambda: batch(next(calls)),
            **kw,
        )


def training(name: str, args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    model, sites, batch, loss_fn = MODELS[name](args.seed)
    opt = _wrapper(model, sites, batch, loss_fn, every=args.every, example_inputs=batch(0)[0][:2])
    start = time.perf_counter()
    for step in range(args.every * args.teleports):  # teleports at steps 0, every, 2 every, ...
        x, y = batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(x)
        loss_fn(out, y).backward()
        opt.step()
    run = "bf16 training" if bf16 else "float32 training"
    return {"run": run, "model": name, "seconds": time.perf_counter() - start, **_counts(opt.reports)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def back_to_back(name: str, args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    model, sites, batch, loss_fn = MODELS[name](args.seed)
    probe = batch(5)[0]
    untouched = copy.deepcopy(model)
    opt = _wrapper(model, sites, batch, loss_fn, example_inputs=batch(0)[0][:2])
    x, y = batch(0)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = loss_fn(model(x), y)
    loss.backward()
    start = time.perf_counter()
    for i in range(args.teleports):
        opt.teleport(batch=batch(i))
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"run": "bf16 back to back" if bf16 else "float32 back to back", "model": name, "seconds": seconds}
    out.update(_counts(opt.reports))
    with torch.no_grad():
        f32 = untouched(probe)
        out["f32_change"] = _relative(model(probe), f32)
        if bf16:
            with torch.autocast("cpu", torch.bfloat16):
                b0, b1 = untouched(probe), model(probe)
            out["r0"] = _relative(b0, f32)
            out["bf16_drift"] = _relative(b1, b0)
            out["drift_over_r0"] = out["bf16_drift"] / out["r0"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a text table (``watch``: rollbacks by the watch after a teleport, not round-off)."""
    lines = [
        f"{'model':6} {'run':22} {'tele':>4} {'acc':>4} {'roll(rnd)':>9} {'inconcl':>7} {'decl':>4} {'watch':>5} "
        f"{'f32 chg':>8} {'r0':>8} {'drift':>8} {'d/r0':>5} {'s':>6}"
    ]
    for r in rows:
        f = {k: (f"{r[k]:.1e}" if k in r else "-") for k in ("f32_change", "r0", "bf16_drift")}
        ratio = f"{r['drift_over_r0']:.2f}" if "drift_over_r0" in r else "-"
        lines.append(
            f"{r['model']:6} {r['run']:22} {r['teleports']:4d} {r['accepted']:4d} {r['rolled_back_roundoff']:9d} "
            f"{r['inconclusive_f32']:7d} {r['declined']:4d} {r['watch_rollbacks']:5d} {f['f32_change']:>8} {f['r0']:>8} "
            f"{f['bf16_drift']:>8} {ratio:>5} {r['seconds']:6.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 teleports instead of 20, the llama model only")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None)
    parser.add_argument("--teleports", type=int, default=None)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args(argv)
    args.teleports = args.teleports or (3 if args.quick else 20)
    models = args.models or (["llama"] if args.quick else list(MODELS))
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    rows = []
    for name in models:
        rows.append(training(name, args, bf16=False))
        rows.append(training(name, args, bf16=True))
        rows.append(back_to_back(name, args, bf16=False))
        rows.append(back_to_back(name, args, bf16=True))
    print(table(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(), "args": vars(args)}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
