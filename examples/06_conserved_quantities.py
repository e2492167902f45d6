"""Example 6: the conserved quantities of your model, and what your optimizer does to them.

Every exact linear symmetry gives a quantity that gradient *flow* conserves,
Q_M = <theta, M . theta> (Zhao 2026, Prop. 2.5.1): for the ReLU units of an MLP,
the per-unit imbalance ||w_in||^2 + b^2 - ||w_out||^2 (Ex. 2.5.4).  This example

1. finds the symmetry sites of an ordinary digits MLP (``teleopt.find_symmetries``)
   and computes Q for each (``teleopt.conserved_quantities``); the permutation
   sites have none and are reported, not skipped;
2. trains four copies with a ``ConservationMonitor`` attached: plain SGD keeps Q
   up to its O(lr^2) per-step drift (App. A.4), SGD with momentum and Adam move
   it much more, and ``Teleport(SGD, objective="balance")`` moves it on purpose (each
   accepted teleport sets every unit's Q to its balanced value, a jump along the
   orbit, which the monitor records apart from the drift); it prints
   ``Teleport.summary()`` and the final training loss of Teleport(SGD) beside plain
   SGD's, its baseline (the same weights and full batch);
3. walks the model along a one-parameter curve exp(tM) . theta of the first
   site (``teleopt.orbit_curve``): the outputs stay the same while Q changes,
   so Q tells apart the equivalent networks on one orbit (Zhao 2026, Sec. 2.5).

Needs: the ``demo`` extra (scikit-learn's bundled digits): ``pip install -e ".[demo]"``.

Run: ``python examples/06_conserved_quantities.py [--steps N] [--seed S] [--quick]``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import teleopt
from teleopt.analysis import orbit_outputs
from teleopt.datasets import load_digits
from teleopt.teleport import SafetyConfig


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10)).double()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the initial weights (the same for every optimizer)")
    parser.add_argument("--quick", action="store_true", help="40 steps on 512 images (what the test suite runs)")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else args.steps
    data = load_digits(seed=0)
    n = 512 if args.quick else len(data.x_train)
    x, y = data.x_train[:n].double(), data.y_train[:n]

    # 1. sites and their conserved quantities
    model = make_model(args.seed)
    report = teleopt.find_symmetries(model, x[:8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = teleopt.conserved_quantities(model, report.sites)
    print(f"{len(report.sites)} sites; conserved quantities for {len(q)}: " + ", ".join(f"{n} {tuple(v.shape)}" for n, v in q.items()))
    for name, why in q.unavailable.items():
        print(f"  no Q for {name}: {why}")
    print(f"  ({len(caught)} warning(s) said so)")
    sites = [s for s in report.sites if s.name in q]

    # 2. the drift of Q under three optimizers and Teleport(SGD); plain SGD is the baseline of Teleport(SGD)
    drifts: dict[str, dict[str, float]] = {}
    losses: dict[str, float] = {}
    jumps, summary, reports = 0, "", []
    for label in ("SGD", "SGD+momentum", "Adam", "Teleport(SGD)"):
        model = make_model(args.seed)
        if label == "Adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        elif label == "SGD+momentum":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if label == "Teleport(SGD)":
            # a watch rollback restores the pre-teleport point (the default inverse move would keep the steps taken
            # at the teleported point, and their larger drift), so what the monitor reads besides jumps is SGD's drift
            safety = SafetyConfig(watch_restore="snapshot")
            every = max(steps // 4, 1)
            optimizer = teleopt.Teleport(optimizer, model=model, sites=sites, objective="balance", every=every, safety=safety)
        monitor = teleopt.ConservationMonitor(model, sites)
        monitor.attach(optimizer)
        for _ in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        drifts[label] = monitor.max_drift()
        with torch.no_grad():
            losses[label] = float(F.cross_entropy(model(x), y))
        if isinstance(optimizer, teleopt.Teleport):
            jumps = sum(1 for r in monitor.history if r.teleport_jump)
            summary, reports = optimizer.summary(), list(optimizer.reports)
        print(f"{label:>14}: max relative drift of Q " + ", ".join(f"{n} {d:.1e}" for n, d in drifts[label].items()))
    print(f"Teleport(SGD): {summary}; {jumps} teleport jump(s) recorded apart from the drift")
    # Teleport(SGD) against its baseline, the same SGD loop without teleopt (same weights, same full batch)
    print(f"final training loss: SGD (baseline) {losses['SGD']:.4f}, Teleport(SGD) {losses['Teleport(SGD)']:.4f}")

    # 3. along an orbit the function stays, Q moves
    model = make_model(args.seed)
    site = sites[0]
    generator = torch.randn(q[site.name].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    curve = teleopt.orbit_curve(model, site, generator, torch.linspace(0.0, 1.0, 5, dtype=torch.float64))
    with torch.no_grad():
        output_change = float((orbit_outputs(model, curve, x) - model(x)).abs().max())
    q_along = [
        float(teleopt.conserved_quantities({**dict(model.named_parameters()), **point}, site)[site.name].norm()) for point in curve.points
    ]
    print(f"along exp(tM) . theta of {site.name}: max output change {output_change:.1e}, ||Q|| " + " -> ".join(f"{v:.2f}" for v in q_along))
    return {
        "sites": report.sites,
        "quantities": q,
        "drifts": drifts,
        "jumps": jumps,
        "output_change": output_change,
        "q_along": q_along,
        "losses": losses,
        "reports": reports,
    }


if __name__ == "__main__":
    main()
