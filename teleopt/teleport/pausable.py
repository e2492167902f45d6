"""A forward hook that a teleport can pause: its own forwards are not the training loop's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Pausable"]


class Pausable:
    """Base of the recording hooks of :mod:`teleopt.teleport.check` and :mod:`teleopt.teleport.precision`:
    ``paused`` counts the nested :meth:`pause` blocks in which a hook records nothing."""

    paused: int = 0

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Record nothing inside (the teleport's own forwards)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1
