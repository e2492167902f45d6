"""Zhao et al. 2023, App. I / Fig. 10 in small: group-action ensembles vs eps on digits, next to the random baselines.

A LeakyReLU(0.1) MLP 64-16-10-10 without biases (``teleopt.datasets.digits_mlp``,
the papers' classifier) is trained with Adam (lr 1e-2, batch 64) in float64 on
scikit-learn's bundled digits (1347 train / 450 test, ``load_digits``).  Then, as
in the paper, the last two layers (U, V) = (``4.weight``, ``2.weight``) are
transformed with g = exp(eps M) (M with N(0, 1/h) entries, h = 10) into K members
whose probabilities are averaged (``GroupEnsemble``):

* ``group``: the data-dependent GL_h action (U pi(g, H), g V), pi(g, H) =
  sigma(H) sigma(gH)^+ built on the training set (Zhao et al. 2023, eq. 112, the
  least-squares action ``data_dependent_gl_lstsq`` of Zhao 2026, eq. 4.16);
* the baselines of App. I at the same eps (``BaselineEnsemble``): ``g_inverse``,
  ``random``, ``shuffle``, ``perm_interp``;
* ``rescaling (exact)``: the exact positive rescaling of the same hidden layer,
  whose members all compute the model's function (the ensemble is the model).

Printed per eps and kind, medians over seeds (each seed trains its own model and
draws its own elements): test loss and accuracy of the ensemble, accuracy of the
members' majority vote (the paper's "mode"), the mean relative deviation of the
members' test outputs from the model's (how far in function space the transform
moved), and the same deviation on the training set (for ``group``: the
least-squares residual of the action on its reference batch).

Run: ``python benchmarks/ensemble.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402

from teleopt.analysis.ensemble import BASELINES, BaselineEnsemble, GroupEnsemble, ParameterEnsemble  # noqa: E402
from teleopt.datasets import NEGATIVE_SLOPE, digits_mlp, load_digits  # noqa: E402
from teleopt.registry import get_action  # noqa: E402
from teleopt.site import Site  # noqa: E402

KINDS = ("group", *BASELINES, "rescaling (exact)")


def train(seed: int, epochs: int) -> tuple[torch.nn.Sequential, dict[str, torch.Tensor]]:
    d = load_digits(seed=0)
    data = {"x_train": d.x_train.double(), "y_train": d.y_train, "x_test": d.x_test.double(), "y_test": d.y_test}
    model = digits_mlp(seed=seed).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    shuffles = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data["x_train"]), generator=shuffles)
        for i in range(0, len(order), 64):
            rows = order[i : i + 64]
            optimizer.zero_grad()
            F.cross_entropy(model(data["x_train"][rows]), data["y_train"][rows]).backward()
            optimizer.step()
    return model.eval(), data


def sites() -> dict[str, Site]:
    lstsq = get_action("data_dependent_gl_lstsq", activation="leaky_relu", negative_slope=NEGATIVE_SLOPE, strict=False)
    rescale = get_action("positive_rescaling", activation="leaky_relu", negative_slope=NEGATIVE_SLOPE)
    return {
        "group": Site(lstsq, ("2.weight", None, "4.weight"), name="last_hidden_gl", data_input="2"),
        "rescaling (exact)": Site(rescale, ("2.weight", None, "4.weight"), name="last_hidden_rescaling"),
    }


def build(kind: str, model, eps: float, members: int, seed: int, x_train) -> ParameterEnsemble:
    generator = torch.Generator().manual_seed(10_000 + seed)  # the same g's for every kind at this seed
    s = sites()
    if kind in BASELINES:
        return BaselineEnsemble(model, s["group"], kind, eps, members, reference=x_train, generator=generator)
    with warnings.catch_warnings():  # eq. 4.16 on 1347 samples > 10 units is least squares: reported as train_dev
        warnings.simplefilter("ignore")
        return GroupEnsemble(model, s[kind], eps, members, reference=x_train, generator=generator)


@torch.no_grad()
def evaluate(ensemble: ParameterEnsemble, data: dict) -> dict:
    outs = ensemble.member_outputs(data["x_test"])
    combined = ensemble.combine_outputs(outs)
    votes = torch.mode(outs.argmax(-1), dim=0).values
    return {
        "test_loss": float(F.cross_entropy(combined, data["y_test"])),
        "test_accuracy": float((combined.argmax(1) == data["y_test"]).double().mean()),
        "vote_accuracy": float((votes == data["y_test"]).double().mean()),
        "test_dev": float(ensemble.member_deviation(data["x_test"]).mean()),
        "train_dev": float(ensemble.member_deviation(data["x_train"]).mean()),
    }


def run(seeds: list[int], epochs: int, eps_grid: list[float], members: int, quiet: bool) -> list[dict]:
    per_seed: dict[tuple[str, float], list[dict]] = {}
    for seed in tqdm(seeds, desc="ensemble", disable=quiet):
        model, data = train(seed, epochs)
        with torch.no_grad():
            out = model(data["x_test"])
        single = {
            "test_loss": float(F.cross_entropy(out, data["y_test"])),
            "test_accuracy": float((out.argmax(1) == data["y_test"]).double().mean()),
        }
        single.update(vote_accuracy=single["test_accuracy"], test_dev=0.0, train_dev=0.0)
        per_seed.setdefault(("single model", 0.0), []).append(single)
        for eps in eps_grid:
            for kind in KINDS:
                per_seed.setdefault((kind, eps), []).append(evaluate(build(kind, model, eps, members, seed, data["x_train"]), data))
    rows = []
    for (kind, eps), results in per_seed.items():
        row = {"kind": kind, "eps": eps, "seeds": len(results)}
        for key in results[0]:
            row[key] = statistics.median(r[key] for r in results)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["delta_loss"] = row["test_loss"] - base["test_loss"]
        row["delta_accuracy"] = row["test_accuracy"] - base["test_accuracy"]
    return rows


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    single = next(r for r in rows if r["kind"] == "single model")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for kind in KINDS:
        pts = sorted((r["eps"], r) for r in rows if r["kind"] == kind)
        style = {"linewidth": 2.5} if kind == "group" else {"linestyle": "--" if kind in BASELINES else ":"}
        axes[0].loglog([e for e, _ in pts], [r["test_loss"] for _, r in pts], marker="o", label=kind, **style)
        axes[1].semilogx([e for e, _ in pts], [r["test_accuracy"] for _, r in pts], marker="o", label=kind, **style)
    for ax, key in zip(axes, ("test_loss", "test_accuracy")):
        ax.axhline(single[key], color="k", linewidth=0.8, label="single model")
        ax.set_xlabel("eps (g = exp(eps M))")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("test cross-entropy of the ensemble")
    axes[1].set_ylabel("test accuracy of the ensemble")
    fig.suptitle(f"digits, {result['settings']['members']} members, median over {len(result['settings']['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(directory / "ensemble.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--eps", type=float, nargs="+", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2, 3, 4])
    epochs = args.epochs or (10 if args.quick else 60)
    eps_grid = args.eps or ([1e-3, 1e-1, 3.0] if args.quick else [1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0])
    rows = run(seeds, epochs, eps_grid, args.members, args.quick)
    settings = {
        "seeds": seeds,
        "epochs": epochs,
        "members": args.members,
        "eps": eps_grid,
        "widths": [64, 16, 10, 10],
        "optimizer": "Adam lr 1e-2 batch 64",
        "dtype": "float64",
        "site": "last hidden layer (2.weight, 4.weight)",
    }
    result = {**header("ensemble (Zhao et al. 2023, App. I, Fig. 10)", settings), "rows": rows}
    print(
        f"Zhao et al. 2023, App. I in small: {args.members}-member ensembles on digits, medians over seeds {seeds}, "
        f"{epochs} epochs of Adam; {result['machine']}, {result['date']}"
    )
    print_table(
        rows,
        [
            ("kind", "kind", "s"),
            ("eps", "eps", "g"),
            ("test_loss", "test loss", ".4f"),
            ("delta_loss", "d loss", "+.4f"),
            ("test_accuracy", "test acc", ".3f"),
            ("delta_accuracy", "d acc", "+.3f"),
            ("vote_accuracy", "vote acc", ".3f"),
            ("test_dev", "member dev test", ".2e"),
            ("train_dev", "member dev train", ".2e"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
