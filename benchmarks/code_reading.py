"""How much code a reader goes through for one teleporting ``step()`` on the default fast path.

Builds a small ReLU MLP (float32, batch 16) under a base optimizer (AdamW by
default).  **By default** it wraps it in the README's configuration,
``Teleport(base, model, "auto", example_inputs=x[:4], loss_fn=..., batch_fn=...)``
and nothing else (objective ``"balance"`` every 200 steps from step 200), trains
to step 200 and traces its first teleporting step (lean, with the engine's output
check on ``batch_fn``'s batch around it: ``teleopt.teleport.lean_check``), then
trains on and traces the next one (step 400: on the lean path of
``teleopt.teleport.companion`` where it applies), and prints both counts.
With ``--grad-norm`` (a teleport through the engine's four phases,
``teleopt.teleport.engine``) it wraps the MLP with the library's defaults except the
schedule (``sites="auto"`` found on example inputs, objective ``"grad_norm"``,
default search, safety and state policy, ``every=1``), runs one teleporting step
to warm up (lazy imports, first-call set-up), then traces a second one.  Each
trace runs ``sys.setprofile`` from ``Teleport.step`` down.  Every Python function executed
whose code lies in ``teleopt/`` is collected; a function's lines are its source
span (``def`` line, decorators included, to its last line, as ``ast`` gives it).
Per file the spans are united, so a nested function, lambda or comprehension
counts once.  Reported:

* ``lines``: the united spans (docstrings, comments and blank lines included: what
  a reader scrolls through);
* ``code``: the same lines without blank lines, comments and docstrings;
* ``functions`` and ``files``: how many distinct ones ran.

Run: ``python benchmarks/code_reading.py [--grad-norm] [--base adamw|sgd] [--json out.json] [--top N]`` (it counts
the ``teleopt/`` beside it, whatever is installed).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # count this checkout's teleopt, not an installed one
import teleopt  # noqa: E402
from teleopt.teleport import Teleport  # noqa: E402

PACKAGE = Path(teleopt.__file__).resolve().parent
BASES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


@dataclass
class FileCount:
    """One file of ``teleopt/``: the functions that ran in it and their united line spans."""

    path: str
    functions: list[str] = field(default_factory=list)
    lines: int = 0
    code: int = 0


@dataclass
class Reading:
    """The whole count: totals and one :class:`FileCount` per file, largest first."""

    base: str  # the base optimizer, and for the README configuration which teleport was traced
    lines: int
    code: int
    functions: int
    files: list[FileCount]


def _spans(path: Path) -> dict[int, tuple[str, int, int]]:
    """Every function or lambda of ``path`` by the first line of its code object: (name, first line, last line).

    A code object's ``co_firstlineno`` is its first decorator's line for decorated functions.
    """
    tree = ast.parse(path.read_text(), str(path))
    out: dict[int, tuple[str, int, int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            name = getattr(node, "name", "<lambda>")
            out.setdefault(first, (name, first, node.end_lineno or node.lineno))
    return out


def _non_code_lines(path: Path) -> set[int]:
    """Lines of ``path`` that hold no code: blank, comment-only, or inside a docstring."""
    text = path.read_text()
    lines = text.splitlines()
    skip = {i + 1 for i, line in enumerate(lines) if not line.strip() or line.strip().startswith("#")}
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if isinstance(body[0].value.value, str):
                skip.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip():
            skip.add(tok.start[0])
    return skip


@contextmanager
def _traced() -> Iterator[set[CodeType]]:
    """The code objects of ``teleopt/`` called while the block runs (``sys.setprofile``)."""
    seen: set[CodeType] = set()
    root = str(PACKAGE)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(frame.f_code)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def count(codes: set[CodeType], base: str) -> Reading:
    """Sum the source spans of the traced functions per file (see module docs)."""
    by_file: dict[Path, set[CodeType]] = {}
    for code in codes:
        if code.co_name != "<module>":
            by_file.setdefault(Path(code.co_filename), set()).add(code)
    files = []
    for path, found in by_file.items():
        spans, lines, names = _spans(path), set(), set()
        for code in found:
            span = spans.get(code.co_firstlineno)
            if span is None:  # a comprehension or generator expression: inside a function that ran
                continue
            names.add(f"{span[0]}:{span[1]}")
            lines.update(range(span[1], span[2] + 1))
        code_lines = lines - _non_code_lines(path)
        rel = path.relative_to(PACKAGE.parent).as_posix()
        files.append(FileCount(rel, sorted(names, key=lambda s: int(s.rsplit(":", 1)[1])), len(lines), len(code_lines)))
    files.sort(key=lambda f: (-f.lines, f.path))
    return Reading(base, sum(f.lines for f in files), sum(f.code for f in files), sum(len(f.functions) for f in files), files)


def teleporting_step(base: str = "adamw", seed: int = 0) -> Reading:
    """Trace one teleporting ``step()`` (after a warm-up one) and count what it read."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sites="auto" says which sites it leaves out
        opt = Teleport(BASES[base](model.parameters()), model, example_inputs=x[:4], every=1)

    def step(trace: bool) -> set[CodeType]:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if not trace:
            opt.step()
            return set()
        with _traced() as seen:
            opt.step()
        return seen

    step(False)
    seen = step(True)
    report = opt.reports[-1]
    if report.path != "fast" or report.step != 1:
        raise RuntimeError(f"the traced step did not teleport on the fast path: {report.path}, {report.reason}")
    return count(seen, base)


