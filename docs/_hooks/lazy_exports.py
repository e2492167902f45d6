"""Griffe extension: read the ``__all__`` of teleopt's lazy packages (PEP 562).

``teleopt``, ``teleopt.testing`` and ``teleopt.analysis`` build ``__all__`` from a
``_LAZY`` table (``__all__ = [*_LAZY, ...]``), which static analysis cannot expand.
Importing those package modules is cheap (torch is imported on first attribute
access, not by the package), so the extension imports them and hands griffe the
real ``__all__``; the names resolve to the ``TYPE_CHECKING`` imports griffe sees.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import griffe

#: the checkout being documented comes first on the path (not another installed copy)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class LazyExports(griffe.Extension):
    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        if "_LAZY" in mod.members:
            mod.exports = list(importlib.import_module(mod.path).__all__)
