"""The values one teleport's phases hand on: plan -> search -> apply -> verify (Zhao 2026, Algorithm 1, lines 2-6).

Each phase of :class:`~teleopt.teleport.engine.TeleportEngine` takes the previous phase's value and returns the
next one (:class:`Planned`, :class:`Found`, :class:`Applied`, :class:`Verified`) or a :class:`Declined` with its
reason, the one way a teleport ends without being accepted (nothing moved, or moved and rolled back).  The
values are frozen dataclasses (shallowly: the output check a plan carries records its own forwards, and the
search's measurements are a plain dict); each holds the one before it, so :func:`report_of`, the one place that writes a
:class:`~teleopt.teleport.report.TeleportReport`, reads the whole teleport from the last value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.functional import Batch, FunctionalModel, LossFn
from teleopt.site import Site
from teleopt.teleport.check import OutputCheck
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.evaluator import Evaluator
from teleopt.teleport.objectives import Objective
from teleopt.teleport.precision import Precision
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import InverseSnapshot, SafetyConfig, Snapshot
from teleopt.teleport.search import SearchConfig
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transaction import Transaction
from teleopt.teleport.watch import InverseMove, TeleportRecord

__all__ = ["EngineConfig", "PhaseEngine", "TeleportRequest", "Planned", "Found", "Applied", "Checked", "Verified", "Declined", "report_of"]


@dataclass
class EngineConfig:
    """What every teleport of one ``Teleport`` shares: the model, the base optimizer and the settings.

    ``trust_key`` is the param-group key of the trust-region radius; ``generator`` draws the objectives' random
    directions, ``seed`` seeds the stability cap's. ``sharded``: the module's parameters are FSDP2 ``DTensor``s (fast
    path only; see :mod:`~teleopt.teleport.distributed`)."""

    module: nn.Module
    optimizer: Optimizer
    objective: Objective
    search: SearchConfig
    safety: SafetyConfig
    policy: StatePolicy
    loss_fn: LossFn | None
    generator: torch.Generator
    seed: int
    trust_key: str
    sharded: bool = False
    hook_target: nn.Module | None = None


@dataclass
class TeleportRequest:
    """One call for a teleport: the loss at w (from the closure, if any), the closure to re-run after it, the teleport
    batch and the held-out batch; for the check (:mod:`~teleopt.teleport.check`) the probe inputs and where they came
    from, the RNG seed of its forwards and the closure's output leaves at w; the sites left out and why; the precision
    the model trains in; whether the lean balance path (:mod:`~teleopt.teleport.companion`) may still take it."""

    loss: Any
    closure: Callable[[], Any] | None
    batch: Batch | None
    heldout: Batch | None
    probe: Batch | None = None
    probe_source: str = ""
    seed: int = 0
    closure_outputs: list[Tensor] | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    precision: Precision = field(default_factory=Precision)
    lean: bool = True  # False: the lean balance path already declined it (a scheduled teleport's fallback)


class PhaseEngine(Protocol):
    """What the phases ask of the engine that runs them (:class:`~teleopt.teleport.engine.TeleportEngine`)."""

    config: EngineConfig
    record: TeleportRecord

    def _trust_region(self, site: Site, ctx: TeleportContext) -> float | None: ...
    def _loss_value(self, fmodel: FunctionalModel, out: Any, batch: Batch) -> float | None: ...
    def _heldout_loss(self, heldout: Batch, seed: int) -> float: ...
    def check_forward(self, check: OutputCheck, reference: bool = False) -> Any: ...
    def plan_check(self, sites: Sequence[Site], request: TeleportRequest) -> OutputCheck | None: ...
    def rerun_closure(
        self, closure: Callable[[], Any], check: OutputCheck | None = None, precision: Precision | None = None
    ) -> tuple[Any, list[Tensor] | None]: ...


@dataclass(frozen=True)
class Planned:
    """The plan phase's value: the path, the sites, the check (its outputs at w recorded), the losses at w and the
    evaluator (``None`` for an engine that evaluates the model itself); ``transaction`` is what any exception rolls
    back to (``Teleport`` opens it before the plan)."""

    sites: list[Site]
    path: str
    request: TeleportRequest
    ctx: TeleportContext
    fmodel: FunctionalModel | None
    check: OutputCheck
    evaluator: Evaluator | None = None
    loss_before: float | None = None
    heldout_before: float | None = None
    transaction: Transaction | None = None

    @property
    def loss(self) -> Any:
        """The loss to hand back when the teleport stops here (the closure's at w)."""
        return self.request.loss

    def need_evaluator(self) -> Evaluator:
        """The evaluator (planned by every engine that searches)."""
        if self.evaluator is None:
            raise RuntimeError("this teleport was planned without an evaluator")
        return self.evaluator

    def names(self) -> set[str]:
        """The names of the tensors the sites move."""
        return {n for s in self.sites for n in s.tensor_names}

    def fields(self) -> dict[str, Any]:
        """The report fields this phase measured."""
        detail = self.check.describe()
        return {"check": self.check.kind, "check_detail": detail, "loss_before": self.loss_before, "heldout_before": self.heldout_before}


@dataclass(frozen=True)
class Found:
    """The search phase's value: the elements to apply and what the search measured (``grads_finite``: the moved
    gradients are proven finite, :meth:`~teleopt.teleport.fast_path.FastEvaluator.gradients_finite_after`)."""

    planned: Planned
    elements: list[Tensor]
    measured: Mapping[str, Any]
    grads_finite: bool = False

    @property
    def loss(self) -> Any:
        return self.planned.loss

    def by_name(self) -> dict[str, Tensor]:
        """Per site name, the element in float64 (as the report keeps it)."""
        return {s.name: e.to(torch.float64) for s, e in zip(self.planned.sites, self.elements)}

    def fields(self) -> dict[str, Any]:
        return {**self.planned.fields(), **self.measured, "elements": self.by_name()}


@dataclass(frozen=True)
class Applied:
    """The apply phase's value: what a rollback restores, and the state policy's decisions."""

    found: Found
    snapshot: Snapshot | InverseSnapshot
    state_decisions: dict[str, int]

    @property
    def loss(self) -> Any:
        return self.found.loss

    def fields(self) -> dict[str, Any]:
        return {**self.found.fields(), "state_decisions": dict(self.state_decisions)}


@dataclass(frozen=True)
class Checked:
    """What the verify phase measured at g . w: the loss to hand back, the report fields, and why it failed
    (empty: every post-condition held)."""

    loss: Any
    measured: Mapping[str, Any]
    reasons: list[str]


@dataclass(frozen=True)
class Verified:
    """An accepted teleport: the phase value before it, what the verify phase measured, and what the watch keeps to
    undo it (``None``: no watch)."""

    after: Applied | Planned
    checked: Checked
    undo: Snapshot | InverseMove | None = None
    reason: str = "accepted"

    @property
    def loss(self) -> Any:
        return self.checked.loss

    def fields(self) -> dict[str, Any]:
        return {**self.after.fields(), **self.checked.measured, "accepted": True, "reason": self.reason}


@dataclass(frozen=True)
class Declined:
    """A teleport that ends unaccepted, with its ``reason`` (``"declined: ..."`` before anything moved, ``"rolled
    back: ..."`` after): the last phase value it completed, the report fields measured on the way, the loss to
    hand back."""

    reason: str
    loss: Any
    after: Planned | Found | Applied | None = None
    measured: Mapping[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        before = {} if self.after is None else self.after.fields()
        return {**before, **self.measured, "accepted": False, "reason": self.reason}


def report_of(value: Verified | Declined, head: Mapping[str, Any]) -> TeleportReport:
    """The report of a teleport that ended with ``value``; ``head``: step, path, objective, sites, skipped, time_s."""
    return TeleportReport(**head, **value.fields())
