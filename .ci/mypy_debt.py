"""Known type debt outside mypy's checked core: the count may only go down.

``mypy`` (configured in pyproject.toml) must be clean on the typed core.  The rest
of ``teleopt/`` is checked here as a whole; the run fails if it reports more errors
than ``.ci/mypy-debt`` records, and asks for the record to be lowered when it
reports fewer.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("mypy-debt")


def main() -> int:
    result = subprocess.run([sys.executable, "-m", "mypy", "teleopt"], capture_output=True, text=True)
    last = (result.stdout.strip().splitlines() or [""])[-1]
    match = re.search(r"Found (\d+) errors?", last)
    if match is None and not last.startswith("Success"):
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n")
        print("mypy-debt: could not read mypy's summary line")
        return 2
    found = int(match.group(1)) if match else 0
    recorded = int(RECORD.read_text().split()[0])
    print(f"mypy-debt: {found} errors in teleopt/ (recorded {recorded})")
    if found > recorded:
        print(result.stdout[-6000:])
        print(f"mypy-debt: {found - recorded} new type error(s); fix them (the record only goes down)")
        return 1
    if found < recorded:
        print(f"mypy-debt: lower the record in {RECORD} to {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
