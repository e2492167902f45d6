"""The watch after a teleport and the counters a ``Teleport`` keeps, as typed records.

For ``SafetyConfig.watch_steps`` steps after an accepted teleport a :class:`Watch`
keeps what undoes the teleport (its elements, :class:`InverseMove`, or a snapshot of
everything it touched) and the gradient and loss scales at the teleport; if a
gradient or the loss blows up in that window, the teleport is undone (see
:mod:`teleopt.teleport.safety`).  The gradient scale is robust to minibatch noise
(:func:`reference`): the squared norms of the ``REFERENCE_STEPS`` steps before a
scheduled teleport are sampled (only those steps pay for a norm), and a rollback
needs a blow-up that persists for ``SafetyConfig.watch_patience`` steps with the
loss not below the loss at the teleport (or, without one, at the first of those
steps) where a loss is known (or one beyond ``watch_factor**2``, or a non-finite
value).  :class:`TeleportRecord`
holds the step and teleport counters and the backoff of the caps.  Both serialise
to plain data (tensors, ints, floats) for ``state_dict`` and back.

A teleport accepted while an earlier one is still under watch joins that watch
(:meth:`Watch.stack`) instead of replacing it: the strikes carry over, the
references are the smallest of the teleports still in their windows (each earlier
one scaled by the gradient gain of the teleports after it), and a rollback undoes
every teleport still watched, the last first.  A teleport leaves the watch when
its own window ends (:meth:`TeleportRecord.settle`).  So a blow-up that builds up
over teleports closer together than ``watch_steps`` is still rolled back.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from teleopt.detection.certify import output_error, output_leaves
from teleopt.functional import Batch, FunctionalModel, as_batch
from teleopt.sharding import full, is_sharded, local, reshard, square_sum, write_
from teleopt.site import Site, lookup_tensor
from teleopt.teleport.check import forward
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import any_rank
from teleopt.teleport.report import TeleportReport
from teleopt.teleport.safety import Snapshot
from teleopt.teleport.state_policy import StatePolicy
from teleopt.teleport.transport import transport, transport_

__all__ = [
    "InverseMove",
    "Watch",
    "TeleportRecord",
    "watch_elements",
    "keeps_snapshot",
    "keeps_copies",
    "REFERENCE_STEPS",
    "reference",
    "squared_norm",
    "batch_loss",
    "Measure",
]


def watch_elements(sites: Sequence[Site], elements: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> list[Tensor]:
    """The elements an :class:`InverseMove` keeps for ``sites``: each site's element (by site name) in its
    members' dtype, widened to float32 at least (a teleport of float32 weights is undone in float32,
    half the bytes of the float64 report copies; half precisions still get float32 arithmetic)."""
    return [elements[s.name].to(torch.promote_types(tensors[s.tensor_names[0]].dtype, torch.float32)) for s in sites]


#: Steps before a scheduled teleport whose squared gradient norms :func:`reference` takes the median of.
REFERENCE_STEPS = 5


def squared_norm(grads: list[Tensor]) -> float:
    """||grads||^2 in float64 (over all ranks for FSDP2 shards); ``inf``/``nan`` where a gradient is."""
    if any(is_sharded(g) for g in grads):  # FSDP2: the norm of the whole gradients, summed over ranks
        return square_sum(grads)
    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]  # a sparse gradient's norm is its values'
    if not dense:
        return 0.0
    norms = torch._foreach_norm(dense)
    if any(n.device != norms[0].device for n in norms):  # gradients on several devices: one read per norm
        return sum(n.item() ** 2 for n in norms)
    # one device-to-host read for all the norms (a read per norm is a host sync per norm), squared in float64 here
    return sum(v * v for v in torch.stack(norms).tolist())


#: A loss measurement for the watch: ``measure(batch)`` is the loss at the live parameters on ``batch`` (``None``:
#: on a fresh batch) and the batch it was read on (:func:`batch_loss`).
Measure = Callable[[Batch | None], tuple[float | None, Batch | None]]


def _loss_now(loss: Any, measure: Measure | None, batch: Batch | None = None) -> tuple[float | None, Batch | None]:
    """This step's loss: ``loss`` where the step has one, else ``measure(batch)`` (``None`` without either),
    and the batch a measurement read."""
    if loss is not None:
        return float(loss), None
    return (None, None) if measure is None else measure(batch)


def batch_loss(module: nn.Module, loss_fn: Any, batch_fn: Callable[[], Any], seed: int, batch: Batch | None = None) -> tuple[float, Batch]:
    """The loss at the live parameters on ``batch``, else on a fresh ``batch_fn()`` batch (buffers restored, RNG
    seeded), and that batch: what the watch's patience rule compares (:meth:`Watch.alarm`) when a step has no loss."""
    batch = _copied(as_batch(batch_fn())) if batch is None else batch  # kept: a loader may reuse its buffers
    try:
        out = forward(module, batch, None, seed)
    finally:
        reshard(module)  # FSDP2 leaves the root unsharded after a pass without backward (no-op elsewhere)
    return float(FunctionalModel(module, loss_fn).loss_of(out, batch.target)), batch


