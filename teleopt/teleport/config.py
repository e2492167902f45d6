"""``Teleport``'s configuration: four group objects and the keyword shortcuts for them.

``Teleport`` is configured by :class:`~teleopt.teleport.schedule.Schedule` (when),
:class:`~teleopt.teleport.search.SearchConfig` (how elements are chosen),
:class:`~teleopt.teleport.safety.SafetyConfig` (caps, checks, watch) and
:class:`~teleopt.teleport.state_policy.StatePolicy` (the optimizer state).  The
common fields have keyword shortcuts (:class:`Shortcuts`): ``every=100`` means
``schedule=Schedule(every=100)``, ``ascent_steps=20`` means
``search=SearchConfig(steps=20)``.  A group object and its shortcuts are not
given together.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

from teleopt.functional import Batch, LossFn, as_batch, check_has_rows
from teleopt.teleport.objectives import Objective
from teleopt.teleport.safety import SafetyConfig
from teleopt.teleport.schedule import Schedule
from teleopt.teleport.search import Path, SearchConfig
from teleopt.teleport.state_policy import StatePolicy

__all__ = [
    "DEFAULT_OBJECTIVE",
    "DataSources",
    "Shortcuts",
    "check_seed",
    "check_shortcuts",
    "resolve_objective",
    "resolve_data",
    "checked_batch",
    "resolve_safety",
    "resolve_schedule",
    "resolve_search",
    "resolve_state_policy",
]


class Shortcuts(TypedDict, total=False):
    """Keyword shortcuts of ``Teleport`` for fields of its group objects."""

    every: int | None
    at: Sequence[int] | None
    when: Callable[[int], bool] | None
    warmup: int
    batches: int
    max_teleports: int | None
    ascent_steps: int
    ascent_lr: float
    trust_region: float | None
    path: Path
    state_fallback: str | dict[str, str] | None


def check_shortcuts(shortcuts: Mapping[str, object]) -> None:
    """``TypeError`` for a keyword that is no shortcut (as Python says for unknown keywords)."""
    known = set(Shortcuts.__annotations__)
    for key in shortcuts:
        if key not in known:
            raise TypeError(f"Teleport() got an unexpected keyword argument {key!r}")


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
                "Teleport has no schedule (no every=, at= or when=, and the objective has no default one): step() "
                "never teleports, only explicit opt.teleport() calls do. Pass every=N to teleport every N steps, or "
                "schedule=Schedule() to say that teleports are manual",
                UserWarning,
                stacklevel=3,
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


def resolve_search(search: SearchConfig | None, s: Shortcuts) -> SearchConfig:
    """``search``, or one built from the ``ascent_steps``/``ascent_lr``/``trust_region``/``path`` shortcuts."""
    if search is None:
        default = SearchConfig()
        return SearchConfig(
            steps=s.get("ascent_steps", default.steps),
            lr=s.get("ascent_lr", default.lr),
            trust_region=s.get("trust_region", default.trust_region),
            path=s.get("path", default.path),
            ascent_configured="ascent_steps" in s or "ascent_lr" in s,
        )
    if not isinstance(search, SearchConfig):
        raise TypeError(f"search must be a teleopt SearchConfig, got {type(search).__name__}")
    if any(key in s for key in ("ascent_steps", "ascent_lr", "trust_region", "path")):
        raise ValueError("give either search= or ascent_steps/ascent_lr/trust_region/path, not both")
    return search


def resolve_state_policy(policy: StatePolicy | str | dict[str, str] | None, shortcuts: Shortcuts) -> StatePolicy:
    """``policy`` as a :class:`StatePolicy` (a string or dict is its ``policy``, ``state_fallback`` its fallback)."""
    fallback = shortcuts.get("state_fallback")
    if not isinstance(policy, StatePolicy):
        return StatePolicy(policy, fallback)
    if fallback is not None:
        raise ValueError("give either state_policy=StatePolicy(...) or state_fallback, not both")
    return policy


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


def check_seed(value: object) -> int:
    """``value`` when it is an int >= 0 (the teleport seed)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"seed must be an int >= 0, got {value!r}")
    return value
