"""The general path: teleport objectives evaluated with ``torch.func`` on a batch.

Data-dependent actions (Zhao 2026, Prop. 4.4.2, eq. 4.13 and 4.16; Zhao et al. 2023
Theorem 2.4.1), approximate ones and learned ones (Zhao et al. 2024b) have no
closed-form gradient transport: the gradient at g . w must be computed at g . w,
on the batch the symmetry holds on.  The model is evaluated with
``torch.func.functional_call`` on a dictionary of tensors, with *copies* of its
buffers, so BatchNorm running statistics are never touched by the extra passes
(CONVENTIONS.md section 1), and the objective is differentiated with respect to
the group coordinates through the model (a double backward for gradient norms).

Sites act in list order (see :mod:`teleopt.teleport.transport`).  A
data-dependent site reads its batch input (the input of the module its
``data_input`` names) at the parameters produced by the sites before it, so
chained data-dependent GL actions stay exact; the first-order teleport of the
papers' code reads stale hidden states instead (:mod:`teleopt.teleport.paper_compat`).
Every site acts through ``GroupAction.act`` only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.base import required
from teleopt.functional import FunctionalModel, LossFn, as_batch
from teleopt.site import Site
from teleopt.teleport.context import TeleportContext
from teleopt.teleport.distributed import broadcast_
from teleopt.teleport.state_policy import StatePolicy

__all__ = ["GeneralEvaluator"]


class GeneralEvaluator:
    """Teleport quantities at g . w computed through the model on a batch (see module docs).

    Parameters
    ----------
    sites:
        All sites of the teleport, in composition order.
    ctx:
        The model/optimizer view of this teleport.
    batch:
        ``(inputs, target)`` the objective and the data-dependent actions use.
    loss_fn:
        ``loss_fn(output, target) -> scalar``; ``None`` if the output is the loss.
    """

    path = "general"
    moves_gradients = False

    def __init__(self, sites: Sequence[Site], ctx: TeleportContext, batch: Any, loss_fn: LossFn | None) -> None:
        self.sites = list(sites)
        self.ctx = ctx
        self.batch = as_batch(batch)
        self.fmodel = FunctionalModel(ctx.module, loss_fn)
        self.names = {n for site in self.sites for n in site.tensor_names}
        self.like = {n: ctx.tensors[n] for n in self.names}
        self.base = {
            n: t.detach().requires_grad_(n in ctx.trainable) for n, t in ctx.tensors.items() if n in ctx.trainable or n in self.names
        }

    def elements(self, coords: Sequence[Tensor]) -> list[Tensor]:
        """exp of each site's coordinates."""
        return [
            site.action.exp(xi, tuple(None if n is None else self.like[n] for n in site.members)) for site, xi in zip(self.sites, coords)
        ]

    def params(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Every trainable parameter and site member at g . w (sites in order, inputs re-read)."""
        cur = dict(self.base)
        for site, g in zip(self.sites, elements):
            data = None
            if site.action.needs_data or site.data_input is not None:
                if site.data_input is None:
                    raise ValueError(f"site {site.name!r} is data-dependent but names no data_input module")
                data = self.fmodel.module_input(cur, self.batch, site.data_input)
            vals = tuple(None if n is None else cur[n] for n in site.members)
            new = site.action.act(g, vals, data)
            for n, v in zip(site.members, new):
                if n is not None:
                    cur[n] = required(v, n)
        return cur

    def site_params(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        """Site members at g . w."""
        params = self.params(elements)
        return {n: params[n] for n in self.names}

    def site_gains(self, elements: Sequence[Tensor], n0: float) -> dict[str, float | None]:
        """Not known in closed form on the general path: empty."""
        return {}

    @torch.no_grad()
    def apply(self, elements: Sequence[Tensor]) -> Counter[str]:
        """Move the site members and optimizer state to g . w in place (identical on every rank);
        ``.grad`` is left for the caller to recompute at g . w."""
        ctx = self.ctx
        states = ctx.states(self.names)
        with torch.enable_grad():
            new_params = self.params(elements)
        moved_state = ctx.policy.move(ctx.optimizer, self.sites, elements, states, self.like, ctx.groups)
        for n in self.names:
            ctx.tensors[n].copy_(new_params[n].detach())
        broadcast_([ctx.tensors[n] for n in sorted(self.names)])
        StatePolicy.write(states, moved_state)
        return Counter(d for dec in moved_state.decisions.values() for d in dec.values())

    def end_search(self) -> None:
        """Nothing to free: each quantity is computed through the model when asked for."""

    def can_undo(self) -> bool:
        """Never: ``.grad`` is recomputed at g . w, so only a snapshot restores it."""
        return False

    def exactly_invertible(self, elements: Sequence[Tensor]) -> bool:
        """Never (see :meth:`can_undo`)."""
        return False

    def undo(self, elements: Sequence[Tensor], params: bool = False) -> None:
        raise RuntimeError("the general path cannot undo a teleport by its inverse; restore a snapshot")

    def originals(self, elements: Sequence[Tensor]) -> dict[str, Tensor]:
        raise RuntimeError("the general path cannot undo a teleport by its inverse; restore a snapshot")

    def loss(self, params: Mapping[str, Tensor]) -> Tensor:
        """The batch loss at ``params``."""
        return self.fmodel.loss(params, self.batch)

    def grads(self, params: Mapping[str, Tensor], create_graph: bool = True) -> dict[str, Tensor]:
        """Gradient of the batch loss at ``params`` for every trainable parameter."""
        names = list(self.ctx.trainable)
        with torch.enable_grad():
            loss = self.loss(params)
            gs = torch.autograd.grad(loss, [params[n] for n in names], create_graph=create_graph, allow_unused=True)
        return {n: torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, gs)}

    def grad_norm_sq(self, elements: Sequence[Tensor]) -> Tensor:
        """||grad L(g . w)||^2 over all trainable parameters (float64)."""
        grads = self.grads(self.params(elements))
        return sum((g.to(torch.float64).square().sum() for g in grads.values()), torch.zeros((), dtype=torch.float64))

    def _updates(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor], elements: Sequence[Tensor]) -> dict[str, Tensor]:
        ctx = self.ctx
        states = ctx.states(ctx.trainable)
        moved = ctx.policy.move(
            ctx.optimizer, self.sites, elements, {n: s for n, s in states.items() if n in self.names}, self.like, ctx.groups
        )
        out = {}
        for name, g in grads.items():
            state = moved.values.get(name, states.get(name, {}))
            out[name] = ctx.model.update(ctx.groups[name], params[name], g, state)
        return out

    def next_step_point(self, elements: Sequence[Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Every trainable parameter at g . w and the base optimizer's diagonal preconditioner there."""
        ctx = self.ctx
        with torch.enable_grad():
            params = self.params(elements)
            grads = self.grads(params, create_graph=False)
        states = ctx.states(ctx.trainable)
        moved = ctx.policy.move(
            ctx.optimizer, self.sites, elements, {n: s for n, s in states.items() if n in self.names}, self.like, ctx.groups
        )
        P = {}
        for name, g in grads.items():
            state = moved.values.get(name, states.get(name, {}))
            P[name] = ctx.model.preconditioner(ctx.groups[name], params[name].detach(), g.detach(), state)
        return {n: params[n].detach() for n in ctx.trainable}, P

    def first_order_decrease(self, elements: Sequence[Tensor]) -> Tensor:
        """<grad, u> of the base optimizer's next step from g . w, over all trainable parameters."""
        params = self.params(elements)
        grads = self.grads(params)
        updates = self._updates(params, grads, elements)
        return sum(
            ((g.to(torch.float64) * updates[n].to(torch.float64)).sum() for n, g in grads.items()), torch.zeros((), dtype=torch.float64)
        )

    def lookahead_loss(self, elements: Sequence[Tensor]) -> Tensor:
        """L(g . w - u): the batch loss after the base optimizer's next step from g . w."""
        params = self.params(elements)
        grads = self.grads(params)
        updates = self._updates(params, grads, elements)
        stepped = dict(params)
        for name, u in updates.items():
            stepped[name] = params[name] - u
        return self.loss(stepped)

    def perturbed_loss(self, elements: Sequence[Tensor], direction: Mapping[str, Tensor], t: float) -> Tensor:
        """L(g . w + t d) on the batch, for a direction ``d`` over the trainable parameters."""
        params = self.params(elements)
        moved = dict(params)
        for name, d in direction.items():
            moved[name] = params[name] + t * d
        return self.loss(moved)


@contextmanager
def double_backward_hint() -> Iterator[None]:
    """Re-raise the error of an op without a double backward (torch's fused CPU attention kernel) with
    what to do: the general path differentiates the model's gradient, the fast path does not."""
    try:
        yield
    except RuntimeError as e:
        if "derivative for" not in str(e) or "is not implemented" not in str(e):
            raise
        raise RuntimeError(
            f"{e}. The general teleport path differentiates the model's gradient (a double backward), "
            "which this op does not support: use path='fast' (exact linear sites need no model pass), or "
            "an implementation of the op that has one (timm attention: set each block's "
            "attn.fused_attn = False)"
        ) from e
