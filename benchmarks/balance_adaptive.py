"""Teleport's default balance against the bare base optimizer, paired over seeds, per base optimizer.

Setting: the loops of ``examples/03_torch_optimizer.py`` (digits MLP 64-64-64-10
with biases, LeakyReLU, batches of 32, lr 1e-2; ``Yogi-lr5e-3`` halves Yogi's,
``AdamW-wd`` adds AdamW's default decoupled weight decay 1e-2) and of ``examples/10_fsdp2.py`` run
in one process (the small CNN, AdamW, windows of 64), 400 steps, no Syre.  Each seed
runs the baseline and every arm from the same initial weights on the same batches;
the table gives the paired difference arm - baseline of the test accuracy (points)
and test loss: the median, each seed's, how many seeds are better/worse and the
two-sided sign-test p-value.

Arms:

* ``default``: ``Teleport(base, model, sites, loss_fn=..., batch_fn=...)``, Teleport's
  default (``objective="balance"`` every 200 steps from step 200: one teleport here);
* ``keep`` / ``reset``: the same with ``state_policy="keep"`` / ``"reset"`` instead of the
  exact transport of the moments;
* ``half``: ``Balance(fraction=0.5)``, halfway to the balanced point;
* ``null``: ``Balance(fraction=0.01)``, a move too small to matter: how far a tiny
  perturbation of the trajectory moves the test figures (the noise floor).
* ``lr-hidden`` / ``lr-head`` / ``lr-both``: no teleport; at step 200 the learning rate of
  the layers before the head times 1.3, of the head times 0.65, or both (the median
  factors the default teleport applies in the MLP under Yogi, see below).

It also prints, for seed 0, what the teleport at step 200 does in the original
coordinates: each element's learning rate is multiplied by 1/s under Adam-type bases
(Yogi, AdamW), by 1/s^2 under SGD and by 1/s times the tensor's norm ratio under Lamb
(its trust ratio), s the element's scale (``tests/test_balance_adaptive.py``
checks the identity); median and range per tensor.

Run: ``python benchmarks/balance_adaptive.py [--seeds 16] [--bases Yogi,Lamb,AdamW,SGD,cnn-AdamW]
[--arms default,keep,reset,half,null,lr-hidden,lr-head,lr-both] [--quick] [--json out.json]`` (needs the ``demo`` extra and
torch-optimizer).  Results: ``benchmarks/realistic/results/cpu_2026-11-27_balance_adaptive.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import teleopt
from teleopt.datasets import digits_mlp, hidden_rescaling_sites, load_digits
from teleopt.teleport.objectives import Balance

STEPS = 400


def _bases() -> dict[str, Callable[[Any], torch.optim.Optimizer]]:
    import torch_optimizer

    return {
        "Yogi": lambda p: torch_optimizer.Yogi(p, lr=1e-2),
        "Yogi-lr5e-3": lambda p: torch_optimizer.Yogi(p, lr=5e-3),
        "Lamb": lambda p: torch_optimizer.Lamb(p, lr=1e-2),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
        "AdamW-wd": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
        "SGD": lambda p: torch.optim.SGD(p, lr=5e-2, momentum=0.9),
        "cnn-AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    }


ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "keep": {"state_policy": "keep"},
    "reset": {"state_policy": "reset"},
    "half": {"objective": Balance(fraction=0.5)},
    "null": {"objective": Balance(fraction=0.01)},
}

#: no teleport: at step 200 the learning rate of the layers before the head / of the head times these factors
LR_SWITCH: dict[str, tuple[float, float]] = {"lr-hidden": (1.3, 1.0), "lr-head": (1.0, 0.65), "lr-both": (1.3, 0.65)}


def cnn(seed: int) -> nn.Module:
    """Example 10's CNN."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def data(base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Example 03's digits split (450 test images) for the MLP, example 10's (297) for the CNN."""
    if not base.startswith("cnn"):
        d = load_digits(seed=0)
        return d.x_train, d.y_train, d.x_test, d.y_test
    from sklearn.datasets import load_digits as sklearn_digits

    raw = sklearn_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def run(base: str, arm: str | None, seed: int, steps: int = STEPS) -> tuple[dict[str, float], nn.Module, Any]:
    """One run: test accuracy and loss; the model and the Teleport (``None`` for the baseline)."""
    xtr, ytr, xte, yte = data(base)
    model = cnn(seed) if base.startswith("cnn") else digits_mlp((64, 64), seed=seed, bias=True)
    params = list(model.parameters())
    switch = LR_SWITCH.get(arm or "")
    opt: torch.optim.Optimizer = _bases()[base]([{"params": params[:-2]}, {"params": params[-2:]}] if switch else params)
    teleport = None
    if arm is not None and not switch:
        rows_gen = torch.Generator().manual_seed(1)

        def batch_fn() -> tuple[torch.Tensor, torch.Tensor]:
            rows = torch.randint(len(xtr), (200,), generator=rows_gen)
            return xtr[rows], ytr[rows]

        sites: Any = "auto" if base.startswith("cnn") else hidden_rescaling_sites(model)
        example = {"example_inputs": (xtr[:4],)} if base.startswith("cnn") else {}
        teleport = teleopt.Teleport(opt, model, sites, loss_fn=F.cross_entropy, batch_fn=batch_fn, **ARMS[arm], **example)
        opt = teleport
    order = torch.Generator().manual_seed(2)
    for step in range(steps):
        if base.startswith("cnn"):  # example 10's windows of the global batch (2 ranks x 32)
            start = (step * 64) % (len(ytr) - 64)
            rows: Any = slice(start, start + 64)
        else:
            rows = torch.randint(len(xtr), (32,), generator=order)
        if switch and step == 200:
            for group, factor in zip(opt.param_groups, switch):
                group["lr"] *= factor
        opt.zero_grad()
        F.cross_entropy(model(xtr[rows]), ytr[rows]).backward()
        opt.step()
    with torch.no_grad():
        out = model(xte)
    return {"accuracy": float((out.argmax(1) == yte).float().mean()), "test_loss": float(F.cross_entropy(out, yte))}, model, teleport


