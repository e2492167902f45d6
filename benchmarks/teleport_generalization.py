"""Zhao 2026, Sec. 5.2-5.3 at reduced scale: sharpness and curvature of minima, and teleporting to change them.

**Digits stands in for MNIST** (scikit-learn's bundled 8x8 digits, 1347 train / 450
validation images, no download).  The network is the paper's MNIST MLP
W3 s(W2 s(W1 x)), 64-16-10-10, LeakyReLU(0.1), no biases, trained with SGD
(lr 0.01) on mini-batches of 20 for 40 epochs (Sec. 5.2.3).

Part 1, correlation (Sec. 5.2.3, Table 5.1): ``--models`` (default 30; the paper
trains 100) networks from different initialisations.  For each trained network:

* validation loss;
* sharpness phi(w, T, D) = mean over t in T, d in D of L(w + t d) (eq. 5.1) on the
  training set, with the paper's MNIST displacements T = 0.001, 0.011, ..., 0.191
  and |D| = 200 random unit directions over all parameters; the paper's text also
  speaks of "the change in loss", so phi - L(w) is reported as well (phi itself
  contains the training loss L(w), which correlates with the validation loss on
  its own: printed as a reference row);
* curvature psi(w, k) (eq. 5.2): the mean curvature of k orbit curves
  gamma_M(t) = exp(t M) . w through w, for random Lie-algebra elements M of the
  exact positive rescalings of both hidden layers (Ex. 1.2.4).  The paper used
  k = 1 curve of its GL group; we report k = 1 and k = 16.

Both are evaluated with teleopt's own objectives (:class:`teleopt.teleport.Sharpness`,
:class:`teleopt.teleport.Curvature`, the ones a teleport optimises), read from a
teleport with zero ascent steps.  Printed: the Pearson correlation of each with the
validation loss, next to Table 5.1's MNIST values (sharpness 0.704, curvature
-0.050; over all three datasets 0.70-0.90 and -0.05 to -0.23).

Part 2, teleporting for generalization (Sec. 5.3, Fig. 5.7): ``--runs`` (default 5)
seeds; at epoch 20 each network is teleported on 5 random training batches of 500
samples (the paper: 5 batches of 2000 CIFAR-10 images) to decrease or increase
sharpness (10 ascent steps per batch) or curvature (1 step per batch; ascent step
size 0.05 as in the paper, in log-scale units here), then trained to epoch 40.
The group is again the exact positive rescaling, so the training loss is unchanged
by the teleport, and the arms differ only in where on the orbit training resumes.
Printed: the objective before and after the teleport, and the validation loss at
epoch 20, 21 and 40 and its minimum over epochs 20-40, mean +- std over seeds,
next to the run without teleport, and the change of the epoch-40 validation loss
paired by seed (same initialisation and batch order as the run without teleport).

Run: ``python benchmarks/teleport_generalization.py [--quick] [--models N] [--runs N] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402
from teleport_digits import cross_entropy, mean_std, train  # noqa: E402

from teleopt.datasets import Digits, digits_mlp, hidden_rescaling_sites, load_digits  # noqa: E402
from teleopt.teleport import Curvature, Objective, SearchConfig, Sharpness, Teleport  # noqa: E402

LR, BATCH, EPOCHS, TELEPORT_EPOCH = 0.01, 20, 40, 20
DISPLACEMENTS = tuple(0.001 + 0.01 * i for i in range(20))  # 0.001, 0.011, ..., 0.191 (Sec. 5.2.3, MNIST)
TABLE_5_1 = {"sharpness": 0.704, "curvature": -0.050}  # MNIST column of Zhao 2026, Table 5.1
TELEPORT_BATCHES, TELEPORT_BATCH_SIZE, ASCENT_LR = 5, 500, 0.05
ARMS: dict[str, tuple[str, str, int] | None] = {
    "none": None,
    "sharpness down": ("sharpness", "decrease", 10),
    "sharpness up": ("sharpness", "increase", 10),
    "curvature up": ("curvature", "increase", 1),
    "curvature down": ("curvature", "decrease", 1),
}


def measure(model: torch.nn.Module, objective: Objective, batch: tuple[torch.Tensor, torch.Tensor], seed: int) -> float:
    """The objective's value at the model's current weights (a teleport with zero ascent steps changes nothing)."""
    probe = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model,
        hidden_rescaling_sites(model),
        objective=objective,
        loss_fn=cross_entropy,
        search=SearchConfig(steps=0, seed=seed),
    )
    report = probe.teleport(batch=batch)
    probe.zero_grad()
    assert report.objective_before is not None and not report.accepted
    return float(report.objective_before)


def sharpness(quick: bool) -> Sharpness:
    return Sharpness(displacements=DISPLACEMENTS, directions=10 if quick else 200)


def pearson(x: list[float], y: list[float]) -> float:
    t = torch.tensor([x, y], dtype=torch.float64)
    return float(torch.corrcoef(t)[0, 1])


def correlation(models: int, data: Digits, epochs: int, quick: bool) -> tuple[list[dict[str, Any]], dict[str, float]]:
    rows = []
    batch = (data.x_train, data.y_train)
    for seed in tqdm(range(models), desc="correlation: train and measure", disable=quick):
        model = digits_mlp(seed=1000 + seed)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        curves = train(model, lambda opt=opt: opt, data, epochs, BATCH, seed)
        phi = measure(model, sharpness(quick), batch, seed)
        rows.append(
            {
                "seed": 1000 + seed,
                "train_loss": curves.train[-1],
                "validation_loss": curves.test[-1],
                "sharpness": phi,
                "sharpness_increase": phi - curves.train[-1],
                "curvature_k1": measure(model, Curvature(curves=1), batch, seed),
                "curvature_k16": measure(model, Curvature(curves=16), batch, seed),
            }
        )
    val = [r["validation_loss"] for r in rows]
    keys = ("sharpness", "sharpness_increase", "curvature_k1", "curvature_k16", "train_loss")
    corr = {key: pearson([r[key] for r in rows], val) for key in keys}
    return rows, corr


def teleport_run(arm: str, seed: int, data: Digits, epochs: int, teleport_epoch: int, quick: bool) -> dict[str, Any]:
    model = digits_mlp(seed=2000 + seed)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    spec = ARMS[arm]
    rows = torch.Generator().manual_seed(3000 + seed)
    record: dict[str, Any] = {}

    def before_epoch(epoch: int) -> None:
        if epoch != teleport_epoch or spec is None:
            return
        kind, direction, steps = spec
        objective: Objective = (
            Sharpness(direction, displacements=DISPLACEMENTS, directions=4) if kind == "sharpness" else Curvature(direction, curves=16)
        )
        teleport = Teleport(
            opt,
            model,
            hidden_rescaling_sites(model),
            objective=objective,
            loss_fn=cross_entropy,
            search=SearchConfig(steps=steps, lr=ASCENT_LR, seed=seed),
        )
        probe = sharpness(quick) if kind == "sharpness" else Curvature(curves=16)
        full = (data.x_train, data.y_train)
        record["objective_before"] = measure(model, probe, full, seed)
        for _ in range(TELEPORT_BATCHES):
            idx = torch.randint(len(data.x_train), (TELEPORT_BATCH_SIZE,), generator=rows)
            teleport.zero_grad()
            teleport.teleport(batch=(data.x_train[idx], data.y_train[idx]))
        teleport.zero_grad()
        record["objective_after"] = measure(model, probe, full, seed)
        record["accepted"] = sum(r.accepted for r in teleport.reports)
        record["max_drift"] = max((r.loss_drift or 0.0 for r in teleport.reports), default=0.0)

    curves = train(model, lambda: opt, data, epochs, BATCH, seed, before_epoch)
    return {"train": curves.train, "validation": curves.test, **record}


def plot(result: dict[str, Any], directory: Path) -> None:
    """Scatter of validation loss vs sharpness and curvature (Fig. 5.3-5.4) and the teleport curves (Fig. 5.7)."""
    import matplotlib.pyplot as plt

    rows = result["correlation"]["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    val = [r["validation_loss"] for r in rows]
    for ax, key, label in zip(axes[:2], ("sharpness", "curvature_k16"), ("sharpness phi (eq. 5.1)", "curvature psi, k = 16 (eq. 5.2)")):
        ax.scatter([r[key] for r in rows], val, s=14)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.set_title(f"Pearson r = {result['correlation']['pearson'][key]:.3f}", fontsize=10)
    for ax, kind in zip(axes[2:], ("sharpness", "curvature")):
        for k, arm in enumerate(a for a in result["teleport"]["curves"] if a == "none" or a.startswith(kind)):
            runs = result["teleport"]["curves"][arm]
            for key, style in (("validation", "-"), ("train", "--")):
                values = torch.tensor([r[key] for r in runs], dtype=torch.float64)
                mean = values.mean(0)
                std = values.std(0) if len(runs) > 1 else torch.zeros_like(mean)
                xs = range(len(mean))
                ax.plot(xs, mean, style, color=f"C{k}", label=arm if key == "validation" else None)
                if key == "validation":
                    ax.fill_between(xs, mean - std, mean + std, color=f"C{k}", alpha=0.15)
        ax.axvline(result["settings"]["teleport_epoch"], color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss (solid: validation, dashed: train)")
        ax.set_title(f"teleport to change {kind} (mean +- std)", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"Zhao 2026, Sec. 5.2-5.3 on digits (stand-in for MNIST); {result['machine']}, {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(directory / "teleport_generalization.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--models", type=int, default=None, help="networks for the correlation (default 30)")
    p.add_argument("--runs", type=int, default=None, help="seeds per teleport arm (default 5)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    quick = args.quick
    models = args.models or (4 if quick else 30)
    runs = args.runs or (1 if quick else 5)
    epochs, teleport_epoch = (3, 2) if quick else (EPOCHS, TELEPORT_EPOCH)
    data = load_digits(seed=0)

    corr_rows, corr = correlation(models, data, epochs, quick)
    curves: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for arm, seed in tqdm([(a, s) for a in ARMS for s in range(runs)], desc="teleport arms", disable=quick):
        curves[arm].append(teleport_run(arm, seed, data, epochs, teleport_epoch, quick))
    arm_rows = []
    for arm, rs in curves.items():
        row: dict[str, Any] = {"arm": arm}
        for key, e in (("val_before", teleport_epoch), ("val_next", teleport_epoch + 1), ("val_end", epochs)):
            row[key], row[key + "_std"] = mean_std([r["validation"][e] for r in rs])
        row["val_min"], row["val_min_std"] = mean_std([min(r["validation"][teleport_epoch:]) for r in rs])
        # paired with the run without teleport of the same seed (same initialisation and batch order)
        row["val_end_change"], row["val_end_change_std"] = mean_std(
            [r["validation"][-1] - b["validation"][-1] for r, b in zip(rs, curves["none"])]
        )
        row["train_end"] = mean_std([r["train"][-1] for r in rs])[0]
        row["objective_before"] = mean_std([r["objective_before"] for r in rs])[0] if ARMS[arm] else None
        row["objective_after"] = mean_std([r["objective_after"] for r in rs])[0] if ARMS[arm] else None
        row["accepted"] = sum(r.get("accepted", 0) for r in rs) / len(rs)
        arm_rows.append(row)

    settings = {
        "dataset": "scikit-learn digits (stand-in for MNIST), 1347 train / 450 validation",
        "widths": [64, 16, 10, 10],
        "optimizer": "SGD",
        "lr": LR,
        "batch": BATCH,
        "epochs": epochs,
        "models": models,
        "runs": runs,
        "displacements": list(DISPLACEMENTS),
        "directions": 10 if quick else 200,
        "teleport_epoch": teleport_epoch,
        "teleport_batches": TELEPORT_BATCHES,
        "teleport_batch_size": TELEPORT_BATCH_SIZE,
        "ascent_lr": ASCENT_LR,
        "group": "positive rescaling of both hidden layers (exact)",
    }
    result = {
        **header("teleport_generalization (Zhao 2026, Sec. 5.2-5.3)", settings),
        "correlation": {"rows": corr_rows, "pearson": corr, "table_5_1_mnist": TABLE_5_1},
        "rows": arm_rows,
        "teleport": {"curves": curves},
    }

    print(
        f"Zhao 2026, Sec. 5.2-5.3 on digits (stand-in for MNIST), 64-16-10-10 LeakyReLU MLP, SGD lr {LR}, batch {BATCH}, "
        f"{epochs} epochs; {result['machine']}, {result['date']}"
    )
    print(f"\nPearson correlation with validation loss over {models} trained networks:")
    print_table(
        [
            {"quantity": "sharpness phi (eq. 5.1)", "r": corr["sharpness"], "paper": TABLE_5_1["sharpness"]},
            {"quantity": "sharpness increase phi - L(w)", "r": corr["sharpness_increase"], "paper": TABLE_5_1["sharpness"]},
            {"quantity": "curvature psi, k = 1 (eq. 5.2)", "r": corr["curvature_k1"], "paper": TABLE_5_1["curvature"]},
            {"quantity": "curvature psi, k = 16", "r": corr["curvature_k16"], "paper": TABLE_5_1["curvature"]},
            {"quantity": "train loss (reference)", "r": corr["train_loss"], "paper": float("nan")},
        ],
        [("quantity", "quantity", "s"), ("r", "Pearson r", ".3f"), ("paper", "Table 5.1 MNIST", ".3f")],
    )
    print(f"\nTeleport at epoch {teleport_epoch} ({TELEPORT_BATCHES} batches of {TELEPORT_BATCH_SIZE}), mean over {runs} seeds:")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print_table(
        [
            {**r, "objective_before": fmt(r["objective_before"], ".4g"), "objective_after": fmt(r["objective_after"], ".4g")}
            for r in arm_rows
        ],
        [
            ("arm", "arm", "s"),
            ("objective_before", "objective before", "s"),
            ("objective_after", "after", "s"),
            ("val_before", f"val@{teleport_epoch}", ".4f"),
            ("val_next", f"val@{teleport_epoch + 1}", ".4f"),
            ("val_end", f"val@{epochs}", ".4f"),
            ("val_end_std", "+-", ".4f"),
            ("val_end_change", "paired change", "+.4f"),
            ("val_end_change_std", "+-", ".4f"),
            ("val_min", f"min val {teleport_epoch}-{epochs}", ".4f"),
            ("train_end", f"train@{epochs}", ".4f"),
            ("accepted", "teleports", ".1f"),
        ],
    )
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
