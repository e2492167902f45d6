"""What a teleport optimises over the orbit: Zhao 2026, Algorithm 1 and Ch. 5.

Every objective is a function of the group elements, evaluated by an
:class:`~teleopt.teleport.evaluator.Evaluator`
(:class:`~teleopt.teleport.fast_path.FastEvaluator` from ``.grad`` alone, or
:class:`~teleopt.teleport.general_path.GeneralEvaluator` through the model on a
batch) and maximised or minimised by projected ascent on the coordinates
(:mod:`teleopt.teleport.ascent`):

``GradientNorm`` (``"grad_norm"``)
    ||grad L(g . w)||^2, Algorithm 1 line 3.  Unbounded on non-compact orbits, so
    it is always used inside the trust region and under the gain caps of
    :class:`~teleopt.teleport.safety.SafetyConfig`.  Fast path.
``PreconditionedNorm`` (``"preconditioned_norm"``)
    <grad, u>, where u is the base optimizer's next update from g . w given the
    transported state: the optimizer's own rate of loss decrease (eq. 4.17 with
    eta its preconditioner; Sec. 5.4.1, eq. 5.7 ||grad||_A for AdaGrad with
    A = (eps + diag G_{t+1})^{-1/2}).  Fast path.
``Lookahead`` (``"lookahead"``)
    L(g . w - u): the batch loss after the base optimizer's next step, bounded
    below by the loss floor, so maximising the decrease cannot run off to
    infinity.  Needs a batch (general path).
``Sharpness`` (``"sharpness"``)
    phi(w, T, D) = mean over t in T, d in D of L(w + t d) (eq. 5.1), with D drawn
    uniformly on the unit sphere (normalised Gaussians, an unbiased choice) once
    per teleport.  Needs a batch.  Decrease by default (flatter minima).
``Balance`` (``"balance"``)
    sum ||(g . w)_m||^2 over the trainable site members, decreased: the point of
    least weight norm on the orbit (ENorm, Stock et al. 2019), solved in closed form
    per site by block-coordinate sweeps (:mod:`~teleopt.teleport.balance`) instead of
    by ascent.  No loss is involved; fast path.
``Curvature`` (``"curvature"``)
    psi(w, k) = mean_i kappa(gamma_{M_i}, 0) (eq. 5.2), the curvature of the
    orbit curves gamma_M(t) = exp(t M) . w for k random Lie algebra elements.  For
    axis actions gamma' = d rho(M) w and gamma'' = d rho(M)^2 w in closed form,
    vectorised over the k curves (:mod:`~teleopt.teleport.lie_algebra`); other
    actions are differentiated through ``act`` by autograd, one curve at a time.  No loss is involved, so exact sites need no
    batch.  Increase by default (Sec. 5.3: larger curvature, lower test loss).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from teleopt.groups import BALANCE_RCOND
from teleopt.teleport.balance import WeightNormModel
from teleopt.teleport.evaluator import Evaluator, require_batch
from teleopt.teleport.lie_algebra import has_infinitesimal_action, infinitesimal_action
from teleopt.teleport.schedule import Schedule

__all__ = [
    "Objective",
    "GradientNorm",
    "PreconditionedNorm",
    "Lookahead",
    "Sharpness",
    "Curvature",
    "Balance",
    "get_objective",
    "OBJECTIVES",
]

Direction = Literal["increase", "decrease"]

#: The balance objective's default schedule: every this many steps, the first one after as many.
DEFAULT_BALANCE_EVERY = 200


def _check_direction(direction: str) -> Direction:
    if direction == "increase":
        return "increase"
    if direction == "decrease":
        return "decrease"
    raise ValueError(f"direction must be 'increase' or 'decrease', got {direction!r}")


class Objective(ABC):
    """A quantity of the teleported point to increase or decrease.

    Subclasses implement :meth:`value`; :meth:`prepare` draws any randomness once
    per teleport (so the objective is deterministic during the search) from the
    teleport's generator.
    """

    name: str = ""
    needs_batch: bool = False
    needs_optimizer_model: bool = False
    direction: Direction = "increase"
    closed_form: bool = False  #: whether :meth:`solve` gives the optimum (then no ascent runs by default)
    #: whether :meth:`value` (or :meth:`solve`) reads the gradients; when not, a teleport measures ||grad|| for its
    #: report and watch off ``.grad`` before and after, and never builds the gradient norm's model
    reads_gradients: bool = True
    #: whether the value depends on the transported gradients through their Euclidean norm only, so that it
    #: is the same all along the orbit of an isometric site (:attr:`GroupAction.isometric`) acting alone
    isometry_invariant: bool = False

    @property
    def maximum_on_boundary(self) -> bool:
        """Whether the score is convex in the log-scales of diagonal sites, so that its maximum over a box
        trust region lies at a corner and :class:`~teleopt.teleport.search.BoundaryStep` may replace the
        ascent for them by default, and convex along the boundary step's ray over GL blocks too, so that
        the step evaluates the boundary point alone (``False`` unless an objective proves it)."""
        return False

    def prepare(self, evaluator: Evaluator, generator: torch.Generator) -> Any:
        """Per-teleport randomness (``None`` for deterministic objectives)."""
        return None

    def default_schedule(self) -> Schedule | None:
        """When to teleport if ``Teleport`` is given no ``every``/``at``/``when`` (``None``: only on request).

        ``None`` for the searched objectives: scheduled gradient-norm teleports diverged or collapsed
        training in benchmarks/realistic (figures: ``docs/performance.md``)."""
        return None

    @abstractmethod
    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: Any) -> Tensor:
        """The objective at g . w (a float64 scalar, differentiable in the elements)."""

    def solve(self, prepared: Any, trust_regions: Sequence[float | None], start: Sequence[Tensor]) -> tuple[list[Tensor], float]:
        """``closed_form`` objectives: the optimal coordinates per site, each inside its trust region (``None``:
        unbounded), from the identity's coordinates ``start``, and the value at the identity."""
        raise TypeError(f"objective {self.name!r} has no closed form: it is searched by ascent")

    def score(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: Any) -> Tensor:
        """What the ascent maximises: the value, negated for ``direction="decrease"``."""
        v = self.value(evaluator, elements, prepared)
        return v if self.direction == "increase" else -v

    def __repr__(self) -> str:
        return f"{type(self).__name__}(direction={self.direction!r})"


