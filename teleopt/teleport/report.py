"""What teleports did: the record ``Teleport.teleport()`` returns and post-teleport hooks receive, and the
:class:`Tally` of all of them behind ``Teleport.summary()``."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from teleopt.site import Site, lookup_tensor
from teleopt.teleport.transport import transport

__all__ = ["TeleportReport", "Tally", "relative_drift"]


def relative_drift(before: float | None, after: float | None) -> float | None:
    """|after - before| / |before| (``None`` if either is unknown)."""
    if before is None or after is None:
        return None
    return abs(after - before) / max(abs(before), torch.finfo(torch.float64).tiny)


@dataclass
class TeleportReport:
    """One teleport (or one rollback) of :class:`~teleopt.teleport.Teleport`.

    Attributes
    ----------
    step:
        The optimizer step before whose update it happened.
    path:
        ``"fast"`` (closed-form transport), ``"general"`` (through the model on a
        batch) or ``"paper_compat"``.
    objective:
        Name of the objective.
    accepted:
        Whether the parameters are now at the teleported point.
    reason:
        ``"accepted"`` or why not (declined by the caps, rolled back by a
        post-condition, rolled back after the teleport by the watch).
    check:
        What the outputs were compared on (:mod:`~teleopt.teleport.check`):
        ``"batch"`` (the teleport batch), ``"closure"`` (the closure's forwards),
        ``"probe"`` (``example_inputs`` or the last forward's inputs), or ``"none"``
        only for a teleport declined before anything moved.  No teleport is accepted
        with ``"none"``.
    check_error:
        The measured relative change of the model outputs, in the precision the model
        runs in (``None`` when not measured).  Every accepted teleport of exact sites
        has ``check_error <= check_tol``, or an inconclusive check (above the tolerance
        but within 100 times it, below float64) that its float64 re-run decided:
        ``check_error_float64 <= check_tol_float64`` (:attr:`check_passed` is either).
        Approximate sites are decided by the loss tolerance instead.
    check_tol:
        The tolerance ``check_error`` was compared with.
    check_error_float64, check_tol_float64:
        The float64 re-run of an inconclusive check (the same elements and inputs on a
        float64 copy of the model) and its tolerance; ``None`` when there was none.
    check_detail:
        What exactly was compared (inputs, mode, a float64 re-run of an inconclusive
        check).
    skipped:
        Sites left out of this teleport and why (frozen members, teleports disabled
        for their param group, members the optimizer does not update).
    loss_before, loss_after:
        Teleport-batch loss at w and g . w (``None`` when no batch or closure was given).
    heldout_before, heldout_after:
        The same on the held-out batch, when given.
    grad_norm_before, grad_norm_after:
        ||grad L|| over all trainable parameters at w and at g . w.
    objective_before, objective_after:
        The objective's value at w and g . w.
    sharpness_before:
        lambda_max(P^1/2 H P^1/2) at w when ``SafetyConfig.stability_margin`` is on.
    site_gains:
        Per site: ||grad L||^2 ratio when only that site moves (fast path), or
        ``None`` on the general path.
    coordinate_norms:
        Per site: the largest |coordinate| of the chosen element (log-scale or
        generator entry), 0 for the identity.
    shrink:
        The factor s in [0, 1] the caps scaled the coordinates by (1: not needed).
    elements:
        Per site name: the applied element (float64, detached); use
        :meth:`apply_to` to move an EMA/SWA copy of the model along.
    state_decisions:
        Count of each state policy decision taken (``"transport"``, ``"keep"``,
        ``"fallback:reset"``, ...).
    time_s:
        Wall-clock seconds the teleport took.
    """

    step: int
    path: str
    objective: str
    accepted: bool = False
    reason: str = ""
    check: str = "none"
    check_error: float | None = None
    check_tol: float | None = None
    check_error_float64: float | None = None
    check_tol_float64: float | None = None
    check_detail: str = ""
    skipped: dict[str, str] = field(default_factory=dict)
    loss_before: float | None = None
    loss_after: float | None = None
    heldout_before: float | None = None
    heldout_after: float | None = None
    grad_norm_before: float | None = None
    grad_norm_after: float | None = None
    objective_before: float | None = None
    objective_after: float | None = None
    sharpness_before: float | None = None
    site_gains: dict[str, float | None] = field(default_factory=dict)
    coordinate_norms: dict[str, float] = field(default_factory=dict)
    shrink: float = 1.0
    elements: dict[str, Tensor] = field(default_factory=dict)
    state_decisions: dict[str, int] = field(default_factory=dict)
    time_s: float = 0.0
    sites: list[Site] = field(default_factory=list, repr=False)

    @property
    def loss_drift(self) -> float | None:
        """|L(g . w) - L(w)| / |L(w)| on the teleport batch (``None`` if unknown)."""
        return relative_drift(self.loss_before, self.loss_after)

    @property
    def check_passed(self) -> bool:
        """Whether the outputs stayed within tolerance: ``check_error <= check_tol``, or, for an
        inconclusive check below float64, ``check_error_float64 <= check_tol_float64``."""
        measured = [(self.check_error, self.check_tol), (self.check_error_float64, self.check_tol_float64)]
        return any(err is not None and tol is not None and err <= tol for err, tol in measured)

    @property
    def gain(self) -> float | None:
        """||grad L(g . w)||^2 / ||grad L(w)||^2."""
        if self.grad_norm_before is None or self.grad_norm_after is None or self.grad_norm_before == 0:
            return None
        return (self.grad_norm_after / self.grad_norm_before) ** 2

    @torch.no_grad()
    def apply_to(self, module: nn.Module) -> None:
        """Move another copy of the model (EMA, SWA, Lookahead slow weights) by the same elements.

        Only data-independent sites can be replayed this way (a data-dependent
        element depends on the batch and the weights it was computed at).
        """
        if not self.accepted:
            return
        sites = [s for s in self.sites if s.name in self.elements]
        for site in sites:
            if site.action.needs_data:
                raise ValueError(f"site {site.name!r} is data-dependent: its element cannot be replayed on another model")
        live = {n: lookup_tensor(module, n) for s in sites for n in s.tensor_names}
        device = next(iter(live.values())).device if live else None
        elements = [self.elements[s.name].to(device) for s in sites]
        moved, _ = transport(sites, elements, live, live, "params")
        for n, t in live.items():
            t.copy_(moved[n])

    def summary(self) -> Mapping[str, Any]:
        """Plain-data view (for logging)."""
        return {
            "step": self.step,
            "path": self.path,
            "objective": self.objective,
            "accepted": self.accepted,
            "reason": self.reason,
            "check": self.check,
            "check_error": self.check_error,
            "check_tol": self.check_tol,
            "check_error_float64": self.check_error_float64,
            "check_tol_float64": self.check_tol_float64,
            "check_detail": self.check_detail,
            "skipped": dict(self.skipped),
            "loss_before": self.loss_before,
            "loss_after": self.loss_after,
            "loss_drift": self.loss_drift,
            "grad_norm_before": self.grad_norm_before,
            "grad_norm_after": self.grad_norm_after,
            "gain": self.gain,
            "shrink": self.shrink,
            "time_s": self.time_s,
        }


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside teleopt and torch, counted from the caller of this function."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class Tally:
    """Counts of what a ``Teleport``'s teleports came to, each counted once.

    ``accepted`` passed the check; ``rolled_back`` of them were undone later by the watch
    (``kept`` = accepted - rolled_back); ``failed`` were undone at the check (a post-condition);
    ``declined`` never moved.  ``streak`` counts consecutive teleports not kept (a teleport accepted
    and then rolled back counts as not kept); when it reaches ``warn_after`` a ``UserWarning`` says so.
    """

    accepted: int = 0
    rolled_back: int = 0
    failed: int = 0
    declined: int = 0
    streak: int = 0
    before_accept: int = 0
    warn_after: int = 3

    @property
    def teleports(self) -> int:
        """Teleports attempted (a watch rollback is not a new one)."""
        return self.accepted + self.failed + self.declined

    def count(self, report: TeleportReport) -> None:
        """Count ``report`` (a teleport or a watch rollback); warn when ``warn_after`` in a row were not kept."""
        if report.path == "watch":
            self.rolled_back += 1
            self.streak = self.before_accept + 1
        elif report.accepted:
            self.accepted += 1
            self.before_accept, self.streak = self.streak, 0
            return
        elif report.reason.startswith("rolled back"):
            self.failed += 1
            self.streak += 1
        else:
            self.declined += 1
            self.streak += 1
        if self.streak == self.warn_after:
            warnings.warn(
                f"Teleport: the last {self.streak} teleports were not kept (last: {report.reason[:160]}); {self.summary()}. "
                "See the safety section of docs/teleport.md for what to change.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    def summary(self) -> str:
        """One line, e.g. ``"12 teleports: 8 accepted, 7 kept, 1 rolled back, 0 undone by the check, 4 declined"``."""
        kept = self.accepted - self.rolled_back
        return (
            f"{self.teleports} teleport{'' if self.teleports == 1 else 's'}: {self.accepted} accepted, {kept} kept, {self.rolled_back} rolled back, "
            f"{self.failed} undone by the check, {self.declined} declined"
        )

    def to_state(self) -> dict[str, int]:
        """Plain ints for ``state_dict``."""
        return {k: getattr(self, k) for k in ("accepted", "rolled_back", "failed", "declined", "streak", "before_accept")}

    @classmethod
    def from_state(cls, data: dict[str, int] | None) -> Tally:
        """Rebuild a tally saved by :meth:`to_state` (``None``: a fresh one)."""
        return cls(**{k: int(v) for k, v in (data or {}).items()})
