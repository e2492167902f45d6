"""A training monitor for the drift of conserved quantities (Zhao 2026, Sec. 2.5 and App. A.4).

Gradient flow conserves Q_M exactly; gradient descent changes it by
O(lr^2) per step (Zhao 2026, Prop. A.4.1), and momentum, adaptive step sizes,
weight decay or non-invariant regularisers change it faster.  Teleportation
changes Q on purpose (applying g moves Q along the orbit, Zhao 2026, Sec. 2.5).
:class:`ConservationMonitor` records, after every ``every``-th optimizer step,

* per site with conserved quantities, the relative drift
  ||Q_t - Q_ref|| / scale_ref (the normalisation of eq. A.29: the size of the
  members' contributions, so a balanced network with Q ~ 0 is not divided by 0);
* per orthogonal site, the angular-momentum residual of Theorem 2.5.6 for the
  last update (theta_{t+1} - theta_t as the velocity), relative to
  ||theta|| ||theta_{t+1} - theta_t||: zero for plain (S)GD on an invariant loss;
* any extra user quantity ``fn(model) -> Tensor``.

The reference is the value at attachment, rebased after every accepted teleport
when the optimizer is :class:`teleopt.Teleport` (the jump is recorded
separately), so drift measures what the optimizer did, not what teleports did.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.actions.base import required
from teleopt.analysis.conserved import (
    ConservedQuantities,
    angular_momentum,
    conserved_quantities,
    site_params,
)
from teleopt.site import Site

__all__ = ["ConservationMonitor", "MonitorRecord"]


@dataclass
class MonitorRecord:
    """One measurement after optimizer step ``step``.

    ``drift``: relative change since the reference; ``step_drift``: since the
    previous measurement (the per-step change Zhao 2026, Prop. A.4.1 bounds by
    lr^2 |dL/dt|); ``angular_momentum``: residuals of orthogonal sites;
    ``teleport_jump``: the relative change a teleport (or rollback) made before this step.
    """

    step: int
    drift: dict[str, float] = field(default_factory=dict)
    step_drift: dict[str, float] = field(default_factory=dict)
    angular_momentum: dict[str, float] = field(default_factory=dict)
    teleport_jump: dict[str, float] = field(default_factory=dict)


class _Handles:
    """Removes every hook the monitor registered on an optimizer."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ConservationMonitor:
    """Logs the drift of conserved quantities Q_M during training (Zhao 2026, Prop. 2.5.1, App. A.4).

    Parameters
    ----------
    model:
        The model being trained (sites refer to its tensor names).
    sites:
        The symmetry sites.  Sites with neither a conserved quantity nor an
        angular-momentum relation (discrete, data-dependent, approximate,
        non-linear) are listed in ``unavailable`` and warned about once.
    every:
        Measure after every ``every``-th optimizer step.
    quantities:
        Extra conserved quantities ``name -> fn(model)`` returning a tensor q,
        or a tuple of tensors whose sum is q (its terms, e.g.
        ``whitened_conserved_quantity(U, V, "tanh", parts=True)``); the drift is
        ||q_t - q_ref|| over ||q_ref||, or over the sum of the terms' norms.

    Use :meth:`attach` with any ``torch.optim.Optimizer`` (it registers a step
    post-hook), or call :meth:`update` after each ``optimizer.step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        sites: Sequence[Site],
        *,
        every: int = 1,
        quantities: Mapping[str, Callable[[nn.Module], Tensor]] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        quantities = dict(quantities or {})
        for name, fn in quantities.items():
            if not callable(fn):
                raise TypeError(f"quantities[{name!r}] must be callable(model) -> Tensor")
        self.model = model
        self.every = every
        self.quantities = quantities
        probe = conserved_quantities(model, sites, missing="ignore")
        by_name = {s.name: s for s in sites}
        self.sites = [by_name[n] for n in probe]
        self.orthogonal_sites = [
            by_name[n]
            for n in probe.unavailable
            if by_name[n].action.group_type.kind == "orthogonal" and by_name[n].action.linear and by_name[n].action.exactness == "exact"
        ]
        self.unavailable = {n: why for n, why in probe.unavailable.items() if n not in {s.name for s in self.orthogonal_sites}}
        clash = set(quantities) & set(by_name)
        if clash:
            raise ValueError(f"extra quantity names clash with site names: {', '.join(sorted(clash))}")
        if not self.sites and not self.orthogonal_sites and not quantities:
            raise ValueError(
                "nothing to monitor: no site has a conserved quantity or angular-momentum relation "
                f"({'; '.join(f'{n}: {w}' for n, w in self.unavailable.items()) or 'no sites given'})"
            )
        if self.unavailable:
            lines = "; ".join(f"{n}: {w}" for n, w in self.unavailable.items())
            warnings.warn(f"ConservationMonitor cannot monitor {len(self.unavailable)} site(s): {lines}", UserWarning, stacklevel=2)
        self.history: list[MonitorRecord] = []
        self._steps = 0
        self._pending_jump: dict[str, float] = {}
        self._reference = self._measure()
        self._last = self._reference
        self._previous = self._orthogonal_params()

    # ------------------------------------------------------------------ measuring
    def _measure(self) -> tuple[ConservedQuantities, dict[str, tuple[Tensor, float]]]:
        with torch.no_grad():
            q = conserved_quantities(self.model, self.sites, missing="ignore")
            extra = {}
            for name, fn in self.quantities.items():
                value = fn(self.model)
                terms = tuple(value) if isinstance(value, (tuple, list)) else (value,)
                if not terms or not all(isinstance(t, Tensor) for t in terms):
                    raise TypeError(f"quantity {name!r} must return a tensor or a tuple of tensors")
                total = torch.stack([t.detach().to(torch.float64) for t in terms]).sum(0) if len(terms) > 1 else terms[0].detach().clone()
                extra[name] = (total, float(sum(float(t.detach().norm()) for t in terms)))
        return q, extra

    def _orthogonal_params(self) -> dict[str, dict[str, Tensor]]:
        return {
            s.name: {m: required(t, m).clone() for m, t in zip(s.members, site_params(self.model, s)) if m is not None}
            for s in self.orthogonal_sites
        }

    def _drifts(
        self,
        now: tuple[ConservedQuantities, dict[str, tuple[Tensor, float]]],
        ref: tuple[ConservedQuantities, dict[str, tuple[Tensor, float]]],
    ) -> dict[str, float]:
        out = now[0].drift(ref[0])
        for name, (value, _) in now[1].items():
            base, scale = ref[1][name]
            diff = float((value - base).norm())
            out[name] = diff / scale if scale > 0 else diff
        return out

    def _angular_residuals(self) -> dict[str, float]:
        current = self._orthogonal_params()
        out = {}
        for site in self.orthogonal_sites:
            before, after = self._previous[site.name], current[site.name]
            velocity = {m: after[m] - before[m] for m in before}
            with torch.no_grad():
                omega = angular_momentum(before, velocity, site)
            theta = sum(float(t.norm()) ** 2 for t in before.values()) ** 0.5
            speed = sum(float(v.norm()) ** 2 for v in velocity.values()) ** 0.5
            out[site.name] = float(omega.norm()) / (theta * speed) if theta * speed > 0 else 0.0
        self._previous = current
        return out

    def update(self) -> MonitorRecord | None:
        """Count one optimizer step; measure (and return the record) on every ``every``-th."""
        self._steps += 1
        if self._steps % self.every:
            return None
        now = self._measure()
        record = MonitorRecord(
            self._steps, self._drifts(now, self._reference), self._drifts(now, self._last), self._angular_residuals(), self._pending_jump
        )
        self._last = now
        self._pending_jump = {}
        self.history.append(record)
        return record

    def rebase(self) -> dict[str, float]:
        """Make the current values the reference; returns the relative change since the old one."""
        now = self._measure()
        jump = self._drifts(now, self._last)
        self._reference = self._last = now
        self._previous = self._orthogonal_params()
        return jump

    # ------------------------------------------------------------------ hooks
    def attach(self, optimizer: Optimizer) -> _Handles:
        """Measure after ``optimizer.step()``; with :class:`teleopt.Teleport`, rebase after accepted teleports.

        Returns a handle whose ``remove()`` detaches the monitor.
        """
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        handles = [optimizer.register_step_post_hook(self._on_step)]
        register = getattr(optimizer, "register_teleport_hook", None)
        if register is not None:
            handles.append(register(self._on_teleport))
        return _Handles(handles)

    def _on_step(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.update()

    def _on_teleport(self, wrapper: Any, report: Any) -> None:
        if report.accepted or report.reason.startswith("rolled back"):
            # an accepted teleport moves Q along the orbit; a rollback moves it back
            self._pending_jump = self.rebase()

    # ------------------------------------------------------------------ results
    def max_drift(self) -> dict[str, float]:
        """The largest recorded drift per site / extra quantity (0 before any record)."""
        names = [s.name for s in self.sites] + list(self.quantities)
        return {n: max((r.drift[n] for r in self.history), default=0.0) for n in names}

    def max_angular_momentum(self) -> dict[str, float]:
        """The largest recorded relative angular-momentum residual per orthogonal site."""
        return {s.name: max((r.angular_momentum[s.name] for r in self.history), default=0.0) for s in self.orthogonal_sites}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the records, the monitored and the unavailable sites."""
        return {
            "sites": [s.name for s in self.sites],
            "orthogonal_sites": [s.name for s in self.orthogonal_sites],
            "quantities": list(self.quantities),
            "unavailable": dict(self.unavailable),
            "records": [vars(r) for r in self.history],
        }
