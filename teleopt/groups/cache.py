"""What the groups remember about their elements: an owned cache with a lifetime, not a module global.

Actions build a group per call, so facts about an element that are costly to
recompute (a GL element's contragredient g^-T, the eigendecomposition of a
symmetric boundary point, a block matrix copied to another device) are kept by
element: each entry holds a weak reference to the element and its version, and
is used only while the element lives unchanged (same object, no in-place write).

A :class:`GroupCache` belongs to whoever creates it; it is read and written only
while it is active (``with cache.active():``), by the code running in that block
(a ``contextvars`` context: threads and tasks do not share it).  ``Teleport``
owns one per teleport (plan to verify); :func:`remembering_placements` owns one
for the device copies of one apply.  With no active cache nothing is remembered
and every value is computed afresh: the same values, more work.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor

__all__ = ["GroupCache", "active_cache", "active_placements", "remembering_placements"]

_Entry = tuple["weakref.ref[Tensor]", int, Any]


class GroupCache:
    """Values remembered per live element, in named tables of at most ``size`` entries (oldest dropped first)."""

    def __init__(self, size: int = 64) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size must be a positive int, got {size!r}")
        self.size = size
        self.tables: dict[str, OrderedDict[Hashable, _Entry]] = {}

    def get(self, table: str, g: Tensor, key: Hashable) -> Any:
        """The value remembered under ``key`` for ``g``, or ``None`` (another element, or ``g`` changed since)."""
        entries = self.tables.get(table)
        hit = None if entries is None else entries.get(key)
        return hit[2] if hit is not None and hit[0]() is g and hit[1] == g._version else None

    def put(self, table: str, g: Tensor, key: Hashable, value: Any) -> None:
        """Remember ``value`` for ``g`` under ``key`` until ``g`` dies, changes, or ``size`` newer entries push it out."""
        entries = self.tables.setdefault(table, OrderedDict())

        def forget(_: object, entries: OrderedDict[Hashable, _Entry] = entries, key: Hashable = key) -> None:
            entries.pop(key, None)

        entries[key] = (weakref.ref(g, forget), g._version, value)
        entries.move_to_end(key)
        while len(entries) > self.size:
            entries.popitem(last=False)

    def keys(self, table: str) -> list[Hashable]:
        """The keys of ``table`` now held."""
        return list(self.tables.get(table, {}))

    @contextmanager
    def active(self) -> Iterator[GroupCache]:
        """Make this the cache the groups use inside the block (the enclosing one again afterwards)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


#: the cache in use in this context (None: nothing is remembered)
_ACTIVE: ContextVar[GroupCache | None] = ContextVar("teleopt_group_cache", default=None)
#: the device copies of the apply running in this context (None: outside an apply)
_PLACEMENTS: ContextVar[GroupCache | None] = ContextVar("teleopt_group_placements", default=None)


def active_cache() -> GroupCache | None:
    """The cache of the enclosing :meth:`GroupCache.active` block, if any."""
    return _ACTIVE.get()


def active_placements() -> GroupCache | None:
    """The device copies of the enclosing :func:`remembering_placements` block, if any."""
    return _PLACEMENTS.get()


@contextmanager
def remembering_placements() -> Iterator[None]:
    """Inside, a GL element's block matrices copied to another device are remembered for the other tensors it
    moves; forgotten on exit of the outermost block, however long the element itself lives (a teleport's
    report keeps its elements)."""
    if _PLACEMENTS.get() is not None:
        yield
        return
    token = _PLACEMENTS.set(GroupCache(size=128))
    try:
        yield
    finally:
        _PLACEMENTS.reset(token)
