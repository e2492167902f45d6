"""Keeping teleports safe: caps before, checks at, and a watch after the teleport.

A teleport must never silently corrupt training (DESIGN.md).  Three layers:

**Caps (before).**  The gradient norm is unbounded on GL and scaling orbits, and
a huge gradient at the teleported point makes the next steps of a fixed learning
rate unstable (the papers' 3x teleport learning rate diverges).  Besides the
trust region on the coordinates, a teleport is scaled back towards the identity
(:func:`~teleopt.teleport.ascent.shrink_to_feasible`) until

* ``max_gain``: ||grad L(g . w)||^2 <= max_gain * ||grad L(w)||^2, and
* ``max_predicted_decrease``: the first-order decrease of the base optimizer's
  next step, <grad', u'>, is at most this multiple of L(w) - loss_floor (or at
  most its value before the teleport, if that is already larger).  For a
  quadratic model, L(w - eta grad) >= loss_floor forces
  eta * lambda >= 2 - 2 / ratio along the gradient (lambda the curvature there),
  so a large ratio means the step sits at the edge of GD's stability region
  eta * lambda < 2.  This ties the cap to the learning rate; it needs the loss
  (a closure or batch) and a modelled optimizer, and is skipped otherwise.  On the
  fast path it is decided from one pass over the site tensors' gradients and
  moments (:mod:`~teleopt.teleport.decrease_bound`: exact for SGD under scalings,
  an upper bound within eps for Adam), not by simulating the optimizer per candidate.
* ``stability_margin`` (opt-in; needs a teleport batch and a modelled optimizer):
  the sharpness of the teleported point as the optimizer sees it,
  lambda_max(P^1/2 H P^1/2) with P the next step's diagonal preconditioner
  (``OptimizerModel.preconditioner``), by ``stability_iterations`` rounds of power
  iteration with Hessian-vector products, is at most ``stability_margin`` times
  the update rule's linear-stability threshold (2 for GD, (2 + 2 mu) for
  heavy-ball momentum, 2 (1 + beta1) / (1 - beta1) for Adam), or its value
  before the teleport if larger.  Teleporting to a large gradient usually
  sharpens the landscape in directions the gradient-norm cap never looks at;
  this cap looks at all of them, at the cost of ~``stability_iterations``
  Hessian-vector products per candidate.

**Post-conditions (at).**  Invariance is checked, not assumed, for every teleport
(:mod:`teleopt.teleport.check`): the model outputs on the teleport batch, the
closure's forwards or probe inputs (``example_inputs``, else the last forward's
inputs; with none of them the teleport is declined) must change by at most
``loss_tol`` relative to their norm (default 1e-10 in float64, 1e-5 in float32,
1e-2 in half precisions; a failure by less than 100x below float64 is re-run on a
float64 copy), the loss on the teleport batch (and on a held-out batch when
given) likewise, and every moved tensor must be finite.  Approximate sites are
decided by the loss alone (their outputs are measured and reported).  Otherwise
the teleport is rolled back and the report says why: from copies of everything it
moved, or, on the fast path (no closure, unsharded) with a state policy that
resets nothing and the watch off or ``watch_restore="inverse"``, from copies of
the site members alone, ``.grad`` and the optimizer state being moved back by the
inverse elements (:class:`InverseSnapshot`: the parameters come back bit for bit,
the rest up to round-off); where every element multiplies the parameters by powers
of two (the default boundary step's 4, 1/4 and 1) the parameters move back by the
inverse elements too, bit for bit, nothing is copied, and the outputs are compared
once more.  A non-finite gradient declines the teleport before anything moves.

**Watch (after).**  For ``watch_steps`` steps after an accepted teleport the
watch looks at every step's gradient and loss.  The gradient's reference is the
larger of ||grad||^2 at the teleport (before and after the move) and the median
||grad||^2 of the 5 steps before a scheduled teleport times the teleport's gain
(:func:`~teleopt.teleport.watch.reference`): one minibatch's gradient norm varies
by large factors from step to step late in training, so a single value is a
noisy yardstick.  If within that window a gradient or the loss is non-finite, or
the squared gradient norm (or the loss, against its pre-teleport value) exceeds
``watch_factor**2`` times its reference once or ``watch_factor`` times it on
``watch_patience`` consecutive steps (for the gradient, with the loss at the last of
them not below the loss at the teleport, or without one (a lean teleport) at the
first of them: the step's loss, else one measured on a ``batch_fn`` batch; a gradient
that grows while the loss falls costs the run nothing), that step's update is skipped,
the teleport is undone, the
trust region and caps are multiplied by ``backoff`` for later teleports, and a
rollback report is issued.  How it is undone (``watch_restore``):

* ``"inverse"`` (default): the watch keeps the teleport's sites and elements
  (O(units)), in memory and in ``state_dict`` alike.  The rollback moves the
  *current* parameters and optimizer state of its sites back by the inverse
  elements (:class:`~teleopt.teleport.watch.InverseMove`, the sites in reverse
  order; the state by the state policy's rules for g^-1), a symmetry like the
  teleport itself, so the model computes what it did (the probe outputs before and
  after the move are compared, a change beyond ``loss_tol`` is reported), the
  steps since are kept, and training goes on at the conditioning of the orbit
  point it came from.  A run resumed from a checkpoint made inside the window
  rolls back by the same elements at the same step, bit for bit.  It cannot undo
  what the steps since did to the loss: when the alarm fires after the weights
  already diverged (the papers' MLP teleported to a 1000x gradient without caps),
  training diverges on from there, where the snapshot recovers; the caps before
  the teleport are what prevents that.  A teleport with a site that has no
  inverse move (not a fast-path site: data-dependent, learned or approximate
  actions) keeps a snapshot as below.
* ``"snapshot"``: a snapshot of all parameters, buffers and optimizer state is
  kept (3x the parameters under Adam), in memory and in ``state_dict`` alike, and
  everything is restored to the pre-teleport point: the steps since are
  discarded, and so is whatever damage they did.  torch's distributed-checkpoint
  functions carry only the elements' record (:mod:`teleopt.checkpoint`), so a
  snapshot watch resumes exactly through ``state_dict`` alone.

Each later teleport that comes through its watch window divides the factor by
``backoff`` again (up to 1), so a rollback shrinks the next teleports, not all
teleports for the rest of training.  ``watch_steps=0`` turns the watch off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from teleopt.numerics import default_rtol
from teleopt.teleport.evaluator import Evaluator

__all__ = ["SafetyConfig", "Caps", "Snapshot", "default_loss_tol", "preconditioned_sharpness"]

#: Relative loss change a loss-preserving teleport may show: the library-wide table of
#: :func:`teleopt.numerics.default_rtol` (1e-10 float64, 1e-5 float32, 1e-2 otherwise).
default_loss_tol = default_rtol


def _positive(value: Any, what: str, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a positive finite number{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


@dataclass
class SafetyConfig:
    """Safety settings of a :class:`~teleopt.teleport.Teleport` (see module docs).

    ``heldout_batch`` is a batch on which the loss is also checked (to ``heldout_tol``), in the
    forms :func:`teleopt.functional.as_batch` takes; ``Teleport`` checks it has rows."""

    max_gain: float | None = None
    max_predicted_decrease: float | None = 8.0
    stability_margin: float | None = None
    stability_iterations: int = 20
    loss_floor: float = 0.0
    loss_tol: float | None = None
    heldout_tol: float | None = None
    watch_steps: int = 10
    watch_factor: float = 10.0
    watch_patience: int = 3
    watch_restore: str = "inverse"
    backoff: float = 0.5
    heldout_batch: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.max_gain = _positive(self.max_gain, "max_gain")
        if self.max_gain is not None and self.max_gain < 1:
            raise ValueError(f"max_gain must be >= 1 (1 allows no gain), got {self.max_gain}")
        self.max_predicted_decrease = _positive(self.max_predicted_decrease, "max_predicted_decrease")
        self.stability_margin = _positive(self.stability_margin, "stability_margin")
        if not isinstance(self.stability_iterations, int) or isinstance(self.stability_iterations, bool) or self.stability_iterations < 1:
            raise ValueError(f"stability_iterations must be a positive int, got {self.stability_iterations!r}")
        if isinstance(self.loss_floor, bool) or not isinstance(self.loss_floor, (int, float)) or not math.isfinite(self.loss_floor):
            raise ValueError(f"loss_floor must be a finite number, got {self.loss_floor!r}")
        self.loss_tol = _positive(self.loss_tol, "loss_tol")
        self.heldout_tol = _positive(self.heldout_tol, "heldout_tol")
        if not isinstance(self.watch_steps, int) or isinstance(self.watch_steps, bool) or self.watch_steps < 0:
            raise ValueError(f"watch_steps must be an int >= 0, got {self.watch_steps!r}")
        watch_factor = _positive(self.watch_factor, "watch_factor", allow_none=False)
        assert watch_factor is not None  # allow_none=False
        self.watch_factor = watch_factor
        if not isinstance(self.watch_patience, int) or isinstance(self.watch_patience, bool) or self.watch_patience < 1:
            raise ValueError(f"watch_patience must be an int >= 1, got {self.watch_patience!r}")
        if self.watch_restore not in ("snapshot", "inverse"):
            raise ValueError(f"watch_restore must be 'snapshot' or 'inverse', got {self.watch_restore!r}")
        if not 0 < self.backoff <= 1:
            raise ValueError(f"backoff must be in (0, 1], got {self.backoff!r}")


#: (sharpness of the teleported point at given coordinates, its cap) for ``stability_margin``.
StabilityCap = tuple[Callable[[Sequence[Tensor]], float], float]


@dataclass
class Caps:
    """The caps of :class:`SafetyConfig` for one teleport (see module docs).

    ``n0`` is ||grad L(w)||^2, ``loss0`` the loss at w, ``backoff`` the factor later
    teleports' caps are scaled by after watch rollbacks.  ``decrease`` turns the
    predicted-decrease cap on; its value at the identity, ``dec0``, is read (at
    ``identity``) only when a candidate's bound exceeds the cap's multiple of the loss.

    The decrease cap is decided by the evaluator's ``decrease_bound`` where it has one
    (:mod:`~teleopt.teleport.decrease_bound`: no pass over the model per candidate); a
    candidate a loose bound cannot clear gets the exact, simulated decrease at most
    ``exact_left`` times per teleport (else it counts as infeasible, so the bisection
    goes on with the bound alone); a tight bound decides alone.  Evaluators without a
    bound are decided by the simulated decrease.
    """

    safety: SafetyConfig
    evaluator: Evaluator
    backoff: float
    n0: float
    dec0: float | None = None
    loss0: float | None = None
    stability: StabilityCap | None = None
    decrease: bool = False
    identity: Sequence[Tensor] | None = None
    exact_left: int = 1

    def __post_init__(self) -> None:
        self.decrease = self.decrease or self.dec0 is not None

    def feasible(self, coords: Sequence[Tensor]) -> bool:
        """Whether every cap holds at ``coords`` (the cheap ones first)."""
        safety, evaluator = self.safety, self.evaluator
        with torch.enable_grad():
            elements = evaluator.elements(coords)
            if safety.max_gain is not None:
                n = float(evaluator.grad_norm_sq(elements).detach())
                if not n <= safety.max_gain * self.n0:
                    return False
            if self.decrease and self.loss0 is not None and safety.max_predicted_decrease is not None:
                if not self._decrease_holds(elements):
                    return False
        if self.stability is not None:
            sharpness, cap = self.stability
            with torch.enable_grad():
                if not sharpness(coords) <= cap:
                    return False
        return True

    def _decrease_holds(self, elements: Sequence[Tensor]) -> bool:
        """<grad', u'> at most the cap, or what the current point already has (the identity stays feasible)."""
        assert self.loss0 is not None and self.safety.max_predicted_decrease is not None  # feasible() checked
        limit = self.safety.max_predicted_decrease * self.backoff * (self.loss0 - self.safety.loss_floor)
        bound_of = getattr(self.evaluator, "decrease_bound", None)
        bound = None if bound_of is None else bound_of(elements)
        if bound is not None and bound <= limit:
            return True
        limit = max(limit, self.decrease_before())
        if bound is not None:
            if bound <= limit:
                return True
            if self.exact_left <= 0 or getattr(self.evaluator, "decrease_bound_tight", False):
                return False
            self.exact_left -= 1
        return float(self.evaluator.first_order_decrease(elements).detach()) <= limit

    def decrease_before(self) -> float:
        """The predicted decrease at the identity (computed once)."""
        if self.dec0 is None:
            at_identity = getattr(self.evaluator, "decrease_at_identity", None)
            if at_identity is not None:
                self.dec0 = float(at_identity())
            else:
                assert self.identity is not None  # given with decrease=True
                with torch.enable_grad():
                    self.dec0 = float(self.evaluator.first_order_decrease(self.evaluator.elements(self.identity)).detach())
        return self.dec0


def preconditioned_sharpness(
    loss_of: Callable[[dict[str, Tensor]], Tensor],
    params: dict[str, Tensor],
    preconditioner: dict[str, Tensor],
    iterations: int,
    generator: torch.Generator,
    start: dict[str, Tensor] | None = None,
) -> tuple[float, dict[str, Tensor]]:
    """lambda_max(P^1/2 H P^1/2) of the loss at ``params`` by power iteration with Hessian-vector
    products (double backward); returns the estimate and the last vector (to warm-start the next call).

    Power iteration finds the eigenvalue of largest magnitude; a dominant negative one reads as
    stable, which is what it is for the update (only large positive curvature makes steps diverge).
    """
    names = list(preconditioner)
    with torch.enable_grad():
        leaves = {n: params[n].detach().requires_grad_(True) for n in names}
        loss = loss_of({**params, **leaves})
        grads = torch.autograd.grad(loss, [leaves[n] for n in names], create_graph=True, allow_unused=True)
    roots = [preconditioner[n].sqrt() for n in names]
    if start is None:
        v = [torch.randn(leaves[n].shape, generator=generator, dtype=torch.float64).to(leaves[n]) for n in names]
    else:
        v = [start[n] for n in names]
    lam = 0.0
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
    if not live:
        return 0.0, dict(zip(names, v))
    for _ in range(iterations):
        norm = torch.sqrt(sum((x.to(torch.float64).square().sum() for x in v), torch.zeros((), dtype=torch.float64)))
        if not float(norm) > 0:
            break
        v = [x / norm.to(x.dtype) for x in v]
        u = [r * x for r, x in zip(roots, v)]
        with torch.enable_grad():
            hv = torch.autograd.grad(
                [grads[i] for i in live],
                [leaves[names[i]] for i in live],
                grad_outputs=[u[i] for i in live],
                retain_graph=True,
                allow_unused=True,
            )
        w = [torch.zeros_like(x) for x in v]
        for i, h in zip(live, hv):
            if h is not None:
                w[i] = roots[i] * h
        lam = float(sum((a.to(torch.float64) * b.to(torch.float64)).sum() for a, b in zip(v, w)))
        v = [x.detach() for x in w]
    return lam, dict(zip(names, v))


def stability_cap(
    evaluator: Evaluator,
    loss_of: Callable[[dict[str, Tensor]], Tensor],
    identity: Sequence[Tensor],
    safety: SafetyConfig,
    generator: torch.Generator,
) -> tuple[Callable[[Sequence[Tensor]], float], float]:
    """The sharpness of a candidate's next-step point as the optimizer sees it (:func:`preconditioned_sharpness`,
    each call warm-started from the last vector), and its value at the identity."""
    warm: dict[str, Any] = {"v": None}

    def sharpness(coords: Sequence[Tensor]) -> float:
        params, P = evaluator.next_step_point(evaluator.elements(coords))
        lam, warm["v"] = preconditioned_sharpness(loss_of, params, P, safety.stability_iterations, generator, warm["v"])
        return lam

    with torch.enable_grad():
        return sharpness, sharpness(identity)


class InverseSnapshot:
    """A rollback that moves ``.grad`` and the optimizer state back with the inverse elements (``undo``,
    e.g. :meth:`FastEvaluator.undo <teleopt.teleport.fast_path.FastEvaluator.undo>`), and restores the
    parameters from copies of the named tensors (the site members), or with ``originals`` (no copies:
    exactly invertible elements, :meth:`FastEvaluator.exactly_invertible
    <teleopt.teleport.fast_path.FastEvaluator.exactly_invertible>`) by the inverse elements too.

    Either way the parameters come back bit for bit, so the model computes exactly what it did (the
    engine checks that again after a rollback without copies); gradients and moments come back up to
    round-off.  It holds one copy of the site members instead of four under Adam (parameters,
    gradients, two moments), or none.
    """

    def __init__(
        self, tensors: dict[str, Tensor], undo: Callable[[bool], None], originals: Callable[[], dict[str, Tensor]] | None = None
    ) -> None:
        self.live = tensors
        self.copies = originals is None
        self._saved = {n: t.detach().clone() for n, t in tensors.items()} if originals is None else None
        self._originals = originals
        self._undo = undo

    @property
    def saved(self) -> dict[str, Tensor]:
        """The site members before the teleport: the copies, or computed by the inverse elements."""
        if self._saved is not None:
            return self._saved
        assert self._originals is not None  # one of the two is given
        return self._originals()

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the gradients and state (while the parameters still sit at g . w), then the parameters:
        copied back in place, or moved by the inverse elements."""
        self._undo(not self.copies)
        if self._saved is not None:
            for n, t in self.live.items():
                t.copy_(self._saved[n])


