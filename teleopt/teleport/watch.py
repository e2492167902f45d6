"""The watch after a teleport and the counters a ``Teleport`` keeps, as typed records.

For ``SafetyConfig.watch_steps`` steps after an accepted teleport a :class:`Watch`
keeps a snapshot of everything the teleport touched and the gradient and loss
scales at the teleport; if a gradient or the loss blows up in that window, the
snapshot is restored (see :mod:`teleopt.teleport.safety`).  :class:`TeleportRecord`
holds the step and teleport counters and the backoff of the caps.  Both serialise
to plain data (tensors, ints, floats) for ``state_dict`` and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.sharding import is_sharded, local, square_sum
from teleopt.site import lookup_tensor
from teleopt.teleport.distributed import any_rank
from teleopt.teleport.safety import Snapshot

__all__ = ["Watch", "TeleportRecord"]


@dataclass
class Watch:
    """An accepted teleport under watch until step ``until`` (see module docs).

    ``grad_ref`` is the squared gradient norm to compare with (the larger of before
    and after the teleport), ``loss_ref`` the pre-teleport loss; ``why`` says what
    triggered a rollback.
    """

    snapshot: Snapshot
    until: int
    teleport_step: int
    grad_ref: float
    loss_ref: float | None
    why: str = ""

    def alarm(self, grads: list[Tensor], loss: Any, factor: float) -> str | None:
        """Why this rank's gradients ``grads`` or ``loss`` call for a rollback (``None``: all well)."""
        if grads:
            if any(is_sharded(g) for g in grads):  # FSDP2: the norm of the whole gradients, summed over ranks
                sq = square_sum(grads)
            else:
                norms = torch.stack([n.to(torch.float64).cpu() for n in torch._foreach_norm(grads)])
                sq = float(norms.square().sum())
            if not math.isfinite(sq):
                return "non-finite gradient"
            if self.grad_ref > 0 and sq > factor * self.grad_ref:
                return f"squared gradient norm grew to {sq / self.grad_ref:.1f}x its value at the teleport"
        if loss is not None and self.loss_ref is not None:
            value = float(loss)
            if not math.isfinite(value):
                return "non-finite loss"
            if self.loss_ref > 0 and value > factor * self.loss_ref:
                return f"loss grew to {value / self.loss_ref:.1f}x its pre-teleport value"
        return None

    def triggered(self, grads: list[Tensor], loss: Any, factor: float) -> bool:
        """Whether any rank's :meth:`alarm` went off (then ``why`` says why)."""
        why = self.alarm(grads, loss, factor)
        device = local(grads[0]).device if grads else None
        fired = any_rank(
            why is not None,
            device=device if device is not None and device.type != "cpu" else None,
        )
        if fired:
            self.why = why or "another rank's watch triggered"
        return fired

    def to_state(self) -> dict[str, Any]:
        """Plain data for ``state_dict``."""
        return {
            "snapshot": self.snapshot.to_state(),
            "until": self.until,
            "teleport_step": self.teleport_step,
            "grad_ref": self.grad_ref,
            "loss_ref": self.loss_ref,
        }

    @classmethod
    def from_state(
        cls,
        data: dict[str, Any],
        module: nn.Module,
        optimizer: Optimizer,
        params: list[Tensor],
    ) -> Watch:
        """Rebuild a watch saved by :meth:`to_state` against ``module``'s live tensors."""
        tensors = {n: lookup_tensor(module, n) for n in data["snapshot"]["tensors"]}
        return cls(
            snapshot=Snapshot.from_state(data["snapshot"], tensors, optimizer, params),
            until=int(data["until"]),
            teleport_step=int(data["teleport_step"]),
            grad_ref=float(data["grad_ref"]),
            loss_ref=None if data["loss_ref"] is None else float(data["loss_ref"]),
        )


@dataclass
class TeleportRecord:
    """What a ``Teleport`` has done so far: steps, accepted teleports, rollbacks, the caps'
    backoff factor and the watch in progress."""

    step: int = 0
    accepted: int = 0
    rollbacks: int = 0
    backoff: float = 1.0
    watch: Watch | None = None

    def to_state(self, rng: Tensor) -> dict[str, Any]:
        """Plain data for ``state_dict`` with the generator state ``rng`` (the watch only when one is in progress)."""
        top: dict[str, Any] = {
            "step": self.step,
            "accepted": self.accepted,
            "rollbacks": self.rollbacks,
            "backoff": self.backoff,
            "rng": rng,
        }
        if self.watch is not None:
            top["watch"] = self.watch.to_state()
        return top

    def load_state(
        self,
        top: dict[str, Any],
        module: nn.Module,
        optimizer: Optimizer,
        params: list[Tensor],
    ) -> None:
        """Restore what :meth:`to_state` returned (missing counters start from zero)."""
        self.step = int(top.get("step", 0))
        self.accepted = int(top.get("accepted", 0))
        self.rollbacks = int(top.get("rollbacks", 0))
        self.backoff = float(top.get("backoff", 1.0))
        watch = top.get("watch")
        self.watch = None if watch is None else Watch.from_state(watch, module, optimizer, params)
