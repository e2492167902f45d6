"""Cost of syre: optimizer-step time and memory over a timm resnet18's parameters (issue 5).

Times ``optimizer.step()`` alone (fixed random gradients, no forward/backward, so
the overhead is not diluted by the model) for bare AdamW/Adam (``foreach=True``)
and ``Syre(AdamW(weight_decay=0))`` in several modes, interleaved round by round;
the overhead of a mode is the median over rounds of its step time divided by a
baseline's step time in the same round.  What syre replaces is the base's own
weight decay, which pulls towards zero instead of the anchor: AdamW's decoupled
``weight_decay=0.01`` for decoupled syre, Adam's coupled L2 ``weight_decay=0.01``
for coupled syre (both allocate a new gradient list per step).  Memory is what the wrapper keeps between steps (anchors
and ``D``) and the largest transient buffer one step allocates.

Run: ``python benchmarks/syre_cost.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from teleopt.syre import Syre

MODES = {
    # name: (syre options or None for a bare optimizer, base weight decay); the base is AdamW(foreach=True)
    # except for "adam L2", torch's coupled weight decay (Adam(weight_decay=...)), what coupled syre replaces.
    "adamw (wd=0.01)": (None, 0.01),
    "adam L2 (wd=0.01)": (None, 0.01),
    "adamw (wd=0)": (None, 0.0),
    "syre decoupled": ({"decoupled": True}, 0.0),
    "syre coupled": ({"decoupled": False}, 0.0),
    "syre decoupled eq.7": ({"decoupled": True, "diagonal_eps": 0.1}, 0.0),
    "syre decoupled regen": ({"decoupled": True, "store_anchors": False}, 0.0),
    "syre coupled regen": ({"decoupled": False, "store_anchors": False}, 0.0),
}
BASELINE = "adamw (wd=0.01)"
COUPLED_BASELINE = "adam L2 (wd=0.01)"
NO_DECAY = "adamw (wd=0)"


def model_parameters(name: str) -> list[torch.Tensor]:
    import timm

    return [p.detach() for p in timm.create_model(name, pretrained=False).parameters()]


def build(mode: str, template: list[torch.Tensor], generator: torch.Generator, gamma: float):
    options, weight_decay = MODES[mode]
    params = [torch.nn.Parameter(t.clone()) for t in template]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    if mode == COUPLED_BASELINE:
        return torch.optim.Adam(params, lr=1e-3, weight_decay=weight_decay, foreach=True)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=weight_decay, foreach=True)
    if options is not None:
        optimizer = Syre(optimizer, gamma=gamma, exclude_1d=True, **options)
    return optimizer


def kept_bytes(optimizer) -> int:
    if not isinstance(optimizer, Syre):
        return 0
    tensors = list(optimizer._anchors.values()) + list(optimizer._diagonals.values())
    return sum(t.numel() * t.element_size() for t in tensors)


def transient_bytes(optimizer) -> int:
    """Largest buffer a step allocates beyond the base: coupled gradients, eq. 7 differences, regenerated anchors."""
    if not isinstance(optimizer, Syre):
        return 0
    params = [p for _, _, p in optimizer._targets()]
    sizes = [p.numel() * p.element_size() for p in params]
    group = optimizer.param_groups[0]
    decoupled = group[Syre.prefix + "decoupled"]
    with_d = group[Syre.prefix + "diagonal_eps"] > 0
    if not optimizer.store_anchors:
        # one regenerated anchor (+ its difference) at a time, plus all new gradients when coupled
        return max(sizes) * (1 if decoupled else 2) + (0 if decoupled else sum(sizes))
    if decoupled and not with_d:
        return 0  # in-place lerp towards the anchor
    return sum(sizes) * (1 if decoupled else 2)  # differences (+ new gradients)


def run(model: str, rounds: int, warmup: int, gamma: float, threads: int) -> dict:
    torch.set_num_threads(threads)
    template = model_parameters(model)
    generator = torch.Generator().manual_seed(0)
    optimizers = {mode: build(mode, template, generator, gamma) for mode in MODES}
    for optimizer in optimizers.values():  # materialise state and anchors
        for _ in range(warmup):
            optimizer.step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for r in range(rounds):
        for mode in order[r % len(order):] + order[: r % len(order)]:  # rotate to spread drift
            start = time.perf_counter()
            optimizers[mode].step()
            times[mode].append(time.perf_counter() - start)
    rows = []
    def overhead(mode: str, baseline: str) -> float:
        return statistics.median(t / b for t, b in zip(times[mode], times[baseline])) - 1

    for mode in MODES:
        rows.append({
            "mode": mode,
            "median_step_ms": 1e3 * statistics.median(times[mode]),
            "overhead_vs_adamw_wd": overhead(mode, BASELINE),
            "overhead_vs_adam_l2": overhead(mode, COUPLED_BASELINE),
            "overhead_vs_no_decay": overhead(mode, NO_DECAY),
            "kept_mib": kept_bytes(optimizers[mode]) / 2**20,
            "transient_mib": transient_bytes(optimizers[mode]) / 2**20,
        })
    n_params = sum(t.numel() for t in template)
    return {
        "benchmark": "syre_cost",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} thread(s), torch {torch.__version__}".strip(),
        "model": model,
        "parameters": n_params,
        "parameter_mib": sum(t.numel() * t.element_size() for t in template) / 2**20,
        "rounds": rounds,
        "gamma": gamma,
        "goal": "syre decoupled overhead <= 10% vs AdamW",
        "rows": rows,
    }


def print_table(result: dict) -> None:
    print(f"syre cost on {result['model']} ({result['parameters'] / 1e6:.2f}M parameters, "
          f"{result['parameter_mib']:.1f} MiB), {result['rounds']} rounds, {result['machine']}, {result['date']}")
    header = (f"{'mode':<22} {'step ms':>8} {'vs AdamW wd':>12} {'vs Adam L2':>11} {'vs no decay':>12} "
              f"{'kept MiB':>9} {'transient MiB':>14}")
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        print(f"{row['mode']:<22} {row['median_step_ms']:>8.1f} {100 * row['overhead_vs_adamw_wd']:>+11.1f}% "
              f"{100 * row['overhead_vs_adam_l2']:>+10.1f}% {100 * row['overhead_vs_no_decay']:>+11.1f}% "
              f"{row['kept_mib']:>9.1f} {row['transient_mib']:>14.1f}")


def plot(result: dict, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["mode"] not in (BASELINE, COUPLED_BASELINE)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["mode"] for r in rows], [100 * r["overhead_vs_adamw_wd"] for r in rows])
    ax.axvline(10, color="red", linestyle="--", label="goal 10%")
    ax.set_xlabel(f"step-time overhead vs AdamW(weight_decay=0.01) [%], {result['model']}")
    ax.legend()
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "syre_cost.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke run)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--gamma", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps shared machines quieter)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 40)
    result = run(args.model, rounds, warmup=1 if args.quick else 3, gamma=args.gamma, threads=args.threads)
    print_table(result)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    plot_dir = args.plot_dir or (args.json.parent if args.json is not None else None)
    if plot_dir is not None:
        plot(result, plot_dir)
    return result


if __name__ == "__main__":
    main()
