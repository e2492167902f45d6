"""``python -m teleopt``: see :mod:`teleopt.cli`."""

import sys

from teleopt.cli import main

sys.exit(main())
