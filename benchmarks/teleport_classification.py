"""Zhao 2026, Sec. 5.4.2 (Fig. 5.10-5.11) on digits: teleportation inside AdaGrad, SGD+momentum, RMSprop and Adam.

**Digits stands in for MNIST**: scikit-learn's bundled 8x8 digits (1347 train /
450 test images, no download) replace MNIST's 50000 / 10000, so the input layer has
64 units instead of 784.  Otherwise the setting is the paper's: the MLP
W3 s(W2 s(W1 x)) with widths 64-16-10-10, LeakyReLU(0.1), no biases,
cross-entropy, mini-batches of 20, 40 epochs, 5 seeds (initialisation and batch
order), learning rates AdaGrad 1e-2, SGD with momentum 0.9 1e-3, RMSprop 1e-4,
Adam 1e-4.  Teleport: 8 teleports in a row, each with 10 ascent steps of the group
coordinates on its own random 200-sample batch, before the first update of epoch 2
(AdaGrad) or epoch 0 (the others), maximising the squared gradient norm
(Algorithm 1).

Group: the exact positive rescalings of both hidden layers (Zhao 2026, Ex. 1.2.4),
searched with teleopt's library defaults (projected Adam on log-scales, ascent_lr
0.05, trust region log 4 per teleport, stability cap, loss check on the batch and
the 10-step watch that rolls a teleport back if the gradient or loss blows up).
The paper's group, GL acting through the data (eq. 4.13), is exact only on batches
no larger than a layer's input width (64 and 16 here), so it cannot act exactly on
200-sample batches; the published code applied it to first order regardless.

Arms:

* ``none``: the bare optimizer;
* ``teleport+transport`` / ``+reset`` / ``+keep``: Teleport with each optimizer-state
  policy (:class:`teleopt.teleport.StatePolicy`: move first and second moments
  exactly with the rescaling, reset them, or keep them);
* ``reset only``: no teleport, but a fresh optimizer at the teleport epoch.  The
  published runs rebuilt the optimizer after teleporting, so their gain mixes the
  teleport with a state reset; this arm measures the reset alone.  With a teleport
  at epoch 0 the state is still empty, so there all policies and this arm coincide
  with the bare optimizer's state handling;
* ``teleport+transport, ascent_lr 0.01``: the ablation of the ascent step size (8
  consecutive teleports compound: up to 8 x 0.5 in log-scale at the default);
* ``teleport+transport, stability cap``: the default step with Teleport's opt-in
  cap on the optimizer's preconditioned sharpness at the teleported point
  (``SafetyConfig(stability_margin=1.0)``: at most the update rule's linear
  stability threshold, or the value before the teleport if larger).

Printed: mean over seeds of the full-batch train and test loss after epochs
1/5/10/40, the test loss at the end (mean +- std), the median number of epochs and
seconds to reach the bare optimizer's final train loss (per seed; "-" when fewer
than half the seeds reach it), the training seconds (teleports and resets
included), and the teleports accepted and rolled back.  ``--json`` writes all
curves; the plot (mean +- std over seeds) goes next to it or to ``--plot-dir``.

Run: ``python benchmarks/teleport_classification.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser, print_table  # noqa: E402
from teleport_digits import cross_entropy, first_epoch_at_or_below, mean_std, median_or_none, train  # noqa: E402

from teleopt.datasets import digits_mlp, hidden_rescaling_sites, load_digits  # noqa: E402
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport  # noqa: E402

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdaGrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "SGD+momentum": (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-4}),
    "Adam": (torch.optim.Adam, {"lr": 1e-4}),
}
TELEPORT_EPOCH = {"AdaGrad": 2, "SGD+momentum": 0, "RMSprop": 0, "Adam": 0}
ARMS = (
    "none",
    "teleport+transport",
    "teleport+reset",
    "teleport+keep",
    "reset only",
    "teleport+transport, ascent_lr 0.01",
    "teleport+transport, stability cap",
)
REPORT_EPOCHS = (1, 5, 10, 40)
TELEPORTS, ASCENT_STEPS, TELEPORT_BATCH, BATCH = 8, 10, 200, 20


def run(opt_name: str, arm: str, seed: int, epochs: int, data) -> dict[str, Any]:
    """One training run; returns its curves and teleport counts."""
    model = digits_mlp(seed=seed)
    cls, kwargs = OPTIMIZERS[opt_name]
    current: list[torch.optim.Optimizer] = [cls(model.parameters(), **kwargs)]
    teleport = None
    if arm.startswith("teleport"):
        policy = arm.split("+")[1].split(",")[0]
        ascent_lr = 0.01 if "ascent_lr 0.01" in arm else 0.05
        safety = SafetyConfig(stability_margin=1.0) if "stability cap" in arm else None
        # no schedule: the benchmark calls teleport() itself, on its own batches, at the epoch boundary
        teleport = Teleport(
            current[0],
            model,
            hidden_rescaling_sites(model),
            loss_fn=cross_entropy,
            state_policy=policy,
            safety=safety,
            search=SearchConfig(steps=ASCENT_STEPS, lr=ascent_lr),
            schedule=Schedule(),
        )
        current[0] = teleport
    teleport_rows = torch.Generator().manual_seed(10_000 + seed)

    def before_epoch(epoch: int) -> None:
        if epoch != TELEPORT_EPOCH[opt_name]:
            return
        if arm == "reset only":
            current[0] = cls(model.parameters(), **kwargs)
        elif teleport is not None:
            for _ in range(TELEPORTS):
                rows = torch.randint(len(data.x_train), (TELEPORT_BATCH,), generator=teleport_rows)
                teleport.zero_grad()  # the gradient for the objective comes from the teleport batch
                teleport.teleport(batch=(data.x_train[rows], data.y_train[rows]))
            teleport.zero_grad()

    curves = train(model, lambda: current[0], data, epochs, BATCH, seed, before_epoch)
    reports = [] if teleport is None else teleport.reports
    return {
        "train": curves.train,
        "test": curves.test,
        "seconds": curves.seconds,
        "test_accuracy": curves.test_accuracy,
        "accepted": sum(r.accepted and r.path != "watch" for r in reports),
        "rollbacks": sum(r.path == "watch" for r in reports),
        "declined": sum((not r.accepted) and r.path != "watch" for r in reports),
    }


def cell(value: Any, spec: str) -> str:
    """A table cell: ``-`` for missing values, numbers formatted with ``spec``."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, spec)