def reference(before: float | None, after: float | None, recent: Sequence[float] = ()) -> float:
    """The squared gradient norm the watch compares with: the larger of ||g||^2 at the teleport step before and
    after the move, and the median of the ``recent`` steps' ||g||^2 times the teleport's gain (where > 1).

    One minibatch's gradient norm varies by large factors from step to step late in training; the median of a
    few steps is what the steps after a healthy teleport fluctuate around.
    """
    ref = max(before or 0.0, after or 0.0) ** 2
    if recent and before:
        ref = max(ref, statistics.median(recent) * max(1.0, (after or 0.0) ** 2 / before**2))
    return ref


class InverseMove:
    """The watch's rollback without a snapshot (``SafetyConfig.watch_restore="inverse"``): the accepted
    teleport's sites and elements, O(units).

    :meth:`restore` moves the current parameters and optimizer state of the site members by the inverse
    elements, the sites in reverse order (Zhao 2026, Prop. 4.5.1: the teleport's transport rules for
    g^-1).  That is a symmetry like the teleport itself: the model computes what it computed before the
    move (up to round-off, bit for bit for powers of two), the steps since the teleport are kept, and
    the parameters return to the conditioning of the orbit point training came from.  What the steps since
    did to the loss stays (the default snapshot undoes that too).
    """

    def __init__(self, sites: list[Site], elements: list[Tensor], module: nn.Module, optimizer: Optimizer, policy: StatePolicy) -> None:
        self.sites = sites
        self.elements = [e.detach() for e in elements]
        self.module, self.optimizer, self.policy = module, optimizer, policy

    @torch.no_grad()
    def restore(self, probe: Batch | None = None, seed: int = 0) -> float | None:
        """Move back; returns the relative change of the model's outputs on ``probe`` (``None`` without one)."""
        if probe is None:
            self._move()
            return None
        before = output_leaves(forward(self.module, probe, False, seed))
        self._move()
        return output_error([output_leaves(forward(self.module, probe, False, seed))], [before])

    def _move(self) -> None:
        """Move by the inverse elements in place; on FSDP2 shards the same in-place arithmetic runs on gathered
        copies whose shards are written back (identical on every rank: so are the elements)."""
        ctx = TeleportContext.build(self.module, self.optimizer, self.policy)
        names = sorted({n for s in self.sites for n in s.tensor_names})
        live = {n: ctx.tensors[n] for n in names}
        sharded = any(is_sharded(t) for t in live.values())
        like = {n: full(t) for n, t in live.items()} if sharded else live
        sites = self.sites[::-1]
        inverses = [
            site.action.inverse(g.to(next(like[n] for n in site.tensor_names).device)) for site, g in zip(sites, self.elements[::-1])
        ]
        states = ctx.states(names)
        whole = {n: {k: full(v) if isinstance(v, Tensor) else v for k, v in st.items()} for n, st in states.items()} if sharded else states
        StatePolicy.write(states, self.policy.move(self.optimizer, sites, inverses, whole, like, ctx.groups, in_place=True))
        moved = like if transport_(sites, inverses, like, like, "params") else transport(sites, inverses, like, like, "params")[0]
        for n, t in moved.items():
            if t is not live[n]:
                write_(live[n], t)

    def to_state(self) -> dict[str, Any]:
        """Plain data for ``state_dict``: the sites and their elements."""
        return {"sites": [s.to_dict() for s in self.sites], "elements": [e.cpu() for e in self.elements]}

    @classmethod
    def from_state(
        cls, data: dict[str, Any], module: nn.Module, optimizer: Optimizer, policy: StatePolicy, known: Sequence[Site] = ()
    ) -> InverseMove:
        """Rebuild a move saved by :meth:`to_state`: its sites are the ``known`` ones of the same names (a
        ``Teleport``'s own sites), else rebuilt from their plain data (registered or axis actions)."""
        by_name = {s.name: s for s in known}
        sites = [by_name.get(d["name"]) or Site.from_dict(d) for d in data["sites"]]
        return cls(sites, list(data["elements"]), module, optimizer, policy)


