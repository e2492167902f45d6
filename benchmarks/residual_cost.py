"""What the residual-stream rotation costs a teleport, kept or left out (docs/residual-stream.md).

On ``teleport_cost.py``'s 4-layer Llama (transformers ``LlamaConfig``, Adam, one thread), one teleport
right after a backward, ``teleport(batch=...)`` with ``loss_fn`` and ``batch_fn`` (the README's checked
configuration), for each objective: with the sites ``"auto"`` keeps under ``"balance"``, with and without
the gained residual rotation, passed explicitly.  ``"auto"`` keeps the rotation only under a closed-form objective (``"balance"``): under a
searched one its point-reading gradient transport runs, with the attention sites sharing its axes, under
autograd at every ascent step.  Prints CPU seconds per teleport (median of ``--reps``) and the ratio to an
iteration.

Run: ``python benchmarks/residual_cost.py [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import teleport_cost as tc  # noqa: E402

from teleopt.teleport import Schedule, Teleport  # noqa: E402


def _teleport(objective: str, with_rotation: bool) -> Teleport:
    model, _, (x, y) = tc._llama(4, lora=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = Teleport(torch.optim.Adam(model.parameters(), lr=1e-4), model, "auto", example_inputs=x[:2], objective="balance").sites
        chosen = [s for s in kept if with_rotation or not s.name.startswith("residual_rotation")]
        opt = Teleport(
            torch.optim.Adam(model.parameters(), lr=1e-4),
            model,
            chosen,
            example_inputs=x[:2],
            loss_fn=tc.lm_loss,
            batch_fn=lambda: (x, y),
            objective=objective,
            schedule=Schedule(),
        )
    opt.batch = (x, y)  # type: ignore[attr-defined]
    return opt


def measure(objective: str, with_rotation: bool, reps: int) -> dict[str, Any]:
    """CPU seconds of an iteration and of one checked teleport after a backward (medians of ``reps``)."""
    opt = _teleport(objective, with_rotation)
    x, y = opt.batch  # type: ignore[attr-defined]
    model = opt.module

    def iteration() -> None:
        opt.zero_grad()
        tc.lm_loss(model(x), y).backward()
        opt.step()

    iteration()
    iters, teleports, accepted = [], [], 0
    for _ in range(reps):
        start = time.process_time()
        iteration()
        iters.append(time.process_time() - start)
        opt.zero_grad()
        tc.lm_loss(model(x), y).backward()
        start = time.process_time()
        report = opt.teleport(batch=(x, y))
        teleports.append(time.process_time() - start)
        accepted += report.accepted
    sites = [s.name for s in opt.sites]
    it, tp = statistics.median(iters), statistics.median(teleports)
    return {
        "objective": objective,
        "rotation": any(n.startswith("residual_rotation") for n in sites),
        "sites": len(sites),
        "iteration_s": it,
        "teleport_s": tp,
        "teleport_over_iteration": tp / it,
        "accepted": accepted,
        "reps": reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 5")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    reps = 2 if args.quick else 5
    rows = [measure(obj, rot, reps) for obj in ("balance", "grad_norm") for rot in (False, True)]
    print(f"residual rotation cost, 4-layer Llama, Adam, torch {torch.__version__}, one thread, median of {reps}")
    print(f"{'objective':10} {'rotation':>8} {'sites':>5} {'iter s':>7} {'teleport s':>10} {'/iter':>7} {'accepted':>8}")
    for r in rows:
        print(
            f"{r['objective']:10} {'kept' if r['rotation'] else 'out':>8} {r['sites']:>5} {r['iteration_s']:>7.3f} "
            f"{r['teleport_s']:>10.3f} {r['teleport_over_iteration']:>7.1f} {r['accepted']:>4}/{r['reps']}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
