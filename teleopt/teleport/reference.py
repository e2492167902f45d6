"""A reference teleport: the papers' Algorithm 1 written directly with ``torch.func``.

Symmetry teleportation (Zhao, Dehmamy, Walters, Yu 2022, "Symmetry teleportation
for accelerated optimization", Algorithm 1; Zhao 2026, Sec. 4.3, Algorithm 1):

    line 3:  g <- argmax_g ||grad L(g . w_t)||^2
    line 4:  w_t <- g . w_t
    line 6:  w_{t+1} <- w_t - eta grad L(w_t)

Here g = exp(xi) per site (Sec. 4.3: gradient ascent on the Lie algebra), sites act
in list order (each on the result of those before it), and line 3's argmax is
plain gradient ascent xi <- xi + lr dJ/dxi on J(xi) = ||grad L(exp(xi) . w)||^2,
every derivative taken by ``torch.func.grad`` through the model: no closed-form
transport, no caches, no trust region, no safety checks.  It is slow on purpose
and exists to be compared with: the fast path's closed-form evaluation (Prop.
4.5.1, eq. 4.19) must agree with it at the same element
(``tests/test_reference_teleport.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad

from teleopt.site import Site

__all__ = ["ReferenceTeleport", "reference_teleport"]

LossFn = Callable[[Any, Any], Tensor]


@dataclass(frozen=True)
class ReferenceTeleport:
    """What :func:`reference_teleport` found.

    ``coords`` and ``elements`` per site; ``params`` and ``grads`` every trainable
    parameter and its gradient at g . w; ``objective_before``/``objective_after`` the
    objective J at the identity and at g; ``stepped`` g . w - ``sgd_lr`` grad L(g . w)
    (the base optimizer's step, plain SGD) when ``sgd_lr`` was given.
    """

    coords: list[Tensor]
    elements: list[Tensor]
    params: dict[str, Tensor]
    grads: dict[str, Tensor]
    objective_before: float
    objective_after: float
    stepped: dict[str, Tensor] | None


def _members(site: Site, tensors: dict[str, Tensor]) -> tuple[Tensor | None, ...]:
    return tuple(None if n is None else tensors[n] for n in site.members)


def _shape(site: Site, tensors: dict[str, Tensor]) -> tuple[int, ...]:
    shape = site.action.coord_shape(_members(site, tensors))
    if shape is None:
        raise TypeError(f"reference_teleport: site {site.name!r} is discrete (no Lie algebra coordinates)")
    return shape


def _elements(sites: Sequence[Site], coords: Sequence[Tensor], tensors: dict[str, Tensor]) -> list[Tensor]:
    """exp(xi) of each site's group (Zhao 2026, Sec. 4.3: g parametrised by its Lie algebra)."""
    return [s.action.exp(x, _members(s, tensors)) for s, x in zip(sites, coords)]


def _act(sites: Sequence[Site], elements: Sequence[Tensor], tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """g_n ... g_1 . w: each site acts on the result of the sites before it (members named twice,
    slices of one tensor, are merged as x + sum_i (out_i - x))."""
    out = dict(tensors)
    for site, g in zip(sites, elements):
        members = _members(site, out)
        moved = site.action.act(g, members)
        merged: dict[str, Tensor] = {}
        for name, x, y in zip(site.members, members, moved):
            if name is not None and x is not None and y is not None:
                merged[name] = merged.get(name, x) + (y - x)
        out.update(merged)
    return out


def reference_teleport(
    model: nn.Module,
    sites: Sequence[Site],
    batch: tuple[Any, Any],
    loss_fn: LossFn,
    *,
    steps: int = 0,
    lr: float = 0.1,
    coords: Sequence[Tensor] | None = None,
    sgd_lr: float | None = None,
) -> ReferenceTeleport:
    """Teleport ``model``'s parameters by Algorithm 1 (see module docs); the model is not changed.

    ``batch`` is ``(inputs, target)`` (``inputs`` a tensor or a tuple of positional
    inputs) and the loss is ``loss_fn(model(*inputs), target)``.  The ascent starts
    from ``coords`` (default: the identity, zeros of each site's ``coord_shape``) and
    takes ``steps`` steps of size ``lr``.  Every parameter with ``requires_grad`` is
    trainable and counted in J; buffers are passed through unchanged.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    inputs, target = batch
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: t.detach() for n, t in model.named_buffers()}
    fixed.update({n: p.detach() for n, p in model.named_parameters() if not p.requires_grad})

    def loss(trainable: dict[str, Tensor]) -> Tensor:
        return loss_fn(functional_call(model, {**fixed, **trainable}, inputs), target)

    def moved(xs: list[Tensor]) -> dict[str, Tensor]:
        return {**params, **_act(sites, _elements(sites, xs, every), every)}

    def objective(xs: list[Tensor]) -> Tensor:
        at = moved(xs)
        g = grad(lambda p: loss({**at, **p}))({n: at[n] for n in params})
        return sum((v.square().sum() for v in g.values()), torch.zeros((), dtype=torch.float64))

    every = {**fixed, **params}
    if coords is None:
        coords = [torch.zeros(_shape(s, every), dtype=torch.float64) for s in sites]
    xs = [c.detach().to(torch.float64).clone() for c in coords]
    before = float(objective([torch.zeros_like(x) for x in xs]))
    for _ in range(steps):
        dxs = grad(objective)(xs)
        xs = [x + lr * d for x, d in zip(xs, dxs)]
    at = moved(xs)
    members = {n: at[n] for n in params}
    grads = grad(lambda p: loss({**at, **p}))(members)
    elements = _elements(sites, xs, every)
    after = float(sum(v.square().sum() for v in grads.values()))
    stepped = None if sgd_lr is None else {n: members[n] - sgd_lr * grads[n] for n in members}
    return ReferenceTeleport(xs, elements, members, dict(grads), before, after, stepped)
