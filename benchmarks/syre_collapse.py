"""Ziyin et al. 2025, Fig. 1: a two-layer ReLU network started in a collapsed state stays collapsed; syre escapes.

The hidden layer (64 units) starts with only ``k`` distinct neurons: every unit is a
copy (incoming weights, bias, outgoing weights) of one of ``k`` random templates,
the symmetric state of the permutation symmetry (Ziyin et al. 2025, Sec. 4).  The network
is trained on scikit-learn's digits with SGD+momentum and with Adam, either plain,
with the base optimizer's weight decay ``gamma``, or with ``Syre(gamma)`` (coupled,
eq. 6, biases excluded unless ``--one-d decay``).  Printed per run: the training loss along the way, test
accuracy, the number of distinct hidden neurons (units whose parameter vectors
differ by more than ``1e-3`` relative) and the rank of the hidden representation
(eigenvalues of its covariance over the training set above ``1e-4`` times the
largest).  The paper's claim: plain training keeps exactly ``k`` distinct neurons
(Prop. 3), so its loss depends on the initial capacity; with syre it does not.

Run: ``python benchmarks/syre_collapse.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import digits, finish, header, parser, print_table  # noqa: E402

from teleopt.syre import Syre  # noqa: E402

HIDDEN = 64


def collapsed_init(k: int, seed: int) -> list[torch.nn.Parameter]:
    """W1 (64, 64), b1, W2 (10, 64), b2 with only k distinct hidden neurons (torch's default init scale)."""
    g = torch.Generator().manual_seed(seed)
    bound1, bound2 = 1 / 64**0.5, 1 / HIDDEN**0.5
    w1 = (torch.rand(HIDDEN, 64, generator=g) * 2 - 1) * bound1
    b1 = (torch.rand(HIDDEN, generator=g) * 2 - 1) * bound1
    w2 = (torch.rand(10, HIDDEN, generator=g) * 2 - 1) * bound2
    b2 = (torch.rand(10, generator=g) * 2 - 1) * bound2
    template = torch.arange(HIDDEN) % k
    return [torch.nn.Parameter(t.clone()) for t in (w1[template], b1[template], w2[:, template], b2)]


def forward(params, x):
    w1, b1, w2, b2 = params
    hidden = torch.relu(x @ w1.T + b1)
    return hidden @ w2.T + b2, hidden


def distinct_neurons(params, rtol: float = 1e-3) -> int:
    w1, b1, w2, _ = params
    neurons = torch.cat([w1, b1[:, None], w2.T], 1).detach()
    representatives: list[int] = []
    for i in range(len(neurons)):
        scale = float(neurons[i].norm())
        if not any(float((neurons[i] - neurons[j]).norm()) <= rtol * scale for j in representatives):
            representatives.append(i)
    return len(representatives)


def representation_rank(params, x, rtol: float = 1e-4) -> int:
    with torch.no_grad():
        eigenvalues = torch.linalg.eigvalsh(torch.cov(forward(params, x)[1].T))
    return int((eigenvalues > rtol * eigenvalues.max()).sum())


def train(
    k: int, optimizer_name: str, method: str, data, steps: int, gamma: float, sigma0: float, exclude_1d: bool = True, seed: int = 0
) -> dict:
    x_train, y_train, x_test, y_test = data
    params = collapsed_init(k, seed=1 + seed)
    weight_decay = gamma if method == "weight decay" else 0.0
    if optimizer_name == "sgd":
        base = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=weight_decay)
    else:
        base = torch.optim.Adam(params, lr=1e-3, weight_decay=weight_decay)
    optimizer = Syre(base, gamma=gamma, sigma0=sigma0, exclude_1d=exclude_1d) if method == "syre" else base
    batches = torch.Generator().manual_seed(2 + seed)
    curve = []
    for step in range(steps):
        rows = torch.randint(0, len(x_train), (64,), generator=batches)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(forward(params, x_train[rows])[0], y_train[rows]).backward()
        optimizer.step()
        if (step + 1) % max(1, steps // 20) == 0:
            with torch.no_grad():
                curve.append((step + 1, float(torch.nn.functional.cross_entropy(forward(params, x_train)[0], y_train))))
    with torch.no_grad():
        accuracy = float((forward(params, x_test)[0].argmax(1) == y_test).float().mean())
    return {
        "optimizer": optimizer_name,
        "initial_distinct": k,
        "method": method,
        "loss_10pct": curve[1][1],
        "loss_50pct": curve[len(curve) // 2 - 1][1],
        "final_loss": curve[-1][1],
        "test_accuracy": accuracy,
        "distinct_neurons": distinct_neurons(params),
        "rank": representation_rank(params, x_train),
        "curve": curve,
    }


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    optimizers = sorted({r["optimizer"] for r in rows})
    methods = ["plain", "syre"]
    fig, axes = plt.subplots(len(optimizers), len(methods), figsize=(9, 3.2 * len(optimizers)), squeeze=False)
    capacities = sorted({r["initial_distinct"] for r in rows})
    for i, name in enumerate(optimizers):
        for j, method in enumerate(methods):
            ax = axes[i][j]
            for r in rows:
                if r["optimizer"] == name and r["method"] == method:
                    shade = 0.8 * (1 - capacities.index(r["initial_distinct"]) / max(1, len(capacities) - 1))
                    steps, losses = zip(*r["curve"])
                    ax.semilogy(steps, losses, color=str(shade), label=f"k={r['initial_distinct']}")
            ax.set_title(f"{name}, {method}")
            ax.set_xlabel("iteration")
            ax.set_ylabel("training loss")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "syre_collapse.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--gamma", type=float, default=1e-3)
    p.add_argument("--sigma0", type=float, default=0.01)
    p.add_argument(
        "--one-d",
        choices=["exclude", "decay"],
        default="exclude",
        help="syre's treatment of biases (1-D tensors): timm's exclusion or decay towards an anchor",
    )
    p.add_argument("--seed", type=int, default=0, help="offset of the initialisation and batch seeds")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (200 if args.quick else 2000)
    capacities = [1, 64] if args.quick else [1, 4, 16, 64]
    optimizers = ["sgd"] if args.quick else ["sgd", "adam"]
    data = digits()
    runs = [(name, k, method) for name in optimizers for k in capacities for method in ("plain", "weight decay", "syre")]
    rows = [
        train(k, name, method, data, steps, args.gamma, args.sigma0, args.one_d == "exclude", args.seed)
        for name, k, method in tqdm(runs, desc="syre_collapse", disable=args.quick)
    ]
    result = {
        **header(
            "syre_collapse (Ziyin et al. 2025, Fig. 1)",
            {
                "steps": steps,
                "gamma": args.gamma,
                "sigma0": args.sigma0,
                "hidden": HIDDEN,
                "batch": 64,
                "one_d": args.one_d,
                "seed": args.seed,
            },
        ),
        "rows": rows,
    }
    print(
        f"Ziyin et al. 2025, Fig. 1 on digits: 64-unit ReLU net from k distinct neurons, {steps} steps, "
        f"gamma={args.gamma}, sigma0={args.sigma0}; {result['machine']}, {result['date']}"
    )
    print_table(
        rows,
        [
            ("optimizer", "opt", "s"),
            ("initial_distinct", "k", "d"),
            ("method", "method", "s"),
            ("loss_10pct", "loss@10%", ".4f"),
            ("loss_50pct", "loss@50%", ".4f"),
            ("final_loss", "final loss", ".4f"),
            ("test_accuracy", "test acc", ".3f"),
            ("distinct_neurons", "distinct", "d"),
            ("rank", "rank", "d"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
