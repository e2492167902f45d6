"""Coverage and detection time of ``teleopt.find_symmetries`` on a pinned timm zoo.

For every model (``pretrained=False``, float32, CPU, one example image at the
model's default resolution; the ``hf:`` rows are Hugging Face transformers roots, BERT,
GPT-2 and Llama with 2 layers of width 128, built from configs and called on 16 tokens
through ``example_kwargs``; the ``lm:`` rows are the language models users train,
Llama, Qwen2, Mistral (grouped-query attention), GPT-2 and BERT with hidden 64, 2
layers, 4 heads, called as ``model(input_ids=ids)``), one table row: parameters, sites found (continuous /
discrete / approximate), the fraction of parameter entries acted on by at least one
continuous site (all sites, and exact sites only, i.e. without the eps-approximate
BatchNorm input scaling), and the median detection time over repeated runs, with
certification (the default: every proposed site checked numerically in float64,
``teleopt.detection.certify``), the part of it spent certifying, the sites
certification dropped, and the time of one run with ``certify=False``.

Goal (issue 3): detection on vit_base_patch16_224 takes < 5 s on CPU.

Run: ``python benchmarks/coverage.py [--quick | --lm] [--json out.json] [--plot-dir DIR]``.
``--quick`` runs three small models at 32x32 once (the smoke test uses it).

``--residual`` prints the residual stream's rows instead (:func:`residual_rows`): tiny causal
LMs (hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary 1000, 16 tokens) as built (trainable
gains read by the rotation, never folded), GPT-2 with and without dropout on the stream and with
a tied or untied head; ``--residual-big`` adds a 12-layer, 768-wide Llama (vocabulary 32000) and
GPT-2 small, timed on one thread.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from teleopt.detection import find_symmetries

# Hugging Face transformers roots built from small configs (never downloaded): name -> (config class,
# model class, config kwargs); they take input_ids and an attention mask through example_kwargs
HF_ZOO = {
    "hf:bert": (
        "BertConfig",
        "BertModel",
        {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512},
    ),
    "hf:gpt2": ("GPT2Config", "GPT2Model", {"n_embd": 128, "n_layer": 2, "n_head": 4}),
    "hf:llama": (
        "LlamaConfig",
        "LlamaModel",
        {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 344},
    ),
}
# the language models users train, tiny (hidden 64, 2 layers, 4 heads, 2 key/value heads where the architecture
# has grouped-query attention, vocabulary 100), called as users call them: model(input_ids=ids), sdpa attention
_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_GQA = {**_TINY, "num_key_value_heads": 2, "intermediate_size": 128}
LM_ZOO = {
    "lm:llama": ("LlamaConfig", "LlamaForCausalLM", _GQA),
    "lm:qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GQA),
    "lm:mistral": ("MistralConfig", "MistralForCausalLM", _GQA),
    "lm:gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_embd": 64, "n_layer": 2, "n_head": 4}),
    # GPT-2 as pretraining often runs it: no dropout on the stream, an untied head (the rotation needs both)
    "lm:gpt2-d0-untied": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False},
    ),
    "lm:bert": ("BertConfig", "BertModel", {**_TINY, "intermediate_size": 128}),
}


ZOO = [
    ("resnet18", {}),
    ("resnet50", {}),
    ("resnext50_32x4d", {}),
    ("vit_tiny_patch16_224", {}),
    ("deit_tiny_patch16_224", {}),
    ("vit_base_patch16_224", {}),
    ("convnext_atto", {}),
    ("efficientnet_b0", {}),
    ("mobilenetv3_small_050", {}),
    ("regnetx_002", {}),
    *((name, {}) for name in HF_ZOO),
    *((name, {}) for name in LM_ZOO),
]
QUICK = [("resnet18", {}), ("vit_tiny_patch16_224", {"img_size": 32}), ("convnext_atto", {})]
TIME_GOAL = ("vit_base_patch16_224", 5.0)


def build(name: str, kwargs: dict[str, Any], size: int) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any] | None]:
    """The model and its example inputs: a timm model on one image, or an ``hf:`` root on 16 tokens."""
    if name in LM_ZOO:
        import transformers

        config_cls, model_cls, config = LM_ZOO[name]
        extra = {"n_positions": 64} if config_cls == "GPT2Config" else {"max_position_embeddings": 64}
        cfg = getattr(transformers, config_cls)(vocab_size=100, **extra, **config)
        cfg._attn_implementation = "sdpa"
        ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
        return getattr(transformers, model_cls)(cfg), (), {"input_ids": ids}
    if name in HF_ZOO:
        import transformers

        config_cls, model_cls, config = HF_ZOO[name]
        cfg = getattr(transformers, config_cls)(vocab_size=1000, max_position_embeddings=64, **config)
        ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
        call: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if name != "hf:bert":
            call["use_cache"] = False
        return getattr(transformers, model_cls)(cfg), (), call
    import timm

    return timm.create_model(name, pretrained=False, **kwargs), (torch.randn(1, 3, size, size),), None


def measure(name: str, kwargs: dict[str, Any], size: int, repeats: int) -> dict[str, Any]:
    model, args, call = build(name, kwargs, size)
    times, certify_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        report = find_symmetries(model, *args, example_kwargs=call)
        times.append(time.perf_counter() - start)
        certify_times.append(report.certify_seconds)
    start = time.perf_counter()
    find_symmetries(model, *args, example_kwargs=call, certify=False)
    unchecked = time.perf_counter() - start
    kinds = [s.action for s in report.sites]
    return {
        "model": name,
        "parameters": report.parameters,
        "sites": len(report.sites),
        "continuous": sum(a.continuous for a in kinds),
        "discrete": sum(not a.continuous for a in kinds),
        "approximate": sum(a.exactness == "approximate" for a in kinds),
        "coverage": report.coverage,
        "coverage_exact": report.coverage_exact,
        "skipped": len(report.skipped),
        "seconds_median": statistics.median(times),
        "seconds": times,
        "certify_seconds_median": statistics.median(certify_times),
        "dropped": len(report.dropped),
        "unchecked_seconds": unchecked,
    }


#: causal LMs of the residual-stream rows: name -> (config class, model class, config kwargs), all as built
_STREAM = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
_TINY_GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "bos_token_id": 0, "eos_token_id": 0}
_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
RESIDUAL_ZOO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _STREAM),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _STREAM),
    "mistral": ("MistralConfig", "MistralForCausalLM", _STREAM),
    "gemma (1 + w gains, untied)": ("GemmaConfig", "GemmaForCausalLM", {**_STREAM, "head_dim": 16, "tie_word_embeddings": False}),
    "gpt2 (default: dropout 0.1, tied)": ("GPT2Config", "GPT2LMHeadModel", _TINY_GPT2),
    "gpt2 (dropout 0, tied)": ("GPT2Config", "GPT2LMHeadModel", {**_TINY_GPT2, **_NO_DROPOUT}),
    "gpt2 (dropout 0, untied)": ("GPT2Config", "GPT2LMHeadModel", {**_TINY_GPT2, **_NO_DROPOUT, "tie_word_embeddings": False}),
}
_BIG = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12, "intermediate_size": 2048}
#: --residual-big: real vocabularies (Llama 32000, GPT-2 small 50257), one thread
BIG_ZOO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-12x768": ("LlamaConfig", "LlamaForCausalLM", {**_BIG, "vocab_size": 32000}),
    "gpt2-small (default)": ("GPT2Config", "GPT2LMHeadModel", {}),
    "gpt2-small (dropout 0, untied)": ("GPT2Config", "GPT2LMHeadModel", {**_NO_DROPOUT, "tie_word_embeddings": False}),
}


def residual_rows(big: bool = False) -> list[dict[str, Any]]:
    """Exact coverage and the residual rotation as built (no folding) on causal LMs, detection time with certification."""
    import transformers

    rows = []
    cases = [(name, spec, False) for name, spec in RESIDUAL_ZOO.items()] + ([(n, s, True) for n, s in BIG_ZOO.items()] if big else [])
    threads = torch.get_num_threads()
    for name, (config_cls, model_cls, config), large in cases:
        torch.manual_seed(0)
        extra = {} if large else {"vocab_size": 1000}
        extra.update({} if config_cls == "GPT2Config" else {"max_position_embeddings": 64})
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**extra, **config})).eval()
        ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
        call: dict[str, Any] = {"input_ids": ids} if config_cls == "GPT2Config" else {"input_ids": ids, "use_cache": False}
        torch.set_num_threads(1 if large else threads)
        start, cpu = time.perf_counter(), time.process_time()
        report = find_symmetries(model, example_kwargs=call)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        torch.set_num_threads(threads)
        stream = [s for s in report.sites if s.action.name == "residual_rotation"]
        why = next((e.reason for e in report.skipped if e.where == "residual stream"), "")
        rows.append(
            {
                "model": name,
                "parameters": report.parameters,
                "residual_site": bool(stream),
                "residual_members": len(stream[0].members) if stream else 0,
                "coverage_exact": report.coverage_exact,
                "seconds": seconds,
                "cpu_seconds": cpu,
                "certify_seconds": report.certify_seconds,
                "threads": 1 if large else threads,
                "left_out": why,
            }
        )
        print(f"{name}: coverage {100 * report.coverage_exact:.1f}%, {seconds:.2f} s ({cpu:.2f} s CPU)", flush=True)
    return rows


def residual_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`residual_rows` as text."""
    lines = [("model", "params", "residual site", "exact coverage", "detect s", "cpu s", "certify s", "threads")]
    for r in rows:
        site = f"yes ({r['residual_members']} members)" if r["residual_site"] else "no"
        lines.append(
            (
                r["model"],
                f"{r['parameters'] / 1e6:.2f}M",
                site,
                f"{100 * r['coverage_exact']:.1f}%",
                f"{r['seconds']:.2f}",
                f"{r['cpu_seconds']:.2f}",
                f"{r['certify_seconds']:.2f}",
                str(r["threads"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    reasons = sorted({r["left_out"] for r in rows if r["left_out"]})
    return "\n".join(out + [f"left out: {why}" for why in reasons])


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "model",
        "params",
        "sites",
        "cont.",
        "discr.",
        "approx.",
        "coverage",
        "exact only",
        "detect s",
        "certify s",
        "dropped",
        "unchecked s",
    )
    lines = [head]
    for r in rows:
        lines.append(
            (
                r["model"],
                f"{r['parameters'] / 1e6:.1f}M",
                str(r["sites"]),
                str(r["continuous"]),
                str(r["discrete"]),
                str(r["approximate"]),
                f"{100 * r['coverage']:.1f}%",
                f"{100 * r['coverage_exact']:.1f}%",
                f"{r['seconds_median']:.2f}",
                f"{r['certify_seconds_median']:.2f}",
                str(r["dropped"]),
                f"{r['unchecked_seconds']:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1))
    ax.barh(names, [100 * r["coverage"] for r in rows], color="#9ecae1", label="all continuous sites")
    ax.barh(names, [100 * r["coverage_exact"] for r in rows], color="#3182bd", label="exact sites only")
    ax.set_xlabel("parameters acted on by a continuous site (%)")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="three small models at 32x32, one run each")
    parser.add_argument("--json", type=str, default=None, help="write the rows as JSON")
    parser.add_argument("--plot-dir", type=str, default=None, help="write coverage.png here (default: next to --json)")
    parser.add_argument("--repeats", type=int, default=3, help="detection runs per model (median reported)")
    parser.add_argument("--models", type=str, default=None, help="comma-separated subset of the zoo (e.g. vit_base_patch16_224,resnet50)")
    parser.add_argument("--residual", action="store_true", help="only the residual stream's rows (tiny causal LMs, as built)")
    parser.add_argument("--residual-big", action="store_true", help="with --residual: add a 12-layer 768-wide Llama and GPT-2 small")
    parser.add_argument("--lm", action="store_true", help="only the tiny language models (lm: rows)")
    args = parser.parse_args()
    if args.residual:
        rows = residual_rows(big=args.residual_big)
        print(f"\n# exact coverage with the residual stream's rotation ({datetime.date.today().isoformat()}; torch {torch.__version__})")
        print(residual_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return

    zoo = QUICK if args.quick else ZOO
    if args.lm:
        zoo = [(n, {}) for n in LM_ZOO]
    if args.models:
        wanted = args.models.split(",")
        zoo = [(n, k) for n, k in zoo if n in wanted]
    size = 32 if args.quick else 224
    repeats = 1 if args.quick else args.repeats
    rows = []
    for name, kwargs in zoo:
        if (name in HF_ZOO or name in LM_ZOO) and importlib.util.find_spec("transformers") is None:
            print(f"{name}: skipped (transformers is not installed: pip install -e '.[hf]')", flush=True)
            continue
        rows.append(measure(name, kwargs, size, repeats))
        print(
            f"{name}: {rows[-1]['sites']} sites, coverage {100 * rows[-1]['coverage']:.1f}%, {rows[-1]['seconds_median']:.2f} s", flush=True
        )
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    date = datetime.date.today().isoformat()
    print()
    print(
        f"# find_symmetries coverage ({date}; {machine}; CPU, float32, timm: batch 1 at {size}x{size}, hf: 16 tokens; median of {repeats})"
    )
    print(table(rows))
    goal_name, goal_s = TIME_GOAL
    for r in rows:
        if r["model"] == goal_name:
            verdict = "meets" if r["seconds_median"] < goal_s else "MISSES"
            print(
                f"\n{goal_name}: detection {r['seconds_median']:.2f} s with certification "
                f"({r['certify_seconds_median']:.2f} s of it), {r['unchecked_seconds']:.2f} s unchecked "
                f"(goal < {goal_s:.0f} s: {verdict} it)"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"date": date, "machine": machine, "image_size": size, "repeats": repeats, "rows": rows}, f, indent=1)
    plot_dir = args.plot_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else None)
    if plot_dir:
        os.makedirs(plot_dir, exist_ok=True)
        plot(rows, os.path.join(plot_dir, "coverage.png"))


if __name__ == "__main__":
    main()
