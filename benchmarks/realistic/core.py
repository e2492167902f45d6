"""One training run, the per-seed targets, the summaries over seeds and the verdicts."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.realistic.arms import ArmContext
from benchmarks.realistic.configs import Config, Problem
from teleopt.teleport import Teleport
from teleopt.wrapper import OptimizerWrapper

__all__ = ["train_run", "add_targets", "summarise", "verdicts", "overall_verdict", "TELEPORT_BATCH"]

TELEPORT_BATCH = 256
DIVERGENCE_BLOWUP = 10.0  # diverged: ends this many times above its best train loss ...
DIVERGENCE_START = 0.5  # ... and above this fraction of its initial train loss (or non-finite)
EVAL_CHUNK = 512


def _find_teleport(opt: Any) -> Teleport | None:
    while True:
        if isinstance(opt, Teleport):
            return opt
        if not isinstance(opt, OptimizerWrapper):
            return None
        opt = opt.base


@torch.no_grad()
def _evaluate(model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable) -> tuple[float, float]:
    """Mean loss and accuracy over (x, y) in eval mode.

    Targets may have more than one entry per row (a language model's next tokens, logits as
    ``(batch, classes, time)``): the accuracy is then over every entry.
    """
    total, correct = 0.0, 0
    for i in range(0, len(x), EVAL_CHUNK):
        out = model(x[i : i + EVAL_CHUNK])
        total += float(loss_fn(out, y[i : i + EVAL_CHUNK])) * len(out)
        correct += int((out.argmax(1) == y[i : i + EVAL_CHUNK]).sum())
    return total / len(x), correct / max(1, y.numel())


@torch.no_grad()
def dead_and_rank(features: Tensor) -> tuple[int, int]:
    """Dead units (std below 1e-6 of the largest, the criterion of ``teleopt.demo.feature_rank``) and feature rank."""
    from teleopt.demo import feature_rank

    z = features.detach().to(torch.float64)
    std = z.std(0)
    dead = int((std <= 1e-6 * std.max()).sum()) if float(std.max()) > 0 else z.shape[1]
    return dead, feature_rank(features)


def train_run(
    cfg: Config, problem: Problem, arm: str, build: Callable[[ArmContext], Any], lr: float, seed: int, steps: int, device: str = "cpu"
) -> dict[str, Any]:
    """Train one arm for one seed; returns its curves (evaluation excluded from the seconds) and final figures."""
    model = problem.make_model(seed).to(device)
    n = len(problem.x_train)
    batch_gen = torch.Generator().manual_seed(10_000 + seed)
    teleport_gen = torch.Generator().manual_seed(20_000 + seed)
    order: list[Tensor] = []

    def next_batch() -> tuple[Tensor, Tensor]:
        if not order or len(order[0]) < cfg.batch:  # epochs of a fresh permutation, same for every arm
            order[:] = [torch.randperm(n, generator=batch_gen)]
        rows, order[0] = order[0][: cfg.batch], order[0][cfg.batch :]
        rows = rows.to(device)
        return problem.x_train[rows], problem.y_train[rows]

    def teleport_batch() -> tuple[Tensor, Tensor]:
        rows = torch.randint(n, (min(TELEPORT_BATCH, n),), generator=teleport_gen).to(device)
        return problem.x_train[rows], problem.y_train[rows]

    ctx = ArmContext(
        model,
        cfg.optimizer,
        lr,
        cfg.base_wd,
        cfg.decay,
        min(cfg.teleport_at, steps // 2),
        problem.x_train[:32],
        problem.loss_fn,
        teleport_batch,
    )
    start = time.perf_counter()
    opt = build(ctx)
    setup_s = time.perf_counter() - start  # detection for sites="auto" runs here when example_inputs are given
    lrs = [g["lr"] for g in opt.param_groups]
    curve: dict[str, list] = {k: [] for k in ("step", "seconds", "train_loss", "val_loss", "val_acc")}
    best_state: dict[str, Tensor] = {}

    def evaluate(step: int, elapsed: float) -> None:
        model.eval()
        rows = problem.info.get("train_eval_rows", len(problem.x_train))  # the LMs' train loss on a fixed subset
        tr, _ = _evaluate(model, problem.x_train[:rows], problem.y_train[:rows], problem.loss_fn)
        va, va_acc = _evaluate(model, problem.x_val, problem.y_val, problem.loss_fn)
        model.train()
        if math.isfinite(va) and (not curve["val_loss"] or va < min(curve["val_loss"])):
            # the early-stopping checkpoint: its test figures are measured once at the end
            best_state.clear()
            best_state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        for k, v in zip(curve, (step, elapsed, tr, va, va_acc)):
            curve[k].append(v)

    step_times: list[float] = []
    elapsed, diverged = setup_s, False
    model.train()
    evaluate(0, elapsed)
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = next_batch()
        factor = cfg.lr_factor(step, steps)
        for group, base_lr in zip(opt.param_groups, lrs):
            group["lr"] = base_lr * factor
        opt.zero_grad()
        loss = problem.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step_times.append(dt)
        elapsed += dt
        if not math.isfinite(float(loss.detach())):
            diverged = True
            break
        if (step + 1) % cfg.eval_every == 0 or step + 1 == steps:
            evaluate(step + 1, elapsed)
            if not all(math.isfinite(curve[k][-1]) for k in ("train_loss", "val_loss")):
                diverged = True
                break
    final_train = curve["train_loss"][-1]
    finite = [v for v in curve["train_loss"] if math.isfinite(v)]
    if not math.isfinite(final_train) or final_train > max(DIVERGENCE_BLOWUP * min(finite), DIVERGENCE_START * curve["train_loss"][0]):
        diverged = True  # non-finite, or it trained and then blew up back towards (or past) its start
    best = min(range(len(curve["val_loss"])), key=lambda i: curve["val_loss"][i] if math.isfinite(curve["val_loss"][i]) else math.inf)
    model.eval()
    with torch.no_grad():
        dead, rank = dead_and_rank(problem.features(model, problem.x_train[:1024]))
        units = int(problem.features(model, problem.x_train[:2]).shape[1])
    test_loss, test_acc = _evaluate(model, problem.x_test, problem.y_test, problem.loss_fn)
    if best_state:
        model.load_state_dict(best_state)
    best_test_loss, best_test_acc = _evaluate(model, problem.x_test, problem.y_test, problem.loss_fn)
    tp = _find_teleport(opt)
    reports = [] if tp is None else list(tp.reports)
    median_step = statistics.median(step_times) if step_times else math.nan
    teleport_s = sum(r.time_s for r in reports)
    result = {
        "arm": arm,
        "seed": seed,
        "lr": lr,
        "steps": steps,
        "diverged": diverged,
        "setup_seconds": setup_s,
        "train_seconds": elapsed,
        "median_step_seconds": median_step,
        "final_train_loss": final_train,
        "best_val_loss": curve["val_loss"][best],
        "best_val_step": curve["step"][best],
        "test_loss": test_loss,
        "test_acc": test_acc,
        "test_loss_at_best_val": best_test_loss,
        "test_acc_at_best_val": best_test_acc,
        "train_loss_at_best_val": curve["train_loss"][best],
        "dead_units": dead,
        "feature_rank": rank,
        "feature_units": units,
        "teleports_accepted": sum(1 for r in reports if r.accepted and r.path != "watch"),
        "teleports_declined": sum(1 for r in reports if r.reason.startswith("declined")),
        # post-condition rollbacks and the watch's later rollbacks of accepted teleports (path "watch")
        "teleports_rolled_back": sum(1 for r in reports if r.reason.startswith("rolled back")),
        "teleports_kept": sum(1 for r in reports if r.accepted and r.path != "watch") - sum(1 for r in reports if r.path == "watch"),
        "teleport_seconds": teleport_s,
        "teleport_cost_iters": teleport_s / median_step if reports and median_step > 0 else 0.0,
        "teleport_reasons": sorted({r.reason for r in reports}),
        "teleport_events": [[r.step, r.time_s] for r in reports],
        "perturbation": getattr(opt, "perturbation", None),  # the round-off control's (step, changed, max relative)
        "sites": None if tp is None or tp._sites is None else len(tp._sites),
        "curve": curve,
    }
    return result


def _first(curve: dict[str, list], key: str, target: float) -> int | None:
    for i, v in enumerate(curve[key]):
        if v <= target:
            return i
    return None


def step_overhead(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """arm -> the median over seeds of its median iteration time over the baseline's (same seed).

    The wrapper's own per-step cost (Syre's anchor decay, Teleport's schedule check) as a ratio.  A ratio of
    runs that ran minutes apart still carries machine load, but its median over interleaved seeds does not
    follow one slow run.
    """
    base = {r["seed"]: r["median_step_seconds"] for r in runs if r["arm"] == "baseline"}
    ratios: dict[str, list[float]] = {}
    for r in runs:
        ref = base.get(r["seed"])
        if ref and r["median_step_seconds"] > 0:
            ratios.setdefault(r["arm"], []).append(r["median_step_seconds"] / ref)
    return {arm: statistics.median(v) for arm, v in ratios.items()}


def modelled_seconds(run: dict[str, Any], step: int, reference_step: float, overhead: float) -> float:
    """Load-robust wall-clock to ``step``, in the baseline's iteration time of the same seed.

    ``reference_step * (step * overhead + teleports)``: ``overhead`` is :func:`step_overhead` of the run's arm
    and ``teleports`` the teleports before ``step`` in iterations of the run itself (their seconds over the
    run's median iteration time).  On a shared machine the measured seconds of identical computations differ by
    +-50%, and so did median iteration times of whole runs (20.5 against 9.8 ms for the same LoRA steps):
    timing each arm by its own iteration time gave a 1.55x "speed-up" at equal steps.  Here both sides of a
    speed-up share one iteration time, so only steps, the per-step overhead and the teleports' cost count.
    The one-off set-up (site detection, 0.01-0.2 s) is left out and reported as ``setup_seconds``.
    """
    own = run["median_step_seconds"]
    teleports = sum(t for s, t in run.get("teleport_events", []) if s < step) / own if own > 0 else 0.0
    return reference_step * (step * overhead + teleports)


def add_targets(runs: Sequence[dict[str, Any]]) -> None:
    """Per seed, steps and seconds to the baseline's T1, T2 and best validation loss (Vbest), and speed-ups.

    ``seconds_to_*`` is measured wall-clock; ``time_to_*`` is :func:`modelled_seconds`; ``speedup_*`` (used by
    the verdict) is the baseline's ``time_to_*`` over the arm's, per seed (0 when the arm never reaches it).
    """
    base = {r["seed"]: r for r in runs if r["arm"] == "baseline"}
    overhead = step_overhead(runs)
    for r in runs:
        ref = base.get(r["seed"])
        if ref is None:
            continue
        r["step_overhead"] = overhead.get(r["arm"], 1.0)
        targets = {
            "T1": ("train_loss", ref["train_loss_at_best_val"]),
            "T2": ("train_loss", ref["final_train_loss"]),
            "Vbest": ("val_loss", ref["best_val_loss"]),
        }
        for name, (key, value) in targets.items():
            i = _first(r["curve"], key, value)
            r[f"steps_to_{name}"] = None if i is None else r["curve"]["step"][i]
            r[f"seconds_to_{name}"] = None if i is None else r["curve"]["seconds"][i]
            step = None if i is None else r["curve"]["step"][i]
            r[f"time_to_{name}"] = None if step is None else modelled_seconds(r, step, ref["median_step_seconds"], r["step_overhead"])
    for r in runs:
        ref = base.get(r["seed"])
        if ref is None:
            continue
        for name in ("T1", "T2", "Vbest"):
            mine, theirs = r.get(f"time_to_{name}"), ref.get(f"time_to_{name}")
            r[f"speedup_{name}"] = (theirs / mine if mine else math.inf) if mine is not None and theirs is not None else 0.0
            mine, theirs = r.get(f"seconds_to_{name}"), ref.get(f"seconds_to_{name}")
            r[f"measured_speedup_{name}"] = (theirs / mine if mine else math.inf) if mine is not None and theirs is not None else 0.0


SUMMARY_KEYS = (
    "final_train_loss",
    "best_val_loss",
    "test_loss",
    "test_acc",
    "test_acc_at_best_val",
    "steps_to_T1",
    "seconds_to_T1",
    "steps_to_T2",
    "seconds_to_T2",
    "steps_to_Vbest",
    "seconds_to_Vbest",
    "time_to_T1",
    "time_to_T2",
    "time_to_Vbest",
    "measured_speedup_Vbest",
    "speedup_T1",
    "speedup_T2",
    "speedup_Vbest",
    "train_seconds",
    "median_step_seconds",
    "step_overhead",
    "setup_seconds",
    "teleports_accepted",
    "teleports_declined",
    "teleports_rolled_back",
    "teleports_kept",
    "teleport_seconds",
    "teleport_cost_iters",
    "dead_units",
    "feature_rank",
)


def _stats(values: list[Any]) -> dict[str, Any]:
    """Median, min, max and IQR over seeds; a run that never reached a target counts as +inf (reported as None)."""
    vals = [math.inf if v is None else float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    vals.sort()

    def clean(v: float) -> float | None:
        return None if not math.isfinite(v) else v

    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 and all(map(math.isfinite, vals)) else [math.nan, 0, math.nan]
    return {
        "median": clean(statistics.median(vals)),
        "min": clean(vals[0]),
        "max": clean(vals[-1]),
        "q1": clean(q[0]),
        "q3": clean(q[2]),
        "n": len(vals),
        "reached": sum(1 for v in values if v is not None),
    }


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """arm -> metric -> stats over seeds (plus the divergence count)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        out[arm] = {k: _stats([r.get(k) for r in mine]) for k in SUMMARY_KEYS}
        out[arm]["divergences"] = sum(r["diverged"] for r in mine)
        out[arm]["seeds"] = len(mine)
    return out


ACC_TOLERANCE = 0.005  # 0.5 points
VAL_RATIO = 1.05
SPEEDUP = 1.3


def verdicts(summary: dict[str, dict[str, Any]], collapse: bool, val_ratio: float = VAL_RATIO) -> dict[str, Any]:
    """The issue's done-when, per configuration (None where an arm it needs was not run).

    * ``default_never_worse``: teleport_default's median test accuracy >= baseline's - 0.5 points, median best
      validation loss <= ``val_ratio`` x baseline's (1.05; the language models 1.01), no divergence in any seed;
    * ``wins``: teleopt arms (Teleport or Syre) with a median per-seed wall-clock speed-up >= 1.3 to the baseline's
      best validation loss, or a best validation loss / test accuracy better than the baseline beyond the seed
      spread (every seed of the arm better than every seed of the baseline; needs >= 2 seeds);
    * ``syre_collapse`` (collapse configurations): syre_default against plain weight decay at the same strength:
      fewer dead units and higher feature rank (medians) at equal or better test accuracy (median, 0.5-point tolerance).
    """
    out: dict[str, Any] = {}
    base = summary.get("baseline")
    med = lambda arm, key: summary[arm][key]["median"]  # noqa: E731
    if base is not None and "teleport_default" in summary:
        acc_delta = med("teleport_default", "test_acc") - med("baseline", "test_acc")
        ratio = med("teleport_default", "best_val_loss") / med("baseline", "best_val_loss")
        div = summary["teleport_default"]["divergences"]
        out["default_never_worse"] = {
            "pass": acc_delta >= -ACC_TOLERANCE and ratio <= val_ratio and div == 0,
            "test_acc_delta": acc_delta,
            "best_val_ratio": ratio,
            "divergences": div,
        }
    else:
        out["default_never_worse"] = None
    if base is not None:
        wins = {}
        for arm, s in summary.items():
            if arm in ("baseline", "baseline_roundoff", "weight_decay", "cautious_wd", "balora"):  # not teleopt arms
                continue
            reasons = []
            speed = s["speedup_Vbest"]["median"]
            if speed is not None and speed >= SPEEDUP:
                reasons.append(f"{speed:.2f}x sooner to baseline best val")
            spread = s["seeds"] >= 2 and base["seeds"] >= 2  # one seed has no spread to go beyond
            if spread and s["divergences"] == 0 and s["best_val_loss"]["max"] < base["best_val_loss"]["min"]:
                reasons.append("best val loss beyond spread")
            if spread and s["divergences"] == 0 and s["test_acc"]["min"] > base["test_acc"]["max"]:
                reasons.append("test acc beyond spread")
            if reasons:
                wins[arm] = reasons
        out["wins"] = {"pass": bool(wins), "arms": wins}
    else:
        out["wins"] = None
    if collapse and "syre_default" in summary and "weight_decay" in summary:
        s, w = summary["syre_default"], summary["weight_decay"]
        fewer_dead = s["dead_units"]["median"] < w["dead_units"]["median"]
        higher_rank = s["feature_rank"]["median"] > w["feature_rank"]["median"]
        acc_ok = s["test_acc"]["median"] >= w["test_acc"]["median"] - ACC_TOLERANCE
        out["syre_collapse"] = {
            "pass": fewer_dead and higher_rank and acc_ok,
            "fewer_dead_units": fewer_dead,
            "higher_feature_rank": higher_rank,
            "test_acc_ok": acc_ok,
            "dead_units": [s["dead_units"]["median"], w["dead_units"]["median"]],
            "feature_rank": [s["feature_rank"]["median"], w["feature_rank"]["median"]],
            "test_acc": [s["test_acc"]["median"], w["test_acc"]["median"]],
        }
    else:
        out["syre_collapse"] = None if collapse else "not a collapse configuration"
    return out


def overall_verdict(per_config: dict[str, dict[str, Any]], language_models: Sequence[str] = ()) -> dict[str, Any]:
    """Across configurations: default never worse everywhere; wins on >= 3 of the 5 vision/LoRA configurations and on
    >= 2 language-model configurations; Syre on every collapse configuration."""
    never = [v["default_never_worse"]["pass"] for v in per_config.values() if v.get("default_never_worse")]
    wins = [c for c, v in per_config.items() if v.get("wins") and v["wins"]["pass"]]
    lm_wins = [c for c in wins if c in language_models]
    syre = [v["syre_collapse"]["pass"] for v in per_config.values() if isinstance(v.get("syre_collapse"), dict)]
    from benchmarks.realistic.configs import CONFIGS

    return {
        "default_never_worse": (all(never) if never else None),
        "default_never_worse_configs": f"{sum(never)}/{len(never)}",
        "wins_configs": wins,
        "wins_pass": len([c for c in wins if c not in language_models]) >= 3 and len(lm_wins) >= min(2, len(language_models)),
        "wins_needed": "3 of the 5 vision/LoRA configurations and 2 language-model configurations",
        "syre_collapse": (all(syre) if syre else None),
        "syre_collapse_configs": f"{sum(syre)}/{len(syre)}",
        "complete": set(per_config) == set(CONFIGS),
    }
