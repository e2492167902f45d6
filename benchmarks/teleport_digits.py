"""Shared plumbing of the digits teleportation benchmarks (Zhao 2026, Sec. 5.2-5.4 at reduced scale).

scikit-learn's bundled 8x8 digits (1347 train / 450 test images, no download) stand
in for MNIST; the network is the papers' W3 s(W2 s(W1 x)) with LeakyReLU(0.1) and
no biases, 64-16-10-10 (:func:`teleopt.datasets.digits_mlp`), trained with
cross-entropy on shuffled mini-batches.  :func:`train` runs the epochs, evaluates
the full train and test losses after each one, and calls ``before_epoch(e)`` before
epoch ``e`` (where the benchmarks teleport or reset the optimizer); the seconds it
reports count training and what ``before_epoch`` does, not evaluation.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from teleopt.datasets import Digits

cross_entropy = nn.functional.cross_entropy


@dataclass
class Curves:
    """Full-batch train and test loss after each epoch (index 0: before training) and cumulative seconds."""

    train: list[float] = field(default_factory=list)
    test: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    test_accuracy: float = float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, data: Digits) -> tuple[float, float, float]:
    """(train loss, test loss, test accuracy) on the full sets."""
    train = float(cross_entropy(model(data.x_train), data.y_train))
    logits = model(data.x_test)
    return train, float(cross_entropy(logits, data.y_test)), float((logits.argmax(1) == data.y_test).float().mean())


def train(
    model: nn.Module,
    optimizer: Callable[[], torch.optim.Optimizer],
    data: Digits,
    epochs: int,
    batch_size: int,
    seed: int,
    before_epoch: Callable[[int], None] | None = None,
) -> Curves:
    """Train ``model`` with the optimizer ``optimizer()`` returns at each step (the benchmark may swap it).

    Batches are a fresh permutation of the training set per epoch, drawn from a
    generator seeded by ``seed``.
    """
    order = torch.Generator().manual_seed(seed)
    curves = Curves()
    tr, te, _ = evaluate(model, data)
    curves.train.append(tr)
    curves.test.append(te)
    curves.seconds.append(0.0)
    elapsed = 0.0
    n = len(data.x_train)
    for epoch in range(epochs):
        start = time.perf_counter()
        if before_epoch is not None:
            before_epoch(epoch)
        permutation = torch.randperm(n, generator=order)
        for i in range(0, n, batch_size):
            rows = permutation[i : i + batch_size]
            opt = optimizer()
            opt.zero_grad()
            cross_entropy(model(data.x_train[rows]), data.y_train[rows]).backward()
            opt.step()
        elapsed += time.perf_counter() - start
        tr, te, acc = evaluate(model, data)
        curves.train.append(tr)
        curves.test.append(te)
        curves.seconds.append(elapsed)
        curves.test_accuracy = acc
    return curves


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); non-finite values propagate."""
    vals = list(values)
    if not vals:
        return float("nan"), float("nan")
    if not all(math.isfinite(v) for v in vals):
        return float("nan"), float("nan")
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def first_epoch_at_or_below(curve: Sequence[float], target: float) -> int | None:
    """First epoch (index into the curve, 0 = before training) whose loss is <= target."""
    for e, v in enumerate(curve):
        if v <= target:
            return e
    return None


def median_or_none(values: Sequence[Any]) -> float | None:
    """Median of the values that are not None, if at least half of them are not None."""
    present = [v for v in values if v is not None]
    if not present or 2 * len(present) < len(values):
        return None
    return statistics.median(present)
