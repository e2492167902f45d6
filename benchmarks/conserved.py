"""Conserved quantities: their distribution under Xavier initialisation and their drift under gradient descent.

Three reproductions from Zhao 2026 (Sec. 2.6, Fig. 2.2-2.3, App. A.4), all through
``teleopt.analysis``:

1. **eq. 2.16** (Fig. 2.2): two-layer linear nets U V with the paper's Xavier
   initialisation (eq. 2.15: U_ij ~ N(0, 1/h), V_ij ~ N(0, 1/n)); Q = Tr[U^T U - V V^T]
   is minus the trace of the ``gl_linear`` site's Q.  E[Q] = m - h; the table
   prints the sample mean over N draws, its standard error and the z-score
   (mean - (m - h)) / SE, and the same for torch's ``xavier_normal_``
   (variance 2 / (fan_in + fan_out)), whose E[Q] = 2mh/(m+h) - 2hn/(h+n).
   (eq. 2.14 writes Q with a factor 1/2, which eq. 2.16's m - h does not have.)
2. **Fig. 2.3**: m = h = n = 100 nets U sigma(V) with identity, ReLU, tanh and
   sigmoid, Q of eq. 2.17 (``whitened_conserved_quantity``); E[Q] from
   ``expected_whitened_quantity`` (Gauss-Hermite), histogram summaries.
3. **App. A.4**: gradient descent on L = 1/2 ||Y - U sigma(V)||^2 (eq. A.30 with
   whitened input X = I; U 5x50, V 50x10) at several learning rates over the same
   flow time T, with ``ConservationMonitor`` on the model (the ``gl_linear`` /
   ``positive_rescaling`` site for identity / ReLU, eq. 2.17 for tanh / sigmoid).
   The mean per-step drift |Q_{t+1} - Q_t| / scale over [0, T] scales as lr^2
   (Prop. A.4.1): the log-log slope is printed; the accumulated drift at T scales
   as lr (T / lr steps of lr^2 each).

Run: ``python benchmarks/conserved.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import math
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402

import teleopt  # noqa: E402,F401
from teleopt.analysis.conserved import (  # noqa: E402
    conserved_quantities,
    expected_whitened_quantity,
    whitened_conserved_quantity,
)
from teleopt.analysis.monitor import ConservationMonitor  # noqa: E402
from teleopt.registry import get_action  # noqa: E402
from teleopt.site import Site  # noqa: E402

LINEAR_SITE = Site(get_action("gl_linear"), ("V", None, "U"), name="gl")


def summary(values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values, torch.tensor([0.05, 0.5, 0.95], dtype=values.dtype))
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "se": float(values.std() / math.sqrt(len(values))),
        "q05": float(q[0]),
        "median": float(q[1]),
        "q95": float(q[2]),
    }


def linear_q(m: int, h: int, n: int, samples: int, init: str, generator: torch.Generator) -> tuple[torch.Tensor, float]:
    """Q = Tr[U^T U - V V^T] for ``samples`` draws, and E[Q] = sum of variance x count."""
    if init == "paper":
        var_u, var_v = 1.0 / h, 1.0 / n
    else:  # torch.nn.init.xavier_normal_: variance 2 / (fan_in + fan_out)
        var_u, var_v = 2.0 / (h + m), 2.0 / (n + h)
    values = []
    for _ in range(samples):
        if init == "paper":
            U = torch.randn(m, h, generator=generator, dtype=torch.float64) * math.sqrt(var_u)
            V = torch.randn(h, n, generator=generator, dtype=torch.float64) * math.sqrt(var_v)
        else:  # torch's own initialiser (weights are (fan_out, fan_in)), so the convention is tested, not our formula
            U = nn.init.xavier_normal_(torch.empty(m, h, dtype=torch.float64), generator=generator)
            V = nn.init.xavier_normal_(torch.empty(h, n, dtype=torch.float64), generator=generator)
        values.append(-conserved_quantities({"V": V, "U": U}, LINEAR_SITE)["gl"].trace())
    return torch.stack(values), var_u * m * h - var_v * h * n


def xavier_linear(tuples: list[tuple[int, int, int]], samples: int) -> list[dict]:
    rows = []
    for init in ("paper", "torch"):
        for i, (m, h, n) in enumerate(tuples):
            values, expected = linear_q(m, h, n, samples, init, torch.Generator().manual_seed(1000 * i + len(init)))
            s = summary(values)
            rows.append(
                {
                    "init": init,
                    "m": m,
                    "h": h,
                    "n": n,
                    "m_minus_h": m - h,
                    "expected": expected,
                    **s,
                    "z": (s["mean"] - expected) / s["se"],
                    "values": values.tolist(),
                }
            )
    return rows


def xavier_nonlinear(size: int, samples: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(7)
    for name in ("identity", "relu", "tanh", "sigmoid"):
        values = torch.stack(
            [
                whitened_conserved_quantity(
                    torch.randn(size, size, generator=g, dtype=torch.float64) / math.sqrt(size),
                    torch.randn(size, size, generator=g, dtype=torch.float64) / math.sqrt(size),
                    name,
                )
                for _ in range(samples)
            ]
        )
        expected = expected_whitened_quantity(size, size, size, name)
        s = summary(values)
        rows.append(
            {
                "activation": name,
                "m": size,
                "h": size,
                "n": size,
                "expected": expected,
                **s,
                "z": (s["mean"] - expected) / s["se"],
                "values": values.tolist(),
            }
        )
    return rows


ACTIVATIONS = {"identity": nn.Identity, "relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


def drift_run(name: str, lr: float, horizon: float, seed: int = 0) -> dict[str, float]:
    """GD on 1/2 ||Y - U sigma(V)||^2 (eq. A.30, X = I) for horizon / lr steps; the monitor's drifts."""
    g = torch.Generator().manual_seed(seed)
    m, h, n = 5, 50, 10
    model = nn.Sequential(nn.Linear(n, h, bias=False), ACTIVATIONS[name](), nn.Linear(h, m, bias=False)).double()
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(h, n, generator=g, dtype=torch.float64) / math.sqrt(n))
        model[2].weight.copy_(torch.randn(m, h, generator=g, dtype=torch.float64) / math.sqrt(h))
    x = torch.eye(n, dtype=torch.float64)  # whitened input: sample j is e_j, so the pre-activations are V itself
    y = torch.randn(n, m, generator=g, dtype=torch.float64)
    members = ("0.weight", None, "2.weight")
    if name == "identity":
        sites, extra = [Site(get_action("gl_linear"), members, name="Q")], {}
    elif name == "relu":
        sites, extra = [Site(get_action("positive_rescaling", activation="relu"), members, name="Q")], {}
    else:
        sites, extra = [], {"Q": lambda mod: whitened_conserved_quantity(mod[2].weight, mod[0].weight, name, parts=True)}
    monitor = ConservationMonitor(model, sites, quantities=extra)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor.attach(opt)
    steps = round(horizon / lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.5 * ((model(x) - y) ** 2).sum()
        loss.backward()
        opt.step()
    per_step = [r.step_drift["Q"] for r in monitor.history]
    return {
        "activation": name,
        "lr": lr,
        "steps": steps,
        "mean_step_drift": statistics.fmean(per_step),
        "total_drift": monitor.history[-1].drift["Q"],
        "final_loss": float(loss.detach()),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def drift_vs_lr(lrs: list[float], horizon: float) -> tuple[list[dict], list[dict]]:
    runs, fits = [], []
    for name in ACTIVATIONS:
        rows = [drift_run(name, lr, horizon) for lr in lrs]
        runs += rows
        fits.append(
            {
                "activation": name,
                "step_slope": slope(lrs, [r["mean_step_drift"] for r in rows]),
                "total_slope": slope(lrs, [r["total_drift"] for r in rows]),
            }
        )
    return runs, fits


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for row in result["xavier_linear"]:
        if row["init"] == "paper":
            axes[0].hist(row["values"], bins=40, alpha=0.5, label=f"(m,h,n)=({row['m']},{row['h']},{row['n']}), m-h={row['m_minus_h']}")
            axes[0].axvline(row["m_minus_h"], color="k", lw=0.5)
    axes[0].set(title="Fig. 2.2: Q = Tr[U^T U - V V^T], Xavier (eq. 2.15)", xlabel="Q")
    axes[0].legend(fontsize=7)
    for row in result["xavier_nonlinear"]:
        axes[1].hist(row["values"], bins=40, alpha=0.5, label=f"{row['activation']} (E[Q]={row['expected']:.2f})")
    axes[1].set(title="Fig. 2.3: Q of eq. 2.17, m = h = n = 100", xlabel="Q")
    axes[1].legend(fontsize=7)
    for fit in result["fits"]:
        rows = [r for r in result["drift"] if r["activation"] == fit["activation"]]
        axes[2].loglog(
            [r["lr"] for r in rows],
            [r["mean_step_drift"] for r in rows],
            "o-",
            label=f"{fit['activation']} (slope {fit['step_slope']:.2f})",
        )
    axes[2].set(title="App. A.4: mean per-step drift of Q under GD", xlabel="learning rate", ylabel="|dQ| / scale per step")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "conserved.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=None, help="initialisations per (m, h, n) tuple")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    samples = args.samples or (200 if args.quick else 1000)
    tuples = [(20, 10, 5), (10, 30, 20), (50, 50, 50), (100, 20, 200)]
    size = 30 if args.quick else 100
    # sigmoid's mean 1/2 gives the output layer curvature ~ h n / 4 = 125: the largest lr is a quarter of 2 / 125
    lrs = [1e-3, 2e-3, 4e-3] if args.quick else [5e-4, 1e-3, 2e-3, 4e-3]
    horizon = 0.2 if args.quick else 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every site here has a conserved quantity
        linear = xavier_linear(tuples, samples)
        nonlinear = xavier_nonlinear(size, samples)
        runs, fits = drift_vs_lr(lrs, horizon)
    settings = {
        "samples": samples,
        "tuples": tuples,
        "nonlinear_size": size,
        "lrs": lrs,
        "horizon": horizon,
        "drift_problem": "1/2 ||Y - U sigma(V)||^2, U 5x50, V 50x10, X = I (eq. A.30)",
        "dtype": "float64",
    }
    result = {
        **header("conserved quantities (Zhao 2026, Sec. 2.6, App. A.4)", settings),
        "xavier_linear": linear,
        "xavier_nonlinear": nonlinear,
        "drift": runs,
        "fits": fits,
    }
    print(f"eq. 2.16: E[Q] = m - h under Xavier init, {samples} draws per tuple; {result['machine']}, {result['date']}")
    print_table(
        linear,
        [
            ("init", "init", "s"),
            ("m", "m", "d"),
            ("h", "h", "d"),
            ("n", "n", "d"),
            ("expected", "E[Q]", ".3f"),
            ("mean", "mean", ".3f"),
            ("se", "SE", ".3f"),
            ("z", "z", "+.2f"),
            ("std", "std", ".3f"),
            ("q05", "5%", ".2f"),
            ("median", "median", ".2f"),
            ("q95", "95%", ".2f"),
        ],
    )
    print(f"\nFig. 2.3: Q of eq. 2.17, m = h = n = {size}, {samples} draws")
    print_table(
        nonlinear,
        [
            ("activation", "activation", "s"),
            ("expected", "E[Q]", ".4f"),
            ("mean", "mean", ".4f"),
            ("se", "SE", ".4f"),
            ("z", "z", "+.2f"),
            ("std", "std", ".3f"),
            ("q05", "5%", ".2f"),
            ("median", "median", ".2f"),
            ("q95", "95%", ".2f"),
        ],
    )
    print(f"\nApp. A.4: GD drift of Q over flow time T = {horizon} (T / lr steps), ConservationMonitor")
    print_table(
        runs,
        [
            ("activation", "activation", "s"),
            ("lr", "lr", "g"),
            ("steps", "steps", "d"),
            ("mean_step_drift", "mean per-step drift", ".3e"),
            ("total_drift", "drift at T", ".3e"),
            ("final_loss", "loss at T", ".4f"),
        ],
    )
    print()
    print_table(
        fits,
        [
            ("activation", "activation", "s"),
            ("step_slope", "log-log slope per step (lr^2: 2)", ".3f"),
            ("total_slope", "slope at fixed T (lr: 1)", ".3f"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
