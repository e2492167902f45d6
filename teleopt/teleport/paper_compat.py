"""The official first-order teleport of Zhao 2026, Sec. 4.6.1, for comparisons only.

**This mode is not loss-preserving and is never the default.**  It reproduces
what the papers' MLP experiments do (Sec. 4.6.1: "We use the first order
approximation of the exponential map ... we replace g_m by I + T and g_m^{-1} by
I - T in equation 4.13, where T is initialized to 0.  Then we perform gradient
ascent steps on T"), so that teleopt's exact teleports can be compared with it
at the same settings.  Per ascent step:

1. T_m = 0 for every site; the gradient norm sum ||dL/dW||^2 is evaluated with
   g_m = I + T_m applied through eq. 4.13 layer by layer, hidden states
   recomputed after each lower layer moved;
2. T_m <- lr * d(sum ||dL/dW||^2)/dT_m (one fixed-learning-rate step from 0);
3. every pair is updated with W_m <- W_m (I - T_m) and
   W_{m-1} <- sigma^{-1}((I + T_m) sigma(W_{m-1} h_{m-2})) h_{m-2}^+ , where the
   hidden states h_{m-2} are those of the weights *before* this ascent step
   (stale once a lower layer moved).

Both approximations change the loss: (I - T) is not (I + T)^{-1}, and the stale
hidden states break eq. 4.13's invariance for every layer above the first.
The report of a paper-compat teleport measures the drift like any other.
Supported sites: ``data_dependent_gl`` (eq. 4.13) without first-layer bias, and
GL sites between linear layers (``gl_linear``, where eq. 4.13 reduces to g W1,
g b1, W2 g^{-1}, approximated the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from teleopt.actions.axis import AxisAction
from teleopt.actions.data_dependent import DataDependentGL
from teleopt.detection.certify import output_leaves
from teleopt.functional import Batch, FunctionalModel
from teleopt.site import Site
from teleopt.teleport.engine import TeleportEngine
from teleopt.teleport.phases import Checked, Declined, Planned, Verified

__all__ = ["check_paper_compat_sites", "paper_compat_teleport", "PaperCompatEngine"]


def check_paper_compat_sites(sites: Sequence[Site]) -> None:
    """Raise ``ValueError`` unless every site is a GL action the official code's approximation applies to."""
    for site in sites:
        action = site.action
        if isinstance(action, DataDependentGL):
            if site.members[1] is not None:
                raise ValueError(f"paper_compat: site {site.name!r} has a first-layer bias; the official MLP teleport has none")
            if site.data_input is None:
                raise ValueError(f"paper_compat: data-dependent site {site.name!r} names no data_input module")
        elif not (isinstance(action, AxisAction) and action.group_type.full_matrix_algebra and action.blocks is None):
            raise ValueError(
                f"paper_compat reproduces the official first-order GL teleport (I + T, I - T); site {site.name!r} "
                f"({action.name}, {action.group_name}) is not a GL site"
            )


def _present(name: str | None) -> str:
    if name is None:
        raise ValueError("paper_compat: a required site member is absent")
    return name


def _first_order(site: Site, T: Tensor, cur: dict[str, Tensor], hidden: Tensor | None) -> None:
    eye = torch.eye(T.shape[0], dtype=T.dtype, device=T.device)
    action = site.action
    if isinstance(action, DataDependentGL):
        n1, n2 = _present(site.members[0]), _present(site.members[2])
        W1, W2 = cur[n1], cur[n2]
        act, inverse = action.activation, action.activation.inverse
        if hidden is None or inverse is None:
            raise ValueError(f"paper_compat: site {site.name!r} needs its layer input and an invertible activation")
        # row convention: Z = H W1^T (samples x hidden); (I + T) acts on the hidden axis
        Z = act(hidden @ W1.T) @ (eye + T).T
        cur[n1] = (torch.linalg.pinv(hidden) @ inverse(Z)).T
        cur[n2] = W2 @ (eye - T)
        return
    if not isinstance(action, AxisAction):
        raise TypeError(f"paper_compat: site {site.name!r} is not a GL site")  # check_paper_compat_sites refuses it
    for member, name in zip(action.members, site.members):
        if name is None:
            continue
        t = cur[name]
        factor = (eye + T) if member.power == 1 else (eye - T).T
        cur[name] = torch.movedim(torch.tensordot(factor, t.movedim(member.axis, 0), dims=1), 0, member.axis)