def summarise(opt_name: str, arm: str, runs: list[dict[str, Any]], baselines: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    row: dict[str, Any] = {"optimizer": opt_name, "arm": arm}
    for e in REPORT_EPOCHS:
        if e <= epochs:
            row[f"train@{e}"] = mean_std([r["train"][e] for r in runs])[0]
            row[f"test@{e}"] = mean_std([r["test"][e] for r in runs])[0]
    row["test_end"], row["test_end_std"] = mean_std([r["test"][-1] for r in runs])
    row["best_test"] = mean_std([min(r["test"]) for r in runs])[0]
    row["accuracy"] = mean_std([r["test_accuracy"] for r in runs])[0]
    hits = [first_epoch_at_or_below(r["train"], b["train"][-1]) for r, b in zip(runs, baselines)]
    row["epochs_to_target"] = median_or_none(hits)
    row["seconds_to_target"] = median_or_none([None if h is None else r["seconds"][h] for h, r in zip(hits, runs)])
    row["reached"] = f"{sum(h is not None for h in hits)}/{len(hits)}"
    row["seconds"] = mean_std([r["seconds"][-1] for r in runs])[0]
    row["accepted"] = sum(r["accepted"] for r in runs) / len(runs)
    row["rollbacks"] = sum(r["rollbacks"] for r in runs) / len(runs)
    return row


def plot(result: dict[str, Any], directory: Path) -> None:
    """Train (dashed) and test (solid) loss per epoch, mean +- std over seeds (shaded: test), one panel per optimizer."""
    import matplotlib.pyplot as plt

    names = list(result["curves"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, opt_name in zip(axes.flat, names):
        for k, (arm, runs) in enumerate(result["curves"][opt_name].items()):
            colour = f"C{k}"
            for key, style in (("test", "-"), ("train", "--")):
                values = torch.tensor([r[key] for r in runs], dtype=torch.float64)
                mean = values.mean(0)
                std = values.std(0) if len(runs) > 1 else torch.zeros_like(mean)
                xs = range(len(mean))
                ax.plot(xs, mean, style, color=colour, label=arm if key == "test" else None)
                if key == "test":
                    ax.fill_between(xs, mean - std, mean + std, color=colour, alpha=0.15)
        ax.set_yscale("log")
        ax.set_xlabel("epoch")
        ax.set_ylabel("cross-entropy (solid: test, dashed: train)")
        ax.set_title(f"{opt_name} (teleport before epoch {TELEPORT_EPOCH[opt_name]})", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Zhao 2026, Fig. 5.10 on digits (stand-in for MNIST), mean +- std over {len(result['settings']['seeds'])} seeds; "
        f"{result['machine']}, {result['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(directory / "teleport_classification.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    epochs = args.epochs or (3 if args.quick else 40)
    seeds = list(range(args.seeds or (1 if args.quick else 5)))
    data = load_digits(seed=0)
    plan = [(o, a, s) for o in OPTIMIZERS for a in ARMS for s in seeds]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {o: {a: [] for a in ARMS} for o in OPTIMIZERS}
    for opt_name, arm, seed in tqdm(plan, desc="teleport_classification", disable=args.quick):
        raw[opt_name][arm].append(run(opt_name, arm, seed, epochs, data))
    rows = [summarise(o, a, raw[o][a], raw[o]["none"], epochs) for o in OPTIMIZERS for a in ARMS]
    settings = {
        "dataset": "scikit-learn digits (stand-in for MNIST), 1347 train / 450 test",
        "widths": [64, 16, 10, 10],
        "activation": "LeakyReLU(0.1)",
        "bias": False,
        "batch": BATCH,
        "epochs": epochs,
        "seeds": seeds,
        "optimizers": {k: v[1] for k, v in OPTIMIZERS.items()},
        "teleport_epoch": TELEPORT_EPOCH,
        "teleports": TELEPORTS,
        "ascent_steps": ASCENT_STEPS,
        "teleport_batch": TELEPORT_BATCH,
        "group": "positive rescaling of both hidden layers (exact)",
        "objective": "grad_norm",
    }
    result = {**header("teleport_classification (Zhao 2026, Sec. 5.4.2, Fig. 5.10-5.11)", settings), "rows": rows, "curves": raw}
    print(
        f"Zhao 2026, Sec. 5.4.2 on digits (stand-in for MNIST): 64-16-10-10 LeakyReLU MLP, batch {BATCH}, {epochs} epochs, "
        f"mean over {len(seeds)} seeds; {result['machine']}, {result['date']}"
    )
    shown = [e for e in REPORT_EPOCHS if e <= epochs]
    columns = [("optimizer", "optimizer", "s"), ("arm", "arm", "s")]
    columns += [(f"train@{e}", f"train@{e}", ".3f") for e in shown] + [(f"test@{e}", f"test@{e}", ".3f") for e in shown]
    columns += [] if epochs in shown else [("test_end", f"test@{epochs}", ".3f")]
    columns += [
        ("test_end_std", f"+-@{epochs}", ".3f"),
        ("best_test", "best test", ".3f"),
        ("accuracy", "test acc", ".3f"),
        ("epochs_to_target", "ep->base", ".0f"),
        ("seconds_to_target", "s->base", ".2f"),
        ("reached", "reached", "s"),
        ("seconds", "s total", ".2f"),
        ("accepted", "teleports", ".1f"),
        ("rollbacks", "rolled back", ".1f"),
    ]
    print_table([{k: cell(r.get(k), f) for k, _, f in columns} for r in rows], [(k, t, "s") for k, t, _ in columns])
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
