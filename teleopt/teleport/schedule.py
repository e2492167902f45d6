"""When to teleport: the schedule K of Zhao 2026, Algorithm 1 (Sec. 4.3, 4.6.3).

Steps are counted from 0: step t is the t-th call of ``Teleport.step()``, and a
teleport at step t happens *before* the base optimizer's t-th update, exactly as
in Algorithm 1 (lines 2-6).  A schedule is one of

* ``every=k``: t = warmup, warmup + k, warmup + 2k, ...;
* ``at={5, 100}``: an explicit set of steps;
* ``when=callable(t) -> bool``;
* none of these: the objective's default schedule
  (:meth:`Objective.default_schedule <teleopt.teleport.objectives.Objective.default_schedule>`:
  every 200 steps from step 200 for ``"balance"``), else only when
  ``Teleport.teleport()`` is called.  No default schedule fires at step 0.

``warmup`` skips every step before it, ``batches`` is the number of teleport
batches per teleport (Zhao 2026, Sec. 4.6.3 teleports on several mini-batches
in turn; with a ``batch_fn`` each draws one batch), ``max_teleports`` stops
teleporting after that many accepted ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["Schedule"]


def _int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


class Schedule:
    """A teleport schedule (see module docs).

    Parameters
    ----------
    every, at, when:
        At most one of them; none means teleports happen only on request.
    warmup:
        No scheduled teleport before this step.
    batches:
        Number of teleport batches per scheduled teleport.
    max_teleports:
        Stop after this many accepted teleports (``None``: no limit).
    """

    def __init__(
        self,
        every: int | None = None,
        at: Iterable[int] | None = None,
        when: Callable[[int], bool] | None = None,
        warmup: int = 0,
        batches: int = 1,
        max_teleports: int | None = None,
    ) -> None:
        given = [name for name, v in (("every", every), ("at", at), ("when", when)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of every, at, when; got {', '.join(given)}")
        self.every = None if every is None else _int(every, "every", 1)
        if at is not None:
            if isinstance(at, (str, bytes)) or not isinstance(at, Iterable):
                raise TypeError(f"at must be an iterable of step numbers, got {type(at).__name__}")
            at = frozenset(_int(t, "each step in at", 0) for t in at)
        self.at: frozenset[int] | None = at
        if when is not None and not callable(when):
            raise TypeError(f"when must be callable(step) -> bool, got {type(when).__name__}")
        self.when = when
        self.warmup = _int(warmup, "warmup", 0)
        self.batches = _int(batches, "batches", 1)
        self.max_teleports = None if max_teleports is None else _int(max_teleports, "max_teleports", 1)

    #: The quiet steps found last (:meth:`quiet`): steps in [lo, hi) at ``accepted`` teleports with ``within``.
    _window: tuple[int, float, int, int] = (0, 0.0, -1, -1)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name != "_window":  # a changed schedule has other quiet steps
            super().__setattr__("_window", Schedule._window)

    @property
    def manual(self) -> bool:
        """True when teleports happen only on request."""
        return self.every is None and self.at is None and self.when is None

    def due(self, step: int, accepted: int) -> bool:
        """Whether a teleport is scheduled before the base update of ``step``."""
        if self.manual or step < self.warmup:
            return False
        if self.max_teleports is not None and accepted >= self.max_teleports:
            return False
        if self.every is not None:
            return (step - self.warmup) % self.every == 0
        if self.at is not None:
            return step in self.at
        return self.when is not None and bool(self.when(step))

    def soon(self, step: int, accepted: int, within: int) -> bool:
        """Whether ``every`` or ``at`` schedules a teleport in steps ``step + 1 .. step + within`` (``when``
        callables and manual schedules are not asked ahead: ``False``).  O(1) for ``every``."""
        if self.manual or self.when is not None or step + within < self.warmup:
            return False
        if self.max_teleports is not None and accepted >= self.max_teleports:
            return False
        if self.every is not None:
            first = max(step + 1, self.warmup)
            return first + (-(first - self.warmup)) % self.every <= step + within
        return self.at is not None and any(step + j in self.at for j in range(1, within + 1))

    def quiet(self, step: int, accepted: int, within: int) -> bool:
        """``not due(step, accepted) and not soon(step, accepted, within)``, for a step that must cost little.

        ``every`` and manual schedules (and one whose ``max_teleports`` are used up) answer from the window of
        quiet steps found last, two integer comparisons; ``at`` and ``when`` schedules answer ``False`` (the
        caller asks :meth:`due` and :meth:`soon`: a ``when`` callable is called once per step, by them)."""
        lo, hi, known, near = self._window
        if lo <= step < hi and known == accepted and near == within:
            return True
        return self._open_window(step, accepted, within)

    def _open_window(self, step: int, accepted: int, within: int) -> bool:
        """:meth:`quiet` without the window; opens the window of quiet steps from ``step`` where there is one."""
        if self.when is not None or self.at is not None:
            return False
        hi: float = math.inf
        if self.every is not None and (self.max_teleports is None or accepted < self.max_teleports):
            due = self.warmup if step <= self.warmup else step + (-(step - self.warmup)) % self.every  # the next due
            hi = due - within  # from there on a teleport is due within `within` steps (soon) or now (due)
        if step >= hi:
            return False
        self._window = (step, hi, accepted, within)
        return True

    def __repr__(self) -> str:
        if self.every is not None:
            what = f"every={self.every}"
        elif self.at is not None:
            what = f"at={sorted(self.at)}"
        elif self.when is not None:
            what = f"when={self.when!r}"
        else:
            what = "manual"
        return f"Schedule({what}, warmup={self.warmup}, batches={self.batches}, max_teleports={self.max_teleports})"
