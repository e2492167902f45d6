"""Learned group actions: the experiments of Zhao et al. 2024b, Sec. 5.3-5.4 and Zhao 2026, Sec. 6.5.4-6.5.5.

Trains ``teleopt.discover`` on each problem and prints, per case, the figure the
issue's done-when asks for:

* ``linear``: two-layer linear network, m = h = n = k = 1 (Zhao et al. 2024b, Sec. 5.3,
  Fig. 2): |cos(h, diag(1, -1))| (goal >= 0.99) and training time (goal < 60 s);
* ``relu`` / ``leaky_relu``: two-layer homogeneous network, width 3 (Zhao et al. 2024b
  Sec. 5.3, App. C): largest projection residual of the learned generators onto the
  span of the rescaling generators (goal <= 0.05) and principal angles;
* ``sigmoid``: two-layer sigmoid network, W1 3x3, W2 3x1, one data point (Sec. 5.4,
  Fig. 3), ``tanh``: three-layer tanh network 2x2, 2x2, 2x1 (Fig. 4) and
  ``transformer``: the tiny transformer of Zhao 2026, Sec. 6.5.5 (8 generators):
  loss variation along learned curves vs random curves of the same arc length
  over 100 sampled (theta, X) (Zhao 2026, Fig. 6.6; goal: ratio >= 10) and the
  sensitivity of the learned action to the data (nonzero derivative w.r.t. X);
* ``sigmoid_bare``: the sigmoid network with the papers' bare action network (no
  linear term g theta), reported against straight random curves.

Every case also reports the ratio against straight random segments, saves the
generator heatmaps (top h_i, bottom exp(h_i)) and the curve plot as PNG, and
writes everything to JSON (``--json``; plots next to it or in ``--plot-dir``).
``--quick`` trains for a fraction of the steps (a smoke run; its figures do not
meet the goals).  Runs on the CPU; times are wall-clock seconds of this run.

    python benchmarks/discovery.py --json benchmarks/results/discovery.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

import teleopt
from teleopt.discovery import LossWeights, problems
from teleopt.discovery.diagnostics import abs_cosine, compare_curves, data_sensitivity, principal_angles, span_residual

# (problem factory, discover() arguments, quick-run steps).  Settings beyond the
# papers' (see the README section "Learned group actions"): the homogeneous cases
# use the scale-free ("cosine") invariance term, the data-dependent ones the
# gradient-normalised one ("gradient"), both a smaller generator learning rate and a
# faster decay (Adam's jitter on the generators otherwise sets the invariance
# floor).  The data-dependent ones drop teleopt's linearity term (weight 0: the
# papers' objective) and train the 128-wide network of Zhao 2026 at lr 3e-3: with
# the Zhao et al. 2024b, Sec. 5.4 weights (gamma_1 = 1, gamma_2 = gamma_4 = 10) the
# invariance term was too weak to shape anything (curve ratio about 2 on the
# sigmoid network).  ``sigmoid_bare`` is the papers' bare action network (no linear
# term): strongly data-dependent, invariant for every generator alike.
# The homogeneous cases keep the best of 3 restarts by training objective: on the
# LeakyReLU network seeds 0 and 3 (of 0-3) left one generator outside the rescaling
# span (residual 1.0, invariance term 15x larger), more steps (3000) did not help.
HOMOGENEOUS = {"steps": 1500, "num_generators": 3, "generator_lr": 3e-3, "lr_decay_every": 500, "invariance": "cosine", "restarts": 3}
DATA_DEPENDENT = {
    "steps": 2000,
    "num_generators": 3,
    "weights": LossWeights(linearity=0.0),
    "invariance": "gradient",
    "hidden": (128, 128, 128),
    "lr": 3e-3,
    "generator_lr": 3e-3,
    "lr_decay": 0.5,
    "lr_decay_every": 400,
}
CASES: dict[str, tuple[Any, dict[str, Any], int]] = {
    "linear": (lambda: problems.two_layer(), {"steps": 300}, 100),
    "relu": (lambda: problems.two_layer(m=1, hidden=3, n=2, k=4, activation="relu"), HOMOGENEOUS, 150),
    "leaky_relu": (lambda: problems.two_layer(m=1, hidden=3, n=2, k=4, activation="leaky_relu"), HOMOGENEOUS, 150),
    "sigmoid": (lambda: problems.two_layer(m=1, hidden=3, n=3, k=1, activation="sigmoid"), DATA_DEPENDENT, 150),
    "sigmoid_bare": (
        lambda: problems.two_layer(m=1, hidden=3, n=3, k=1, activation="sigmoid"),
        DATA_DEPENDENT | {"linear_base": False, "invariance": "cosine"},
        150,
    ),
    # tanh: 2000 steps left the ratio at 9.6 (seed 0); twice the steps, same decay per step, reach 11.6
    "tanh": (lambda: problems.three_layer(), DATA_DEPENDENT | {"steps": 4000, "lr_decay_every": 800}, 150),
    "transformer": (
        lambda: problems.tiny_transformer(),
        DATA_DEPENDENT | {"steps": 1500, "num_generators": 8, "hidden": (128, 128, 128), "lr_decay_every": 250},
        100,
    ),
}
RATIO_CASES = ("sigmoid", "tanh", "transformer")
SPAN_CASES = ("relu", "leaky_relu")


def _labels(problem: problems.DiscoveryProblem) -> list[str]:
    labels = []
    for name, shape in zip(problem.member_names, problem.param_shapes):
        for index in torch.cartesian_prod(*[torch.arange(d) for d in shape]).reshape(-1, len(shape)).tolist():
            labels.append(f"{name}[{','.join(map(str, index))}]")
    return labels


def run_case(name: str, quick: bool, seed: int, plot_dir: Path | None, progress: bool) -> dict[str, Any]:
    factory, kwargs, quick_steps = CASES[name]
    problem = factory()
    kwargs = dict(kwargs)
    if quick:
        kwargs["steps"] = quick_steps
    start = time.perf_counter()
    action = teleopt.discover(problem, seed=seed, progress=progress, name=f"learned_{name}", **kwargs)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {
        "case": name,
        "problem": problem.loss_fn.spec,
        "num_params": action.spec.num_params,
        "generators": action.num_generators,
        "steps": kwargs["steps"],
        "train_seconds": seconds,
        "restarts": action.config.get("restarts"),
        "final_terms": {k: float(v) for k, v in zip(action.history["terms"], action.history["values"][-50:].mean(dim=0))},
    }
    comparison = compare_curves(action, problem.sampler, num_samples=100, generator=torch.Generator().manual_seed(seed + 100))
    out["curves"] = comparison.summary()
    sensitivity = data_sensitivity(action, problem.sampler, num_samples=100, generator=torch.Generator().manual_seed(seed + 200))
    out["data_sensitivity_median"] = float(sensitivity["relative"].median())
    out["data_sensitivity_min"] = float(sensitivity["relative"].min())
    if name == "linear":
        cosine = abs_cosine(action.generators[0], torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64)))
        out["figure"], out["goal"], out["met"] = cosine, ">= 0.99 and < 60 s", bool(cosine >= 0.99 and seconds < 60)
        out["abs_cosine"] = cosine
    elif name in SPAN_CASES:
        config = problem.loss_fn.spec["config"]
        reference = problems.rescaling_generators(config["m"], config["hidden"], config["n"])
        residual = span_residual(action.generators, reference)
        out["span_residuals"] = residual.tolist()
        out["principal_angles_deg"] = torch.rad2deg(principal_angles(action.generators, reference)).tolist()
        out["figure"], out["goal"], out["met"] = float(residual.max()), "<= 0.05", bool(residual.max() <= 0.05)
    elif name == "sigmoid_bare":
        ratio = comparison.straight_ratio
        out["figure"], out["goal"] = ratio, "straight ratio >= 10, sensitivity > 0"
        out["met"] = bool(ratio >= 10 and out["data_sensitivity_min"] > 0)
    else:
        ratio = comparison.invariance_ratio
        out["figure"], out["goal"] = ratio, ">= 10 and data sensitivity > 0"
        out["met"] = bool(ratio >= 10 and out["data_sensitivity_min"] > 0)
    if plot_dir is not None:
        from teleopt.discovery.plots import plot_curves, plot_generators

        labels = _labels(problem)
        fig = plot_generators(action, plot_dir / f"discovery_{name}_generators.png", labels=labels, title=f"{name}: learned generators")
        fig2 = plot_curves(
            comparison,
            plot_dir / f"discovery_{name}_curves.png",
            title=f"{name}: loss along curves (ratio {comparison.invariance_ratio:.3g})",
        )
        import matplotlib.pyplot as plt

        plt.close(fig)
        plt.close(fig2)
        action.save(plot_dir / f"discovery_{name}.pt")
        out["files"] = [f"discovery_{name}_generators.png", f"discovery_{name}_curves.png", f"discovery_{name}.pt"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced smoke run (goals are not expected to be met)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where to save PNGs and learned actions (default: next to --json)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="which problems to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: the networks are tiny)")
    parser.add_argument("--progress", action="store_true", help="show tqdm progress bars")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plot_dir = args.plot_dir or (args.json.parent if args.json is not None else None)
    if plot_dir is not None:
        plot_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "quick": args.quick,
        "seed": args.seed,
        "cases": {},
    }
    header = f"{'case':<12} {'p':>3} {'n':>2} {'steps':>5} {'train s':>8} {'figure':>10} {'goal':<32} {'met':<5} {'ratio':>9} {'straight':>9} {'data sens.':>10}"
    print(header)
    print("-" * len(header))
    for name in args.cases:
        r = run_case(name, args.quick, args.seed, plot_dir, args.progress)
        results["cases"][name] = r
        c = r["curves"]
        print(
            f"{name:<12} {r['num_params']:>3} {r['generators']:>2} {r['steps']:>5} {r['train_seconds']:>8.1f} {r['figure']:>10.4g} "
            f"{r['goal']:<32} {str(r['met']):<5} {c['invariance_ratio']:>9.3g} {c['straight_ratio']:>9.3g} {r['data_sensitivity_median']:>10.3g}",
            flush=True,
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
