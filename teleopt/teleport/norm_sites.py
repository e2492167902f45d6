"""Which normalisation-affine rescalings ``sites="auto"`` keeps under optimizers with scale-free steps.

A normalisation-affine site rescales a norm's gain and bias by ``c`` and the weights
reading them (its consumers) by ``1/c``.  Under a step that does not scale with the
gradient (Adam, AdamW, Adagrad, RMSprop: :func:`~teleopt.teleport.sites.scale_free_updates`)
each coordinate moves by about the learning rate whatever its size, so the
rescaling changes every moved tensor's step relative to its size: its effective
learning rate (Heo et al. 2021; Kosson et al. 2024).  Where a
consumer weight is *scale-invariant* (its output is normalised again, as a
BatchNorm'd convolution's is in training mode) its effective learning rate is set
by its norm alone, which the decoupled decay and the updates bring back to the same
equilibrium norm (Kosson et al. 2024), so the change a rescaling makes wears off.  Where it is
not (a LayerNorm'd or RMSNorm'd linear feeding attention or an MLP), the changed
scale and step ratio persist: that collapsed a ViT under AdamW.  So the rule: keep a
normalisation-affine site under scale-free steps when every weight it rescales,
besides the norms' own gains and biases, is under decoupled weight decay (AdamW's; the
equilibrium argument is for it, so coupled L2 and optimizers teleopt has no model of do
not count) and scale-invariant in training
mode (checked numerically on the example inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from teleopt.detection.certify import output_error, output_leaves, to_float64
from teleopt.detection.float64 import keep_float64
from teleopt.functional import Batch
from teleopt.numerics import default_rtol
from teleopt.site import Site
from teleopt.teleport.check import seeded
from teleopt.teleport.sites import is_norm, moved_names, normalization_affine, scale_free_updates

__all__ = ["ScaleInvariance", "norm_sites_left_out"]

#: The norms' eps in the float64 copy: positive (BatchNorm refuses 0 in training mode) and
#: negligible against any variance a float32 model's activations have.
_NEGLIGIBLE_EPS = 1e-30


class ScaleInvariance:
    """Whether a weight of ``model`` is scale-invariant in training mode on ``batch``.

    ``model`` is copied once to float64 with every norm's ``eps`` made negligible (a norm
    is scale-invariant up to its eps); a weight is scale-invariant when doubling it leaves
    every output leaf unchanged within :func:`~teleopt.numerics.default_rtol` of float64
    (the same dropout masks drawn) *because a norm absorbs it*: among the copy's leaf modules,
    those whose input changed and whose output did not are norms, and there is one (a
    weight that moves no output, before a zero-initialised projection or in a dead branch,
    is not shown invariant).  A forward that raises, or a non-finite output, is "not
    invariant": the check fails closed.
    """

    def __init__(self, model: nn.Module, batch: Batch, seed: int = 0) -> None:
        self._model, self._batch, self._seed = model, batch, seed
        self._copy: nn.Module | None = None
        self._reference: list[list[torch.Tensor]] | None = None
        self._modules: dict[str, list[list[torch.Tensor]]] = {}
        self._known: dict[str, bool] = {}
        self._failed = False

    def __call__(self, name: str) -> bool:
        if name not in self._known:
            self._known[name] = self._check(name)
        return self._known[name]

    @torch.no_grad()
    def _outputs(self) -> tuple[list[list[torch.Tensor]], dict[str, list[list[torch.Tensor]]]]:
        """The output leaves, and per leaf module of the copy its first input and its output leaves."""
        assert self._copy is not None
        seen: dict[str, list[list[torch.Tensor]]] = {}
        hooks = [
            m.register_forward_hook(lambda mod, args, out, name=n: seen.__setitem__(name, [output_leaves(args[:1]), output_leaves(out)]))
            for n, m in self._copy.named_modules()
            if not list(m.children())
        ]
        try:
            with seeded(self._copy, self._seed), keep_float64():  # the same dropout masks, CPU and CUDA
                out = self._copy(*to_float64(self._batch.inputs), **to_float64(self._batch.kwargs or {}))
        finally:
            for hook in hooks:
                hook.remove()
        return [output_leaves(out)], seen

    @torch.no_grad()
    def _check(self, name: str) -> bool:
        if self._failed:
            return False
        try:
            if self._reference is None:
                self._copy = _float64_copy(self._model)
                self._reference, self._modules = self._outputs()
            weight = dict(self._copy.named_parameters())[name]  # type: ignore[union-attr]
            weight.mul_(2.0)
            try:
                doubled, modules = self._outputs()
            finally:
                weight.div_(2.0)
        except Exception:  # noqa: BLE001 - a model that does not run this way: not shown invariant
            self._failed = self._reference is None  # (no copy or no reference: every later check fails too)
            return False
        tol = default_rtol(torch.float64)
        if output_error(doubled, self._reference) > tol:
            return False
        # who absorbed the doubling: a leaf module whose input changed and whose output did not.  Scale-invariant:
        # a norm did, and nothing else (a zero-initialised projection after the weight, a dead branch: no)
        owners = dict(self._copy.named_modules())  # type: ignore[union-attr]
        absorbed = [
            n
            for n, (args, out) in modules.items()
            if n in self._modules
            and output_error([args], [self._modules[n][0]]) > tol
            and output_error([out], [self._modules[n][1]]) <= tol
        ]
        return bool(absorbed) and all(is_norm(owners[n]) for n in absorbed)


def _float64_copy(model: nn.Module) -> nn.Module:
    import copy

    twin = copy.deepcopy(model).to(torch.float64).train()
    for m in twin.modules():
        if is_norm(m) and isinstance(getattr(m, "eps", None), float):
            setattr(m, "eps", _NEGLIGIBLE_EPS)  # noqa: B010 - nn.Module types attributes as Tensor | Module
    return twin


def _rescaled_weights(site: Site, model: nn.Module) -> list[str]:
    """The parameters ``site`` moves that no normalisation layer owns (its consumers, or producers)."""
    owners = dict(model.named_modules())
    params = dict(model.named_parameters())
    names = []
    for name in moved_names(site):
        owner = owners.get(name.rpartition(".")[0])
        if name in params and not (owner is not None and is_norm(owner)):
            names.append(name)
    return names


def norm_sites_left_out(
    sites: Sequence[Site], model: nn.Module, optimizer: Optimizer, batch: Batch, param_groups: Sequence[dict[str, Any]] | None = None
) -> list[str]:
    """The names of the normalisation-affine sites ``sites="auto"`` leaves out under ``optimizer``.

    None under steps that scale with the gradient (SGD); under scale-free steps every
    normalisation-affine site (:func:`~teleopt.teleport.sites.normalization_affine`) but
    those whose rescaled weights besides the norms' own are all under decoupled decay
    (``weight_decay`` > 0 and ``decoupled_weight_decay`` in their group of ``param_groups``,
    by default the optimizer's, as AdamW sets it: the equilibrium the effective learning
    rate returns to is the decay's) and scale-invariant in
    training mode (:class:`ScaleInvariance` on ``batch``).
    """
    if not scale_free_updates(optimizer):
        return []
    norm = [s for s in sites if normalization_affine(s, model)]
    if not norm:
        return []
    groups = optimizer.param_groups if param_groups is None else param_groups
    decayed = {
        id(p) for g in groups if float(g.get("weight_decay") or 0.0) > 0 and g.get("decoupled_weight_decay") is True for p in g["params"]
    }
    params = dict(model.named_parameters())
    invariant = ScaleInvariance(model, batch)
    left_out = []
    for site in norm:
        weights = _rescaled_weights(site, model)
        if not weights or not all(id(params[n]) in decayed and invariant(n) for n in weights):
            left_out.append(site.name)
    return left_out
