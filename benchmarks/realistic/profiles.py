"""AlgoPerf's performance profiles over the realistic suite's results: time to a fixed validation target.

The protocol of AlgoPerf (Dahl et al. 2023, "Benchmarking Neural Network Training Algorithms"; Kasimbeg et
al., ICLR 2025): per workload w the **target** is the tuned baseline's median (over seeds) best validation
loss; an arm's **time to target** on a seed is the load-robust wall-clock
(:func:`~benchmarks.realistic.core.modelled_seconds`: teleports counted, evaluation not) to the first
evaluation at or below the target, and +inf when it never gets there; its time on w is the median over seeds
(+inf when more than half of the seeds miss).  With ``t_{a,w}`` that time and
``r_{a,w} = t_{a,w} / min_b t_{b,w}`` its ratio to the fastest arm on w, the **performance profile** of arm a
is the fraction of workloads it solves within a factor tau of the fastest,

    rho_a(tau) = |{w : r_{a,w} <= tau}| / |W|,

and its **score** the area under rho_a on 1 <= tau <= ``tau_max``, normalised to [0, 1] (AlgoPerf's benchmark
score; ``tau_max`` 4 as there).  An arm that misses every target scores 0; one that is fastest everywhere
scores 1.

Only arms run on every workload given are compared (the others are named and left out), so that each
rho_a has the same denominator.

Run (from the repository root)::

    python -m benchmarks.realistic.profiles results/a.json results/b.json [--arms A B] [--rename OLD=NEW] \\
        [--target-arm ARM] [--tau-max 4] [--json out.json] [--plot out.png]

``--target-arm`` sets the target to another arm's median best validation loss (for example BaLoRA's on
``llama_lora``: how soon each arm reaches what that baseline reaches).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.realistic.core import modelled_seconds, step_overhead

__all__ = ["WorkloadTimes", "workload_times", "profile", "score", "main"]

TAU_MAX = 4.0


@dataclass
class WorkloadTimes:
    """One workload: the target, each arm's time to it per seed (``None``: never) and its median over seeds."""

    workload: str
    target: float
    seeds: list[int]
    per_seed: dict[str, list[float | None]] = field(default_factory=dict)
    median: dict[str, float] = field(default_factory=dict)  # math.inf: more than half the seeds missed

    def only(self, arms: Sequence[str]) -> WorkloadTimes:
        """The same workload with just ``arms`` (the fastest arm is then the fastest of them)."""
        return WorkloadTimes(self.workload, self.target, self.seeds, {a: self.per_seed[a] for a in arms}, {a: self.median[a] for a in arms})

    def ratios(self) -> dict[str, float]:
        """Each arm's median time over the fastest arm's on this workload (inf where it, or every arm, missed)."""
        best = min(self.median.values(), default=math.inf)
        return {a: (t / best if math.isfinite(t) and math.isfinite(best) and best > 0 else math.inf) for a, t in self.median.items()}


def _first_at_or_below(curve: dict[str, list[Any]], target: float) -> int | None:
    for i, v in enumerate(curve["val_loss"]):
        if v is not None and v <= target:
            return i
    return None


def workload_times(config: dict[str, Any], target_arm: str = "baseline") -> WorkloadTimes:
    """The times to target of one configuration's runs (``config``: one entry of a suite JSON's ``configs``);
    the target is ``target_arm``'s median best validation loss (AlgoPerf: the tuned baseline's)."""
    runs = config["runs"]
    base = {r["seed"]: r for r in runs if r["arm"] == "baseline"}
    if not base:
        raise ValueError(f"workload {config['config']!r} has no baseline runs: its target is undefined")
    setters = [r for r in runs if r["arm"] == target_arm]
    if not setters:
        raise ValueError(f"workload {config['config']!r} has no runs of the target arm {target_arm!r}")
    target = statistics.median(r["best_val_loss"] for r in setters)
    overhead = step_overhead(runs)
    seeds = sorted(base)
    out = WorkloadTimes(config["config"], target, seeds)
    for arm in dict.fromkeys(r["arm"] for r in runs):
        by_seed = {r["seed"]: r for r in runs if r["arm"] == arm}
        times: list[float | None] = []
        for seed in seeds:
            run = by_seed.get(seed)
            i = None if run is None else _first_at_or_below(run["curve"], target)
            if run is None or i is None:
                times.append(None)
                continue
            step = run["curve"]["step"][i]
            times.append(modelled_seconds(run, step, base[seed]["median_step_seconds"], overhead.get(arm, 1.0)))
        out.per_seed[arm] = times
        out.median[arm] = statistics.median(math.inf if t is None else t for t in times)
    return out


def profile(workloads: Sequence[WorkloadTimes], arm: str, taus: Sequence[float]) -> list[float]:
    """rho_arm(tau) for each tau: the fraction of ``workloads`` the arm solves within tau of the fastest arm."""
    if not workloads:
        raise ValueError("no workloads to profile")
    ratios = [w.ratios()[arm] for w in workloads]
    return [sum(1 for r in ratios if r <= tau) / len(ratios) for tau in taus]


def score(workloads: Sequence[WorkloadTimes], arm: str, tau_max: float = TAU_MAX) -> float:
    """The area under rho_arm on [1, tau_max] over (tau_max - 1): exact, since rho is a step function."""
    if not tau_max > 1:
        raise ValueError(f"tau_max must be > 1, got {tau_max!r}")
    ratios = sorted(min(w.ratios()[arm], tau_max) for w in workloads)
    return sum(tau_max - r for r in ratios) / (len(ratios) * (tau_max - 1))


