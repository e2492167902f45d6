"""``python -m teleopt demo``: teleopt at work on your machine in about a minute, with no downloads.

Two small problems, each trained with and without teleopt's wrappers, from the
same seed, so every difference in a row comes from the wrapper:

* **regression**: the papers' three-layer LeakyReLU MLP regression (Zhao 2026
  Sec. 4.6.1; :func:`teleopt.datasets.mlp_regression`), full batch, with gradient
  descent (lr 1e-4) and AdaGrad (lr 0.1), each alone and under
  :class:`~teleopt.teleport.Teleport` with one exact teleport at step 5 (positive
  rescaling of both hidden layers, Zhao 2026, Ex. 1.2.4);
* **digits**: scikit-learn's bundled 8x8 digits, a 64-64-64-10 LeakyReLU MLP with
  SGD+momentum and mini-batches of 32.  Teleport: at the papers' learning rate
  1e-3 and at 1e-2, with one teleport at the first step (Zhao 2026, Sec. 5.4.2),
  and at 1e-2 with ``objective="balance"`` every 50 steps (the realistic suite's
  recommendation for SGD, docs/teleport.md "When to use which").
  Syre: weight decay 0.1 towards zero (torch's ``weight_decay``) against the same
  decay towards a random static anchor (:class:`~teleopt.syre.Syre`, Ziyin et al. 2025
  eq. 6), and Syre wrapped around Teleport.  Decay towards zero pulls the first
  hidden layer into a collapsed low-rank state (Ziyin et al. 2025, Sec. 6.3); the anchor
  does not.

It prints one table (final full-batch train loss, test loss and accuracy, rank
of the first hidden layer's features, steps and seconds to reach the loss the
row's reference run ends with, teleports accepted and the seconds they took, included in the run's time) and writes ``demo.png`` (train loss vs step and vs wall-clock seconds)
and ``demo.json`` to the output folder.  Timings are measured in this process on
a machine that may be busy: compare rows, not machines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.datasets import Digits, MLPRegression, digits_mlp, hidden_rescaling_sites, load_digits, mlp_regression
from teleopt.syre import Syre
from teleopt.teleport import Schedule, Teleport

__all__ = ["RunResult", "DemoResult", "run_demo", "plot", "main", "feature_rank"]

DEFAULT_STEPS = {"regression": 300, "digits": 1000}
QUICK_STEPS = {"regression": 300, "digits": 300}
_EVALUATIONS = 60  # points per loss curve


@dataclass
class RunResult:
    """One training run of the demo.

    Attributes
    ----------
    task, name:
        ``"regression"`` or ``"digits"``, and the run's label in the table.
    reference:
        The run whose final train loss is this run's target (``None`` for a reference run).
    panel:
        ``"teleport"`` or ``"syre"``: which comparison the run belongs to (a row of the plot).
    steps, train_loss, seconds:
        The curve: optimizer step, full-batch train loss there, training seconds
        so far (evaluation excluded).
    metrics:
        Final figures (``train_loss``, ``test_loss``, ``test_accuracy``,
        ``feature_rank``, ``teleports``, ``teleport_seconds``; ``None`` where they do
        not apply) and, once compared, ``steps_to_target`` and ``seconds_to_target``.
    """

    task: str
    name: str
    reference: str | None
    panel: str = "teleport"
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoResult:
    """All runs of one demo, with the settings and the machine they ran on."""

    runs: list[RunResult]
    settings: dict[str, Any]
    machine: str
    date: str

    def run(self, task: str, name: str) -> RunResult:
        """The run called ``name`` in ``task``."""
        for r in self.runs:
            if r.task == task and r.name == name:
                return r
        raise KeyError(f"no run {name!r} in task {task!r}")

    def table(self) -> str:
        """The results table the demo prints."""
        columns = [
            ("task", "task", "s"),
            ("name", "run", "s"),
            ("train_loss", "train loss", ".4g"),
            ("test_loss", "test loss", ".4g"),
            ("test_accuracy", "test acc", ".3f"),
            ("feature_rank", "rank", "d"),
            ("steps_to_target", "steps to ref", "d"),
            ("seconds_to_target", "s to ref", ".2f"),
            ("teleport_seconds", "teleport s", ".3f"),
            ("teleports", "teleports", "d"),
        ]
        rows = [{"task": r.task, "name": r.name, **r.metrics} for r in self.runs]
        cells = [[_cell(row.get(key), spec) for key, _, spec in columns] for row in rows]
        widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (_, title, _) in enumerate(columns)]
        lines = ["  ".join(title.ljust(w) if i < 2 else title.rjust(w) for i, ((_, title, _), w) in enumerate(zip(columns, widths)))]
        lines.append("  ".join("-" * w for w in widths))
        for c in cells:
            lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths))))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``demo.json`` holds)."""
        return {"date": self.date, "machine": self.machine, "settings": self.settings, "runs": [asdict(r) for r in self.runs]}


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def machine() -> str:
    """One line naming the machine, thread count and versions."""
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


