"""Ziyin et al. 2025, Sec. 6.3 / Fig. 5 in small: feature rank and accuracy of a 4-layer MLP on digits, vanilla vs syre.

A four-layer fully connected ReLU network (64 -> 300 -> 300 -> 300 -> 10, as in the
paper's Fig. 5 but on scikit-learn's bundled 8x8 digits instead of MNIST) is trained
with SGD+momentum (lr 0.05, batch 64) at several weight decays ``gamma``: vanilla uses
SGD's own ``weight_decay=gamma`` (decay towards zero, the symmetric point of the
permutation symmetry), syre uses ``Syre(gamma, sigma0)`` (coupled, biases excluded unless ``--one-d decay``)
for several anchor scales ``sigma0``.  Inputs are standardised and multiplied by
``alpha`` (the paper's input-output correlation strength).  Printed: train/test
accuracy and the rank of the covariance of the first layer's output over the
training set before and after the ReLU (eigenvalues above ``1e-4 * alpha^2``, the
paper's threshold and scaling; the pre-activation rank is at most 61 because three
digits pixels are constant).

Run: ``python benchmarks/syre_digits.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import digits, finish, header, parser, print_table  # noqa: E402

from teleopt.syre import Syre  # noqa: E402


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 10),
    )


def first_layer_ranks(model: torch.nn.Sequential, x: torch.Tensor, alpha: float) -> tuple[int, int]:
    with torch.no_grad():
        pre = model[0](x)
        ranks = []
        for z in (pre, torch.relu(pre)):
            eigenvalues = torch.linalg.eigvalsh(torch.cov(z.T))
            ranks.append(int((eigenvalues > 1e-4 * alpha**2).sum()))
    return ranks[0], ranks[1]


def train(method: str, gamma: float, sigma0: float | None, alpha: float, epochs: int, exclude_1d: bool = True, seed: int = 0) -> dict:
    x_train, y_train, x_test, y_test = digits(alpha=alpha)
    model = mlp(seed=1 + seed)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=gamma if method == "vanilla" else 0.0)
    optimizer = Syre(base, gamma=gamma, sigma0=sigma0, exclude_1d=exclude_1d) if method == "syre" else base
    shuffles = torch.Generator().manual_seed(2 + seed)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=shuffles)
        for i in range(0, len(x_train), 64):
            rows = order[i : i + 64]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[rows]), y_train[rows]).backward()
            optimizer.step()
    with torch.no_grad():
        train_accuracy = float((model(x_train).argmax(1) == y_train).float().mean())
        test_accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    pre, post = first_layer_ranks(model, x_train, alpha)
    return {
        "alpha": alpha,
        "gamma": gamma,
        "method": method,
        "sigma0": "-" if sigma0 is None else sigma0,
        "train_accuracy": train_accuracy,
        "test_accuracy": test_accuracy,
        "rank_pre": pre,
        "rank_post": post,
    }


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    series = sorted({(r["alpha"], r["method"], str(r["sigma0"])) for r in rows})
    for alpha, method, sigma0 in series:
        pts = sorted((r["gamma"], r) for r in rows if (r["alpha"], r["method"], str(r["sigma0"])) == (alpha, method, sigma0))
        label = f"{method}" + ("" if method == "vanilla" else f" sigma0={sigma0}") + f" alpha={alpha}"
        gammas = [max(g, 1e-4) for g, _ in pts]
        axes[0].semilogx(gammas, [r["test_accuracy"] for _, r in pts], marker="o", label=label)
        axes[1].semilogx(gammas, [r["rank_post"] for _, r in pts], marker="o", label=label)
    axes[0].set_ylabel("test accuracy")
    axes[1].set_ylabel("rank of first-layer features (after ReLU)")
    for ax in axes:
        ax.set_xlabel("weight decay gamma (0 drawn at 1e-4)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "syre_digits.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--alpha", type=float, nargs="+", default=[1.0])
    p.add_argument("--gammas", type=float, nargs="+", default=None)
    p.add_argument("--sigma0", type=float, nargs="+", default=None)
    p.add_argument(
        "--one-d",
        choices=["exclude", "decay"],
        default="exclude",
        help="syre's treatment of biases (1-D tensors): timm's exclusion or decay towards an anchor",
    )
    p.add_argument("--seed", type=int, default=0, help="offset of the initialisation and shuffling seeds")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    epochs = args.epochs or (3 if args.quick else 40)
    gammas = args.gammas or ([0.0, 0.1] if args.quick else [0.0, 1e-3, 1e-2, 3e-2, 1e-1])
    sigma0s = args.sigma0 or ([1.0] if args.quick else [0.01, 0.1, 1.0])
    runs = [(alpha, gamma, "vanilla", None) for alpha in args.alpha for gamma in gammas]
    runs += [(alpha, gamma, "syre", s) for alpha in args.alpha for gamma in gammas if gamma > 0 for s in sigma0s]
    rows = [
        train(method, gamma, sigma0, alpha, epochs, args.one_d == "exclude", args.seed)
        for alpha, gamma, method, sigma0 in tqdm(runs, desc="syre_digits", disable=args.quick)
    ]
    rows.sort(key=lambda r: (r["alpha"], r["gamma"], r["method"] != "vanilla", str(r["sigma0"])))
    result = {
        **header(
            "syre_digits (Ziyin et al. 2025, Sec. 6.3, Fig. 5)",
            {
                "epochs": epochs,
                "lr": 0.05,
                "momentum": 0.9,
                "batch": 64,
                "widths": [64, 300, 300, 300, 10],
                "one_d": args.one_d,
                "seed": args.seed,
            },
        ),
        "rows": rows,
    }
    print(
        f"Ziyin et al. 2025, Fig. 5 in small: 4-layer MLP on digits, {epochs} epochs of SGD+momentum; {result['machine']}, {result['date']}"
    )
    print_table(
        rows,
        [
            ("alpha", "alpha", "g"),
            ("gamma", "gamma", "g"),
            ("method", "method", "s"),
            ("sigma0", "sigma0", ""),
            ("train_accuracy", "train acc", ".3f"),
            ("test_accuracy", "test acc", ".3f"),
            ("rank_pre", "rank pre-ReLU", "d"),
            ("rank_post", "rank post-ReLU", "d"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
