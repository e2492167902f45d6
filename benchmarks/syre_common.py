"""Shared plumbing of the syre benchmarks: command line, machine description, tables, JSON, digits data."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch


def parser(doc: str) -> argparse.ArgumentParser:
    """``--quick``, ``--json PATH``, ``--plot-dir DIR``, ``--threads N`` for every syre benchmark."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced run (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="write the printed figures as JSON")
    p.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here (default: next to --json)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 keeps shared machines quiet)")
    return p


def machine() -> str:
    """One line naming the machine and library versions (for the result tables)."""
    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), "
        f"python {sys.version.split()[0]}, torch {torch.__version__}"
    )


def header(benchmark: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The common head of a result dict."""
    return {"benchmark": benchmark, "date": date.today().isoformat(), "machine": machine(), "settings": settings}


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print rows as a table; columns are (key, title, format spec)."""
    widths = [max(len(title), *(len(format(row[key], spec)) for row in rows)) for key, title, spec in columns]
    print("  ".join(title.rjust(w) for (_, title, _), w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(format(row[key], spec).rjust(w) for (key, _, spec), w in zip(columns, widths)))


def finish(result: dict[str, Any], args: argparse.Namespace, plot=None) -> None:
    """Write ``--json`` and, where a plot function is given, the PNG (``--plot-dir`` or next to the JSON)."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    directory = args.plot_dir or (args.json.parent if args.json is not None else None)
    if plot is not None and directory is not None:
        import matplotlib

        matplotlib.use("Agg")
        directory.mkdir(parents=True, exist_ok=True)
        plot(result, directory)


def digits(seed: int = 0, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits via :func:`teleopt.datasets.load_digits` as (x_train, y_train, x_test, y_test)."""
    from teleopt.datasets import load_digits

    d = load_digits(seed=seed, alpha=alpha)
    return d.x_train, d.y_train, d.x_test, d.y_test