class GradientNorm(Objective):
    """||grad L(g . w)||^2 (Zhao 2026, Algorithm 1, line 3)."""

    name = "grad_norm"
    isometry_invariant = True

    def __init__(self, direction: Direction = "increase") -> None:
        self.direction = _check_direction(direction)

    @property
    def maximum_on_boundary(self) -> bool:
        """Increasing only: each gradient entry moves by a product of scales, so ||grad L(g . w)||^2 is a
        sum of exp(linear forms in the log-scales) with nonnegative weights, a convex function."""
        return self.direction == "increase"

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: Any) -> Tensor:
        return evaluator.grad_norm_sq(elements)


class PreconditionedNorm(Objective):
    """<grad, u(grad, state)> of the base optimizer's next step (Zhao 2026, eq. 4.17, Sec. 5.4.1 eq. 5.7)."""

    name = "preconditioned_norm"
    needs_optimizer_model = True

    def __init__(self, direction: Direction = "increase") -> None:
        self.direction = _check_direction(direction)

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: Any) -> Tensor:
        return evaluator.first_order_decrease(elements)


class Lookahead(Objective):
    """L(g . w - u): the loss after the base optimizer's next step from the teleported point."""

    name = "lookahead"
    needs_batch = True
    needs_optimizer_model = True

    def __init__(self, direction: Direction = "decrease") -> None:
        self.direction = _check_direction(direction)

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: Any) -> Tensor:
        return require_batch(evaluator, "objective 'lookahead'").lookahead_loss(elements).to(torch.float64)


