"""Ziyin et al. 2025, Fig. 4: degree of symmetry versus objective value for syre, weight decay and plain training.

Minimise ``(w^T w)^2 - w^T B w`` over ``w`` in R^d (d = 1000) by gradient descent with
learning rate 1e-4 from a standard Gaussian ``w`` (Ziyin et al. 2025, Sec. 6.2).  With
``B = sum_i lambda_i v_i v_i^T`` the objective has the reflection symmetries
``w -> w - 2 (v_i^T w) v_i``; the degree of symmetry is the number of ``i`` with
``|v_i^T w| < c_th``.  Two spectra: unstructured ``B = G + G^T`` (Gaussian ``G``,
``c_th = 1e-3``) and structured ``B = diag(g)`` (Gaussian ``g``, ``c_th = 1e-1``).
Methods: plain GD, GD with ``weight_decay = gamma``, and ``Syre(gamma)`` for gamma
from 0.1 to 10; every configuration is one param group of one optimizer (batched
in one backward pass).  ``w`` is a ``(1, d)`` tensor whose group sets ``fan_in = 1``,
so ``sigma0`` is the anchor's absolute standard deviation (the problem has no layer
scale).  Printed: degree of symmetry and the objective (without the decay term) at
the end; the optimum is ``-lambda_max^2 / 4``.

Run: ``python benchmarks/syre_symmetry_degree.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402

from teleopt.syre import Syre  # noqa: E402

GAMMAS = (0.1, 0.3, 1.0, 3.0, 10.0)
THRESHOLDS = {"unstructured": 1e-3, "structured": 1e-1}


def spectrum(kind: str, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "unstructured":
        gaussian = torch.randn(d, d, generator=g)
        return gaussian + gaussian.T
    return torch.diag(torch.randn(d, generator=g))


def objective(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise (w^T w)^2 - w^T B w for a batch of rows w."""
    return (w * w).sum(1) ** 2 - ((w @ b) * w).sum(1)


def run(kind: str, d: int, steps: int, sigma0: float, seed: int, progress: bool) -> list[dict]:
    b = spectrum(kind, d, seed)
    eigenvalues, eigenvectors = torch.linalg.eigh(b)
    start = torch.randn(1, d, generator=torch.Generator().manual_seed(seed + 1))
    configs = [("plain", 0.0)] + [("weight decay", g) for g in GAMMAS] + [("syre", g) for g in GAMMAS]
    weights = [torch.nn.Parameter(start.clone()) for _ in configs]
    groups = [
        {
            "params": [w],
            "weight_decay": gamma if method == "weight decay" else 0.0,
            Syre.prefix + "enabled": method == "syre",
            Syre.prefix + "gamma": gamma if method == "syre" else 0.0,
            Syre.prefix + "fan_in": 1,
        }
        for (method, gamma), w in zip(configs, weights)
    ]
    optimizer = Syre(torch.optim.SGD(groups, lr=1e-4), gamma=0.0, sigma0=sigma0, seed=seed)
    for _ in tqdm(range(steps), desc=f"syre_symmetry_degree ({kind})", disable=not progress):
        optimizer.zero_grad()
        objective(torch.cat(weights), b).sum().backward()
        optimizer.step()
    with torch.no_grad():
        final = torch.cat(weights)
        components = final @ eigenvectors
        degree = (components.abs() < THRESHOLDS[kind]).sum(1)
        values = objective(final, b)
    optimum = -(float(eigenvalues.max()) ** 2) / 4
    return [
        {"spectrum": kind, "method": method, "gamma": gamma, "degree_of_symmetry": int(deg), "objective": float(value), "optimum": optimum}
        for (method, gamma), deg, value in zip(configs, degree, values)
    ]


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    kinds = list(THRESHOLDS)
    fig, axes = plt.subplots(1, len(kinds), figsize=(10, 3.8))
    for ax, kind in zip(axes, kinds):
        for method, marker in (("plain", "s"), ("weight decay", "o"), ("syre", "^")):
            rows = [r for r in result["rows"] if r["spectrum"] == kind and r["method"] == method]
            ax.plot([r["objective"] for r in rows], [r["degree_of_symmetry"] for r in rows], marker=marker, label=method)
        ax.set_xlabel("objective")
        ax.set_ylabel("degree of symmetry")
        ax.set_title(f"{kind} B (c_th = {THRESHOLDS[kind]:g})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "syre_symmetry_degree.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--d", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--sigma0", type=float, default=0.5, help="absolute anchor standard deviation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    d = args.d or (200 if args.quick else 1000)
    steps = args.steps or (2000 if args.quick else 20000)
    rows = [row for kind in THRESHOLDS for row in run(kind, d, steps, args.sigma0, args.seed, not args.quick)]
    result = {
        **header(
            "syre_symmetry_degree (Ziyin et al. 2025, Fig. 4)",
            {"d": d, "steps": steps, "lr": 1e-4, "sigma0": args.sigma0, "seed": args.seed},
        ),
        "rows": rows,
    }
    print(
        f"Ziyin et al. 2025, Fig. 4: (w^T w)^2 - w^T B w, d={d}, GD lr=1e-4, {steps} steps, sigma0={args.sigma0}; "
        f"{result['machine']}, {result['date']}"
    )
    print_table(
        rows,
        [
            ("spectrum", "B", "s"),
            ("method", "method", "s"),
            ("gamma", "gamma", "g"),
            ("degree_of_symmetry", "degree of symmetry", "d"),
            ("objective", "objective", ".3f"),
            ("optimum", "optimum", ".3f"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
