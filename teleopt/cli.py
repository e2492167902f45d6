"""Command line: ``python -m teleopt list`` prints the registry of group actions; ``demo`` shows teleopt at work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m teleopt`` and the ``teleopt`` script."""
    parser = argparse.ArgumentParser(prog="teleopt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the registry of known and registered group actions")
    sub.add_parser("demo", help="show what teleopt does (prints the registry for now)")
    args = parser.parse_args(argv)
    if args.command in ("list", "demo"):
        from teleopt.registry import format_table

        print(format_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