class Sharpness(Objective):
    """phi(w, T, D) = mean_{t, d} L(w + t d) over random unit directions (Zhao 2026, eq. 5.1).

    Parameters
    ----------
    direction:
        ``"decrease"`` (default: flatter) or ``"increase"``.
    displacements:
        The set T of step lengths t.
    directions:
        |D|, the number of unit directions over all trainable parameters.
    """

    name = "sharpness"
    needs_batch = True

    def __init__(self, direction: Direction = "decrease", displacements: Sequence[float] = (0.01, 0.05), directions: int = 4) -> None:
        self.direction = _check_direction(direction)
        disp = tuple(float(t) for t in displacements)
        if not disp or any(not t > 0 for t in disp):
            raise ValueError(f"displacements must be positive numbers, got {displacements!r}")
        if not isinstance(directions, int) or isinstance(directions, bool) or directions < 1:
            raise ValueError(f"directions must be a positive int, got {directions!r}")
        self.displacements = disp
        self.directions = directions

    def prepare(self, evaluator: Evaluator, generator: torch.Generator) -> list[dict[str, Tensor]]:
        trainable = evaluator.ctx.trainable
        out = []
        for _ in range(self.directions):
            raw = {n: torch.randn(p.shape, generator=generator, dtype=torch.float64) for n, p in trainable.items()}
            norm = torch.sqrt(sum((d.square().sum() for d in raw.values()), torch.zeros((), dtype=torch.float64)))
            out.append({n: (d / norm).to(device=trainable[n].device, dtype=trainable[n].dtype) for n, d in raw.items()})
        return out

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: list[dict[str, Tensor]]) -> Tensor:
        batched = require_batch(evaluator, "objective 'sharpness'")
        total = torch.zeros((), dtype=torch.float64)
        for d in prepared:
            for t in self.displacements:
                total = total + batched.perturbed_loss(elements, d, t).to(torch.float64)
        return total / (len(prepared) * len(self.displacements))


class Curvature(Objective):
    """psi(w, k): mean curvature of k random orbit curves through g . w (Zhao 2026, eq. 5.2).

    kappa = sqrt(|g'|^2 |g''|^2 - (g' . g'')^2) / |g'|^3 at t = 0 for
    gamma(t) = exp(t M) . w, with M drawn per site as Gaussian Lie algebra
    coordinates (scale 1/sqrt(n) for matrix groups).
    """

    name = "curvature"

    def __init__(self, direction: Direction = "increase", curves: int = 4) -> None:
        self.direction = _check_direction(direction)
        if not isinstance(curves, int) or isinstance(curves, bool) or curves < 1:
            raise ValueError(f"curves must be a positive int, got {curves!r}")
        self.curves = curves

    def prepare(self, evaluator: Evaluator, generator: torch.Generator) -> list[Tensor]:
        out = []
        for site in evaluator.sites:
            group = site.action.group(tuple(None if n is None else evaluator.like[n] for n in site.members))
            coord_shape = group.coord_shape
            if coord_shape is None:
                raise TypeError(f"site {site.name!r}: {group!r} is discrete, it has no orbit curves")
            shape = (self.curves, *coord_shape)
            scale = 1.0 / group.n**0.5 if len(coord_shape) >= 2 else 1.0
            device = next(evaluator.like[n] for n in site.tensor_names).device
            out.append((torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(device))
        return out

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: list[Tensor]) -> Tensor:
        sites = evaluator.sites
        if all(has_infinitesimal_action(s) for s in sites):
            v, a = self._closed_form(evaluator, elements, prepared)
        else:
            v, a = self._autograd(evaluator, elements, prepared)
        vv = (v * v).sum(-1)
        aa = (a * a).sum(-1)
        va = (v * a).sum(-1)
        tiny = torch.finfo(torch.float64).tiny
        kappa = (vv * aa - va * va).clamp_min(tiny).sqrt() / vv.clamp_min(tiny) ** 1.5
        return kappa.mean()

    def _closed_form(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: list[Tensor]) -> tuple[Tensor, Tensor]:
        """gamma' = d rho(M) w and gamma'' = d rho(M)^2 w for all k curves at once (axis actions)."""
        sites, like = evaluator.sites, evaluator.like
        groups = [s.action.group(tuple(None if n is None else like[n] for n in s.members)) for s in sites]
        points = evaluator.site_params(elements)
        batched = {n: t.to(torch.float64).unsqueeze(0).expand(self.curves, *t.shape) for n, t in points.items()}
        velocity = infinitesimal_action(sites, groups, prepared, batched)
        acceleration = infinitesimal_action(sites, groups, prepared, velocity)
        names = sorted(velocity)
        v = torch.cat([velocity[n].reshape(self.curves, -1) for n in names], dim=1)
        a = torch.cat([acceleration[n].reshape(self.curves, -1) for n in names], dim=1)
        return v, a

    def _autograd(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: list[Tensor]) -> tuple[Tensor, Tensor]:
        """gamma' and gamma'' through ``act`` for any action, one curve at a time.

        Derivatives in t come from reverse mode twice (the double-vjp trick: for y(t),
        u^T y'(t) = vjp, and y'(t) = d(u^T y')/du), not nested ``torch.func.jvp``:
        torch 2.14's forward-over-forward derivative of ``torch.linalg.solve`` is
        wrong, and GL actions solve with g^T.
        """
        sites, like = evaluator.sites, evaluator.like

        def curve(t: Tensor, Ms: Sequence[Tensor]) -> Tensor:
            moved = []
            for site, M, g in zip(sites, Ms, elements):
                params = tuple(None if n is None else like[n] for n in site.members)
                moved.append(site.action.compose(site.action.group(params).exp(t * M), g))
            pts = evaluator.site_params(moved)
            return torch.cat([pts[n].reshape(-1).to(torch.float64) for n in sorted(pts)])

        def derivative(y: Tensor, t: Tensor) -> Tensor:
            u = torch.zeros_like(y, requires_grad=True)
            (uy,) = torch.autograd.grad(y, t, grad_outputs=u, create_graph=True)
            (dy,) = torch.autograd.grad(uy, u, create_graph=True)
            return dy

        vs, accs = [], []
        with torch.enable_grad():
            for i in range(self.curves):
                t = torch.zeros((), dtype=torch.float64, device=prepared[0].device, requires_grad=True)
                v = derivative(curve(t, [M[i] for M in prepared]), t)
                vs.append(v)
                accs.append(derivative(v, t))
        return torch.stack(vs), torch.stack(accs)


