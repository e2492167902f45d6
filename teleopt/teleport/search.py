"""How a teleport chooses its group elements: the search phase and its settings.

A :class:`SearchStrategy` receives a :class:`SearchProblem` (the sites, their
groups, the evaluator, the objective and the trust regions) and returns Lie
algebra coordinates per site; the element applied is exp of them, after the
safety caps scaled them towards the identity where needed
(:func:`~teleopt.teleport.ascent.shrink_to_feasible`).  The default,
:class:`GradientAscent`, is the projected Adam of Zhao 2026, Algorithm 1 line 3
(:func:`~teleopt.teleport.ascent.ascend`).  Any other way to choose an element
(a learned teleport policy, a closed form, a grid) plugs in through
``SearchConfig(strategy=...)`` without touching the rest of a teleport.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from teleopt.actions.base import GroupAction
from teleopt.groups import Group
from teleopt.site import Site
from teleopt.teleport.ascent import ascend
from teleopt.teleport.coordinates import within_roundoff
from teleopt.teleport.evaluator import Evaluator
from teleopt.teleport.objectives import Objective
from teleopt.teleport.precision import Precision

__all__ = [
    "Path",
    "SearchProblem",
    "SearchResult",
    "SearchStrategy",
    "GradientAscent",
    "BoundaryStep",
    "ClosedForm",
    "SearchConfig",
]

Path = Literal["auto", "fast", "general"]

_ASCENT_STEPS, _ASCENT_LR = 100, 0.2  # the projected ascent's defaults (SearchConfig's steps, lr)


@dataclass
class SearchProblem:
    """What a search strategy is given for one teleport.

    ``start`` holds the identity's coordinates (float64 zeros of each group's
    ``coord_shape``); ``trust_regions`` each site's radius (``None``: unbounded),
    to be kept with :meth:`Group.project_coordinates <teleopt.groups.Group.project_coordinates>`.
    """

    sites: Sequence[Site]
    groups: Sequence[Group]
    evaluator: Evaluator
    objective: Objective
    prepared: Any
    start: list[Tensor]
    trust_regions: list[float | None]
    roundoff_limited: list[tuple[str, torch.dtype]] = field(default_factory=list)

    def idle(self) -> list[bool]:
        """Per site: whether the score is the same all along its orbit, so the search leaves it at the identity.

        An isometric site (:attr:`GroupAction.isometric <teleopt.actions.base.GroupAction.isometric>`, the
        residual stream's rotation) under an objective of Euclidean norms (:attr:`Objective.isometry_invariant`):
        each transported gradient is an isometric image, unless another site of the problem acts on one of its
        axes (a scaling after a rotation of the same axis changes the norm).  Ascending it would move the
        parameters by round-off directions for no gain (and cost the boundary step its one-step search)."""
        n = max(len(self.sites), len(self.groups))
        if not self.objective.isometry_invariant or len(self.sites) != n:
            return [False] * n
        axes = [list(zip(s.members, s.action.acted_axes())) for s in self.sites]
        return [
            site.action.isometric
            and site.action.continuous
            and not any(
                other == name and (a is None or b is None or a < 0 or b < 0 or a == b)
                for name, a in mine
                if name is not None
                for j, theirs in enumerate(axes)
                if j != i
                for other, b in theirs
            )
            for i, (site, mine) in enumerate(zip(self.sites, axes))
        ]

    def score(self, coords: Sequence[Tensor]) -> Tensor:
        """What the search maximises at ``coords``: the objective's score at exp(coords) . w."""
        return self.objective.score(self.evaluator, self.evaluator.elements(coords), self.prepared)

    def within_roundoff(self, coords: Sequence[Tensor], precision: Precision) -> list[Tensor]:
        """``coords`` with each GL block's round-off amplification bounded for the dtype its site's products are
        computed in under ``precision`` (:func:`~teleopt.teleport.coordinates.within_roundoff`): an element that
        would amplify the training precision's round-off is shrunk here, before anything moves."""
        members = [tuple(None if n is None else self.evaluator.like[n] for n in s.members) for s in self.sites]
        dtypes = [precision.compute_dtype(m) for m in members]
        out = within_roundoff(self.sites, self.groups, coords, members, dtypes)
        self.roundoff_limited = [(s.name, d) for s, d, a, b in zip(self.sites, dtypes, coords, out) if a is not b]
        return out

    def limits(self) -> str:
        """Why a teleport that found no move moved no site: the round-off bound, naming the sites it shrank."""
        if not self.roundoff_limited:
            return ""
        names = ", ".join(f"{n} ({str(d).replace('torch.', '')})" for n, d in self.roundoff_limited[:3])
        more = f" and {len(self.roundoff_limited) - 3} more" if len(self.roundoff_limited) > 3 else ""
        return f" within the round-off bound of the training precision (shrunk: {names}{more})"

    def score_and_gradient(self) -> tuple[float, list[Tensor | None]]:
        """The score at ``start`` (the identity) and its gradient in the Lie algebra coordinates: the
        linearisation :class:`BoundaryStep` steps along (Zhao 2026, Algorithm 1 line 3).

        Where every site's element is the plain exponential of its coordinates
        (:attr:`Group.plain_exp <teleopt.groups.Group.plain_exp>`, with the action's default ``exp``), d exp
        at 0 is the identity map, and the gradient is taken in the elements at the identity: no forward or
        backward through ``matrix_exp`` (most of a boundary step's time on GL sites otherwise).  Otherwise by
        autograd through exp.
        """
        plain = all(g.plain_exp and type(s.action).exp is GroupAction.exp for s, g in zip(self.sites, self.groups))
        if plain:
            leaves = [g.identity(dtype=c.dtype, device=c.device).requires_grad_(True) for g, c in zip(self.groups, self.start)]
            with torch.enable_grad():
                score = self.objective.score(self.evaluator, leaves, self.prepared)
        else:
            leaves = [c.detach().clone().requires_grad_(True) for c in self.start]
            with torch.enable_grad():
                score = self.score(leaves)
        if not score.requires_grad:
            return float(score.detach()), [None] * len(leaves)
        grads = torch.autograd.grad(score, leaves, allow_unused=True)
        return float(score.detach()), [None if g is None else g.detach() for g in grads]


@dataclass
class SearchResult:
    """Chosen coordinates per site; ``score_start`` is the score at the identity when the
    strategy evaluated it (else the teleport evaluates it for its report)."""

    coords: list[Tensor]
    score_start: float | None = None
    evaluations: int = 0


@runtime_checkable
class SearchStrategy(Protocol):
    """Chooses the group coordinates of a teleport (see module docs)."""

    def search(self, problem: SearchProblem) -> SearchResult:
        """Coordinates per site of ``problem`` (the identity's zeros decline the teleport)."""
        ...


@dataclass(frozen=True)
class GradientAscent:
    """Projected Adam on the coordinates from the identity (Zhao 2026, Algorithm 1 line 3):
    ``steps`` steps of size ``lr`` (a distance in coordinates, e.g. log-scales)."""

    steps: int = _ASCENT_STEPS
    lr: float = _ASCENT_LR

    def search(self, problem: SearchProblem) -> SearchResult:
        idle = problem.idle()

        def score(coords: Sequence[Tensor]) -> Tensor:  # idle sites stay at the identity (no gradient, no step)
            return problem.score([x0 if skip else x for x, x0, skip in zip(coords, problem.start, idle)])

        found = ascend(
            score if any(idle) else problem.score,
            problem.start,
            problem.groups,
            self.steps,
            self.lr,
            problem.trust_regions,
        )
        return SearchResult(found.coords, found.score_start, found.evaluations)


@dataclass(frozen=True)
class BoundaryStep:
    """One step from the identity to the trust region's boundary along the objective's gradient there,
    then a short line search: the first step of the Frank-Wolfe method, for a score maximised over
    the trust region (Zhao 2026, Algorithm 1 line 3, with the ascent replaced by its linearisation).

    Each site moves to :meth:`Group.boundary_point <teleopt.groups.Group.boundary_point>` of the
    gradient of the score at the identity (r sign(d) for scalings, the polar factor r U V^T of d for
    GL blocks), scaled by the best of ``fractions`` (the identity when none improves the score; by
    default 1 alone where the score is convex along the ray, else 1, 0.5 and 0.25).
    The gradient norm is convex in the log-scales and, for a GL site, in g^T g, so its maximum over
    the trust region lies on the boundary; the linearisation picks the boundary point in one
    gradient evaluation instead of ``GradientAscent``'s up to 100 (gains compared in
    ``docs/performance.md``).

    Needs a finite trust region and a boundary point for every site; otherwise the search is
    ``fallback`` (projected ascent).
    """

    fractions: tuple[float, ...] | None = None
    fallback: GradientAscent = field(default_factory=GradientAscent)

    def __post_init__(self) -> None:
        if self.fractions is None:
            return
        if (
            not isinstance(self.fractions, tuple)
            or not self.fractions
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 1 for t in self.fractions)
        ):
            raise ValueError(f"BoundaryStep: fractions must be a non-empty tuple of numbers in (0, 1] or None, got {self.fractions!r}")

    def _fractions(self, problem: SearchProblem) -> tuple[float, ...]:
        """``fractions`` when given; by default only the boundary (1) where the score is convex along the ray
        (an objective whose maximum lies on the boundary, the gradient norm, over scalings and GL blocks),
        else (1, 0.5, 0.25).  Along r U sign(L) U^T the gradient norm is a nonnegative sum of exponentials
        of t (on GL blocks too), so with a positive slope at the identity its maximum on [0, 1] is at 1."""
        if self.fractions is not None:
            return self.fractions
        convex = problem.objective.maximum_on_boundary and all(g.boundary_search or g.boundary_search_when_convex for g in problem.groups)
        return (1.0,) if convex else (1.0, 0.5, 0.25)

    def search(self, problem: SearchProblem) -> SearchResult:
        if any(r is None for r, idle in zip(problem.trust_regions, problem.idle()) if not idle):
            return self.fallback.search(problem)
        start, grads = problem.score_and_gradient()
        points = []
        for grp, g, radius, x0, idle in zip(problem.groups, grads, problem.trust_regions, problem.start, problem.idle()):
            if idle:
                points.append(torch.zeros_like(x0))
                continue
            # every radius is finite here (checked above); the test narrows the type
            point = None if g is None or radius is None else grp.boundary_point(g.detach(), radius)
            if point is None and g is not None and bool((g != 0).any()):
                return self.fallback.search(problem)  # a group without a boundary point
            points.append(torch.zeros_like(x0) if point is None else point.to(x0.dtype))
        del grads, g  # the memory of one coordinate set before the candidates
        best: list[Tensor] | None = None
        best_score, evaluations = start, 1
        for t in self._fractions(problem):
            candidate = points if t == 1.0 else [t * p for p in points]
            with torch.no_grad():
                value = float(problem.score(candidate))
            evaluations += 1
            if value == value and value > best_score:
                best, best_score = candidate, value
        return SearchResult(best if best is not None else [x.detach().clone() for x in problem.start], start, evaluations)


