"""syre: remove parameter-space symmetries with a static random bias (Ziyin et al. 2025).

Ziyin et al. 2025 trains on

    eq. 6:  l_r(theta)  = l(theta + theta_0) + gamma_p |theta|^2
    eq. 7:  l_ar(theta) = l(theta + theta_0) + gamma_p |theta|_D^2,   |theta|_D^2 = theta^T D theta

with a small fixed random ``theta_0`` and, for eq. 7, a random positive diagonal
``D ~ Uniform(1 - eps, 1 + eps)`` with distinct entries.  The model only ever sees
``w = theta + theta_0``, so in the model's own weights ``w`` (what the parameters
hold) both are ``l(w) + gamma_p |w - theta_0|_D^2``: weight decay that pulls the
weights towards the random static *anchor* ``theta_0`` instead of towards zero
(Ziyin et al. 2025, Sec. 5.1, "equivalently ... a random bias in the L2 regularization").
Zero is a symmetric point of every reflection symmetry with ``theta' = 0``
(permutation, rescaling, sign flip, rotation), so ordinary weight decay pulls into
the collapsed low-capacity states; the random anchor is not symmetric under any of
them with probability one (Theorem 1), and with distinct ``D`` neither under the
infinitely many reflections of a rotation symmetry (Theorem 2).

:class:`Syre` adds this decay to any ``torch.optim`` optimizer.  Units and conventions:

* ``gamma`` is torch's ``weight_decay`` coefficient: the decay adds
  ``gamma * D * (w - theta_0)`` to the gradient (coupled) or subtracts ``lr`` times it
  from the weights (decoupled); as a loss, ``(gamma / 2) |w - theta_0|_D^2``, so the
  paper's ``gamma_p`` is ``gamma / 2`` (its quoted decays are ``gamma``, Sec. 5.4).
* ``sigma0`` is relative to the standard initialisation scale (Sec. 5.4): every
  anchor entry is drawn with standard deviation ``sigma0 / sqrt(fan_in)`` (torch.nn.init's
  fan-in, ``shape[1] * prod(shape[2:])``); the default ``sigma0 = 0.01`` is the paper's
  ``0.01 / sqrt(d)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from teleopt.sharding import full, is_sharded, local, shard_like
from teleopt.syre_anchors import (
    OPTION_NAMES,
    add_penalty,
    anchor_std,
    check_options,
    check_scales,
    decay_list,
    draw_anchor,
    draw_diagonal,
    fan_in,
    install_grads,
    real_view,
    use_foreach,
    warn_fixed_step_lbfgs,
)
from teleopt.wrapper import OptimizerWrapper, no_grad_step

__all__ = ["Syre", "fan_in"]

_Swapped = list[tuple[Tensor, Tensor | None]]  # (parameter, its gradient before the coupled decay)
_Deferred = list[tuple[Tensor, Tensor]]  # (parameter, decoupled decrement applied after the step)


def _coupled_grad(index: int, p: Tensor) -> Tensor:
    """``p.grad`` for the coupled decay (``Syre._acting`` gives coupled groups only members with a gradient)."""
    if p.grad is None:
        raise RuntimeError(f"Syre: parameter {index} has no gradient for the coupled decay")
    return p.grad


class Syre(OptimizerWrapper):
    r"""Weight decay towards a random static anchor: syre (Ziyin et al. 2025, eq. 6) and advanced removal (eq. 7).

    Wraps any ``torch.optim`` / torch-optimizer optimizer (the drop-in contract of
    :class:`~teleopt.wrapper.OptimizerWrapper`) and, in every ``step()``, decays each
    parameter ``w`` towards its anchor ``theta_0``:

    * **coupled** (``decoupled=False``, default): the base optimizer sees the gradient
      ``grad + gamma * D * (w - theta_0)`` (``p.grad`` holds the data gradient again
      after ``step()``).  This *is* eq. 6 (eq. 7 with ``D``), with ``gamma = 2 gamma_p``:
      torch optimizers without their own decay are translation-equivariant, so stepping
      on ``theta = w - theta_0`` gives this trajectory of ``w`` (the paper's
      implementation, Sec. 5.4).  The decay passes through momentum and
      preconditioner (like Adam's L2).
    * **decoupled** (``decoupled=True``): before the base step,
      ``w <- w - lr * gamma * D * (w - theta_0)`` (``torch.lerp`` towards the anchor
      when ``D = 1``), like AdamW.  It equals the paper's implementation with
      ``AdamW(weight_decay=gamma)`` on ``theta``.

    The two coincide for plain SGD without momentum; with momentum the decay
    accumulates in the buffer, and coupled decay is divided by Adam's ``sqrt(v)``.
    The anchor is a fixed point of the decay; under pure decay ``|w - theta_0|``
    contracts by ``1 - lr * gamma * D`` per SGD step.

    Anchors are drawn once per parameter tensor from a CPU ``torch.Generator`` seeded
    by ``(seed, parameter index)`` (``state_dict`` order) with standard deviation
    ``sigma0 / sqrt(fan_in)`` (:func:`fan_in`; Sec. 5.4's relative units), so every
    process, rank and device gets the same anchors; ``D`` comes from a second stream.
    Sharded (FSDP2 ``DTensor``) parameters get their shards of the same whole-tensor
    draw and decay locally; :meth:`penalty` then all-reduces (every rank calls it).
    ``store_anchors=True`` keeps the anchors (made at first use, saved in
    ``state_dict``; loaded anchors take precedence); ``store_anchors=False``
    regenerates them every step from the seeds (no memory, a CPU draw per parameter
    per step: ``benchmarks/syre_cost.py``).  Memory and costs: the Syre user guide.

    Every option is a per-group hyperparameter ``"teleopt_syre_<name>"`` in the base's
    param groups (:meth:`param_group`; schedulers may change ``gamma``);
    ``enabled=False`` opts a group out.  ``exclude_1d=True`` (default, timm's
    convention) leaves 1-D and 0-D tensors alone; give ``exclude_1d=False`` when a
    symmetry lives in 1-D tensors only (Ziyin et al. 2025's ``u * w``), which then use their
    length as ``d``.  ``fan_in`` overrides every tensor's fan-in in a group.  Complex
    parameters decay in their real view.  ``sigma0`` and ``gamma`` must keep anchors
    and decay finite in each parameter's dtype (checked when wrapping, adding groups,
    loading and stepping).

    Composition: ``Syre(Teleport(base))`` and ``Teleport(Syre(base))`` take the same
    steps (the decay runs in a step pre-hook of the innermost optimizer, at the
    teleported point).  A teleport keeps the data loss but not the decay term
    (:meth:`penalty`), which pulls the model back towards the anchor over
    ``~1 / (lr * gamma)`` steps.  ``Syre(Syre(...))`` is rejected.

    Parameters
    ----------
    optimizer:
        The base optimizer; give it ``weight_decay=0`` (a nonzero base decay pulls
        towards zero at the same time, so the target becomes a mixture: warned).
    gamma:
        Decay strength, torch's ``weight_decay`` units (see above); ``>= 0``.
        ``gamma = 0`` makes the wrapper bitwise transparent.
    sigma0:
        Anchor scale relative to ``1 / sqrt(fan_in)`` (default 0.01, Sec. 5.4); ``>= 0``.
    decoupled:
        AdamW-style decoupled decay instead of the coupled eq. 6 gradient.
    diagonal_eps:
        ``eps`` of eq. 7's ``D ~ Uniform(1 - eps, 1 + eps)``; 0 (default) is eq. 6.
    exclude_1d:
        Leave tensors with fewer than two dimensions alone (default, timm's convention).
    seed:
        Seed of the anchors (and ``D``).
    store_anchors:
        Keep anchors in memory (default) or regenerate them in every step.
    """

    prefix = "teleopt_syre_"

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        gamma: float,
        sigma0: float = 0.01,
        decoupled: bool = False,
        diagonal_eps: float = 0.0,
        exclude_1d: bool = True,
        seed: int = 0,
        store_anchors: bool = True,
    ) -> None:
        options = {
            "gamma": gamma,
            "sigma0": sigma0,
            "decoupled": decoupled,
            "diagonal_eps": diagonal_eps,
            "enabled": True,
            "exclude_1d": exclude_1d,
            "fan_in": None,
            "seed": seed,
        }
        check_options(options, "Syre")
        if not isinstance(store_anchors, bool):
            raise TypeError(f"Syre: store_anchors must be a bool, got {store_anchors!r}")
        inner = optimizer
        while isinstance(inner, OptimizerWrapper):
            if isinstance(inner, Syre):
                raise ValueError("Syre: the optimizer is already wrapped by Syre (both would share the same group keys)")
            inner = inner.base
        self.store_anchors = store_anchors
        self._anchors: dict[Tensor, Tensor] = {}
        self._diagonals: dict[Tensor, Tensor] = {}
        self._scratch: dict[Tensor, Tensor] = {}
        super().__init__(optimizer, {**options, "gamma": float(gamma), "sigma0": float(sigma0)})
        start = 0
        for number, group in enumerate(self.param_groups):
            self._check_group(group, number, start)
            start += len(group["params"])
        self._warn_base_weight_decay(range(len(self.param_groups)))
        warn_fixed_step_lbfgs(inner)

    @classmethod
    def param_group(cls, params: Iterable[Tensor] | Tensor, **options: Any) -> dict[str, Any]:
        """A param group dict with syre options (names without prefix) for the base optimizer's constructor.

        Example: ``AdamW([{"params": body}, Syre.param_group(head, gamma=0.0)])``.
        """
        check_options(options, "Syre.param_group")
        group: dict[str, Any] = {"params": [params] if isinstance(params, Tensor) else list(params)}
        group.update({cls.prefix + name: value for name, value in options.items()})
        return group

    def _options(self, group: dict[str, Any]) -> dict[str, Any]:
        return {name: group[self.prefix + name] for name in OPTION_NAMES}

    def _check_group(self, group: dict[str, Any], number: int, start: int) -> None:
        """Options valid, parameters floating point (real or complex), anchors and decay finite in their dtype."""
        options = self._options(group)
        check_options(options, f"Syre (param group {number})")
        if not options["enabled"]:
            return
        for offset, p in enumerate(group["params"]):
            where = f"Syre: parameter {start + offset} (param group {number}, shape {tuple(p.shape)})"
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"{where} has dtype {p.dtype}; syre needs floating-point parameters")
            if p.is_complex() and is_sharded(p):
                raise TypeError(f"{where} is a complex sharded (DTensor) parameter; syre shards real parameters only")
            if not self._excluded(options, p):
                check_scales(options, p, where)

    @staticmethod
    def _excluded(options: dict[str, Any], p: Tensor) -> bool:
        """1-D/0-D tensors are excluded under ``exclude_1d`` unless their group gives a ``fan_in``."""
        return options["exclude_1d"] and p.dim() < 2 and options["fan_in"] is None

    def _warn_base_weight_decay(self, numbers: Iterable[int]) -> None:
        numbers = [
            number
            for number in numbers
            if (group := self.param_groups[number])[self.prefix + "enabled"]
            and group[self.prefix + "gamma"] > 0
            and group.get("weight_decay", 0) > 0
        ]
        if numbers:
            warnings.warn(
                f"Syre: the base optimizer also applies weight_decay > 0 in param group(s) {numbers}, so the "
                "weights are pulled towards zero and towards the anchors at once (a mixture); give the base "
                "optimizer weight_decay=0",
                UserWarning,
                stacklevel=3,
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer with the syre defaults; validated like the constructor's groups."""
        if getattr(self, "_initialising", False):
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"Syre.add_param_group: param_group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        if params is not None and not isinstance(params, Tensor):
            param_group = {**param_group, "params": list(params)}
        start = sum(len(group["params"]) for group in self.param_groups)
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1, start)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._warn_base_weight_decay([len(self.param_groups) - 1])

    # -- anchors ----------------------------------------------------------------------
    def _targets(self) -> Iterator[tuple[int, dict[str, Any], Tensor]]:
        """(index, group, parameter) of every parameter syre acts on (enabled group, not excluded)."""
        for index, group, p in self.iter_params():
            excluded = group[self.prefix + "exclude_1d"] and p.dim() < 2 and group[self.prefix + "fan_in"] is None
            if group[self.prefix + "enabled"] and not excluded:
                yield index, group, p

    def _draw_anchor(self, index: int, group: dict[str, Any], p: Tensor) -> Tensor:
        std = anchor_std(group[self.prefix + "sigma0"], p.shape, group[self.prefix + "fan_in"])
        return draw_anchor(group[self.prefix + "seed"], index, p, std)

    def _draw_diagonal(self, index: int, group: dict[str, Any], p: Tensor) -> Tensor | None:
        eps = group[self.prefix + "diagonal_eps"]
        return None if eps == 0 else draw_diagonal(group[self.prefix + "seed"], index, p, eps)

    def _check_match(self, index: int, p: Tensor, value: Tensor, what: str) -> Tensor:
        """``value`` (an anchor or ``D``, kept in the real view of complex parameters) matches ``p``."""
        target = real_view(p)
        if value.shape != target.shape:
            raise ValueError(f"Syre: the {what} of parameter {index} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")
        if value.device != target.device or value.dtype != target.dtype:
            raise ValueError(
                f"Syre: parameter {index} is a {p.dtype} tensor on {p.device} but its {what} is a {value.dtype} tensor "
                f"on {value.device}; the parameter was moved or cast after its {what} was made: move the model "
                "before the first step, or round-trip the optimizer's state_dict (it is cast to the parameters)"
            )
        return value

    def _anchor_of(self, index: int, group: dict[str, Any], p: Tensor) -> Tensor:
        anchor = self._anchors.get(p)
        if anchor is None:
            anchor = self._draw_anchor(index, group, p)
            if self.store_anchors:
                self._anchors[p] = anchor
            return anchor
        return self._check_match(index, p, anchor, "anchor")

    def _diagonal_of(self, index: int, group: dict[str, Any], p: Tensor) -> Tensor | None:
        diagonal = self._diagonals.get(p)
        if diagonal is None:
            diagonal = self._draw_diagonal(index, group, p)
            if diagonal is not None and self.store_anchors:
                self._diagonals[p] = diagonal
            return diagonal
        return self._check_match(index, p, diagonal, "diagonal D")

    def _locate(self, p: Tensor) -> tuple[int, dict[str, Any]]:
        for index, group, q in self._targets():
            if q is p:
                return index, group
        raise ValueError("Syre: this tensor is not a parameter syre acts on (not in the optimizer, opted out or excluded)")

    def anchor(self, p: Tensor) -> Tensor:
        """The anchor ``theta_0`` of parameter ``p`` (Ziyin et al. 2025, eq. 6), on ``p``'s device and dtype; do not modify it."""
        index, group = self._locate(p)
        anchor = self._anchor_of(index, group, p)
        return torch.view_as_complex(anchor) if p.is_complex() else anchor

    def diagonal(self, p: Tensor) -> Tensor | None:
        """The diagonal of eq. 7's ``D`` for parameter ``p`` (in its real view when complex), or None for eq. 6."""
        index, group = self._locate(p)
        return self._diagonal_of(index, group, p)

    def penalty(self) -> Tensor:
        """The decay as a loss: sum over groups of ``(gamma / 2) |w - theta_0|_D^2`` (float64 scalar on CPU).

        Differentiable in the parameters; its gradient is exactly what coupled mode adds
        to the data gradient, so coupled syre trains on ``loss + penalty()`` (eq. 6/7 with
        ``gamma_p = gamma / 2``).  Useful for logging the regularised objective.
        """
        return self._penalty(coupled_only=False)

    def _penalty(self, coupled_only: bool) -> Tensor:
        """:meth:`penalty`; ``coupled_only``: of coupled groups, negated under ``maximize`` (LBFGS's objective)."""
        total = torch.zeros((), dtype=torch.float64)
        for index, group, p in self._targets():
            gamma = group[self.prefix + "gamma"]
            if gamma == 0 or (coupled_only and group[self.prefix + "decoupled"]):
                continue
            if coupled_only and group.get("maximize", False):
                gamma = -gamma
            diff = real_view(p) - self._anchor_of(index, group, p)
            diagonal = self._diagonal_of(index, group, p)
            squares = diff * diff if diagonal is None else diff * diff * diagonal
            # a sharded parameter's sum is partial on each rank: full_tensor() all-reduces it (differentiably)
            summed = squares.sum()
            summed = summed.full_tensor() if is_sharded(summed) else summed
            total = total + (0.5 * gamma) * summed.to(device="cpu", dtype=torch.float64)
        return total

    # -- step -------------------------------------------------------------------------
    def _acting(self, with_grad: bool = True) -> Iterator[tuple[dict[str, Any], list[tuple[int, Tensor]]]]:
        """Groups that decay in this step with their (index, parameter) members that have a gradient.

        ``with_grad=False`` takes every member that requires grad instead (a base that
        evaluates the closure itself has no gradients yet when the decay starts).
        """
        members: dict[int, list[tuple[int, Tensor]]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for index, group, p in self._targets():
            if (p.grad is None if with_grad else not p.requires_grad) or group[self.prefix + "gamma"] == 0:
                continue
            groups[id(group)] = group
            members.setdefault(id(group), []).append((index, p))
        for key, group in groups.items():
            yield group, members[key]

    def _scratch_of(self, p: Tensor) -> Tensor:
        """A reused buffer shaped like ``p``'s real view for ``w - theta_0`` (CPU, stored-anchor mode; never saved)."""
        target = real_view(local(p))
        buffer = self._scratch.get(p)
        if buffer is None or buffer.shape != target.shape or buffer.dtype != target.dtype or buffer.device != target.device:
            buffer = torch.empty_like(target, memory_format=torch.contiguous_format)
            self._scratch[p] = buffer
        return buffer

    def _decay_group(self, group: dict[str, Any], members: list[tuple[int, Tensor]], deferred: _Deferred) -> _Swapped:
        """Decay one group's parameters; returns (parameter, original gradient) pairs swapped in coupled mode.

        Complex parameters decay in their real view.  Gradients with a graph
        (``backward(create_graph=True)``, as Adahessian needs) keep one: the coupled
        decay is added out of place with autograd on, so Hessian-vector products see
        the penalty's ``gamma * D``; the decoupled decay is not applied in place
        before the base step (that would invalidate the saved weights of the graph)
        but appended to ``deferred`` as ``(parameter, decrement)`` for after it.
        """
        gamma = group[self.prefix + "gamma"]
        if group[self.prefix + "decoupled"]:
            coefficient = float(group["lr"]) * gamma
        else:
            # maximize=True negates the gradient inside the base; the decay must still pull towards the anchor.
            coefficient = -gamma if group.get("maximize", False) else gamma
            for index, p in members:
                if _coupled_grad(index, p).is_sparse:
                    raise TypeError(f"Syre: parameter {index} has a sparse gradient; coupled decay needs dense gradients")
        swapped: _Swapped = []
        if any(p.grad is not None and p.grad.requires_grad for _, p in members):
            self._decay_with_graph(group, members, coefficient, deferred, swapped)
        elif not self.store_anchors:
            self._decay_regenerated(group, members, coefficient, swapped)
        else:
            self._decay_stored(group, members, coefficient, swapped)
        return swapped

    def _decay_with_graph(
        self, group: dict[str, Any], members: list[tuple[int, Tensor]], coefficient: float, deferred: _Deferred, swapped: _Swapped
    ) -> None:
        """Gradients with a graph: the coupled decay added with autograd on, the decoupled one deferred."""
        for index, p in members:
            anchor, diagonal = self._anchor_of(index, group, p), self._diagonal_of(index, group, p)
            with torch.enable_grad():
                scaled = (real_view(p) - anchor) * (coefficient if diagonal is None else coefficient * diagonal)
            if group[self.prefix + "decoupled"]:
                deferred.append((p, scaled.detach()))
            else:
                with torch.enable_grad():
                    install_grads(swapped, [p], [real_view(_coupled_grad(index, p)) + scaled])

    def _decay_regenerated(self, group: dict[str, Any], members: list[tuple[int, Tensor]], coefficient: float, swapped: _Swapped) -> None:
        """Anchors regenerated tensor by tensor: never more than one anchor in memory."""
        for index, p in members:
            anchor, diagonal = self._anchor_of(index, group, p), self._diagonal_of(index, group, p)
            grads = [] if p.grad is None else [real_view(local(p.grad))]
            diagonals = None if diagonal is None else [local(diagonal)]
            decoupled = group[self.prefix + "decoupled"]
            install_grads(
                swapped, [p], decay_list([real_view(local(p))], grads, [local(anchor)], diagonals, coefficient, decoupled, foreach=False)
            )

    def _decay_stored(self, group: dict[str, Any], members: list[tuple[int, Tensor]], coefficient: float, swapped: _Swapped) -> None:
        """Stored anchors: one fused decay per device and dtype."""
        buckets: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]] = {}
        has_diagonal, decoupled = group[self.prefix + "diagonal_eps"] > 0, group[self.prefix + "decoupled"]
        for index, p in members:
            stored = self._anchors.get(p)  # matched to p by _check_acting in this step
            anchor = self._anchor_of(index, group, p) if stored is None else stored
            diagonal = self._diagonals.get(p) if has_diagonal else None
            diagonal = self._diagonal_of(index, group, p) if has_diagonal and diagonal is None else diagonal
            ps, gs, anchors, diagonals = buckets.setdefault((p.device, p.dtype), ([], [], [], []))
            ps.append(p)
            # sharded (FSDP2) parameters decay on their local shards: the decay is elementwise
            if p.grad is not None:
                gs.append(real_view(local(p.grad)))
            anchors.append(local(anchor))
            if diagonal is not None:
                diagonals.append(local(diagonal))
        for (device, _), (ps, gs, anchors, diagonals) in buckets.items():
            foreach = use_foreach(group, ps)
            # Reused buffers on the CPU only: accelerators' caching allocators make the transient
            # allocation cheap, and there it is free again for the next forward pass.
            reuse = device.type == "cpu" and not (decoupled and not has_diagonal)
            scratch = [self._scratch_of(p) for p in ps] if reuse else None
            views = [real_view(local(p)) for p in ps]
            install_grads(
                swapped, ps, decay_list(views, gs, anchors, diagonals if has_diagonal else None, coefficient, decoupled, foreach, scratch)
            )

    def _check_acting(self, with_grad: bool = True) -> None:
        """Validate every group's options (written into a group after construction too) and materialise/check
        every anchor, so a bad one fails before any tensor changes."""
        for number, group in enumerate(self.param_groups):
            check_options(self._options(group), f"Syre.step: param group {number}", self.prefix)
        for group, members in self._acting(with_grad):
            options = self._options(group)
            for index, p in members:
                check_scales(options, p, f"Syre.step: parameter {index}")
                if self.store_anchors:
                    self._anchor_of(index, group, p)
                    self._diagonal_of(index, group, p)

    @no_grad_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run the closure (if any), then step the base; the decay is applied right before the innermost update.

        The decay runs in a step pre-hook of the innermost real optimizer (and ``.grad``
        is restored in its post-hook), i.e. after any wrapper in between (such as
        ``Teleport``) has moved the parameters and their gradients: the decay always
        acts at the point the update starts from, so ``Syre(Teleport(base))`` and
        ``Teleport(Syre(base))`` take the same steps.

        A base that evaluates the closure itself (``LBFGS``) gets a closure that adds
        the coupled decay to the gradients and ``gamma / 2 |w - theta_0|_D^2`` of the
        coupled groups to the loss it returns (so its line search sees eq. 6/7's
        objective); decoupled groups decay once before its step.
        """
        in_closure = self.base_needs_closure
        loss = self._closure_before_step(closure)
        self._check_acting(with_grad=not in_closure)
        swapped: _Swapped = []
        deferred: _Deferred = []

        def restore() -> None:
            while swapped:
                p, grad = swapped.pop()
                p.grad = grad

        def finish(*_: Any) -> None:
            while deferred:
                p, decrement = deferred.pop()
                real_view(p).sub_(decrement)
            restore()

        def decay(*_: Any) -> None:  # checked above: a wrapper in between moves no anchor
            for group, members in self._acting(with_grad=not in_closure):
                if not (in_closure and not group[self.prefix + "decoupled"]):
                    swapped.extend(self._decay_group(group, members, deferred))

        def decayed_closure() -> Any:
            restore()  # the closure may accumulate into .grad: give it the data gradients
            assert closure is not None  # _closure_before_step raised if a closure-evaluating base got none
            value = closure()
            with torch.no_grad():
                for group, members in self._acting():
                    if not group[self.prefix + "decoupled"]:
                        swapped.extend(self._decay_group(group, members, deferred))
                penalty = self._penalty(coupled_only=True)
            return add_penalty(value, penalty)

        inner = self.innermost
        handles = (inner.register_step_pre_hook(decay), inner.register_step_post_hook(finish))
        try:
            loss = self._step_base(decayed_closure if in_closure else None, loss)
        finally:
            for handle in handles:
                handle.remove()
            finish()
        return loss

    # -- state --------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_scratch"] = {}  # scratch buffers are not state
        return state

    def _wrapper_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        per_param: dict[int, dict[str, Any]] = {}
        for index, group, p in self._targets():
            if not self.store_anchors and p not in self._anchors:
                continue  # regenerated from the group's seed
            entry = {"anchor": self._anchor_of(index, group, p)}
            diagonal = self._diagonal_of(index, group, p)
            if diagonal is not None:
                entry["diagonal"] = diagonal
            per_param[index] = entry
        return per_param, {}

    def _check_loaded(
        self,
        saved_groups: Sequence[dict[str, Any]],
        current: list[dict[str, Any]],
        per_param: dict[int, dict[str, Any]],
        top: dict[str, Any],
    ) -> None:
        super()._check_loaded(saved_groups, current, per_param, top)
        params = {index: p for index, _, p in self.iter_params()}
        start = 0
        for number, (saved, now) in enumerate(zip(saved_groups, current)):
            mine = {k: v for k, v in saved.items() if isinstance(k, str) and k.startswith(self.prefix)}
            unknown = sorted(set(mine) - {self.prefix + name for name in OPTION_NAMES})
            if unknown:
                raise ValueError(f"Syre.load_state_dict: param group {number} has unknown syre keys {unknown}")
            group = {**now, **mine, "params": self.param_groups[number]["params"]}
            try:
                self._check_group(group, number, start)
            except (TypeError, ValueError) as error:
                raise ValueError(f"Syre.load_state_dict: {error}") from error
            start += len(group["params"])
        for index, entries in per_param.items():
            p = params[index]
            for key, value in entries.items():
                where = f"Syre.load_state_dict: entry {self.prefix + key!r} of parameter {index}"
                if key not in ("anchor", "diagonal") or not isinstance(value, Tensor):
                    raise ValueError(f"Syre.load_state_dict: unexpected entry {self.prefix + key!r} for parameter {index}")
                if not value.is_floating_point():
                    raise ValueError(f"{where} has dtype {value.dtype}; anchors and D are floating point")
                if value.shape != real_view(p).shape:
                    what = "anchor" if key == "anchor" else "diagonal D"
                    raise ValueError(
                        f"Syre: the {what} of parameter {index} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
                    )
                shard = local(value)  # a sharded entry is checked shard by shard, each rank its own
                if not bool(torch.isfinite(shard).all()) or (key == "diagonal" and not bool((shard > 0).all())):
                    raise ValueError(f"{where} has non-finite{' or non-positive' if key == 'diagonal' else ''} entries")

    def _load_wrapper_state(self, per_param: dict[int, dict[str, Any]], top: dict[str, Any]) -> None:
        params = {index: p for index, _, p in self.iter_params()}
        anchors: dict[Tensor, Tensor] = {}
        diagonals: dict[Tensor, Tensor] = {}
        for index, entries in per_param.items():
            p = params[index]
            for key, value in entries.items():
                what = "anchor" if key == "anchor" else "diagonal D"
                # a checkpoint made with another layout (unsharded, or sharded over another world size)
                # holds the same whole tensor: lay it out like the parameter
                if is_sharded(value) and (not is_sharded(p) or value.placements != p.placements or value.device_mesh != p.device_mesh):
                    value = full(value)
                if is_sharded(p) and not is_sharded(value):
                    value = shard_like(value, real_view(p))
                (anchors if key == "anchor" else diagonals)[p] = self._check_match(index, p, value, what)
        self._anchors = anchors
        self._diagonals = diagonals