class Balance(Objective):
    """sum_m ||(g . w)_m||^2 over the trainable site members, minimised in closed form (ENorm, Stock et al. 2019).

    The least weight norm on the orbit: for a positive rescaling c_i = (b_i / a_i)^(1/4) per unit (a_i the
    squared norm of its incoming row and bias, b_i of its outgoing column), for GL the element equalising the
    Gram matrices of the two sides; coupled sites by block-coordinate sweeps (:mod:`~teleopt.teleport.balance`),
    clipped to the trust region.  Orthogonal sites stay (norms are invariant); sites the closed form cannot
    take stay at the identity.

    For a GL site this is the balanced point A A^T = B^T B (a LoRA pair B A: ``teleopt.lora_sites``), for a
    positive rescaling |w_in,i| = |w_out,i| per unit.  No forward or backward pass; no batch.

    Parameters
    ----------
    max_sweeps, tol:
        Block-coordinate passes at most, and the change of a site's coordinates (max abs) below which its
        neighbours are not solved again.
    rcond:
        A unit or GL block whose writer or reader Gram matrix (mass) has an eigenvalue at most ``rcond`` times
        its largest has no balanced point (LoRA's B = 0 at initialisation, a rank-deficient Gram matrix, a
        dead unit) and is left where it is.
    fraction:
        Move ``exp(fraction * xi)`` of the way from the identity to the solution (1: balanced; 0.5: halfway
        along the geodesic of symmetric elements), after the trust-region clip.
    min_move:
        A site whose coordinates are all within ``min_move`` of the identity is already balanced and does not
        move (when no site moves, the teleport is declined).  Default: sqrt(eps) of the site's dtype (1.5e-8
        in float64, 3.5e-4 in float32), above the rounding a balanced site shows and far below any move that
        matters to training.
    """

    name = "balance"
    direction: Direction = "decrease"
    closed_form = True
    reads_gradients = False

    def __init__(
        self,
        max_sweeps: int = 50,
        tol: float = 1e-3,
        rcond: float = BALANCE_RCOND,
        fraction: float = 1.0,
        min_move: float | None = None,
    ) -> None:
        if not isinstance(max_sweeps, int) or isinstance(max_sweeps, bool) or max_sweeps < 1:
            raise ValueError(f"max_sweeps must be a positive int, got {max_sweeps!r}")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ValueError(f"tol must be a number >= 0, got {tol!r}")
        if isinstance(rcond, bool) or not isinstance(rcond, (int, float)) or not 0 < rcond < 1:
            raise ValueError(f"rcond must be in (0, 1), got {rcond!r}")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        if min_move is not None and (isinstance(min_move, bool) or not isinstance(min_move, (int, float)) or not min_move >= 0):
            raise ValueError(f"min_move must be a number >= 0 or None, got {min_move!r}")
        self.max_sweeps = max_sweeps
        self.tol = float(tol)
        self.rcond = float(rcond)
        self.fraction = float(fraction)
        self.min_move = None if min_move is None else float(min_move)

    def default_schedule(self) -> Schedule:
        """Every 200 steps from step 200 (never at step 0, before any training; after the usual lr warm-ups).

        Chosen on benchmarks/realistic as the schedule of ``Teleport``'s default (figures: ``docs/teleport.md``,
        "When to use which"): on the byte-level Llama every 50 steps cost 16-20% of the steps in teleports and
        ended above 1.01x the tuned baseline's best validation loss in one of two seeds; every 200 steps did not."""
        return Schedule(every=DEFAULT_BALANCE_EVERY, warmup=DEFAULT_BALANCE_EVERY)

    def prepare(self, evaluator: Evaluator, generator: torch.Generator) -> WeightNormModel:
        """The members reduced once per teleport (:class:`~teleopt.teleport.balance.WeightNormModel`)."""
        sites = evaluator.sites
        groups = [s.action.group(tuple(None if n is None else evaluator.like[n] for n in s.members)) for s in sites]
        return WeightNormModel(sites, groups, evaluator.like, set(evaluator.ctx.trainable))

    def value(self, evaluator: Evaluator, elements: Sequence[Tensor], prepared: WeightNormModel) -> Tensor:
        """Sites the closed form does not take count at the identity (they are not moved by :meth:`solve`)."""
        return prepared.value(elements)

    def solve(
        self, prepared: WeightNormModel, trust_regions: Sequence[float | None], start: Sequence[Tensor]
    ) -> tuple[list[Tensor], float]:
        found = prepared.solve(trust_regions, start, self.max_sweeps, self.tol, rcond=self.rcond)
        coords = []
        for xi, xi0, dtype in zip(found.coords, start, prepared.dtypes):
            move = xi - xi0
            floor = self.min_move if self.min_move is not None else math.sqrt(torch.finfo(dtype).eps)
            if not (move.numel() and float(move.abs().max()) > floor):
                coords.append(xi0.clone())  # already balanced (or nothing to balance): stays
            else:
                coords.append(xi0 + self.fraction * move if self.fraction != 1.0 else xi)
        return coords, found.norm_start

    def __repr__(self) -> str:
        parts = [f"max_sweeps={self.max_sweeps}", f"tol={self.tol:g}", f"rcond={self.rcond:g}", f"fraction={self.fraction:g}"]
        if self.min_move is not None:
            parts.append(f"min_move={self.min_move:g}")
        return f"Balance({', '.join(parts)})"


OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (GradientNorm, PreconditionedNorm, Lookahead, Sharpness, Curvature, Balance)
}


def get_objective(spec: str | Objective) -> Objective:
    """An :class:`Objective` from its name (``"grad_norm"``, ``"preconditioned_norm"``, ``"lookahead"``,
    ``"sharpness"``, ``"curvature"``, ``"balance"``) or an instance."""
    if isinstance(spec, Objective):
        return spec
    if isinstance(spec, str):
        if spec not in OBJECTIVES:
            raise ValueError(f"unknown teleport objective {spec!r}; known: {sorted(OBJECTIVES)}")
        return OBJECTIVES[spec]()
    raise TypeError(f"objective must be a name or an Objective, got {type(spec).__name__}")
