"""Gideoni 2023, Fig. 1 (and Fig. 4): a linear model learns the data's symmetry, its asymmetric part decaying exponentially.

Problems (inputs completed to whole orbits with ``orbit_closure``, Assumption 1/4):

* ``example_3_1`` (Fig. 1): features ``(1, x)``, target ``|x|``, ``G = {I, diag(1, -1)}``
  (x -> -x), ``x`` on a grid of ``--points`` values in (0, 1] and their mirror images;
* ``swap_equivariant`` (App. E, Fig. 4): inputs ``(x, y)`` uniform in [-1, 1]^2, target
  ``(y^2, x^2)``, ``G`` the swap ``x <-> y`` acting on inputs and outputs.

Five models per problem (``nn.Linear`` without bias, trained together as the rows of
one ``nn.Linear``: the loss ``1/2 sum |y - W x|^2`` is a sum over rows, so each row
is an independent model under ``torch.optim.SGD``) start from: a base point;
two points with the base's asymmetric part and other symmetric parts (Fig. 1b);
two with the base's symmetric part and other asymmetric parts (Fig. 1c).  A small
step ``--lr`` makes GD follow gradient flow at time ``t = step * lr``.

Printed per run: the rate fitted to the asymmetry loss ``E_x |f(x) - E_g f(gx)|``
(log-linear least squares where it lies between ``1e3 * eps`` and ``--fit-upper``
(1e-4) of its start: late, where the slowest mode dominates; in float32 the window
is [1.2e-4, 0.12]), Theorem 3.3's rate (the slowest eigenvalue of ``K_G`` on the asymmetric
subspace, and the rate fitted the same way to the theorem's own curve
``W_asym(0) exp(-K_G t)`` when several modes mix), the exact GD rate
``-log(1 - lr * rate) / lr`` and the relative errors, and the largest distance of
the run's asymmetric part from the theorem's curve ``dev(flow)`` and from its
discrete counterpart ``W_asym(0) (I - lr K_G)^k`` ``dev(GD)`` (relative to
``|W_asym(0)|``: the first is GD's O(lr) discretisation error, the second
round-off), and the asymmetry left at the end.  Then the decoupling check
(Theorem 3.3.2): the largest distance, over time, between the asymmetric parts of
runs that share them (but not their symmetric parts), and vice versa.

Run: ``python benchmarks/invariance.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from teleopt.analysis.invariance import FiniteLinearGroup, asymmetry, linear_regression_flow, orbit_closure, split_weights

PROBLEMS = ("example_3_1", "swap_equivariant")
LABELS = ("base", "other sym 1", "other sym 2", "other asym 1", "other asym 2")


@dataclass
class Problem:
    name: str
    group: FiniteLinearGroup
    rho: Tensor | None
    x: Tensor
    y: Tensor  # (N, out)


def make_problem(name: str, points: int, dtype: torch.dtype, seed: int) -> Problem:
    """The training set of ``name``, orbit-closed."""
    if name == "example_3_1":
        group = FiniteLinearGroup.reflection(2, [1], dtype=dtype)
        xs = (torch.arange(points, dtype=dtype) + 0.5) / points
        x, y = orbit_closure(torch.stack([torch.ones_like(xs), xs], 1), group, xs.abs())
        return Problem(name, group, None, x, y[:, None])
    if name == "swap_equivariant":
        group = FiniteLinearGroup.permutations([[1, 0]], dtype=dtype)
        x0 = torch.rand(points, 2, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2 - 1
        rho = group.elements
        x, y = orbit_closure(x0, group, x0.flip(1).square(), output_representation=rho)
        return Problem(name, group, rho, x, y)
    raise ValueError(f"unknown problem {name!r}; known: {', '.join(PROBLEMS)}")


def initial_weights(problem: Problem, seed: int) -> Tensor:
    """(5, out, in): base, base asym + two other sym parts, base sym + two other asym parts (parts of norms 1, 2, -0.5)."""
    out, d = problem.y.shape[1], problem.x.shape[1]
    g = torch.Generator().manual_seed(seed)
    draws = [
        split_weights(torch.randn(out, d, generator=g, dtype=problem.x.dtype), problem.group, output_representation=problem.rho)
        for _ in range(3)
    ]
    scales = (1.0, 2.0, -0.5)
    sym = [c * s.symmetric / s.symmetric.norm() for c, s in zip(scales, draws)]
    asym = [c * s.asymmetric / s.asymmetric.norm() for c, s in zip(scales, draws)]
    return torch.stack([sym[0] + asym[0], sym[1] + asym[0], sym[2] + asym[0], sym[0] + asym[1], sym[0] + asym[2]])


def train(problem: Problem, initial: Tensor, lr: float, steps: int, records: int) -> tuple[Tensor, Tensor]:
    """SGD on 1/2 sum |y - W x|^2 for every initial W at once; returns times (T,) and weights (T, runs, out, in)."""
    runs, out, d = initial.shape
    model = nn.Linear(d, runs * out, bias=False).to(problem.x.dtype)
    with torch.no_grad():
        model.weight.copy_(initial.reshape(runs * out, d))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    target = problem.y.repeat(1, runs)
    every = max(1, steps // records)
    times, weights = [0.0], [initial.clone()]
    for step in tqdm(range(1, steps + 1), desc=problem.name, leave=False, mininterval=1.0):
        optimizer.zero_grad()
        (0.5 * (target - model(problem.x)).square().sum()).backward()
        optimizer.step()
        if step % every == 0:
            times.append(step * lr)
            weights.append(model.weight.detach().reshape(runs, out, d).clone())
    return torch.tensor(times, dtype=problem.x.dtype), torch.stack(weights)


def asymmetry_curve(problem: Problem, weights: Tensor) -> Tensor:
    """Asymmetry loss of the linear model x -> W x for each W in (T, out, in)."""
    return torch.stack([asymmetry(lambda v, w=w: v @ w.T, problem.x, problem.group, output_representation=problem.rho) for w in weights])


def gd_asymmetric_part(asym0: Tensor, kernel: Tensor, lr: float, times: Tensor) -> Tensor:
    """Theorem 3.3.3 for GD instead of flow: W_asym(k) = W_asym(0) (I - lr K)^k at k = t / lr."""
    lam, vec = torch.linalg.eigh(kernel)
    k = (times / lr).round()[:, None]
    factors = (1 - lr * lam).pow(k)  # (T, in)
    return ((asym0 @ vec).unsqueeze(0) * factors[:, None, :]) @ vec.T


def fit_rate(times: Tensor, values: Tensor, lower: float, upper: float) -> float:
    """Decay rate: minus the least-squares slope of log(values) where values / values[0] is in [lower, upper]."""
    ratio = values / values[0]
    keep = (ratio >= lower) & (ratio <= upper)
    if int(keep.sum()) < 3:
        return math.nan
    t, logv = times[keep], values[keep].log()
    t_c = t - t.mean()
    return float(-(t_c * (logv - logv.mean())).sum() / t_c.square().sum())


def coordinate(path: Tensor, direction: Tensor) -> Tensor:
    """<W(t), u> with u = direction / |direction|, for each t."""
    return path.flatten(1) @ (direction.flatten() / direction.norm())


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def run_problem(name: str, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    problem = make_problem(name, args.points, dtype, args.seed)
    flow = linear_regression_flow(problem.x, problem.y, problem.group, output_representation=problem.rho)
    initial = initial_weights(problem, args.seed)
    steps = round(args.time / args.lr)
    times, weights = train(problem, initial, args.lr, steps, args.records)
    lower = 1e3 * torch.finfo(dtype).eps  # stay above the round-off floor of the asymmetric part
    upper = max(args.fit_upper, 1e3 * lower)  # float32: the window moves up to [1.2e-4, 0.12]
    slowest = flow.decay_rate
    gd_rate = -math.log1p(-args.lr * slowest) / args.lr

    def parts(w: Tensor) -> tuple[Tensor, Tensor]:
        split = split_weights(w, problem.group, output_representation=problem.rho)
        return split.symmetric, split.asymmetric

    runs = []
    sym_paths, asym_paths, measured, predicted_curves = [], [], [], []
    for r, label in enumerate(LABELS):
        sym, asym = zip(*(parts(w) for w in weights[:, r]))
        sym, asym = torch.stack(sym), torch.stack(asym)
        predicted_asym = flow.asymmetric_part(initial[r], times)
        discrete_asym = gd_asymmetric_part(asym[0], flow.kernel, args.lr, times)
        curve = asymmetry_curve(problem, weights[:, r])
        predicted_curve = asymmetry_curve(problem, predicted_asym)
        fitted = fit_rate(times, curve, lower, upper)
        theorem_fit = fit_rate(times, predicted_curve, lower, upper)
        runs.append(
            {
                "run": label,
                "fitted_rate": fitted,
                "theorem_rate": slowest,
                "theorem_curve_rate": theorem_fit,
                "gd_rate": gd_rate,
                "rel_err_vs_theorem": relative(fitted, slowest),
                "rel_err_vs_theorem_curve": relative(fitted, theorem_fit),
                "rel_err_vs_gd": relative(fitted, gd_rate),
                "max_deviation_from_theorem": float((asym - predicted_asym).flatten(1).norm(dim=1).max() / asym[0].norm()),
                "max_deviation_from_gd": float((asym - discrete_asym).flatten(1).norm(dim=1).max() / asym[0].norm()),
                "final_asymmetry_ratio": float(curve[-1] / curve[0]),
            }
        )
        sym_paths.append(sym)
        asym_paths.append(asym)
        measured.append(curve)
        predicted_curves.append(predicted_curve)

    def max_gap(paths: list[Tensor], members: tuple[int, ...]) -> float:
        return max(float((paths[k] - paths[members[0]]).flatten(1).norm(dim=1).max()) for k in members[1:])

    same_asym, same_sym = (0, 1, 2), (0, 3, 4)
    decoupling = {
        "same_asym_max_asym_gap": max_gap(asym_paths, same_asym),  # Theorem 3.3.2: ~round-off
        "same_asym_initial_sym_gap": max(float((sym_paths[k][0] - sym_paths[0][0]).norm()) for k in same_asym[1:]),
        "same_sym_max_sym_gap": max_gap(sym_paths, same_sym),
        "same_sym_initial_asym_gap": max(float((asym_paths[k][0] - asym_paths[0][0]).norm()) for k in same_sym[1:]),
    }
    stride = max(1, len(times) // 400)
    return {
        "problem": name,
        "samples": problem.x.shape[0],
        "group_order": problem.group.order,
        "lr": args.lr,
        "steps": steps,
        "asymmetric_rates": flow.asymmetric_rates.tolist(),
        "symmetric_rates": flow.symmetric_rates.tolist(),
        "decay_rate": slowest,
        "gd_rate": gd_rate,
        "runs": runs,
        "decoupling": decoupling,
        "curves": {
            "t": times[::stride].tolist(),
            "asymmetry": [c[::stride].tolist() for c in measured],
            "theorem_asymmetry": [c[::stride].tolist() for c in predicted_curves],
            # signed coordinates along the base run's initial symmetric / asymmetric directions (Fig. 1b-c)
            "sym_coordinate": [coordinate(p[::stride], sym_paths[0][0]).tolist() for p in sym_paths],
            "asym_coordinate": [coordinate(p[::stride], asym_paths[0][0]).tolist() for p in asym_paths],
        },
    }


def print_result(result: dict[str, Any]) -> None:
    rates = ", ".join(f"{r:.4f}" for r in result["asymmetric_rates"])
    print(
        f"\n{result['problem']}: {result['samples']} samples, |G| = {result['group_order']}, lr {result['lr']:g}, {result['steps']} steps; "
        f"asymmetric rates of K_G: {rates} (slowest {result['decay_rate']:.4f}, exact GD {result['gd_rate']:.4f})"
    )
    header = (
        f"{'run':<14}{'fitted':>10}{'theorem':>10}{'rel.err':>10}{'thm curve':>11}{'rel.err':>10}{'GD exact':>10}{'rel.err':>10}"
        f"{'dev(flow)':>11}{'dev(GD)':>10}{'A(T)/A(0)':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in result["runs"]:
        print(
            f"{r['run']:<14}{r['fitted_rate']:>10.4f}{r['theorem_rate']:>10.4f}{r['rel_err_vs_theorem']:>10.2e}"
            f"{r['theorem_curve_rate']:>11.4f}{r['rel_err_vs_theorem_curve']:>10.2e}{r['gd_rate']:>10.4f}{r['rel_err_vs_gd']:>10.2e}"
            f"{r['max_deviation_from_theorem']:>11.2e}{r['max_deviation_from_gd']:>10.2e}{r['final_asymmetry_ratio']:>11.2e}"
        )
    d = result["decoupling"]
    print(
        f"decoupling (Theorem 3.3.2): same asym part, sym parts {d['same_asym_initial_sym_gap']:.2f} apart -> asym parts differ by "
        f"{d['same_asym_max_asym_gap']:.1e} at most; same sym part, asym parts {d['same_sym_initial_asym_gap']:.2f} apart -> "
        f"sym parts differ by {d['same_sym_max_sym_gap']:.1e} at most"
    )


def plot(results: list[dict[str, Any]], plot_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    for result in results:
        c = result["curves"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for r, label in enumerate(LABELS):
            line = axes[0].semilogy(c["t"], c["asymmetry"][r], label=label)[0]
            axes[0].semilogy(c["t"], c["theorem_asymmetry"][r], "--", color=line.get_color(), lw=0.8)
        axes[0].set(xlabel="t = step * lr", ylabel="asymmetry loss  E|f(x) - E_g f(gx)|", title="(a) asymmetry (dashed: Theorem 3.3)")
        axes[0].legend(fontsize=7)
        for ax, members, title in ((axes[1], (0, 1, 2), "(b) same asymmetric init"), (axes[2], (0, 3, 4), "(c) same symmetric init")):
            for r in members:
                line = ax.plot(c["t"], c["asym_coordinate"][r], label=f"{LABELS[r]}: asymmetric")[0]
                ax.plot(c["t"], c["sym_coordinate"][r], "--", color=line.get_color(), label=f"{LABELS[r]}: symmetric")
            ax.set(xlabel="t = step * lr", ylabel="coordinate along the base's initial part", title=title)
            ax.legend(fontsize=7)
        fig.suptitle(f"Gideoni 2023, Theorem 3.3 on {result['problem']} (decay rate {result['decay_rate']:.3f})")
        fig.tight_layout()
        fig.savefig(os.path.join(plot_dir, f"invariance_{result['problem']}.png"), dpi=120)
        plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="lr 1e-3, time 1.5 and 100 records instead of 1e-4, 2.2 and 400")
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=PROBLEMS)
    parser.add_argument("--lr", type=float, default=None, help="GD step (default 1e-4, quick 1e-3)")
    parser.add_argument(
        "--time", type=float, default=None, help="gradient-flow time to train for, steps = time / lr (default 2.2, quick 1.5)"
    )
    parser.add_argument("--points", type=int, default=25, help="orbit representatives per problem")
    parser.add_argument("--records", type=int, default=None, help="snapshots along the run (default 400, quick 100)")
    parser.add_argument("--fit-upper", type=float, default=1e-4, help="fit where A(t)/A(0) <= this (late: the slowest mode dominates)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the problems are tiny: 2 OpenMP threads ran 6-10x slower on a loaded 2-core machine)",
    )
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--plot-dir", type=str, default=None)
    args = parser.parse_args(argv)
    args.lr = args.lr or (1e-3 if args.quick else 1e-4)
    args.time = args.time or (1.5 if args.quick else 2.2)
    args.records = args.records or (100 if args.quick else 400)
    dtype = getattr(torch, args.dtype)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = [run_problem(name, args, dtype) for name in args.problems]
    finally:
        torch.set_num_threads(threads)
    for result in results:
        print_result(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"config": {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "threads")}, "results": results},
                f,
                indent=1,
            )
    plot_dir = args.plot_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else None)
    if plot_dir:
        plot(results, plot_dir)
    return results


if __name__ == "__main__":
    main()