def _mlp(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def readme_steps(base: str = "adamw", seed: int = 0) -> tuple[Reading, Reading]:
    """The README configuration's first teleporting ``step()`` (the checked one) and its second, each traced
    (the steps between them run untraced); ``base`` of each reading names the teleport and the path it took."""
    model, x, y = _mlp(seed)
    opt = Teleport(
        BASES[base](model.parameters()),
        model,
        "auto",
        example_inputs=x[:4],
        loss_fn=nn.functional.mse_loss,
        batch_fn=lambda: (x, y),
    )
    readings = []
    while len(readings) < 2:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if not opt.schedule.due(opt.record.step, opt.record.accepted):
            opt.step()
            continue
        with _traced() as seen:
            opt.step()
        report = opt.reports[-1]
        if not report.accepted:
            raise RuntimeError(f"the traced teleport at step {report.step} was not accepted: {report.reason}")
        how = "checked" if report.check != "none" else "lean"
        readings.append(count(seen, f"{base}, {report.objective} teleport at step {report.step}, {report.path} path, {how}"))
    return readings[0], readings[1]


def table(reading: Reading, top: int) -> str:
    rows = [f"{'file':<44} {'lines':>6} {'code':>6} {'funcs':>6}"]
    for f in reading.files[:top]:
        rows.append(f"{f.path:<44} {f.lines:>6} {f.code:>6} {len(f.functions):>6}")
    if len(reading.files) > top:
        rest = reading.files[top:]
        label = f"({len(rest)} more files)"
        rows.append(f"{label:<44} {sum(f.lines for f in rest):>6} {sum(f.code for f in rest):>6} {sum(len(f.functions) for f in rest):>6}")
    rows.append(f"{'total: ' + str(len(reading.files)) + ' files':<44} {reading.lines:>6} {reading.code:>6} {reading.functions:>6}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> Reading:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", choices=sorted(BASES), default="adamw", help="the base optimizer")
    parser.add_argument("--json", type=Path, default=None, help="write the count (with every function) as JSON")
    parser.add_argument("--top", type=int, default=40, help="files shown in the table")
    parser.add_argument(
        "--grad-norm",
        action="store_true",
        help='the earlier count: objective "grad_norm", every=1, no loss_fn (not the README configuration)',
    )
    args = parser.parse_args(argv)
    if args.grad_norm:
        readings = [teleporting_step(args.base)]
        titles = [f"one teleporting step() on the default fast path, grad_norm every=1, base {args.base}"]
    else:
        readings = list(readme_steps(args.base))
        titles = [f"the README configuration's {which} teleporting step(): {r.base}" for which, r in zip(("first", "second"), readings)]
    for title, reading in zip(titles, readings):
        print(f"{title}, torch {torch.__version__}")
        print(table(reading, args.top))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in readings], indent=1))
        print(f"wrote {args.json}")
    return readings[0]


if __name__ == "__main__":
    main()
