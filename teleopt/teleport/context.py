"""What a teleport reads from the model and the optimizer, by tensor name.

Sites name tensors by their qualified names in ``model.state_dict()``; the
optimizer knows parameters by identity.  A :class:`TeleportContext` joins the two
once per teleport: live tensors, trainable parameters, their param groups and
optimizer state, the functional model of the optimizer's update and the state
policies.  Quantities of parameters no site touches are constant during the
search and are summed once (:meth:`TeleportContext.constant_terms`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from teleopt.functional import Batch, FunctionalModel
from teleopt.numerics import read_together
from teleopt.sharding import is_sharded, local, total_sum
from teleopt.teleport.distributed import all_reduce_mean_
from teleopt.teleport.optimizer_model import OptimizerModel
from teleopt.teleport.state_policy import StatePolicy

__all__ = ["TeleportContext"]


@dataclass
class TeleportContext:
    """Named view of a model and its optimizer for one teleport.

    ``tensors`` holds every parameter and buffer (live), ``trainable`` the
    parameters the optimizer updates (name -> parameter), ``groups`` their param
    groups.
    """

    module: nn.Module
    optimizer: Optimizer
    model: OptimizerModel
    policy: StatePolicy
    tensors: dict[str, Tensor]
    trainable: dict[str, Tensor]
    groups: dict[str, dict[str, Any]]

    @classmethod
    def build(cls, module: nn.Module, optimizer: Optimizer, policy: StatePolicy) -> TeleportContext:
        """Join ``module``'s named tensors with ``optimizer``'s groups."""
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        tensors: dict[str, Tensor] = {}
        trainable: dict[str, Tensor] = {}
        groups: dict[str, dict[str, Any]] = {}
        for name, p in module.named_parameters():
            tensors[name] = p
            if id(p) in group_of and p.requires_grad:
                trainable[name] = p
                groups[name] = group_of[id(p)]
        for name, b in module.named_buffers():
            tensors[name] = b
        return cls(module, optimizer, OptimizerModel(optimizer), policy, tensors, trainable, groups)

    def state(self, name: str) -> dict[str, Any]:
        """The optimizer state of trainable parameter ``name`` (empty if not initialised yet)."""
        return self.optimizer.state.get(self.trainable[name], {})

    def states(self, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Non-empty optimizer states of the trainable parameters among ``names``."""
        out = {}
        for n in names:
            if n in self.trainable:
                st = self.state(n)
                if st:
                    out[n] = st
        return out

    def grads(self, names: Iterable[str]) -> dict[str, Tensor]:
        """``.grad`` of the trainable parameters among ``names`` that have one."""
        out = {}
        for n in names:
            grad = self.trainable[n].grad if n in self.trainable else None
            if grad is not None:
                out[n] = grad
        return out

    @torch.no_grad()
    def constant_terms(self, exclude: set[str], with_decrease: bool) -> tuple[float, float]:
        """Sum of ||grad||^2 and of <grad, update> over trainable parameters not in ``exclude``.

        Sharded (FSDP2) parameters contribute from their local shards (the modelled
        updates are elementwise), summed over ranks (:func:`~teleopt.sharding.total_sum`).
        """
        squares: list[tuple[Tensor, Tensor]] = []
        products: list[tuple[Tensor, Tensor]] = []
        dense: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for name, p in self.trainable.items():
            if name in exclude or p.grad is None:
                continue
            g = p.grad.to_dense() if p.grad.is_sparse else p.grad  # sparse norms need torch >= 2.13
            if is_sharded(g):
                squares.append((local(g).to(torch.float64).square().sum(), g))
            elif p.grad.is_sparse:  # its norm now, and the dense copy not kept (total_sum only asks whether it is sharded)
                squares.append((torch.linalg.vector_norm(g).to(torch.float64).square(), p.grad))
            else:
                dense.setdefault((g.device, g.dtype), []).append(g)
            if with_decrease:
                state = {k: local(v) if isinstance(v, Tensor) else v for k, v in self.state(name).items()}
                u = self.model.update(self.groups[name], local(p), local(g), state)
                products.append(((local(g).to(torch.float64) * u.to(torch.float64)).sum(), g))
        # the plain gradients' norms a device and dtype at a time (torch.nn.utils.clip_grad_norm_ does the same), read
        # once per device and dtype instead of once per parameter (a device synchronisation each)
        sq = sum(read_together([torch.stack(torch._foreach_norm(gs)).to(torch.float64).square().sum() for gs in dense.values()]))
        return sq + total_sum(squares), total_sum(products)

    def gradients_from_batch(self, fmodel: FunctionalModel, batch: Batch) -> None:
        """Set ``.grad`` of every trainable parameter to the gradient of the loss on ``batch`` at the live point."""
        names = list(self.trainable)
        with torch.enable_grad():
            tensors = {n: self.trainable[n].detach().requires_grad_(True) for n in names}
            loss = fmodel.loss(tensors, batch)
            grads = torch.autograd.grad(loss, [tensors[n] for n in names], allow_unused=True)
        for n, g in zip(names, grads):
            self.trainable[n].grad = torch.zeros_like(self.trainable[n]) if g is None else g.detach()

    def fresh_gradients(self, fmodel: FunctionalModel, batch: Batch) -> None:
        """Replace ``.grad`` by the gradient at the (new) live point on ``batch``, averaged over ranks
        (only if some parameter had a gradient)."""
        had = [p for p in self.trainable.values() if p.grad is not None]
        if not had:
            return
        self.gradients_from_batch(fmodel, batch)
        all_reduce_mean_([g for g in (p.grad for p in had) if g is not None])