def feature_rank(features: Tensor, rtol: float = 1e-4) -> int:
    """Numerical rank of the correlation matrix of ``features`` (samples x units), Ziyin et al. 2025, Sec. 6.3.

    Eigenvalues above ``rtol`` times the largest count.  Units whose standard
    deviation is below 1e-6 of the largest are dead and do not count.  The
    correlation (not the covariance) makes the rank blind to per-unit positive
    rescalings, which teleportation applies and which change no function.
    """
    z = features.detach().to(torch.float64)
    std = z.std(0)
    alive = std > 1e-6 * std.max()
    if int(alive.sum()) < 2:
        return int(alive.sum())
    eigenvalues = torch.linalg.eigvalsh(torch.corrcoef(z[:, alive].T))
    return int((eigenvalues > rtol * eigenvalues.max()).sum())


# ---------------------------------------------------------------------------- the runs
@dataclass
class _Arm:
    """A labelled way of building the optimizer of one run."""

    name: str
    reference: str | None
    build: Callable[[nn.Sequential, Callable[[], tuple[Tensor, Tensor]]], tuple[Optimizer, Teleport | None]]
    panel: str = "teleport"


def _regression_arms() -> list[_Arm]:
    def make(base: Callable[[nn.Module], Optimizer], teleport: bool):
        def build(model: nn.Sequential, batch_fn: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Optimizer, Teleport | None]:
            opt = base(model)
            if not teleport:
                return opt, None
            # one exact teleport before step 5's update (Zhao 2026, Sec. 4.6.1), checked on the full batch
            wrapped = Teleport(
                opt, model, hidden_rescaling_sites(model), loss_fn=MLPRegression.loss_fn, batch_fn=batch_fn, schedule=Schedule(at=[5])
            )
            return wrapped, wrapped

        return build

    def gd(model: nn.Module) -> Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-4)

    def adagrad(model: nn.Module) -> Optimizer:
        return torch.optim.Adagrad(model.parameters(), lr=0.1)

    return [
        _Arm("GD lr 1e-4", None, make(gd, False)),
        _Arm("GD lr 1e-4 + Teleport", "GD lr 1e-4", make(gd, True)),
        _Arm("AdaGrad lr 0.1", None, make(adagrad, False)),
        _Arm("AdaGrad lr 0.1 + Teleport", "AdaGrad lr 0.1", make(adagrad, True)),
    ]


_DECAY = 0.1


def _digits_arms() -> list[_Arm]:
    cross_entropy = nn.functional.cross_entropy

    def sgd(model: nn.Module, lr: float, weight_decay: float = 0.0) -> Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)

    def teleport(opt: Optimizer, model: nn.Sequential, batch_fn: Callable[[], tuple[Tensor, Tensor]]) -> Teleport:
        # one teleport before the first update (Zhao 2026, Sec. 5.4.2), checked on a 200-sample batch
        return Teleport(opt, model, hidden_rescaling_sites(model), loss_fn=cross_entropy, batch_fn=batch_fn, schedule=Schedule(at=[0]))

    def plain(lr: float, weight_decay: float = 0.0):
        return lambda model, batch_fn: (sgd(model, lr, weight_decay), None)

    def teleported(lr: float):
        def build(model: nn.Sequential, batch_fn: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Optimizer, Teleport | None]:
            t = teleport(sgd(model, lr), model, batch_fn)
            return t, t

        return build

    def balanced(lr: float):
        # the realistic suite's recommendation for SGD: least weight norm on the orbit every 50 steps from step 50
        def build(model: nn.Sequential, batch_fn: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Optimizer, Teleport | None]:
            t = Teleport(
                sgd(model, lr),
                model,
                hidden_rescaling_sites(model),
                objective="balance",
                schedule=Schedule(every=50, warmup=50),
                loss_fn=cross_entropy,
                batch_fn=batch_fn,
            )
            return t, t

        return build

    def syre(with_teleport: bool):
        def build(model: nn.Sequential, batch_fn: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Optimizer, Teleport | None]:
            inner: Optimizer = sgd(model, 1e-2)
            t = teleport(inner, model, batch_fn) if with_teleport else None
            # biases have no fan-in for the anchor scale: leave them out, as timm does for weight decay
            return Syre(t if t is not None else inner, gamma=_DECAY, sigma0=1.0, exclude_1d=True), t

        return build

    zero = f"lr 1e-2, decay {_DECAY} to zero"
    return [
        _Arm("SGD+mom lr 1e-3", None, plain(1e-3)),
        _Arm("SGD+mom lr 1e-3 + Teleport", "SGD+mom lr 1e-3", teleported(1e-3)),
        _Arm("SGD+mom lr 1e-2", None, plain(1e-2)),
        _Arm("SGD+mom lr 1e-2 + Teleport", "SGD+mom lr 1e-2", teleported(1e-2)),
        _Arm("SGD+mom lr 1e-2 + balance", "SGD+mom lr 1e-2", balanced(1e-2)),
        _Arm(zero, None, plain(1e-2, _DECAY), "syre"),
        _Arm(f"lr 1e-2, Syre {_DECAY}", zero, syre(False), "syre"),
        _Arm(f"lr 1e-2, Syre {_DECAY} + Teleport", zero, syre(True), "syre"),
    ]


