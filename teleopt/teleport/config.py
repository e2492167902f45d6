"""``Teleport``'s configuration: four group objects and one keyword shortcut.

``Teleport`` is configured by :class:`~teleopt.teleport.schedule.Schedule` (when),
:class:`~teleopt.teleport.search.SearchConfig` (how elements are chosen, the seed,
``paper_compat``), :class:`~teleopt.teleport.safety.SafetyConfig` (caps, checks,
held-out batch, watch) and :class:`~teleopt.teleport.state_policy.StatePolicy`
(the optimizer state).  ``every=100`` is the one shortcut: it means
``schedule=Schedule(every=100)`` and is not given together with ``schedule``.
Keywords that moved into these objects raise a ``TypeError`` naming where
(:data:`MOVED_KEYWORDS`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, ParamSpec, TypedDict

from teleopt.functional import Batch, LossFn, as_batch, check_has_rows
from teleopt.teleport.objectives import Objective
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.search import SearchConfig
from teleopt.teleport.state_policy import StatePolicy

P = ParamSpec("P")

__all__ = [
    "DEFAULT_OBJECTIVE",
    "DataSources",
    "MOVED_KEYWORDS",
    "Shortcuts",
    "reject_moved_keywords",
    "resolve_objective",
    "resolve_data",
    "checked_batch",
    "resolve_safety",
    "resolve_schedule",
    "resolve_search",
    "resolve_state_policy",
]


class Shortcuts(TypedDict, total=False):
    """The schedule fields :func:`resolve_schedule` reads besides a ``Schedule``; ``Teleport`` passes ``every``."""

    every: int | None
    at: Sequence[int] | None
    when: Callable[[int], bool] | None
    warmup: int
    batches: int
    max_teleports: int | None


#: Where each keyword ``Teleport`` no longer takes went (the one shortcut left is ``every``).
MOVED_KEYWORDS: dict[str, str] = {
    "at": "schedule=Schedule(at=...)",
    "when": "schedule=Schedule(when=...)",
    "warmup": "schedule=Schedule(warmup=...)",
    "batches": "schedule=Schedule(batches=...)",
    "max_teleports": "schedule=Schedule(max_teleports=...)",
    "ascent_steps": "search=SearchConfig(steps=...)",
    "ascent_lr": "search=SearchConfig(lr=...)",
    "trust_region": "search=SearchConfig(trust_region=...)",
    "path": "search=SearchConfig(path=...)",
    "seed": "search=SearchConfig(seed=...)",
    "paper_compat": "search=SearchConfig(paper_compat=True)",
    "state_fallback": "state_policy=StatePolicy(policy, fallback=...)",
    "heldout_batch": "safety=SafetyConfig(heldout_batch=...)",
}


def reject_moved_keywords(init: Callable[P, None]) -> Callable[P, None]:
    """``init`` raising a ``TypeError`` that says where a keyword of :data:`MOVED_KEYWORDS` went
    (``inspect.signature`` still shows ``init``'s own parameters)."""

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> None:
        moved = [key for key in kwargs if key in MOVED_KEYWORDS]
        if moved:
            where = "; ".join(f"{key}= -> {MOVED_KEYWORDS[key]}" for key in moved)
            raise TypeError(f"Teleport() no longer takes {', '.join(moved)}: the settings live in the config objects ({where})")
        init(*args, **kwargs)

    return checked


DEFAULT_OBJECTIVE = "balance"
"""The objective of a ``Teleport`` given neither an objective nor a schedule: the closed-form least weight norm on
the orbit (equi-normalization, Stock et al. 2019) on its default schedule; exact and free of extra forward or backward
passes, it is the default that measured never worse than the tuned baselines (docs/teleport.md, "When to use which")."""


def resolve_objective(objective: str | Objective | None, schedule: Schedule | None, s: Shortcuts, paper_compat: bool) -> str | Objective:
    """``objective``, or for ``None`` the default: :data:`DEFAULT_OBJECTIVE` when no schedule is given either (no
    ``schedule``, ``every``, ``at`` or ``when``), else ``"grad_norm"`` (the papers' objective, Zhao 2026 Sec. 5.1),
    as it is for ``paper_compat``, which reproduces the papers' first-order teleport."""
    if objective is not None:
        return objective
    scheduled = schedule is not None or any(s.get(k) is not None for k in ("every", "at", "when"))
    return "grad_norm" if scheduled or paper_compat else DEFAULT_OBJECTIVE


def resolve_schedule(schedule: Schedule | None, s: Shortcuts, default: Schedule | None = None) -> Schedule:
    """``schedule``, or one built from the ``every``/``at``/``when``/``warmup``/``batches``/``max_teleports`` shortcuts.

    With none of ``every``/``at``/``when``, ``default`` (the objective's default schedule) gives them and the
    warm-up (a given ``warmup`` replaces it); without a default, teleports happen only on request, and a
    ``UserWarning`` says so (an explicit ``Schedule()`` is a manual schedule chosen, without warning).
    """
    if schedule is None:
        resolved = _schedule_from_shortcuts(s, default)
        if resolved.manual:
            warnings.warn(
                "Teleport has no schedule (no every= or schedule=, and the objective has no default one): step() "
                "never teleports, only explicit opt.teleport() calls do. Pass every=N to teleport every N steps, or "
                "schedule=Schedule() to say that teleports are manual",
                UserWarning,
                stacklevel=4,  # the user's line: through Teleport.__init__ and its keyword check
            )
        return resolved
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a teleopt Schedule, got {type(schedule).__name__}")
    if any(s.get(k) is not None for k in ("every", "at", "when", "max_teleports")) or s.get("warmup", 0) or s.get("batches", 1) != 1:
        raise ValueError("give either schedule= or every/at/when/warmup/batches/max_teleports, not both")
    return schedule


def _schedule_from_shortcuts(s: Shortcuts, default: Schedule | None) -> Schedule:
    """The schedule of the shortcuts, the objective's ``default`` filling in when none of every/at/when is given."""
    if default is not None and all(s.get(k) is None for k in ("every", "at", "when")):
        return Schedule(
            every=default.every,
            at=default.at,
            when=default.when,
            warmup=s.get("warmup", default.warmup),
            batches=s.get("batches", default.batches),
            max_teleports=s.get("max_teleports", default.max_teleports),
        )
    return Schedule(
        every=s.get("every"),
        at=s.get("at"),
        when=s.get("when"),
        warmup=s.get("warmup", 0),
        batches=s.get("batches", 1),
        max_teleports=s.get("max_teleports"),
    )


def resolve_search(search: SearchConfig | None) -> SearchConfig:
    """``search`` itself, or the default :class:`SearchConfig` for ``None``."""
    if search is None:
        return SearchConfig()
    if not isinstance(search, SearchConfig):
        raise TypeError(f"search must be a teleopt SearchConfig, got {type(search).__name__}")
    return search


def resolve_state_policy(policy: StatePolicy | str | Mapping[str, str] | None) -> StatePolicy:
    """``policy`` as a :class:`StatePolicy` (a string or mapping is its ``policy`` argument)."""
    return policy if isinstance(policy, StatePolicy) else StatePolicy(policy)


class DataSources(NamedTuple):
    """Where ``Teleport`` gets its data: the loss, fresh teleport batches, a held-out batch, example inputs."""

    loss_fn: LossFn | None
    batch_fn: Callable[[], Any] | None
    heldout: Batch | None
    example: Batch | None


def resolve_data(
    loss_fn: LossFn | None,
    batch_fn: Callable[[], Any] | None,
    heldout_batch: Any,
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    *,
    batches: int = 1,
) -> DataSources:
    """Check ``Teleport``'s data arguments and normalise the batches (:func:`teleopt.functional.as_batch`)."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(output, target) -> loss, got {type(loss_fn).__name__}")
    if batch_fn is not None and not callable(batch_fn):
        raise TypeError(f"batch_fn must be callable() -> (inputs, target), got {type(batch_fn).__name__}")
    if batches > 1 and batch_fn is None:
        raise ValueError(f"batches={batches} needs batch_fn to draw the teleport batches")
    if example_kwargs is not None and (not isinstance(example_kwargs, Mapping) or not all(isinstance(k, str) for k in example_kwargs)):
        raise TypeError(f"example_kwargs must be a mapping of keyword arguments, got {type(example_kwargs).__name__}")
    check_has_rows(example_inputs, None, "example_inputs")
    check_has_rows((), example_kwargs, "example_kwargs")
    heldout = None if heldout_batch is None else as_batch(heldout_batch)
    if heldout is not None:
        check_has_rows(heldout.inputs, heldout.kwargs, "heldout_batch")
    example = None
    if example_inputs is not None or example_kwargs:
        inputs = () if example_inputs is None else example_inputs
        example = as_batch((tuple(inputs) if isinstance(inputs, list) else inputs, None, example_kwargs))
    return DataSources(loss_fn, batch_fn, heldout, example)


def checked_batch(batch: Any, name: str) -> Batch | None:
    """``batch`` as a :class:`Batch` (``None`` stays ``None``); ``ValueError`` naming ``name`` when it has no rows
    (a check on its empty outputs would pass anything)."""
    if batch is None:
        return None
    out = as_batch(batch)
    check_has_rows(out.inputs, out.kwargs, name)
    return out


def resolve_safety(safety: SafetyConfig | None) -> SafetyConfig:
    """``safety`` itself, or the default :class:`SafetyConfig` for ``None``."""
    if safety is None:
        return SafetyConfig()
    if not isinstance(safety, SafetyConfig):
        raise TypeError(f"safety must be a SafetyConfig, got {type(safety).__name__}")
    return safety
