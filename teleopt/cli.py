"""Command line: ``python -m teleopt demo`` shows teleopt at work; ``list`` prints the registry of group actions.

Parsing needs only the standard library: ``--help``, ``--version`` and argument
errors answer without importing torch; the command's module is imported after
the arguments are checked.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from teleopt._version import __version__

__all__ = ["build_parser", "main"]


def _at_least(minimum: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {value}")
        return value

    return parse


def _output_folder(text: str) -> Path:
    """A folder that exists or can be created (checked before any training runs)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text!r} exists and is not a folder")
    parent = next((p for p in [path, *path.parents] if p.exists()), Path("."))
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text!r}: {parent} is not a folder")
    return path


def build_parser() -> argparse.ArgumentParser:
    """The ``teleopt`` argument parser (standard library only)."""
    parser = argparse.ArgumentParser(
        prog="teleopt", description="teleopt: parameter-space symmetries for everyday PyTorch training (demo, registry)."
    )
    parser.add_argument("--version", action="version", version=f"teleopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,list}")
    sub.add_parser("list", help="print the registry of known and registered group actions")
    demo = sub.add_parser(
        "demo",
        help="train small models with and without Teleport and Syre; print a table, write a plot",
        description="Train the papers' MLP regression and a digits classifier with and without Teleport and Syre "
        "(no downloads); print a results table and write demo.png and demo.json.",
    )
    demo.add_argument(
        "--steps", type=_at_least(10, "--steps"), default=None, help="optimizer steps per run (default: 300 regression, 1000 digits)"
    )
    demo.add_argument("--seed", type=_at_least(0, "--seed"), default=0, help="seed of data order, initialisation and teleport batches")
    demo.add_argument(
        "--out", type=_output_folder, default=Path("teleopt-demo"), help="folder for demo.png and demo.json (default: ./teleopt-demo)"
    )
    demo.add_argument("--quick", action="store_true", help="reduced run (300 steps per run, well under a minute)")
    demo.add_argument("--threads", type=_at_least(1, "--threads"), default=1, help="torch CPU threads (default 1: these models are tiny)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--no-plot", action="store_true", help="skip demo.png (no matplotlib needed)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m teleopt`` and the ``teleopt`` script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "list":
        from teleopt.registry import format_table

        print(format_table())
        return 0
    from teleopt.demo import main as demo_main

    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
