"""``python -m benchmarks.realistic``: see :mod:`benchmarks.realistic`."""

from benchmarks.realistic.run import main

raise SystemExit(main())