class Snapshot:
    """Copies of named tensors, and of the optimizer state and ``.grad`` of ``params``, to roll back to."""

    def __init__(
        self,
        tensors: dict[str, Tensor],
        optimizer: Optimizer | None = None,
        params: list[Tensor] | None = None,
        grads: bool = False,
    ) -> None:
        self.live = tensors
        self.saved = {n: t.detach().clone() for n, t in tensors.items()}
        self.optimizer = optimizer
        self.state: dict[int, dict[str, Any]] = {}
        self.params = params or []
        self.grads = {i: p.grad.detach().clone() for i, p in enumerate(self.params) if grads and p.grad is not None}
        if optimizer is not None:
            for i, p in enumerate(self.params):
                st = optimizer.state.get(p)
                if st:
                    self.state[i] = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in st.items()}

    @torch.no_grad()
    def restore(self) -> None:
        """Copy everything back in place (tensor identity is kept)."""
        for n, t in self.live.items():
            t.copy_(self.saved[n])
        for i, g in self.grads.items():
            cur = self.params[i].grad
            if cur is not None and cur.shape == g.shape:
                cur.copy_(g)
            else:
                self.params[i].grad = g.clone()
        if self.optimizer is None:
            return
        for i, p in enumerate(self.params):
            saved = self.state.get(i)
            if saved is None:
                self.optimizer.state.pop(p, None)
                continue
            st = self.optimizer.state[p]
            for k in [k for k in st if k not in saved]:
                del st[k]
            for k, v in saved.items():
                cur = st.get(k)
                if isinstance(v, Tensor) and isinstance(cur, Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    st[k] = v.clone() if isinstance(v, Tensor) else v

    def to_state(self) -> dict[str, Any]:
        """Plain data for ``state_dict`` (tensors, ints, floats, strings only)."""
        return {"tensors": dict(self.saved), "state": {i: dict(s) for i, s in self.state.items()}}

    @classmethod
    def from_state(cls, data: dict[str, Any], tensors: dict[str, Tensor], optimizer: Optimizer, params: list[Tensor]) -> Snapshot:
        """Rebuild a snapshot saved by :meth:`to_state` against the live tensors."""
        snap = cls.__new__(cls)
        snap.live = {n: tensors[n] for n in data["tensors"]}
        snap.saved = {n: v.to(device=tensors[n].device, dtype=tensors[n].dtype) for n, v in data["tensors"].items()}
        snap.optimizer = optimizer
        snap.params = params
        snap.state = {}
        snap.grads = {}
        for i, st in data["state"].items():
            p = params[int(i)]
            snap.state[int(i)] = {
                k: (v.to(device=p.device, dtype=p.dtype) if isinstance(v, Tensor) and v.is_floating_point() and k != "step" else v)
                for k, v in st.items()
            }
        return snap