class _Setup(NamedTuple):
    """A task's model, full training set, minibatch and teleport-batch draws and loss."""

    model: nn.Sequential
    full: tuple[Tensor, Tensor]
    batch: Callable[[], tuple[Tensor, Tensor]]
    teleport_batch: Callable[[], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Tensor, Tensor], Tensor]


def _regression_setup(seed: int) -> _Setup:
    problem = mlp_regression(seed)
    full = (problem.inputs, problem.targets)

    def batch() -> tuple[Tensor, Tensor]:
        return full

    # full-batch training: the teleport is checked on the same batch
    return _Setup(problem.model, full, batch, batch, MLPRegression.loss_fn)


def _digits_setup(data: Digits, seed: int) -> _Setup:
    model = digits_mlp((64, 64), seed, bias=True)
    n = len(data.x_train)
    generator, teleport_generator = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)

    def batch() -> tuple[Tensor, Tensor]:
        rows = torch.randint(n, (32,), generator=generator)
        return data.x_train[rows], data.y_train[rows]

    def teleport_batch() -> tuple[Tensor, Tensor]:
        rows = torch.randint(n, (200,), generator=teleport_generator)
        return data.x_train[rows], data.y_train[rows]

    return _Setup(model, (data.x_train, data.y_train), batch, teleport_batch, nn.functional.cross_entropy)


