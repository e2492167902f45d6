"""Lookahead bases: the inner optimizer holds the state, the slow weights follow every teleport.

Lookahead (Zhang et al. 2019) keeps a second, slow copy of the weights and pulls
the fast weights towards it every ``k`` steps.  A teleport moves the fast weights
to ``g . w``; if the slow copy stayed at its old point of the orbit, the next sync
would average two points of *different* orbits and change what the model computes
(``docs/performance.md``).  So after an accepted teleport the slow weights are moved by
the same elements (they transform like the parameters), and a watch rollback
restores them.  The inner optimizer, not the Lookahead shell, is the one whose
state a teleport transports and whose next update the objectives model.

Two implementations are recognised by structure: timm's ``Lookahead`` (inner
optimizer ``_base_optimizer``, slow weights in its state as ``lookahead_slow_buff``)
and torch-optimizer's ``Lookahead`` (inner optimizer ``optimizer``, slow weights in
the shell's own state as ``slow_param``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.teleport.report import TeleportReport
from teleopt.teleport.transport import transport

__all__ = ["LookaheadView"]


@dataclass
class LookaheadView:
    """Where a (possibly Lookahead) base keeps its state and slow weights.

    ``inner`` is the optimizer a teleport reads state and update rules from (the
    base itself when it is not a Lookahead); the slow copy of parameter ``p`` is
    ``slow_owner.state[p][slow_key]`` (plain data, so the wrapper pickles).
    """

    inner: Optimizer
    slow_owner: Optimizer | None = None
    slow_key: str = ""
    _before: dict[str, Tensor] = field(default_factory=dict)

    @property
    def is_lookahead(self) -> bool:
        return self.slow_owner is not None

    def slow(self, p: Tensor) -> Tensor | None:
        """The slow copy of ``p`` (``None`` before Lookahead's first sync, or without Lookahead)."""
        if self.slow_owner is None:
            return None
        value = self.slow_owner.state.get(p, {}).get(self.slow_key)
        return value if isinstance(value, Tensor) else None

    @classmethod
    def of(cls, optimizer: Optimizer) -> LookaheadView:
        """Recognise a Lookahead shell around the inner optimizer, else a view of ``optimizer`` itself."""
        if type(optimizer).__name__ == "Lookahead":
            inner = getattr(optimizer, "_base_optimizer", None)
            if isinstance(inner, Optimizer):  # timm
                return cls(inner, inner, "lookahead_slow_buff")
            inner = getattr(optimizer, "optimizer", None)
            if isinstance(inner, Optimizer):  # torch-optimizer
                return cls(inner, optimizer, "slow_param")
        return cls(optimizer)

    @torch.no_grad()
    def follow(self, report: TeleportReport, module: nn.Module) -> None:
        """Move the slow weights of an accepted teleport's sites by the same elements.

        A data-dependent site's element cannot be replayed on other weights: its slow
        weights are re-synced to the (teleported) fast weights instead.
        """
        self._before = {}
        if not self.is_lookahead or not report.accepted:
            return
        params = dict(module.named_parameters())
        sites = [s for s in report.sites if s.name in report.elements]
        slow: dict[str, Tensor] = {}
        for site in sites:
            for name in site.tensor_names:
                value = self.slow(params[name]) if name in params else None
                if value is not None:
                    slow[name] = value
        if not slow:
            return
        self._before = {n: t.clone() for n, t in slow.items()}
        replay = [s for s in sites if not s.action.needs_data and all(n in slow for n in s.tensor_names)]
        if replay:
            device = next(iter(slow.values())).device
            live = {n: slow[n] for s in replay for n in s.tensor_names}
            moved, _ = transport(replay, [report.elements[s.name].to(device) for s in replay], live, live, "params")
            for n, t in live.items():
                t.copy_(moved[n])
        for site in sites:
            if site not in replay:
                for name in site.tensor_names:
                    if name in slow:
                        slow[name].copy_(params[name])

    @torch.no_grad()
    def undo(self, module: nn.Module) -> None:
        """Put the slow weights back where they were before the last accepted teleport (watch rollback)."""
        params = dict(module.named_parameters())
        for name, before in self._before.items():
            value = self.slow(params[name]) if name in params else None
            if value is not None:
                value.copy_(before)
        self._before = {}
