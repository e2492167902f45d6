"""A teleport as a transaction: completed, or every tensor and counter bitwise as before.

DESIGN.md (Round 3, "All or nothing"): a teleport either completes (applied,
verified, reported, watched) or leaves the parameters, ``.grad``, the optimizer
state, the buffers and the wrapper's counters bit for bit as they were, whatever
is raised wherever (``BaseException`` included: ``KeyboardInterrupt``, an
out-of-memory error from a tensor operation), and the exception propagates
unchanged.

A :class:`Transaction` is opened before the plan phase and records by reference
what a teleport may *replace*: each parameter's ``.grad`` tensor (the plan phase
may compute one from the batch, the verify phase recomputes them), the entries of
each parameter's optimizer state (a reset puts new tensors or ints there, LBFGS's
``n_iter`` is restarted), the wrapper's :class:`~teleopt.teleport.watch.TeleportRecord`
fields and the state of its generator.  Before the apply phase writes anything in
place, :meth:`Transaction.protect` keeps copies of the tensors it will write: the
site members, their gradients and their optimizer state (all gradients when a
closure re-runs).  Copies the apply phase's own rollback snapshot already holds
are shared, not made twice (:func:`snapshot_copies`), so under the default watch,
whose snapshot copies everything, the transaction copies nothing more.

Undoing by the inverse elements is not enough here: it restores gradients and
moments only up to round-off (:class:`~teleopt.teleport.safety.InverseSnapshot`),
and an interrupted apply has moved some tensors and not others.

The user's teleport hooks run after the commit: an exception raised by a hook
propagates with the teleport completed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.site import Site
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.safety import InverseSnapshot, Snapshot
from teleopt.teleport.watch import TeleportRecord

__all__ = ["Transaction", "snapshot_copies"]

#: (live tensor, its copy before the teleport)
Copy = tuple[Tensor, Tensor]


def _unique(optimizers: Iterable[Optimizer | None]) -> list[Optimizer]:
    out: dict[int, Optimizer] = {}
    for opt in optimizers:
        if opt is not None:
            out.setdefault(id(opt), opt)
    return list(out.values())


class Transaction:
    """All or nothing for one teleport (see module docs).

    Parameters
    ----------
    params:
        Every parameter whose ``.grad`` or optimizer state the teleport may touch.
    optimizers:
        The optimizers whose per-parameter state may change (the base, the inner optimizer
        of a Lookahead and the shell that holds its slow weights; duplicates are ignored).
    record:
        The wrapper's counters and watch, restored field by field.
    generator:
        The wrapper's generator (the objectives draw random directions from it).

    Used as a context manager: an exception inside calls :meth:`rollback` and propagates.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        optimizers: Iterable[Optimizer | None],
        record: TeleportRecord,
        generator: torch.Generator | None = None,
    ) -> None:
        self.params = list({id(p): p for p in params}.values())
        self.optimizers = _unique(optimizers)
        self.record = record
        self._fields = {f.name: getattr(record, f.name) for f in fields(record)}
        self._rng = None if generator is None else (generator, generator.get_state())
        self._grads = [p.grad for p in self.params]
        self._states = [
            [(p, opt.state[p], dict(opt.state[p])) if p in opt.state else (p, None, None) for p in self.params] for opt in self.optimizers
        ]
        self._copies: dict[int, Copy] = {}
        self._attributes: list[tuple[object, str, Any]] = []

    @classmethod
    def of(
        cls, module: nn.Module, optimizers: Sequence[Optimizer | None], record: TeleportRecord, generator: torch.Generator | None = None
    ) -> Transaction:
        """A transaction over ``module``'s parameters and those of ``optimizers`` (open it before the plan phase)."""
        params = [p for opt in optimizers if opt is not None for g in opt.param_groups for p in g["params"]]
        return cls(params + list(module.parameters()), optimizers, record, generator)

    def keep(self, owner: object, attribute: str) -> None:
        """Put ``owner.attribute`` back (the object it refers to now) on a rollback."""
        self._attributes.append((owner, attribute, getattr(owner, attribute)))

    @torch.no_grad()
    def protect(self, tensors: Iterable[Tensor], params: Iterable[Tensor] = (), copies: Iterable[Copy] = ()) -> None:
        """Keep copies of ``tensors`` and of ``params``' ``.grad`` and optimizer-state tensors before they are
        written in place; ``copies`` are (live, copy) pairs already held elsewhere, used instead of new ones."""
        held = {id(live): (live, saved) for live, saved in copies}
        targets = list(tensors)
        for p in params:
            if p.grad is not None:
                targets.append(p.grad)
            for opt in self.optimizers:
                targets += [v for v in opt.state.get(p, {}).values() if isinstance(v, Tensor)]
        for t in targets:
            if id(t) not in self._copies:
                self._copies[id(t)] = held.get(id(t)) or (t, t.detach().clone())

    def protect_sites(self, sites: Sequence[Site], ctx: TeleportContext, closure: bool, snapshot: Snapshot | InverseSnapshot) -> None:
        """:meth:`protect` what an apply and verify phase write in place: the site members, their gradients and
        optimizer state, and every gradient when a ``closure`` re-runs (sharing the rollback ``snapshot``'s copies)."""
        names = {n for s in sites for n in s.tensor_names}
        rerun = [p.grad for p in ctx.module.parameters() if p.grad is not None] if closure else []
        members = [ctx.trainable[n] for n in names if n in ctx.trainable]
        self.protect([ctx.tensors[n] for n in names] + rerun, members, snapshot_copies(snapshot))

    @torch.no_grad()
    def rollback(self) -> None:
        """Put every reference recorded at the start back, then copy the protected values back in place."""
        for owner, attribute, value in self._attributes:
            setattr(owner, attribute, value)
        for name, value in self._fields.items():
            setattr(self.record, name, value)
        if self._rng is not None:
            self._rng[0].set_state(self._rng[1])
        for p, grad in zip(self.params, self._grads):
            p.grad = grad
        for opt, states in zip(self.optimizers, self._states):
            for p, live, entries in states:
                if live is None or entries is None:
                    opt.state.pop(p, None)
                    continue
                live.clear()
                live.update(entries)
                opt.state[p] = live
        for live, saved in self._copies.values():
            live.copy_(saved)

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is not None:
            self.rollback()  # the exception propagates unchanged (nothing is returned)


def snapshot_copies(snapshot: Snapshot | InverseSnapshot) -> list[Copy]:
    """The (live, copy) pairs a rollback snapshot holds, taken right after it was made and before the apply:
    its tensors, and for a :class:`~teleopt.teleport.safety.Snapshot` the gradients and optimizer state too."""
    if isinstance(snapshot, InverseSnapshot):
        return [(snapshot.live[n], t) for n, t in snapshot.saved.items()] if snapshot.copies else []
    pairs = [(snapshot.live[n], snapshot.saved[n]) for n in snapshot.live]
    for i, g in snapshot.grads.items():
        grad = snapshot.params[i].grad
        if grad is not None:
            pairs.append((grad, g))
    if snapshot.optimizer is not None:
        for i, saved in snapshot.state.items():
            live = snapshot.optimizer.state.get(snapshot.params[i], {})
            pairs += [(live[k], v) for k, v in saved.items() if isinstance(v, Tensor) and isinstance(live.get(k), Tensor)]
    return pairs