@dataclass(frozen=True)
class ClosedForm:
    """The objective's own optimum (:meth:`Objective.solve <teleopt.teleport.objectives.Objective.solve>`),
    for objectives with a ``closed_form`` such as ``"balance"``; no ascent."""

    def search(self, problem: SearchProblem) -> SearchResult:
        coords, value_start = problem.objective.solve(problem.prepared, problem.trust_regions, problem.start)
        score = value_start if problem.objective.direction == "increase" else -value_start
        return SearchResult(coords, score, 0)


def _check_int(value: Any, what: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def check_positive(value: Any, what: str) -> float:
    """``value`` as a float if it is a positive finite number, else ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def check_positive_or_none(value: Any, what: str) -> float | None:
    """:func:`check_positive`, with ``None`` allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a positive finite number or None, got {value!r}")
    return float(value)


@dataclass
class SearchConfig:
    """Search settings of a :class:`~teleopt.teleport.Teleport`.

    Parameters
    ----------
    steps, lr:
        Projected Adam on the group coordinates: number of steps and step size
        (``None``: not chosen, 100 and 0.2).  Choosing either makes positive-scaling
        sites ascend as chosen instead of stepping to the boundary (:meth:`strategy_for`).
    trust_region:
        Bound on the coordinates (|log-scale| <= r, spectral norm of GL generators
        <= r), stored per param group as ``teleopt_teleport_trust_region`` (a site
        uses the smallest over its parameters' groups).  Default log 4.
    path:
        ``"auto"`` (fast when every site and the objective allow it), ``"fast"`` or ``"general"``.
    strategy:
        How elements are chosen (:class:`SearchStrategy`); default
        ``GradientAscent(steps, lr)``, or :class:`ClosedForm` for objectives that have one (``"balance"``),
        or :class:`BoundaryStep` for fast-path teleports with GL sites, and with positive-scaling sites
        under the gradient-norm objective unless ``steps`` or ``lr`` was chosen (:meth:`strategy_for`).
    seed:
        Seed of the teleport's generator: the random directions of the sharpness and curvature
        objectives and the dropout masks of the check forwards (its state is saved in ``state_dict``).
    paper_compat:
        Run the papers' first-order, non-invariant teleport instead
        (:mod:`~teleopt.teleport.paper_compat`, ``steps`` ascent steps of size ``lr``); for comparisons only.
    """

    steps: int | None = None
    lr: float | None = None
    trust_region: float | None = math.log(4)
    path: Path = "auto"
    strategy: SearchStrategy | None = field(default=None)
    seed: int = 0
    paper_compat: bool = False

    def __post_init__(self) -> None:
        check_positive_or_none(self.trust_region, "trust_region")
        if self.steps is not None:
            _check_int(self.steps, "steps", 0)
        self.lr = None if self.lr is None else check_positive(self.lr, "lr")
        _check_int(self.seed, "seed", 0)
        if not isinstance(self.paper_compat, bool):
            raise TypeError(f"paper_compat must be a bool, got {type(self.paper_compat).__name__}")
        if self.path not in ("auto", "fast", "general"):
            raise ValueError(f"path must be 'auto', 'fast' or 'general', got {self.path!r}")
        if self.strategy is not None and not isinstance(self.strategy, SearchStrategy):
            from teleopt.teleport.objectives import Objective

            if isinstance(self.strategy, Objective):
                raise TypeError(
                    f"strategy must be a SearchStrategy; {self.strategy!r} is an objective: pass "
                    f"Teleport(..., objective={self.strategy.name!r}) or objective={type(self.strategy).__name__}(...)"
                )
            raise TypeError(f"strategy must have a search(problem) method, got {type(self.strategy).__name__}")

    @property
    def ascent_configured(self) -> bool:
        """Whether ``steps`` or ``lr`` was chosen: then scaling sites ascend as chosen."""
        return self.steps is not None or self.lr is not None

    def ascent(self) -> GradientAscent:
        """Projected ascent with ``steps`` and ``lr``, the defaults where they were not chosen."""
        default = GradientAscent()
        return GradientAscent(default.steps if self.steps is None else self.steps, default.lr if self.lr is None else self.lr)

    @property
    def chooser(self) -> SearchStrategy:
        """The strategy given, or projected ascent."""
        return self.strategy if self.strategy is not None else self.ascent()

    def strategy_for(self, objective: Objective, problem: SearchProblem | None = None) -> SearchStrategy:
        """The strategy in use for ``objective`` (and ``problem``): the one given, else the objective's
        closed form if it has one (:class:`ClosedForm`), else a :class:`BoundaryStep` for a fast-path
        problem with finite trust regions everywhere and either a site whose group searches the boundary
        (GL, :attr:`Group.boundary_search <teleopt.groups.Group.boundary_search>`) or, when the ascent
        was not configured and the objective's maximum lies on the boundary (the gradient norm,
        increasing), only groups that search it then (positive scalings); else projected ascent.
        (Gains and times against projected ascent: ``docs/performance.md``.)"""
        if self.strategy is None and objective.closed_form:
            return ClosedForm()
        if self.strategy is None and problem is not None and self._boundary_problem(problem, objective):
            return BoundaryStep(fallback=self.ascent())
        return self.chooser

    def _boundary_problem(self, problem: SearchProblem, objective: Objective) -> bool:
        active = [(g, r) for g, r, idle in zip(problem.groups, problem.trust_regions, problem.idle()) if not idle]
        if not problem.evaluator.moves_gradients or any(r is None for _, r in active):
            return False
        if any(g.boundary_search for g, _ in active):
            return True
        convex = objective.maximum_on_boundary and not self.ascent_configured
        return convex and all(g.boundary_search_when_convex for g, _ in active)
