"""Example 1: add symmetry teleportation to a training loop you already have, in three lines.

The loop below is an ordinary PyTorch classifier on scikit-learn's bundled digits
(no download).  The three marked lines are all teleopt needs:

1. ``import teleopt``;
2. (optional) look at what teleopt sees in the model: ``teleopt.find_symmetries``
   traces it and reports its symmetry sites, here the exact positive rescalings
   of the hidden ReLU units (Zhao 2026, Ex. 1.2.4) and their permutations;
3. wrap the optimizer; ``sites="auto"`` runs the same detection and searches the
   exact continuous sites (pass a list of ``teleopt.Site`` to choose them yourself,
   e.g. ``teleopt.datasets.hidden_rescaling_sites(model)``).  ``Teleport`` *is* a ``torch.optim.Optimizer``: the LR
   scheduler, ``zero_grad``, ``step`` and checkpoints keep working unchanged.  Every
   ``every`` steps it moves the weights along a loss-invariant orbit to where the
   gradient is larger (Zhao 2026, Algorithm 1), checks on a batch from ``batch_fn``
   that the loss did not change, and rolls back if anything goes wrong.

Needs: the ``demo`` extra (scikit-learn's bundled digits): ``pip install -e ".[demo]"``.

Run: ``python examples/01_wrap_training_loop.py [--epochs N] [--quick]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import teleopt  # (1)
from teleopt.datasets import load_digits


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="two epochs (what the test suite runs)")
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else args.epochs

    # ---- your existing set-up -------------------------------------------------------
    torch.manual_seed(0)
    data = load_digits(seed=0)
    loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    # ---- teleopt ------------------------------------------------------------------------
    print(teleopt.find_symmetries(model, data.x_train[:2]).summary())  # (2)
    optimizer = teleopt.Teleport(
        optimizer, model, "auto", example_inputs=data.x_train[:2], every=100, loss_fn=F.cross_entropy, batch_fn=lambda: next(iter(loader))
    )  # (3)

    # ---- your existing loop, unchanged -----------------------------------------------------
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
        with torch.no_grad():
            accuracy = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
        print(f"epoch {epoch + 1}: last batch loss {loss.item():.4f}, test accuracy {accuracy:.3f}")

    # what the teleports did (every report also goes to hooks: optimizer.register_teleport_hook)
    for report in optimizer.reports:
        gain = "-" if report.gain is None else f"{report.gain:.2f}"
        drift = "-" if report.loss_drift is None else f"{report.loss_drift:.1e}"
        print(f"step {report.step}: {report.reason}; squared gradient norm x{gain}, loss drift {drift}, {1e3 * report.time_s:.0f} ms")
    return {"accuracy": accuracy, "reports": optimizer.reports, "optimizer": optimizer}


if __name__ == "__main__":
    main()