def sign_test(better: int, worse: int) -> float:
    """Two-sided sign-test p-value (ties dropped)."""
    n = better + worse
    k = min(better, worse)
    return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def step_factors(base: str) -> str:
    """Seed 0: each tensor's per-element learning-rate factor of the default teleport at step 200, in the
    original coordinates (1/s for Adam-type bases, 1/s^2 for SGD, Lamb's times its norm ratio)."""
    _, model, _ = run(base, None, 0, 200)
    xtr, ytr, _, _ = data(base)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sites: Any = "auto" if base.startswith("cnn") else hidden_rescaling_sites(model)
    teleport = teleopt.Teleport(
        _bases()[base](model.parameters()),
        model,
        sites,
        objective="balance",
        schedule=teleopt.teleport.Schedule(),
        example_inputs=(xtr[:4],),
    )
    teleport.teleport(batch=(xtr[:200], ytr[:200]))
    power = 2 if base == "SGD" else 1
    parts = []
    for name, p in model.named_parameters():
        f = (before[name] / p.detach()).abs() ** power
        if base == "Lamb":  # its trust ratio scales the step by the tensor's (clamped) norm
            f = f * float(p.detach().norm().clamp(max=10) / before[name].norm().clamp(max=10))
        parts.append(f"{name} x{float(f.median()):.2f} [{float(f.min()):.2f}, {float(f.max()):.2f}]")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--bases", default="Yogi,Lamb,AdamW,SGD,cnn-AdamW")
    parser.add_argument("--arms", default="default,keep,reset,half,null")
    parser.add_argument("--quick", action="store_true", help="2 seeds, Yogi, the default arm")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.bases, args.arms = 2, "Yogi", "default"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="teleopt")
    results: dict[str, Any] = {}
    for base in args.bases.split(","):
        baseline = [run(base, None, s)[0] for s in range(args.seeds)]
        print(
            f"{base}: baseline test accuracy median {statistics.median(r['accuracy'] for r in baseline):.4f}, "
            f"test loss {statistics.median(r['test_loss'] for r in baseline):.4f} ({args.seeds} seeds, {STEPS} steps)"
        )
        results[base] = {"baseline": baseline}
        for arm in args.arms.split(","):
            rs = [run(base, arm, s)[0] for s in range(args.seeds)]
            da = [(r["accuracy"] - b["accuracy"]) * 100 for r, b in zip(rs, baseline)]
            dl = [r["test_loss"] - b["test_loss"] for r, b in zip(rs, baseline)]
            up, down = sum(d > 1e-6 for d in da), sum(d < -1e-6 for d in da)
            lower, higher = sum(d < 0 for d in dl), sum(d > 0 for d in dl)
            print(
                f"  {arm:8s} accuracy {statistics.median(da):+.2f} pt (seeds {' '.join(f'{d:+.1f}' for d in da)}), "
                f"better/worse {up}/{down}, p={sign_test(up, down):.2f}; test loss {statistics.median(dl):+.4f}, "
                f"lower/higher {lower}/{higher}, p={sign_test(lower, higher):.2f}"
            )
            results[base][arm] = rs
        factors = step_factors(base)
        print(f"  the teleport at step 200 (seed 0) as per-element learning-rate factors: {factors}")
        results[base]["factors"] = factors
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