@dataclass
class Watch:
    """An accepted teleport under watch until step ``until`` (see module docs).

    ``grad_ref`` is the squared gradient norm to compare with (:func:`reference`),
    ``loss_ref`` the pre-teleport loss, ``strikes`` the number of consecutive watched
    steps so far above ``watch_factor`` times them; ``why`` says what triggered a
    rollback.  ``snapshot`` is what a rollback undoes the teleport with: its
    :class:`InverseMove` (the default) or a :class:`Snapshot`; ``state_dict`` saves
    exactly that, so a watch resumed from a checkpoint rolls back as the
    uninterrupted run would, bit for bit.  ``earlier`` are the watches of earlier
    teleports still in their windows (oldest first, see :meth:`stack`).
    """

    snapshot: Snapshot | InverseMove
    until: int
    teleport_step: int
    grad_ref: float
    loss_ref: float | None
    why: str = ""
    strikes: int = 0
    earlier: list[Watch] = field(default_factory=list)
    #: without a ``loss_ref``: the loss at the first of the current strikes (``None``: not read), see :meth:`alarm`
    strike_loss: float | None = None
    #: the batch ``strike_loss`` was measured on, measured again at the decision (``None``: a step's own loss)
    strike_batch: Batch | None = None

    @property
    def chain(self) -> list[Watch]:
        """The teleports this watch undoes, oldest first (``earlier``, then this one)."""
        return [*self.earlier, self]

    def stack(self, open_watch: Watch | None, gain: float = 1.0) -> Watch:
        """This new teleport's watch joined to the ``open_watch`` of earlier teleports (``None``: alone).

        The strikes carry over; each earlier reference is multiplied by ``gain`` (the new teleport's
        ||g'||^2 / ||g||^2 where above 1), so the smallest reference in the chain (:meth:`alarm`) is what the
        gradient would be had nothing blown up since the oldest teleport still watched.  Nothing is changed
        in place: a teleport rolled back by its transaction puts the open watch back as it was.
        """
        if open_watch is None:
            return self
        scale = gain if math.isfinite(gain) and gain > 1.0 else 1.0  # (no gain known: the references as they were)
        earlier = [replace(w, earlier=[], grad_ref=w.grad_ref * scale) for w in open_watch.chain]
        joined = replace(self, earlier=earlier, strikes=open_watch.strikes, strike_loss=open_watch.strike_loss)
        return replace(joined, strike_batch=open_watch.strike_batch)

    def settle(self, step: int) -> tuple[Watch | None, int]:
        """This watch at ``step`` without the teleports whose own window ended before it (``None`` when none is
        left), and how many left it."""
        alive = [w for w in self.chain if w.until >= step]
        if len(alive) == len(self.chain):
            return self, 0
        return (None if not alive else replace(self, earlier=alive[:-1])), len(self.chain) - len(alive)

    def _references(self) -> tuple[float, float | None]:
        """The smallest squared-gradient and loss references of the teleports in the chain."""
        grads = [w.grad_ref for w in self.chain if w.grad_ref > 0]
        losses = [w.loss_ref for w in self.chain if w.loss_ref is not None]
        return min(grads, default=0.0), min(losses, default=None)

    def alarm(
        self,
        grads: list[Tensor],
        loss: Any,
        factor: float,
        patience: int = 1,
        squared: float | None = None,
        measure: Measure | None = None,
    ) -> str | None:
        """Why this rank's gradients ``grads`` or ``loss`` call for a rollback (``None``: all well).

        A non-finite value or a ratio to the reference above ``max(factor, factor**2)`` does at once.  Ratios above
        ``factor`` on ``patience`` consecutive calls (``strikes`` counts them) do unless the gradient's is the largest
        and the loss at the last call is below the loss at the teleport (``loss_ref``; without one, the loss at the
        first of the strikes, ``strike_loss``): then the gradient grew while the loss fell (a teleport's changed
        per-element learning rates can do that), which costs the run nothing.  A loss is ``loss``, else
        ``measure(batch)`` (read only at those two calls, the second on the batch of the first: a paired
        comparison, free of the batch-to-batch noise of two fresh batches; a decision that keeps the teleport
        starts the count again, so a window of ``w`` steps reads at most ``2 * (w // patience)`` of them); without one, or with
        ``patience=1`` and no ``loss_ref``, the gradient alone decides.  ``squared``: ||grads||^2 when already read
        (:meth:`TeleportRecord.read_grads`), else it is read here.
        """
        grad_ref, loss_ref = self._references()
        ratios: list[tuple[float, str]] = []
        if grads:
            sq = squared_norm(grads) if squared is None else squared
            if not math.isfinite(sq):
                return "non-finite gradient"
            if grad_ref > 0:
                ratios.append((sq / grad_ref, "squared gradient norm"))
        if loss is not None and loss_ref is not None:
            value = float(loss)
            if not math.isfinite(value):
                return "non-finite loss"
            if loss_ref > 0:
                ratios.append((value / loss_ref, "loss"))
        ratio, what = max(ratios, default=(0.0, ""))
        strikes = self.strikes + 1 if ratio > factor else 0
        if ratio > max(factor, factor * factor):
            return f"{what} grew to {ratio:.1f}x its reference at the teleport"
        strike_loss, strike_batch = (self.strike_loss, self.strike_batch) if strikes > 1 else (None, None)
        if strikes == 1 < patience and loss_ref is None:  # no loss at the teleport: the loss at the first strike
            strike_loss, strike_batch = _loss_now(loss, measure)
        if strikes >= patience:  # (the count is kept only when all is well: an interrupted rollback leaves it as it was)
            why = f"{what} above {factor:g}x its reference at the teleport for {strikes} step(s) (last {ratio:.1f}x)"
            reference_loss = loss_ref if loss_ref is not None else strike_loss
            if reference_loss is None or what == "loss" or (now := _loss_now(loss, measure, strike_batch)[0]) is None:
                return why
            if not now < reference_loss:  # (a non-finite loss is not below)
                since = "at the teleport" if loss_ref is not None else "at the first step above the factor"
                return f"{why}, the loss {now:.4g} not below its {reference_loss:.4g} {since}"
            strikes, strike_loss, strike_batch = 0, None, None  # kept: the next decision waits for ``patience`` new strikes
        self.strikes, self.strike_loss, self.strike_batch = strikes, strike_loss, strike_batch
        return None

    def triggered(
        self,
        grads: list[Tensor],
        loss: Any,
        factor: float,
        patience: int = 1,
        squared: float | None = None,
        measure: Measure | None = None,
    ) -> bool:
        """Whether any rank's :meth:`alarm` went off (then ``why`` says why)."""
        why = self.alarm(grads, loss, factor, patience, squared, measure)
        device = local(grads[0]).device if grads else None
        fired = any_rank(
            why is not None,
            device=device if device is not None and device.type != "cpu" else None,
        )
        if fired:
            self.why = why or "another rank's watch triggered"
        return fired

    def writes(self) -> tuple[list[Tensor], list[Tensor]]:
        """What :meth:`undo` writes in place: the tensors (parameters, buffers), and the parameters whose
        ``.grad`` and optimizer state it writes (for :meth:`Transaction.protect
        <teleopt.teleport.transaction.Transaction.protect>`, which makes a rollback all or nothing)."""
        tensors: dict[int, Tensor] = {}
        params: dict[int, Tensor] = {}
        for w in self.chain:
            undo = w.snapshot
            if isinstance(undo, InverseMove):
                live = [lookup_tensor(undo.module, n) for s in undo.sites for n in s.tensor_names]
                tensors.update((id(t), t) for t in live)
                params.update((id(t), t) for t in live if isinstance(t, nn.Parameter))
            else:
                tensors.update((id(t), t) for t in undo.live.values())
                params.update((id(p), p) for p in undo.params)
        return list(tensors.values()), list(params.values())

    def undo(self, probe: Batch | None, seed: int, tol: float) -> str:
        """Undo the teleports of the chain, the last first (:class:`InverseMove` on ``probe``, checked against
        ``tol``, or the snapshot); returns how, for the rollback report."""
        return "; ".join(w._undo_one(probe, seed, tol) for w in reversed(self.chain))

    def _undo_one(self, probe: Batch | None, seed: int, tol: float) -> str:
        if not isinstance(self.snapshot, InverseMove):
            self.snapshot.restore()
            return f"restored to before the teleport at step {self.teleport_step}"
        drift = self.snapshot.restore(probe, seed)
        how = f"moved back by the inverse elements of the teleport at step {self.teleport_step} (the steps since kept"
        if drift is not None and not drift <= tol:
            warnings.warn(f"Teleport: the watch's inverse move changed the outputs by {drift:.2e} > {tol:.0e}", stacklevel=5)
        return how + (")" if drift is None else f"; outputs on the probe inputs changed by {drift:.1e})")

    def to_state(self) -> dict[str, Any]:
        """Plain data for ``state_dict``: the rollback's elements or snapshot, the window and the references
        (and ``"earlier"``: the same for the earlier teleports still watched, oldest first)."""
        saved = self.snapshot
        data: dict[str, Any] = {
            ("inverse" if isinstance(saved, InverseMove) else "snapshot"): saved.to_state(),
            "until": self.until,
            "teleport_step": self.teleport_step,
            "grad_ref": self.grad_ref,
            "loss_ref": self.loss_ref,
            "strikes": self.strikes,
        }
        if self.strike_loss is not None:
            data["strike_loss"] = self.strike_loss
        if self.strike_batch is not None:
            inputs, target, kwargs = self.strike_batch
            data["strike_batch"] = {"inputs": list(inputs), "target": target, "kwargs": kwargs}
        if self.earlier:
            mine = ("strikes", "strike_loss", "strike_batch")  # the chain's: kept on its last watch
            data["earlier"] = [{k: v for k, v in w.to_state().items() if k not in mine} for w in self.earlier]
        return data

    @classmethod
    def from_state(
        cls,
        data: dict[str, Any],
        module: nn.Module,
        optimizer: Optimizer,
        params: list[Tensor],
        policy: StatePolicy,
        sites: Sequence[Site] = (),
    ) -> Watch:
        """Rebuild a watch saved by :meth:`to_state` against ``module``'s live tensors (``sites``: see
        :meth:`InverseMove.from_state`)."""
        undo: Snapshot | InverseMove
        if "inverse" in data:
            undo = InverseMove.from_state(data["inverse"], module, optimizer, policy, sites)
        else:
            tensors = {n: lookup_tensor(module, n) for n in data["snapshot"]["tensors"]}
            undo = Snapshot.from_state(data["snapshot"], tensors, optimizer, params)
        return cls(
            snapshot=undo,
            until=int(data["until"]),
            teleport_step=int(data["teleport_step"]),
            grad_ref=float(data["grad_ref"]),
            loss_ref=None if data["loss_ref"] is None else float(data["loss_ref"]),
            strikes=int(data.get("strikes", 0)),
            strike_loss=None if data.get("strike_loss") is None else float(data["strike_loss"]),
            strike_batch=None if data.get("strike_batch") is None else _batch_of(data["strike_batch"], module),
            earlier=[cls.from_state(w, module, optimizer, params, policy, sites) for w in data.get("earlier", [])],
        )


