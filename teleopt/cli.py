"""Command line: ``python -m teleopt demo`` shows teleopt at work; ``list`` prints the registry of group actions."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m teleopt`` and the ``teleopt`` script."""
    parser = argparse.ArgumentParser(prog="teleopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the registry of known and registered group actions")
    demo = sub.add_parser(
        "demo",
        help="train small models with and without Teleport and Syre; print a table, write a plot",
        description="Train the papers' MLP regression and a digits classifier with and without Teleport and Syre "
        "(no downloads); print a results table and write demo.png and demo.json.",
    )
    from teleopt.demo import add_arguments

    add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "list":
        from teleopt.registry import format_table

        print(format_table())
        return 0
    from teleopt.demo import main as demo_main

    return demo_main(args)


if __name__ == "__main__":
    sys.exit(main())