def paper_compat_teleport(
    fmodel: FunctionalModel,
    sites: Sequence[Site],
    batch: Batch,
    trainable: Sequence[str],
    live: dict[str, Tensor],
    steps: int,
    lr: float,
) -> None:
    """Run the official first-order teleport in place on ``live`` (see module docs)."""
    for _ in range(steps):
        base = {n: t.detach() for n, t in live.items()}
        stale = [None if site.data_input is None else fmodel.module_input(base, batch, site.data_input) for site in sites]
        with torch.enable_grad():
            cur = {n: t.clone().requires_grad_(n in trainable) for n, t in base.items()}
            Ts = []
            for site in sites:
                ref = cur[site.tensor_names[0]]
                width = _hidden_width(site, cur)
                T = torch.zeros(width, width, dtype=ref.dtype, device=ref.device, requires_grad=True)
                Ts.append(T)
                hidden = None if site.data_input is None else fmodel.module_input(cur, batch, site.data_input)
                _first_order(site, T, cur, hidden)
            loss = fmodel.loss(cur, batch)
            grads = torch.autograd.grad(loss, [cur[n] for n in trainable], create_graph=True)
            objective = sum((g.square().sum() for g in grads), torch.zeros((), dtype=grads[0].dtype, device=grads[0].device))
            dTs = torch.autograd.grad(objective, Ts, allow_unused=True)
        with torch.no_grad():
            moved = dict(base)
            for site, T0, dT, hidden in zip(sites, Ts, dTs, stale):
                _first_order(site, lr * (torch.zeros_like(T0) if dT is None else dT), moved, hidden)
            for n, t in live.items():
                if moved[n] is not base[n]:
                    t.copy_(moved[n])


def _hidden_width(site: Site, cur: dict[str, Tensor]) -> int:
    action = site.action
    if isinstance(action, DataDependentGL):
        return cur[_present(site.members[0])].shape[0]
    if not isinstance(action, AxisAction):
        raise TypeError(f"paper_compat: site {site.name!r} is not a GL site")
    member, name = next((m, n) for m, n in zip(action.members, site.members) if n is not None)
    return cur[name].shape[member.axis]


class PaperCompatEngine(TeleportEngine):
    """The official first-order teleport as a teleport engine: planned like any other (path
    ``"paper_compat"``, always on a batch), then ``SearchConfig.steps`` first-order steps of size
    ``SearchConfig.lr`` replace search, apply and verify.  No caps, no watch; the outputs on the batch
    are compared as for every teleport (``report.check_error``), but the teleport is accepted
    whatever they show."""

    def choose_path(self, sites: Sequence[Site]) -> str:
        return "paper_compat"

    def batch_need(self, sites: Sequence[Site]) -> str:
        return "paper_compat"

    def plan_evaluator(self, planned: Planned) -> Planned | Declined:
        return planned  # the first-order teleport evaluates the model itself

    def execute(self, planned: Planned) -> Verified | Declined:
        cfg, ctx, fmodel, request = self.config, planned.ctx, planned.fmodel, planned.request
        assert fmodel is not None and request.batch is not None, "planned with a batch (paper_compat needs one)"
        live = {n: ctx.tensors[n] for n in ctx.trainable}
        for s in planned.sites:
            live.update({n: ctx.tensors[n] for n in s.tensor_names})
        if planned.transaction is not None:  # all or nothing: the live tensors, their gradients and state
            grads = [p.grad for p in cfg.module.parameters() if p.grad is not None]
            planned.transaction.protect(list(live.values()) + grads, [ctx.trainable[n] for n in live if n in ctx.trainable])
        ascent = cfg.search.ascent()
        paper_compat_teleport(fmodel, planned.sites, request.batch, list(ctx.trainable), live, ascent.steps, ascent.lr)
        # the check is measured like any other teleport's, but decides nothing: this mode is not loss-preserving
        check = planned.check
        assert check.kind == "batch", "planned with a batch (paper_compat needs one)"
        out = check.run(cfg.module)
        loss_after = self._loss_value(fmodel, out, request.batch)
        error = check.error(output_leaves(out))
        measured = {"loss_after": loss_after, "check_error": error, "check_tol": check.tolerance(cfg.safety.loss_tol)}
        loss: Any = loss_after
        if request.closure is not None:
            loss, _ = self.rerun_closure(request.closure)
        else:
            ctx.fresh_gradients(fmodel, request.batch)
        reason = f"accepted (paper_compat: not loss-preserving, never rolled back; outputs changed by {error:.2e})"
        return Verified(planned, Checked(loss, measured, []), None, reason)
