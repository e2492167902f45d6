"""Command line of the realistic suite: tune, run interleaved arms over seeds, print the table and verdicts, write JSON and plots."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/realistic/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.realistic.arms import ARMS  # noqa: E402
from benchmarks.realistic.configs import CONFIGS, Config  # noqa: E402
from benchmarks.realistic.core import add_targets, overall_verdict, summarise, train_run, verdicts  # noqa: E402

TUNED_CACHE = Path(__file__).resolve().parent / "tuned_lr.json"
TUNE_SEED = 1000  # a seed no measured run uses


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
        f"python {sys.version.split()[0]}, torch {torch.__version__}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realistic", description="teleopt's realistic benchmark suite")
    p.add_argument("--quick", action="store_true", help="CI smoke run: minimum steps, small evaluation sets, 1 seed")
    p.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        metavar="CONFIG",
        help=f"configurations to run (default all: {' '.join(CONFIGS)})",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=list(ARMS),
        metavar="ARM",
        help=f"arms to run (default all: {' '.join(ARMS)}); baseline is always added",
    )
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default 5; --quick 1; 0: tune only)")
    p.add_argument(
        "--only-seeds",
        nargs="+",
        type=int,
        default=None,
        metavar="SEED",
        help="run just these of the seeds (parallel processes, one seed each, combined with --merge)",
    )
    p.add_argument("--skip-baseline", action="store_true", help="run only the named arms (parallel processes; --merge adds the baseline's)")
    p.add_argument("--lr-grid", nargs="+", type=float, default=None, help="score just these lrs when tuning (parallel tuning)")
    p.add_argument("--wd-grid", nargs="+", type=float, default=None, help="score just these weight decays when tuning")
    p.add_argument("--steps", type=int, default=None, help="override every configuration's training steps")
    p.add_argument("--retune", action="store_true", help="re-run the lr grid even when the cache has the configuration")
    p.add_argument(
        "--tuned",
        type=Path,
        default=None,
        help=f"tuned-lr cache (default {TUNED_CACHE.name} next to the suite; --quick tunes in memory unless given)",
    )
    p.add_argument("--json", type=Path, default=None, help="write all results (curves, summaries, verdicts) here")
    p.add_argument("--plot-dir", type=Path, default=None, help="write one PNG per configuration here (default: next to --json)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: shared machines)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--large",
        action="store_true",
        help="larger models (GPU): MLP width 1024, full-width resnet18, ViT depth 12 dim 192, transformer d=96 depth 4",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: combine the configurations of earlier --json results (e.g. run in parallel) into one "
        "table, verdict, --json and plots",
    )
    return p


def _signature(cfg: Config, steps: int, args: argparse.Namespace, arm: str = "baseline") -> str:
    own = "" if arm == "baseline" else f"|arm={arm}"
    return f"{cfg.name}|steps={steps}|large={args.large}|quick={args.quick}|device={args.device}{own}"


def _lr(value: float) -> float:
    return float(f"{value:.6g}")


def _point(lr: float, wd: float | None) -> str:
    return f"{lr:g}" if wd is None else f"{lr:g}|wd={wd:g}"


def tune(
    cfg: Config, problem, steps: int, args: argparse.Namespace, cache: dict[str, Any], log, arm: str = "baseline"
) -> tuple[float, float]:
    """(lr, weight decay) with the lowest best validation loss of ``arm`` on the tuning seed.

    Without a weight-decay grid the decay is the configuration's ``base_wd`` and only the lr is
    tuned; with one (AlgoPerf's protocol: Kasimbeg et al., ICLR 2025) every lr x decay pair is
    scored.  The lr grid is extended (up to twice, by the grid's own ratio) while the best point is
    at its edge.  Scores are cached per configuration and arm; only points not yet scored are run
    (``--retune``: all).
    """
    key = _signature(cfg, steps, args, arm)
    entry = None if args.retune else cache.get(key)
    wds: list[float | None] = list(args.wd_grid or (cfg.quick_wd_grid if args.quick else cfg.wd_grid) or [None])
    scores: dict[str, float] = dict(entry["grid"]) if entry else {}
    grid = sorted(_lr(g) for g in (args.lr_grid or (cfg.quick_lr_grid if args.quick else cfg.lr_grid)))

    def score(lr: float, wd: float | None) -> None:
        point = _point(lr, wd)
        if point in scores:
            return
        recipe = cfg if wd is None else dataclasses.replace(cfg, base_wd=wd)
        r = train_run(recipe, problem, arm, ARMS[arm], lr, TUNE_SEED, steps, args.device)
        scores[point] = math.inf if r["diverged"] else r["best_val_loss"]
        log(f"  tune {cfg.name} {arm} {point}: best val loss {scores[point]:.4f} ({r['train_seconds']:.1f} s)")

    def best_of(lrs: list[float]) -> tuple[float, float | None]:
        pairs = [(lr, wd) for lr in lrs for wd in wds if _point(lr, wd) in scores]
        return min(pairs, key=lambda p: scores[_point(*p)])

    for lr in grid:
        for wd in wds:
            score(lr, wd)
    ratio = grid[1] / grid[0] if len(grid) > 1 and args.lr_grid is None else None  # an explicit grid is not extended
    lrs = list(grid)
    for _ in range(2):
        best, _wd = best_of(lrs)
        if ratio is None or len(lrs) < 3 or best not in (lrs[0], lrs[-1]):
            break
        new = _lr(best / ratio if best == lrs[0] else best * ratio)
        lrs = sorted({*lrs, new})
        for wd in wds:
            score(new, wd)
    best, wd = best_of(lrs)
    if len(lrs) >= 3 and best in (lrs[0], lrs[-1]):
        log(f"  note: {cfg.name}'s tuned lr {best:g} is still at the edge of {lrs}")
    cache.setdefault("_tuned_here", []).append(key)
    cache[key] = {
        "lr": best,
        "weight_decay": cfg.base_wd if wd is None else wd,
        "grid": dict(sorted(scores.items())),
        "seed": TUNE_SEED,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
    }
    return best, cfg.base_wd if wd is None else wd


def arms_for(cfg: Config, arms: list[str]) -> list[str]:
    """The arms that mean something on ``cfg``: BaLoRA needs LoRA pairs, Cautious Weight Decay is the LMs' comparison."""
    only = {"balora": cfg.name == "llama_lora", "cautious_wd": cfg.language_model}
    return [a for a in arms if only.get(a, True)]


def run_config(cfg: Config, args: argparse.Namespace, arms: list[str], seeds: int, cache: dict[str, Any], log) -> dict[str, Any]:
    start = time.perf_counter()
    problem = cfg.build(args.quick, args.large).to(args.device)
    steps = args.steps or (cfg.quick_steps if args.quick else cfg.steps)
    arms = arms_for(cfg, arms)
    lr, wd = tune(cfg, problem, steps, args, cache, log)
    recipe = dataclasses.replace(cfg, base_wd=wd)
    own = {arm: tune(cfg, problem, steps, args, cache, log, arm) for arm in cfg.tuned_arms if arm in arms}
    runs = []
    for seed in range(seeds):
        if args.only_seeds is not None and seed not in args.only_seeds:
            continue
        order = arms[seed % len(arms) :] + arms[: seed % len(arms)]  # rotated per seed: machine noise favours no arm
        for arm in order:
            arm_lr, arm_wd = own.get(arm, (lr, wd))
            r = train_run(dataclasses.replace(recipe, base_wd=arm_wd), problem, arm, ARMS[arm], arm_lr, seed, steps, args.device)
            runs.append(r)
            log(
                f"  {cfg.name} seed {seed} {arm:18s} train {r['final_train_loss']:.4f} best val {r['best_val_loss']:.4f} "
                f"test acc {r['test_acc']:.3f} {r['train_seconds']:.1f} s"
                + (
                    f" teleports {r['teleports_accepted']}/{r['teleports_declined']}/{r['teleports_rolled_back']}"
                    if r["sites"] is not None
                    else ""
                )
            )
    add_targets(runs)
    summary = summarise(runs)
    summary = {a: summary[a] for a in arms if a in summary}
    return {
        "config": cfg.name,
        "description": cfg.description,
        "model": problem.info.get("model"),
        "sizes": {
            "train": len(problem.x_train),
            "val": len(problem.x_val),
            "test": len(problem.x_test),
            "steps": steps,
            "batch": cfg.batch,
            "eval_every": cfg.eval_every,
            "warmup": cfg.warmup,
            "cosine": cfg.cosine,
        },
        "optimizer": cfg.optimizer,
        "lr": lr,
        "lr_grid": sorted({float(k.split("|")[0]) for k in cache[_signature(cfg, steps, args)]["grid"]}),
        "base_weight_decay": wd,
        "wd_grid": list(cfg.quick_wd_grid if args.quick else cfg.wd_grid),
        "tuned_arms": {arm: {"lr": v[0], "weight_decay": v[1]} for arm, v in own.items()},
        "compared_decay": cfg.decay,
        "collapse": cfg.collapse,
        "language_model": cfg.language_model,
        "val_ratio": cfg.val_ratio,
        "seeds": seeds,
        "arms": arms,
        "summary": summary,
        "verdict": verdicts(summary, cfg.collapse, cfg.val_ratio),
        "seconds": time.perf_counter() - start,
        "runs": runs,
    }


# ----------------------------------------------------------------------------- printing
def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _cell(stats: dict[str, Any], spec: str) -> str:
    if stats["median"] is None:
        return f"- ({stats.get('reached', 0)}/{stats['n']})" if stats.get("reached") is not None and stats["n"] else "-"
    top = "never" if stats["max"] is None else _fmt(stats["max"], spec)
    return f"{_fmt(stats['median'], spec)} [{_fmt(stats['min'], spec)}-{top}]"


COLUMNS = [
    ("final_train_loss", "final train", ".3g"),
    ("best_val_loss", "best val", ".3g"),
    ("test_loss", "test loss", ".3g"),
    ("test_acc", "test acc", ".3f"),
    ("steps_to_T1", "steps T1", ".0f"),
    ("time_to_T1", "s T1", ".1f"),
    ("steps_to_T2", "steps T2", ".0f"),
    ("time_to_T2", "s T2", ".1f"),
    ("steps_to_Vbest", "steps Vbest", ".0f"),
    ("speedup_Vbest", "x to Vbest", ".2f"),
    ("measured_speedup_Vbest", "x meas.", ".2f"),
    ("median_step_seconds", "ms/step", ".2f"),
    ("step_overhead", "step x", ".2f"),
    ("teleport_cost_iters", "tp cost it", ".0f"),
    ("dead_units", "dead", ".0f"),
    ("feature_rank", "rank", ".0f"),
]


def table(result: dict[str, Any]) -> str:
    lines = []
    for c in result["configs"]:
        lines.append(
            f"\n== {c['config']}: {c['description']}; lr {c['lr']:g} (tuned on {c['lr_grid']}), {c['sizes']['steps']} steps, "
            f"{c['seeds']} seed(s), decay compared at {c['compared_decay']:g}; {c['seconds']:.0f} s"
        )
        if not c["summary"]:
            lines.append("(tuning only: --seeds 0)")
            continue
        header = ["arm", *[t for _, t, _ in COLUMNS], "div", "tp acc/dec/rb"]
        rows = []
        for arm, s in c["summary"].items():
            tp = f"{s['teleports_accepted']['median']:.0f}/{s['teleports_declined']['median']:.0f}/{s['teleports_rolled_back']['median']:.0f}"
            cells = [_cell(s[k], spec) if k != "median_step_seconds" else _cell(_scaled(s[k], 1e3), spec) for k, _, spec in COLUMNS]
            rows.append([arm, *cells, str(s["divergences"]), tp])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        lines.append("  ".join("-" * w for w in widths))
        for r in rows:
            lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
        lines.append("verdict: " + _verdict_line(c["verdict"]))
    o = result["verdict"]
    lines.append(
        f"\n== verdict over {len(result['configs'])} configuration(s)"
        + ("" if o["complete"] else " (incomplete: the done-when needs every configuration)")
        + ":"
    )
    lines.append(f"  default Teleport never worse than the tuned baseline: {o['default_never_worse']} ({o['default_never_worse_configs']})")
    lines.append(
        f"  a teleopt arm wins (>= 1.3x wall-clock to baseline best val, or beyond seed spread): {o['wins_configs']} "
        f"-> {'PASS' if o['wins_pass'] else 'FAIL'} (needs {o['wins_needed']})"
    )
    lines.append(f"  Syre defaults beat plain decay on collapse configurations: {o['syre_collapse']} ({o['syre_collapse_configs']})")
    lines.append(
        "cells: median [min-max] over seeds; T2 = the baseline's final train loss, T1 = its train loss at its best val loss, "
        "Vbest = its best val loss (same seed); s = load-robust wall-clock (the baseline's median "
        "iteration time, same seed, x (steps x the arm's step overhead + teleport seconds / the run's median iteration time); "
        "evaluation excluded); '- (k/n)': only k of n seeds reached it, "
        "'never' in a spread: some seed did not; "
        "x to Vbest = per-seed baseline s / arm s to Vbest (0 = never; the verdict uses it); x meas. = the same from the "
        "raw measured seconds (noisy on a shared machine); ms/step: median iteration time; step x: the arm's step overhead (median over seeds of its "
        "iteration time over the baseline's); tp cost it = teleport seconds / median iteration seconds; tp acc/dec/rb = teleports accepted/declined/"
        "rolled back (medians); dead / rank: units of the last hidden representation on train inputs."
    )
    return "\n".join(lines)


def _scaled(stats: dict[str, Any], factor: float) -> dict[str, Any]:
    return {k: (v * factor if isinstance(v, float) and k != "n" else v) for k, v in stats.items()}


def _verdict_line(v: dict[str, Any]) -> str:
    parts = []
    d = v.get("default_never_worse")
    if d:
        parts.append(
            f"default never worse {'PASS' if d['pass'] else 'FAIL'} (acc {d['test_acc_delta']:+.3f}, "
            f"val x{d['best_val_ratio']:.2f}, div {d['divergences']})"
        )
    w = v.get("wins")
    if w:
        parts.append("wins " + ("PASS: " + "; ".join(f"{a} ({', '.join(r)})" for a, r in w["arms"].items()) if w["pass"] else "none"))
    s = v.get("syre_collapse")
    if isinstance(s, dict):
        parts.append(
            f"syre vs decay {'PASS' if s['pass'] else 'FAIL'} (dead {s['dead_units'][0]:.0f} vs {s['dead_units'][1]:.0f}, "
            f"rank {s['feature_rank'][0]:.0f} vs {s['feature_rank'][1]:.0f}, acc {s['test_acc'][0]:.3f} vs {s['test_acc'][1]:.3f})"
        )
    return "; ".join(parts) or "n/a"


def plot(result: dict[str, Any], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in result["configs"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        colours = {a: plt.cm.tab10(i % 10) for i, a in enumerate(c["arms"])}
        for r in c["runs"]:
            label = r["arm"] if r["seed"] == 0 else None
            axes[0].plot(r["curve"]["seconds"], r["curve"]["val_loss"], color=colours[r["arm"]], alpha=0.7, lw=1, label=label)
            axes[1].plot(r["curve"]["step"], r["curve"]["train_loss"], color=colours[r["arm"]], alpha=0.7, lw=1, label=label)
        axes[0].set_xlabel("wall-clock training seconds (teleports included)")
        axes[0].set_ylabel("validation loss")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("train loss")
        for ax in axes:
            ax.set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"{c['config']}: {c['description']} (lr {c['lr']:g}, {c['seeds']} seeds; {result['machine']})", fontsize=8)
        fig.tight_layout()
        path = directory / f"realistic_{c['config']}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _finish(result: dict[str, Any], args: argparse.Namespace, log) -> None:
    print(f"teleopt realistic suite: {result['machine']}, {result['date']}")
    print(table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=float))
    directory = args.plot_dir or (args.json.parent if args.json is not None else None)
    if directory is not None and not args.no_plot:
        for p in plot(result, directory):
            log(f"wrote {p}")


def merge(args: argparse.Namespace) -> int:
    """Combine earlier results, configurations in the suite's order.

    The runs of a configuration found in several files (seeds run in parallel processes) are
    pooled; for a repeated (arm, seed) the last file wins.
    """
    parts = [json.loads(p.read_text()) for p in args.merge]
    by_name: dict[str, dict[str, Any]] = {}
    for part in parts:
        for c in part["configs"]:
            if c["config"] not in by_name:
                by_name[c["config"]] = c
                continue
            pooled = {(r["arm"], r["seed"]): r for r in by_name[c["config"]]["runs"] + c["runs"]}
            by_name[c["config"]] = {**c, "runs": list(pooled.values()), "seeds": len({seed for _, seed in pooled})}
            by_name[c["config"]]["arms"] = list(dict.fromkeys(arm for arm, _ in pooled))
    configs = [by_name[name] for name in CONFIGS if name in by_name]
    for c in configs:  # summaries and verdicts recomputed from the runs with this version's code
        add_targets(c["runs"])
        c["summary"] = {a: v for a, v in summarise(c["runs"]).items()}
        c["verdict"] = verdicts(c["summary"], c["collapse"], c.get("val_ratio", 1.05))
    result = {
        "benchmark": "realistic",
        "date": max(p["date"] for p in parts),
        "machine": parts[-1]["machine"],
        "settings": {"merged": [str(p) for p in args.merge], "parts": [p["settings"] for p in parts]},
        "configs": configs,
        "verdict": overall_verdict({c["config"]: c["verdict"] for c in configs}, [c["config"] for c in configs if c.get("language_model")]),
        "seconds": sum(p["seconds"] for p in parts),
    }
    _finish(result, args, lambda s: print(s, file=sys.stderr))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; known: {list(ARMS)}")
    arms = list(dict.fromkeys(["baseline", *args.arms]))
    if args.skip_baseline and len(arms) > 1:
        arms.remove("baseline")
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 5)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    if args.merge:
        return merge(args)
    torch.set_num_threads(args.threads)
    cache_path = args.tuned or (None if args.quick else TUNED_CACHE)
    cache = json.loads(cache_path.read_text()) if cache_path is not None and cache_path.is_file() else {}
    log = (lambda s: None) if args.no_progress else (lambda s: print(s, file=sys.stderr, flush=True))
    start = time.perf_counter()
    configs = []
    for name in args.configs:
        configs.append(run_config(CONFIGS[name], args, arms, seeds, cache, log))
        if cache_path is not None:  # re-read first: parallel runs of other configurations share the file
            on_disk = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
            mine = {k: cache[k] for k in cache.get("_tuned_here", [])}  # only what this process tuned
            cache_path.write_text(json.dumps({**on_disk, **mine}, indent=1, sort_keys=True) + "\n")
    result = {
        "benchmark": "realistic",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "configs": configs,
        "verdict": overall_verdict({c["config"]: c["verdict"] for c in configs}, [c["config"] for c in configs if c.get("language_model")]),
        "seconds": time.perf_counter() - start,
    }
    _finish(result, args, log)
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
