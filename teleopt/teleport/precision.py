"""The precision a model trains in, and a teleport's own arithmetic kept out of it.

Mixed-precision training runs the forward under ``torch.autocast`` (matrix products in
bfloat16 or float16, the parameters float32).  A teleport must

* compute its elements and move the parameters with autocast off (float32 or wider),
  even when ``step()`` runs inside the user's autocast region;
* never let autocast's cache of low-precision weight copies stand in for the moved
  weights: the check's forwards run with the cache off, and the cache is cleared once
  the parameters moved (a later forward in the same region casts them afresh);
* check the forward the user trains with: :class:`Precision` records the autocast state
  of the model's last forward (:class:`PrecisionRecorder`, a forward pre-hook), and the
  check runs its forwards in that precision too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.teleport.pausable import Pausable

__all__ = ["DEVICE_TYPES", "Precision", "PrecisionRecorder", "full_precision"]

#: The device types whose autocast state is read and switched.
DEVICE_TYPES = ("cpu", "cuda")


def _enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError):  # a build without that device type
        return False


@dataclass(frozen=True)
class Precision:
    """Autocast's state at one moment: ``(device type, dtype)`` for each device type where it is on
    (empty: no autocast, the forward computes in the parameters' dtype)."""

    autocast: tuple[tuple[str, torch.dtype], ...] = ()

    @classmethod
    def current(cls) -> Precision:
        """The autocast state now."""
        return cls(tuple((d, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES if _enabled(d)))

    def dtype(self, device_type: str) -> torch.dtype | None:
        """The dtype autocast computes matrix products in on ``device_type`` (``None``: autocast off)."""
        return next((dt for d, dt in self.autocast if d == device_type), None)

    def compute_dtype(self, tensors: Iterable[Tensor | None]) -> torch.dtype:
        """The least precise dtype a forward in this precision computes with ``tensors`` in: autocast's for
        float32 tensors on a device type where it is on, else each tensor's own (float64 when there is none)."""
        dtypes = [self.dtype(t.device.type) or t.dtype if t.dtype == torch.float32 else t.dtype for t in tensors if t is not None]
        return max((d for d in dtypes if d.is_floating_point), key=lambda d: torch.finfo(d).eps, default=torch.float64)

    def describe(self) -> str:
        return ", ".join(f"{str(dt).replace('torch.', '')} autocast on {d}" for d, dt in self.autocast) or "no autocast"

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run a forward inside in this precision: autocast on where it was (its weight cache off), off elsewhere."""
        with ExitStack() as stack:
            stack.enter_context(full_precision())
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype, cache_enabled=False))
            yield


_NONE = Precision()


@contextmanager
def full_precision() -> Iterator[None]:
    """Autocast off inside on every device type where it is on (a teleport's own arithmetic); autocast's
    weight cache is cleared on the way out, the parameters having maybe moved."""
    on = [d for d in DEVICE_TYPES if _enabled(d)]
    with ExitStack() as stack:
        for device_type in on:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        try:
            yield
        finally:
            if on:
                torch.clear_autocast_cache()


class PrecisionRecorder(Pausable):
    """Forward pre-hook recording the :class:`Precision` of the model's last training forward (one with
    autograd on; an evaluation under ``no_grad`` may run in another precision), else of its last forward.
    Forwards made while ``paused`` (a teleport's own) are not recorded."""

    def __init__(self) -> None:
        self.trained: Precision | None = None
        self.last: Precision | None = None
        self.paused = 0

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.paused:
            return
        # runs on every forward: without autocast (the common case) two flag reads and no allocation
        self.last = Precision.current() if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda") else _NONE
        if torch.is_grad_enabled():
            self.trained = self.last

    def training(self) -> Precision:
        """The precision the model trains in: its last training forward's, else its last forward's, else
        autocast's state now."""
        return self.trained or self.last or Precision.current()
