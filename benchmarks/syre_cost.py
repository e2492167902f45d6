"""Cost of syre: optimizer-step time and memory over a timm resnet18's parameters (issue 5).

Times ``optimizer.step()`` alone (fixed random gradients, no forward/backward, so
the overhead is not diluted by the model) for bare AdamW/Adam (``foreach=True``)
and ``Syre(AdamW(weight_decay=0))`` in several modes, interleaved round by round;
the overhead of a mode is the median over rounds of its step time divided by a
baseline's step time in the same round.  What syre replaces is the base's own
weight decay, which pulls towards zero instead of the anchor: AdamW's decoupled
``weight_decay=0.01`` for decoupled syre, Adam's coupled L2 ``weight_decay=0.01``
for coupled syre (which allocates a new gradient list per step).  Memory is what
the wrapper keeps between steps (anchors, ``D`` and the reused ``w - theta_0``
buffers) and the largest transient allocation of a step.

Run: ``python benchmarks/syre_cost.py [--quick] [--json out.json] [--plot-dir DIR]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from syre_common import finish, header, parser  # noqa: E402

from teleopt.syre import Syre  # noqa: E402

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
    """Bytes the wrapper holds between steps: anchors, eq. 7 diagonals and the reused w - theta_0 buffers."""
    if not isinstance(optimizer, Syre):
        return 0
    held = [*optimizer._anchors.values(), *optimizer._diagonals.values(), *optimizer._scratch.values()]
    return sum(t.numel() * t.element_size() for t in held)


def transient_bytes(optimizer) -> int:
    """Largest extra allocation inside one step (regenerated anchors; coupled gradients while the base steps)."""
    if not isinstance(optimizer, Syre) or optimizer.store_anchors:
        return 0
    sizes = [p.numel() * p.element_size() for _, _, p in optimizer._targets()]
    group = optimizer.param_groups[0]
    per_tensor = 1 + (group[Syre.prefix + "diagonal_eps"] > 0)  # the regenerated anchor (and D)
    if group[Syre.prefix + "decoupled"]:
        return max(sizes) * (per_tensor + (per_tensor > 1))  # + w - theta_0 for eq. 7
    return max(sizes) * per_tensor + sum(sizes)  # every new gradient is alive during the base step


def run(model: str, rounds: int, warmup: int, gamma: float) -> dict:
    template = model_parameters(model)
    generator = torch.Generator().manual_seed(0)
    optimizers = {mode: build(mode, template, generator, gamma) for mode in MODES}
    for optimizer in optimizers.values():  # materialise state and anchors
        for _ in range(warmup):
            optimizer.step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for r in range(rounds):
        for mode in order[r % len(order) :] + order[: r % len(order)]:  # rotate to spread drift
            start = time.perf_counter()
            optimizers[mode].step()
            times[mode].append(time.perf_counter() - start)
    rows = []

    def overhead(mode: str, baseline: str) -> float:
        return statistics.median(t / b for t, b in zip(times[mode], times[baseline])) - 1

    for mode in MODES:
        rows.append(
            {
                "mode": mode,
                "median_step_ms": 1e3 * statistics.median(times[mode]),
                "overhead_vs_adamw_wd": overhead(mode, BASELINE),
                "overhead_vs_adam_l2": overhead(mode, COUPLED_BASELINE),
                "overhead_vs_no_decay": overhead(mode, NO_DECAY),
                "kept_mib": kept_bytes(optimizers[mode]) / 2**20,
                "transient_mib": transient_bytes(optimizers[mode]) / 2**20,
            }
        )
    settings = {
        "model": model,
        "rounds": rounds,
        "gamma": gamma,
        "base": "AdamW(lr=1e-3, foreach=True)",
        "goal": "decoupled syre overhead <= 10% vs AdamW",
    }
    return {
        **header("syre_cost", settings),
        "parameters": sum(t.numel() for t in template),
        "parameter_mib": sum(t.numel() * t.element_size() for t in template) / 2**20,
        "rows": rows,
    }


def print_table(result: dict) -> None:
    settings = result["settings"]
    print(
        f"syre cost on {settings['model']} ({result['parameters'] / 1e6:.2f}M parameters, "
        f"{result['parameter_mib']:.1f} MiB), median of {settings['rounds']} rounds; {result['machine']}, {result['date']}"
    )
    header = f"{'mode':<22} {'step ms':>8} {'vs AdamW wd':>12} {'vs Adam L2':>11} {'vs no decay':>12} {'kept MiB':>9} {'transient MiB':>14}"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        print(
            f"{row['mode']:<22} {row['median_step_ms']:>8.1f} {100 * row['overhead_vs_adamw_wd']:>+11.1f}% "
            f"{100 * row['overhead_vs_adam_l2']:>+10.1f}% {100 * row['overhead_vs_no_decay']:>+11.1f}% "
            f"{row['kept_mib']:>9.1f} {row['transient_mib']:>14.1f}"
        )


def plot(result: dict, directory: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["mode"] not in (BASELINE, COUPLED_BASELINE)]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["mode"] for r in rows], [100 * r["overhead_vs_adamw_wd"] for r in rows])
    ax.axvline(10, color="red", linestyle="--", label="goal 10%")
    ax.set_xlabel(f"step-time overhead vs AdamW(weight_decay=0.01) [%], {result['settings']['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(directory / "syre_cost.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--model", default="resnet18", help="timm model whose parameters are used (pretrained=False)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--gamma", type=float, default=0.01)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 40)
    result = run(args.model, rounds, warmup=1 if args.quick else 3, gamma=args.gamma)
    print_table(result)
    finish(result, args, plot)
    return result


if __name__ == "__main__":
    main()
