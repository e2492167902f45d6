"""Ziyin et al. 2025, Fig. 3 (right): dead units of reparametrized linear regression under SGD, weight decay and syre.

``l(u, w) = mean((x . (u * w) - y)^2)`` with ``u, w, x`` in R^200 and ``y = beta . x +
noise`` (Ziyin et al. 2025, Sec. 6.1).  The rescaling symmetry ``(u_i, w_i) -> (c u_i, w_i / c)``
and the sign flip make ``u_i = w_i = 0`` a symmetric low-capacity state: unit ``i`` is
dead.  Weight decay pulls every weakly used unit into it (its penalty is minimised at
zero, which is the symmetric point); syre's anchor is not symmetric, so the state
stops being a fixed point.  Trained with mini-batch SGD: plain, with SGD's own
``weight_decay=gamma``, and with ``Syre(gamma)``; ``u, w`` form one group with fan-in
200 (so ``sigma0`` is relative to the ``1/sqrt(200)`` initialisation scale).  Printed
over training: the number of dead units, ``max(|u_i|, |w_i|) < tau`` for ``tau = 1e-5``
(collapsed onto the symmetric point, far below the anchor scale
``sigma0 / sqrt(200) = 7e-4``) and ``tau = 1e-3`` (at most anchor-sized), and the
training loss.

Run: ``python benchmarks/syre_dead_units.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402

from teleopt.syre import Syre  # noqa: E402

D = 200
METHODS = ("sgd", "weight decay", "syre")


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    beta = torch.randn(D, generator=g) / D**0.5
    x = torch.randn(n, D, generator=g)
    y = x @ beta + 0.1 * torch.randn(n, generator=g)
    u0 = torch.randn(D, generator=g) / D**0.5
    w0 = torch.randn(D, generator=g) / D**0.5
    return x, y, u0, w0


def train(method: str, problem, steps: int, lr: float, batch: int, gamma: float, sigma0: float, checkpoints: int):
    x, y, u0, w0 = problem
    u, w = torch.nn.Parameter(u0.clone()), torch.nn.Parameter(w0.clone())
    group = {"params": [u, w], Syre.prefix + "fan_in": D}
    base = torch.optim.SGD([group], lr=lr, weight_decay=gamma if method == "weight decay" else 0.0)
    optimizer = Syre(base, gamma=gamma, sigma0=sigma0) if method == "syre" else base
    batches = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        rows = torch.randint(0, len(x), (batch,), generator=batches)
        optimizer.zero_grad()
        ((x[rows] @ (u * w) - y[rows]) ** 2).mean().backward()
        optimizer.step()
        if (step + 1) % (steps // checkpoints) == 0:
            with torch.no_grad():
                size = torch.maximum(u.abs(), w.abs())
                history.append(
                    {
                        "method": method,
                        "step": step + 1,
                        "dead_1e-5": int((size < 1e-5).sum()),
                        "dead_1e-3": int((size < 1e-3).sum()),
                        "train_loss": float(((x @ (u * w) - y) ** 2).mean()),
                    }
                )
    return history


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for method in METHODS:
        rows = [r for r in result["rows"] if r["method"] == method]
        ax.plot([r["step"] for r in rows], [r["dead_1e-5"] for r in rows], marker="o", label=method)
    ax.set_xlabel("iteration")
    ax.set_ylabel("dead units (max(|u_i|, |w_i|) < 1e-5)")
    ax.set_title("reparametrized linear regression, d = 200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "syre_dead_units.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--gamma", type=float, default=0.1)
    p.add_argument("--sigma0", type=float, default=0.01)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (2000 if args.quick else 20000)
    problem = data(args.samples)
    rows = [row for method in METHODS for row in train(method, problem, steps, args.lr, args.batch, args.gamma, args.sigma0, checkpoints=5)]
    settings = {
        "d": D,
        "samples": args.samples,
        "steps": steps,
        "lr": args.lr,
        "batch": args.batch,
        "gamma": args.gamma,
        "sigma0": args.sigma0,
    }
    result = {**header("syre_dead_units (Ziyin et al. 2025, Fig. 3 right)", settings), "rows": rows}
    print(
        f"Ziyin et al. 2025, Fig. 3 right: dead units of l(u, w) = |(u*w).x - y|^2, d={D}, SGD lr={args.lr}, "
        f"batch={args.batch}, gamma={args.gamma}, sigma0={args.sigma0}; {result['machine']}, {result['date']}"
    )
    print_table(
        rows,
        [
            ("method", "method", "s"),
            ("step", "iteration", "d"),
            ("dead_1e-5", "dead (<1e-5)", "d"),
            ("dead_1e-3", "dead (<1e-3)", "d"),
            ("train_loss", "train loss", ".4f"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