def _batch_of(data: Mapping[str, Any], module: nn.Module) -> Batch:
    """The :class:`~teleopt.functional.Batch` :meth:`Watch.to_state` saved as plain data, its tensors on
    ``module``'s device (a checkpoint loaded with ``map_location="cpu"`` into a run on an accelerator)."""
    device = next((p.device for p in module.parameters()), None)
    batch = Batch(tuple(data["inputs"]), data.get("target"), data.get("kwargs"))
    return batch if device is None else tree_map(lambda v: v.to(device) if isinstance(v, Tensor) else v, batch)


def _copied(batch: Batch) -> Batch:
    """``batch`` with every tensor detached and copied (what the watch keeps across steps)."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, batch)


def keeps_copies(watch: Mapping[str, Any]) -> bool:
    """Whether a saved watch (:meth:`Watch.to_state`) holds a snapshot for any of its teleports."""
    return any("snapshot" in w for w in [watch, *watch.get("earlier", [])])


@dataclass
class TeleportRecord:
    """What a ``Teleport`` has done so far: steps, accepted teleports, rollbacks, the caps'
    backoff factor and the watch in progress."""

    step: int = 0
    accepted: int = 0
    rollbacks: int = 0
    backoff: float = 1.0
    watch: Watch | None = None
    recent: list[tuple[int, float]] = field(default_factory=list)
    #: ||grad||^2 as this step's watch or reference sample read it (:meth:`read_grads`), for the lean balance's
    #: ||g||^2 before its move; ``Teleport.step`` clears it before the base's update (never saved)
    read: float | None = field(default=None, compare=False, repr=False)
    #: the last report's step, acceptance and whether its caps took the whole move (``Teleport._call_hooks``)
    last: tuple[int, bool, bool] | None = None
    #: the lean balance's check (:mod:`~teleopt.teleport.companion`): its plan's sites and caps' backoff, the step
    #: its first teleport was checked, whether the lean path started and the step of its last lean teleport;
    #: saved, so that a resumed run takes the lean path (and its near-balance step) where the uninterrupted run does
    lean_check: tuple[tuple[str, ...], float, int, bool, int] | None = None
    #: ``lean_check`` as loaded from a checkpoint, for the first plan built after the load only (never saved)
    loaded_check: tuple[tuple[str, ...], float, int, bool, int] | None = field(default=None, compare=False, repr=False)

    def watch_fired(self, grads: list[Tensor], loss: Any, factor: float, patience: int, measure: Measure | None = None) -> bool:
        """Whether the open watch calls for a rollback on this step's ``grads`` and ``loss`` (:meth:`Watch.triggered`;
        ||grads||^2 read by :meth:`read_grads`; ``measure``: a batch's loss, read only where it decides)."""
        return self.watch is not None and self.watch.triggered(grads, loss, factor, patience, self.read_grads(grads), measure)

    def read_grads(self, grads: list[Tensor]) -> float:
        """||grads||^2 (:func:`squared_norm`; ``nan`` without gradients), kept in :attr:`read` for this step."""
        self.read = squared_norm(grads) if grads else math.nan
        return self.read

    def open_watch(self, undo: Snapshot | InverseMove, steps: int, report: TeleportReport) -> None:
        """Watch the teleport of ``report``, accepted at this step, for ``steps`` steps (rolled back by ``undo``),
        joined to the watch still open (:meth:`Watch.stack`)."""
        before, after = report.grad_norm_before, report.grad_norm_after
        watch = Watch(undo, self.step + steps, self.step, reference(before, after, self.take_recent()), report.loss_before)
        gain = (after / before) ** 2 if before and after else 1.0
        self.watch = watch.stack(self.watch, gain)

    def settle(self, backoff: float) -> None:
        """After a step: the teleports whose watch window ended came through it, each undoing one ``backoff`` of
        the caps (a rollback is not permanent); the watch ends with the last of them."""
        if self.watch is not None:
            self.watch, passed = self.watch.settle(self.step)
            self.backoff = min(1.0, self.backoff / backoff**passed)

    def rolled_back(self, backoff: float) -> None:
        """Count a watch rollback: the watch ends, the caps of later teleports are scaled by ``backoff``."""
        self.watch = None
        self.rollbacks += 1
        self.backoff *= backoff

    def sample(self, grads: list[Tensor]) -> None:
        """Keep this step's ||grad||^2 for the next teleport's :func:`reference` (the last ``REFERENCE_STEPS``)."""
        value = self.read_grads(grads)
        if math.isfinite(value):  # a non-finite step is no reference
            self.recent = [*self.recent[-(REFERENCE_STEPS - 1) :], (self.step, value)]

    def take_recent(self) -> list[float]:
        """The samples of the ``REFERENCE_STEPS`` steps before this one, and forget all of them."""
        recent = [v for t, v in self.recent if self.step - REFERENCE_STEPS <= t < self.step]
        self.recent = []
        return recent

    def to_state(self, rng: Tensor) -> dict[str, Any]:
        """Plain data for ``state_dict`` with the generator state ``rng`` (the watch only when one is in progress)."""
        top: dict[str, Any] = {
            "step": self.step,
            "accepted": self.accepted,
            "rollbacks": self.rollbacks,
            "backoff": self.backoff,
            "rng": rng,
        }
        if self.recent:
            top["recent"] = [[t, v] for t, v in self.recent]
        if self.watch is not None:
            top["watch"] = self.watch.to_state()
        if self.last is not None:
            top["last"] = list(self.last)
        if self.lean_check is not None:
            sites, backoff, checked_at, verified, lean_step = self.lean_check
            top["lean_check"] = {
                "sites": list(sites),
                "backoff": backoff,
                "checked_at": checked_at,
                "verified": verified,
                "lean_step": lean_step,
            }
        return top

    def load_state(
        self,
        top: dict[str, Any],
        module: nn.Module,
        optimizer: Optimizer,
        params: list[Tensor],
        policy: StatePolicy,
        sites: Sequence[Site] = (),
    ) -> None:
        """Restore what :meth:`to_state` returned (missing counters start from zero)."""
        self.step = int(top.get("step", 0))
        self.accepted = int(top.get("accepted", 0))
        self.rollbacks = int(top.get("rollbacks", 0))
        self.backoff = float(top.get("backoff", 1.0))
        self.recent = [(int(t), float(v)) for t, v in top.get("recent", [])]
        last = top.get("last")
        self.last = None if last is None else (int(last[0]), bool(last[1]), bool(last[2]))
        lean = top.get("lean_check")
        self.lean_check = self.loaded_check = (
            None
            if lean is None
            else (
                tuple(str(n) for n in lean["sites"]),
                float(lean["backoff"]),
                int(lean["checked_at"]),
                bool(lean["verified"]),
                int(lean["lean_step"]),
            )
        )
        watch = top.get("watch")
        self.watch = None if watch is None else Watch.from_state(watch, module, optimizer, params, policy, sites)


def keeps_snapshot(safety: Any, sites: Sequence[Site]) -> bool:
    """Whether an accepted teleport's watch keeps a snapshot (``watch_restore="snapshot"``, or a site without an
    inverse move: not a fast-path site) rather than its elements (:class:`InverseMove`)."""
    from teleopt.teleport.fast_path import fast_path_eligible

    return safety.watch_steps > 0 and (safety.watch_restore == "snapshot" or not all(fast_path_eligible(s) for s in sites))
