"""The verify phase's judgement: which post-conditions of a teleport failed, and why.

A teleport moved the parameters along group orbits; the engine
(:class:`~teleopt.teleport.engine.TeleportEngine`) measured what changed and asks
here whether that is within tolerance:

* :func:`loss_failures`: the loss on the teleport batch (or the closure's) and on
  the held-out batch, relative to their values before, against
  ``SafetyConfig.loss_tol`` (:func:`~teleopt.teleport.safety.default_loss_tol` of the
  dtype when unset) and ``heldout_tol`` (the loss tolerance for exact,
  data-independent sites, else unchecked unless given);
* :func:`output_verdict`: the model's outputs before and after
  (:class:`~teleopt.teleport.check.OutputCheck`), measured as ``check_error``
  (:func:`output_failures` writes it into a report);
  exact and data-dependent sites are decided by the outputs, approximate ones by the
  loss when it is known;
* :func:`non_finite_gradient`: a NaN or inf in ``.grad`` declines a teleport before
  anything moves.

Each failure is a :class:`Failure` with the measured value, its tolerance and the
dtype it was measured in; one below float64 within
:data:`~teleopt.teleport.check.INCONCLUSIVE_FACTOR` of its tolerance is
*inconclusive* and re-decided in float64 by the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from teleopt.sharding import local
from teleopt.site import Site
from teleopt.teleport.check import INCONCLUSIVE_FACTOR, OutputCheck
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import SafetyConfig, default_loss_tol

__all__ = ["Failure", "Losses", "loss_failures", "output_failures", "output_verdict", "non_finite_gradient"]

_WHERE = {"batch": "the teleport batch", "closure": "the closure's forwards", "probe": "the probe inputs"}


@dataclass
class Failure:
    """A failed post-condition: why, the measured relative change, its tolerance, the dtype it was measured in."""

    reason: str
    value: float
    tol: float
    dtype: torch.dtype
    settled: bool = False  # not a question of rounding (the training precision's own check)

    def inconclusive(self) -> bool:
        """Below float64 and within ``INCONCLUSIVE_FACTOR`` of the tolerance: maybe rounding."""
        return (
            not self.settled
            and self.dtype != torch.float64
            and math.isfinite(self.value)
            and self.tol < self.value <= INCONCLUSIVE_FACTOR * self.tol
        )


def _relative(after: float, before: float) -> float:
    return abs(after - before) / max(abs(before), 1e-300)


class Losses(Protocol):
    """The losses :func:`loss_failures` compares (a :class:`~teleopt.teleport.report.TeleportReport` has them)."""

    @property
    def loss_before(self) -> float | None: ...
    @property
    def loss_after(self) -> float | None: ...
    @property
    def heldout_before(self) -> float | None: ...
    @property
    def heldout_after(self) -> float | None: ...


def loss_failures(report: Losses, safety: SafetyConfig, sites: Sequence[Site], dtype: torch.dtype) -> list[Failure]:
    """Why the loss or held-out loss in ``report`` changed too much (empty: invariance held)."""
    tol = safety.loss_tol if safety.loss_tol is not None else default_loss_tol(dtype)
    failures = []
    if report.loss_before is not None and report.loss_after is not None:
        drift = _relative(report.loss_after, report.loss_before)
        if not drift <= tol:
            failures.append(Failure(f"loss changed by {drift:.2e} (relative) > tolerance {tol:.1e}", drift, tol, dtype))
    if report.heldout_after is not None and report.heldout_before is not None:
        htol = safety.heldout_tol
        if htol is None and all(s.action.exactness == "exact" and not s.action.needs_data for s in sites):
            htol = tol
        hdrift = _relative(report.heldout_after, report.heldout_before)
        if htol is not None and not hdrift <= htol:
            failures.append(Failure(f"held-out loss changed by {hdrift:.2e} (relative) > tolerance {htol:.1e}", hdrift, htol, dtype))
    return failures


def output_failures(
    check: OutputCheck, after: list[Tensor], report: TeleportReport, sites: Sequence[Site], loss_tol: float | None
) -> list[Failure]:
    """:func:`output_verdict` on ``report``'s loss drift, its check fields written into ``report``."""
    failures, measured = output_verdict(check, after, report.loss_drift, sites, loss_tol, report.check_detail)
    for name, value in measured.items():
        setattr(report, name, value)
    return failures


def output_verdict(
    check: OutputCheck, after: list[Tensor], loss_drift: float | None, sites: Sequence[Site], loss_tol: float | None, detail: str
) -> tuple[list[Failure], dict[str, Any]]:
    """Compare the outputs ``after`` with ``check.before``: why they changed too much, and the report's
    ``check_error``, ``check_tol`` and ``check_detail`` (``detail`` so far).

    Sites that promise exactness (exact, or data-dependent on the batch) are decided by the
    outputs; approximate sites by the loss tolerance when the loss is known (their outputs are
    measured and reported only).  With no tensor output on either side the loss decides.
    """
    tol = check.tolerance(loss_tol)
    if not check.before and not after:
        why = "the closure did not call the model" if check.kind == "closure" else "the output has no tensor"
        measured: dict[str, Any] = {"check_tol": tol, "check_detail": f"the {check.kind}'s loss ({why})", "check_error": loss_drift}
        if loss_drift is None:
            return [Failure(f"nothing was checked ({why} and there is no loss)", math.inf, tol, torch.float64)], measured
        return [], measured
    err = check.error(after)
    exact = all(s.action.exactness in ("exact", "data-dependent") for s in sites)
    failures = (
        []
        if (not exact and loss_drift is not None) or err <= tol
        else [
            Failure(
                f"outputs changed by {err:.2e} (relative) > tolerance {tol:.1e} on {_WHERE[check.kind]}", err, tol, check.output_dtype()
            )
        ]
    )
    trained = check.trained_error()
    if trained is not None:
        what = f"in the training precision ({check.precision.describe()}) outputs changed by {trained[0]:.2e}"
        detail += f"; {what} (tolerance {trained[1]:.1e}: 2x its round-off of the untouched model)"
        if not trained[0] <= trained[1]:
            failures.append(Failure(f"{what} > {trained[1]:.1e} (2x its round-off)", trained[0], trained[1], torch.float32, True))
    return failures, {"check_tol": tol, "check_error": err, "check_detail": detail}


def non_finite_gradient(ctx: TeleportContext) -> str | None:
    """The name of a trainable parameter whose ``.grad`` has a NaN or inf (``None``: all finite)."""
    for name, p in ctx.trainable.items():
        g = p.grad
        if g is not None and g.is_sparse:
            g = g.coalesce().values()
        if g is None or not g.numel():
            continue
        t = local(g)
        # one read of the gradient; NaN and inf propagate through the sum, and only a sum that
        # is not finite (or overflowed) pays for the elementwise test
        if not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            return name
    return None


def restore_difference(after: Sequence[Tensor], before: Sequence[Tensor]) -> float | None:
    """``None`` when the outputs after a rollback equal those before the teleport bit for bit, else the
    largest absolute difference (``inf`` when their structure differs)."""
    if len(after) == len(before) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(after, before)):
        return None
    if len(after) != len(before) or any(a.shape != b.shape for a, b in zip(after, before)):
        return float("inf")
    return max(float((a.detach().double() - b.detach().double()).abs().max()) for a, b in zip(after, before) if a.numel())
