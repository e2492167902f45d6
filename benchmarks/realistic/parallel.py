"""Run configurations of the realistic suite as parallel processes: tuning points first, then one process per seed.

For a machine with many cores and one GPU, where one small model leaves most of both idle::

    python -m benchmarks.realistic.parallel --configs llama_lm llama_lora --device cuda --out results/lm

Phase 0 pre-trains the base model of each seed of a fine-tuning configuration once.  Phase 1 scores every (lr, weight decay) point of every baseline (and of every arm tuned as a
baseline of its own) in its own process, each writing its own cache; the caches are combined
into ``OUT/tuned.json``.  Phase 2 runs each seed of each configuration in its own process (all
arms of a seed in one process, in the suite's rotated order, so that the arms of a seed share
the machine's load); the parts are merged into ``OUT/results.json`` with the table on stdout.
Other arguments (``--arms``, ``--seeds``, ``--steps``, ``--quick``) are passed through.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.realistic.configs import CONFIGS  # noqa: E402


def _launch(jobs: list[list[str]], logs: list[Path], limit: int) -> list[int]:
    """Run the commands, at most ``limit`` at a time; return their exit codes."""
    running: list[tuple[subprocess.Popen, int]] = []
    codes = [0] * len(jobs)
    queue = list(range(len(jobs)))
    while queue or running:
        while queue and len(running) < limit:
            i = queue.pop(0)
            with logs[i].open("w") as log:
                running.append((subprocess.Popen(jobs[i], stdout=log, stderr=subprocess.STDOUT), i))
        for proc, i in list(running):
            if proc.poll() is not None:
                codes[i] = proc.returncode
                running.remove((proc, i))
        time.sleep(0.5)
    return codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realistic.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", required=True, choices=list(CONFIGS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="processes at a time")
    p.add_argument("--arms", nargs="+", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warm", nargs=2, metavar=("CONFIG", "SEED"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--split-arms", action="store_true", help="one process per (configuration, seed, arm) instead of per seed")
    if argv is None and "--warm" in sys.argv:  # phase 0's worker: build one seed's model (pre-training it into the cache)
        name, seed = sys.argv[sys.argv.index("--warm") + 1 :][:2]
        CONFIGS[name].build("--quick" in sys.argv, False).make_model(int(seed))
        return 0
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env_cache = args.out / "pretrained"
    os.environ.setdefault("TELEOPT_BENCH_CACHE", str(env_cache))
    base = [sys.executable, "-m", "benchmarks.realistic", "--device", args.device, "--no-plot", "--no-progress"]
    base += ["--quick"] if args.quick else []
    base += ["--steps", str(args.steps)] if args.steps else []
    arms = ["--arms", *args.arms] if args.arms else []
    # phase 0: pre-train each seed's base model once (configurations that fine-tune one), in parallel
    from benchmarks.realistic.run import TUNE_SEED

    warm = [n for n in args.configs if CONFIGS[n].name == "llama_lora"]
    jobs = [
        [sys.executable, "-m", "benchmarks.realistic.parallel", "--warm", n, str(seed), "--configs", n, "--out", str(args.out)]
        + (["--quick"] if args.quick else [])
        for n in warm
        for seed in [TUNE_SEED, *range(args.seeds)]
    ]
    if jobs:
        start = time.perf_counter()
        codes = _launch(jobs, [args.out / f"warm_{i}.log" for i in range(len(jobs))], args.jobs)
        print(f"phase 0: {len(jobs)} pre-training processes, {sum(c != 0 for c in codes)} failed, {time.perf_counter() - start:.0f} s")
    # phase 1: one process per tuning point (the grids are explicit, so nothing is extended)
    jobs, logs, caches = [], [], []
    for name in args.configs:
        cfg = CONFIGS[name]
        lrs = cfg.quick_lr_grid if args.quick else cfg.lr_grid
        wds = (cfg.quick_wd_grid if args.quick else cfg.wd_grid) or (cfg.base_wd,)
        tuned = [a for a in cfg.tuned_arms if args.arms is None or a in args.arms]
        for lr in lrs:
            for wd in wds:
                cache = args.out / f"tune_{name}_{lr:g}_{wd:g}.json"
                caches.append(cache)
                grid = ["--lr-grid", f"{lr:g}"] + (["--wd-grid", f"{wd:g}"] if cfg.wd_grid else [])
                jobs.append([*base, "--configs", name, "--seeds", "0", "--tuned", str(cache), *grid, "--arms", "baseline", *tuned])
                logs.append(args.out / f"tune_{name}_{lr:g}_{wd:g}.log")
    start = time.perf_counter()
    codes = _launch(jobs, logs, args.jobs)
    print(f"phase 1: {len(jobs)} tuning processes, {sum(c != 0 for c in codes)} failed, {time.perf_counter() - start:.0f} s", flush=True)
    combined: dict = {}
    for cache in caches:
        if not cache.is_file():
            continue
        for key, entry in json.loads(cache.read_text()).items():
            if key.startswith("_"):
                continue
            grid = {**combined.get(key, {}).get("grid", {}), **entry["grid"]}
            combined[key] = {**entry, "grid": grid}
    tuned_path = args.out / "tuned.json"
    tuned_path.write_text(json.dumps(combined, indent=1, sort_keys=True) + "\n")
    # phase 2: one process per (configuration, seed), reading the combined cache with the same explicit grids
    jobs, logs, parts = [], [], []
    for name in args.configs:
        cfg = CONFIGS[name]
        lrs = cfg.quick_lr_grid if args.quick else cfg.lr_grid
        wds = (cfg.quick_wd_grid if args.quick else cfg.wd_grid) or ()
        grid = ["--lr-grid", *(f"{v:g}" for v in lrs)] + (["--wd-grid", *(f"{v:g}" for v in wds)] if wds else [])
        groups = [[a] for a in dict.fromkeys(["baseline", *(args.arms or [])])] if args.split_arms and args.arms else [None]
        for seed in range(args.seeds):
            for group in groups:
                tag = f"{name}_seed{seed}" + ("" if group is None else f"_{group[0]}")
                part = args.out / f"{tag}.json"
                parts.append(part)
                jobs.append([*base, "--configs", name, "--seeds", str(args.seeds), "--only-seeds", str(seed), "--tuned", str(tuned_path)])
                jobs[-1] += [*grid, *(arms if group is None else ["--arms", *group, "--skip-baseline"]), "--json", str(part)]
                logs.append(args.out / f"{tag}.log")
    start = time.perf_counter()
    codes = _launch(jobs, logs, args.jobs)
    print(f"phase 2: {len(jobs)} seed processes, {sum(c != 0 for c in codes)} failed, {time.perf_counter() - start:.0f} s", flush=True)
    done = [str(p) for p in parts if p.is_file()]
    if not done:
        return 1
    merged = subprocess.run(
        [sys.executable, "-m", "benchmarks.realistic", "--merge", *done, "--json", str(args.out / "results.json")],
        capture_output=True,
        text=True,
    )
    print(merged.stdout)
    return merged.returncode or int(any(codes))


if __name__ == "__main__":
    raise SystemExit(main())