def _train(task: str, arm: _Arm, steps: int, seed: int, data: Digits | None, tick: Callable[[], None]) -> RunResult:
    result = RunResult(task, arm.name, arm.reference, arm.panel)
    if task == "regression":
        setup = _regression_setup(seed)
    else:
        assert data is not None
        setup = _digits_setup(data, seed)
    model, full, loss_fn = setup.model, setup.full, setup.loss_fn
    optimizer, teleport = arm.build(model, setup.teleport_batch)
    every = max(1, steps // _EVALUATIONS)

    def evaluate(step: int, elapsed: float) -> None:
        with torch.no_grad():
            result.steps.append(step)
            result.train_loss.append(float(loss_fn(model(full[0]), full[1])))
            result.seconds.append(elapsed)

    elapsed = 0.0
    evaluate(0, 0.0)
    for step in range(steps):
        start = time.perf_counter()
        x, y = setup.batch()
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        elapsed += time.perf_counter() - start
        tick()
        if (step + 1) % every == 0 or step + 1 == steps:
            evaluate(step + 1, elapsed)
    result.metrics.update(_teleport_metrics(teleport))
    result.metrics["train_loss"] = result.train_loss[-1]
    if data is not None and task == "digits":
        result.metrics.update(_test_metrics(model, data))
    return result


def _teleport_metrics(teleport: Teleport | None) -> dict[str, Any]:
    """Accepted teleports (not counting watch rollbacks) and the seconds all teleports took; None without Teleport."""
    if teleport is None:
        return {"teleports": None, "teleport_seconds": None}
    accepted = [r for r in teleport.reports if r.accepted and r.path != "watch"]
    return {"teleports": len(accepted), "teleport_seconds": sum(r.time_s for r in teleport.reports)}


@torch.no_grad()
def _test_metrics(model: nn.Sequential, data: Digits) -> dict[str, Any]:
    logits = model(data.x_test)
    return {
        "test_loss": float(nn.functional.cross_entropy(logits, data.y_test)),
        "test_accuracy": float((logits.argmax(1) == data.y_test).float().mean()),
        "feature_rank": feature_rank(model[1](model[0](data.x_train))),
    }


def _compare(runs: Sequence[RunResult]) -> None:
    """Steps and seconds each run needs to reach its reference run's final train loss."""
    by_name = {(r.task, r.name): r for r in runs}
    for r in runs:
        ref = by_name[(r.task, r.reference)] if r.reference is not None else r
        target = ref.train_loss[-1]
        hit = next((i for i, v in enumerate(r.train_loss) if v <= target), None)
        r.metrics["steps_to_target"] = None if hit is None else r.steps[hit]
        r.metrics["seconds_to_target"] = None if hit is None else r.seconds[hit]


def run_demo(
    steps: int | None = None,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
    tasks: Sequence[str] = ("regression", "digits"),
) -> DemoResult:
    """Train every run of the demo and return the results (see the module docs).

    ``steps`` overrides the number of optimizer steps of every run (default 300
    for the regression, 1000 for digits; ``quick``: 300 each).  ``tasks`` selects
    ``"regression"`` and/or ``"digits"`` (digits needs scikit-learn).
    """
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 10):
        raise ValueError(f"steps must be an int >= 10, got {steps!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    unknown = set(tasks) - {"regression", "digits"}
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of ('regression', 'digits'), got {tuple(tasks)!r}")
    from tqdm.auto import tqdm

    counts = {t: steps if steps is not None else (QUICK_STEPS if quick else DEFAULT_STEPS)[t] for t in tasks}
    plan = [(t, arm) for t in tasks for arm in (_regression_arms() if t == "regression" else _digits_arms())]
    data = load_digits(seed) if "digits" in tasks else None
    runs = []
    with tqdm(total=sum(counts[t] for t, _ in plan), desc="teleopt demo", unit="step", disable=not progress, leave=False) as bar:
        for task, arm in plan:
            bar.set_postfix_str(f"{task}: {arm.name}")
            runs.append(_train(task, arm, counts[task], seed, data, lambda: bar.update(1)))
    _compare(runs)
    settings = {"steps": counts, "seed": seed, "quick": quick, "torch_threads": torch.get_num_threads()}
    return DemoResult(runs, settings, machine(), datetime.datetime.now().isoformat(timespec="seconds"))


def plot(result: DemoResult, path: str | Path) -> Path:
    """Train loss vs step (left) and vs training seconds (right), one row per comparison; written as PNG.

    A run and the same run under Teleport share a colour; Teleport runs are dashed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.task, r.panel) for r in result.runs))
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.8 * len(panels)), squeeze=False)
    titles = {
        ("regression", "teleport"): "MLP regression (Zhao 2026, Sec. 4.6.1), full batch: Teleport",
        ("digits", "teleport"): "digits, 64-64-64-10 MLP, SGD+momentum, batch 32: Teleport",
        ("digits", "syre"): f"digits, same MLP, lr 1e-2: weight decay {_DECAY} towards zero vs towards Syre's anchor",
    }
    for row, (task, panel) in enumerate(panels):
        runs = [r for r in result.runs if (r.task, r.panel) == (task, panel)]
        families = list(dict.fromkeys(r.name.removesuffix(" + Teleport") for r in runs))
        for r in runs:
            colour = f"C{families.index(r.name.removesuffix(' + Teleport'))}"
            style = "--" if r.name.endswith("Teleport") else "-"
            for col, xs in enumerate((r.steps, r.seconds)):
                axes[row][col].plot(xs, r.train_loss, style, color=colour, label=r.name)
        for col, xlabel in enumerate(("optimizer step", "training seconds (this machine, teleports included)")):
            ax = axes[row][col]
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("full-batch train loss")
            ax.set_title(titles.get((task, panel), f"{task}: {panel}"), fontsize=9)
        axes[row][0].legend(fontsize=7)
    fig.suptitle(f"teleopt demo (seed {result.settings['seed']}; {result.machine})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    """Run the demo from arguments parsed by :func:`teleopt.cli.build_parser`: print the table, write ``demo.json`` and ``demo.png``."""
    try:
        import sklearn  # noqa: F401
    except ImportError:
        raise SystemExit('teleopt demo needs scikit-learn and matplotlib: pip install -e ".[demo]"') from None
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = run_demo(args.steps, args.seed, args.quick, progress=not args.no_progress)
    finally:
        torch.set_num_threads(threads)
    print(f"teleopt demo: seed {args.seed}, {result.machine}, {result.date}")
    print(result.table())
    print(
        "steps/s to ref: when the run first reaches the final train loss of the run it is compared with "
        "(the one without the wrapper); rank: rank of the first hidden layer's features (digits, of 64)."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps(result.to_dict(), indent=1))
    written = [args.out / "demo.json"]
    if not args.no_plot:
        written.append(plot(result, args.out / "demo.png"))
    print(f"wrote {', '.join(str(p) for p in written)} in {time.perf_counter() - start:.1f} s")
    return 0