def _common_arms(workloads: Sequence[WorkloadTimes], wanted: Sequence[str] | None) -> tuple[list[str], list[str]]:
    everywhere = [a for a in workloads[0].median if all(a in w.median for w in workloads)]
    arms = [a for a in wanted if a in everywhere] if wanted else everywhere
    left = sorted({a for w in workloads for a in w.median} - set(arms))
    if wanted and (missing := [a for a in wanted if a not in everywhere]):
        raise ValueError(f"arm(s) {missing} were not run on every workload given")
    return arms, left


def _cell(t: float | None) -> str:
    return "never" if t is None or not math.isfinite(t) else f"{t:.2f}"


def table(workloads: Sequence[WorkloadTimes], arms: Sequence[str], tau_max: float, target_arm: str = "baseline") -> str:
    """Per workload the target and each arm's median time, seeds reached and ratio; then rho and the scores."""
    lines = []
    for w in workloads:
        lines.append(f"== {w.workload}: target {w.target:.4g} (the {target_arm}'s median best validation loss over {len(w.seeds)} seeds)")
        ratios = w.ratios()
        for a in arms:
            reached = sum(1 for t in w.per_seed[a] if t is not None)
            per_seed = " ".join(_cell(t) for t in w.per_seed[a])
            lines.append(
                f"  {a:<28} median s {_cell(w.median[a]):>8}  reached {reached}/{len(w.seeds)}  ratio {_cell(ratios[a]):>6}  per seed: {per_seed}"
            )
    taus = [1.0, 1.15, 1.5, 2.0, tau_max]
    lines.append(
        f"== performance profiles over {len(workloads)} workload(s): rho(tau) at tau = {', '.join(f'{t:g}' for t in taus)}; score on [1, {tau_max:g}]"
    )
    for a in arms:
        rho = profile(workloads, a, taus)
        lines.append(f"  {a:<28} rho {' '.join(f'{v:.2f}' for v in rho)}  score {score(workloads, a, tau_max):.3f}")
    return "\n".join(lines)


def plot(workloads: Sequence[WorkloadTimes], arms: Sequence[str], tau_max: float, path: Path) -> None:
    """rho_a(tau) as step curves on a log tau axis, one per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    taus = [1.0 + i * (tau_max - 1.0) / 400 for i in range(401)]
    for a in arms:
        ax.step(taus, profile(workloads, a, taus), where="post", label=f"{a} ({score(workloads, a, tau_max):.2f})")
    ax.set_xscale("log")
    ticks = [t for t in (1.0, 1.15, 1.5, 2.0, 3.0, 4.0, 8.0) if t <= tau_max]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tau: time to target over the fastest arm's")
    ax.set_ylabel("fraction of workloads")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"performance profiles, {len(workloads)} workload(s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load(paths: Sequence[Path], rename: dict[str, str] | None = None, target_arm: str = "baseline") -> list[WorkloadTimes]:
    """Every configuration of the suite JSONs at ``paths``; a workload named twice is an error.  ``rename``
    maps an arm's name in the files to the name it is compared under (one configuration run as two arms)."""
    workloads: dict[str, WorkloadTimes] = {}
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{path}: no such file (a suite JSON: python -m benchmarks.realistic --json PATH)")
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("configs"), list):
            raise ValueError(f"{path}: not a suite JSON (no 'configs' list)")
        for config in data["configs"]:
            if rename:
                config = {**config, "runs": [{**r, "arm": rename.get(r["arm"], r["arm"])} for r in config["runs"]]}
            if config["config"] in workloads:
                raise ValueError(f"workload {config['config']!r} appears twice (in {path}); merge the runs first (--merge)")
            workloads[config["config"]] = workload_times(config, target_arm)
    if not workloads:
        raise ValueError("the JSON files hold no configurations")
    return list(workloads.values())


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (JSON has no inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.realistic.profiles", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="suite JSON files (python -m benchmarks.realistic --json ...)")
    p.add_argument("--arms", nargs="+", help="arms to compare (default: every arm run on every workload)")
    p.add_argument("--rename", nargs="+", default=[], metavar="OLD=NEW", help="compare arm OLD of the files as NEW")
    p.add_argument("--target-arm", default="baseline", help="whose median best validation loss is the target (default the baseline)")
    p.add_argument("--tau-max", type=float, default=TAU_MAX)
    p.add_argument("--json", type=Path, help="write the times, profiles and scores here")
    p.add_argument("--plot", type=Path, help="write the profiles' plot (PNG) here")
    args = p.parse_args(argv)
    pairs = [r.split("=", 1) for r in args.rename]
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise ValueError(f"--rename takes OLD=NEW pairs, got {args.rename!r}")
    workloads = load(args.results, dict(pairs), args.target_arm)
    arms, left = _common_arms(workloads, args.arms)
    workloads = [w.only(arms) for w in workloads]
    print(table(workloads, arms, args.tau_max, args.target_arm))
    if left:
        print(f"left out (not run on every workload): {', '.join(left)}")
    if args.json:
        taus = [1.0, 1.15, 1.5, 2.0, args.tau_max]
        out = {
            "workloads": [asdict(w) for w in workloads],
            "arms": arms,
            "taus": taus,
            "profiles": {a: profile(workloads, a, taus) for a in arms},
            "scores": {a: score(workloads, a, args.tau_max) for a in arms},
            "tau_max": args.tau_max,
        }
        args.json.write_text(json.dumps(_finite(out), indent=1, allow_nan=False))
    if args.plot:
        plot(workloads, arms, args.tau_max, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
