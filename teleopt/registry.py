"""The registry of known and discovered group actions.

Known actions (Zhao 2026, Table 1.1, attention, LoRA, data-dependent GL actions,
reference problems) are registered explicitly from ``teleopt.actions.KNOWN_ACTIONS``
before the registry is first used (the action modules do not import the registry);
users and ``teleopt.discover`` add theirs with :func:`register_action`.  An entry holds a
factory, so configurable actions are fetched with their options::

    get_action("positive_rescaling", activation="relu")
    get_action("attention_qk_gl", num_heads=8)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

if TYPE_CHECKING:
    from teleopt.actions.base import GroupAction

__all__ = ["register_action", "unregister_action", "get_action", "list_actions", "format_table"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    name: str
    factory: Callable[..., GroupAction]
    default: GroupAction
    configurable: bool


_REGISTRY: dict[str, _Entry] = {}
_KNOWN_REGISTERED = False


def _known() -> None:
    """Register the known actions (``teleopt.actions.KNOWN_ACTIONS``) once, before any other entry."""
    global _KNOWN_REGISTERED
    if _KNOWN_REGISTERED:
        return
    _KNOWN_REGISTERED = True
    from teleopt.actions import KNOWN_ACTIONS

    for action in KNOWN_ACTIONS:
        _add(action, None, False)


def _add(target: Any, name: str | None, overwrite: bool) -> None:
    from teleopt.actions.base import GroupAction

    _known()

    if isinstance(target, GroupAction):
        instance, factory, configurable = target, (lambda: target), False
    elif callable(target):
        try:
            instance = target()
        except TypeError as e:
            raise TypeError(f"register_action: {target!r} must be callable without arguments to build its default action ({e})") from e
        if not isinstance(instance, GroupAction):
            raise TypeError(f"register_action: {target!r}() returned {type(instance).__name__}, not a GroupAction")
        factory, configurable = target, True
    else:
        raise TypeError(f"register_action takes a GroupAction, a GroupAction subclass or a factory, got {type(target).__name__}")
    key = name or instance.name
    if not isinstance(key, str) or not key:
        raise ValueError("register_action: the action has no name; set its `name` or pass name=...")
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"an action named {key!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[key] = _Entry(key, factory, instance, configurable)


@overload
def register_action(action: T, *, name: str | None = None, overwrite: bool = False) -> T: ...
@overload
def register_action(action: None = None, *, name: str | None = None, overwrite: bool = False) -> Callable[[T], T]: ...


def register_action(action=None, *, name=None, overwrite=False):
    """Register a group action under ``name`` (default: the action's ``name``).

    Use as a call on an instance (``register_action(my_action)``), or as a decorator
    on a :class:`GroupAction` subclass or factory callable without arguments
    (``@register_action`` / ``@register_action(name="mine")``); the callable is
    kept so :func:`get_action` can pass configuration.  Duplicate names raise
    ``ValueError`` unless ``overwrite=True``.  Registered actions are listed by
    :func:`list_actions` and checked by ``teleopt.testing.check_action``
    (Zhao 2026, Table 1.1 lists the known ones).
    """
    if action is None:

        def decorator(target: T) -> T:
            _add(target, name, overwrite)
            return target

        return decorator
    _add(action, name, overwrite)
    return action


def unregister_action(name: str) -> None:
    """Remove a registered action (``KeyError`` if absent)."""
    _known()
    if name not in _REGISTRY:
        raise KeyError(f"no action named {name!r} is registered")
    del _REGISTRY[name]


def get_action(name: str, **config: Any) -> GroupAction:
    """The registered action ``name``, built with ``config`` if its factory takes options.

    Without options the same default instance is returned every time.
    """
    if not isinstance(name, str):
        raise TypeError(f"action name must be a string, got {type(name).__name__}")
    _known()
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no action named {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None
    if not config:
        return entry.default
    if not entry.configurable:
        raise TypeError(f"action {name!r} was registered as an instance and takes no options (got {sorted(config)})")
    return entry.factory(**config)


def list_actions() -> list[dict[str, Any]]:
    """One description row per registered action: name, group, continuous, exactness, linear, members, reference."""
    _known()
    return [entry.default.describe() | {"name": entry.name} for entry in sorted(_REGISTRY.values(), key=lambda e: e.name)]


def format_table(
    rows: list[dict[str, Any]] | None = None, columns: tuple[str, ...] = ("name", "group", "exactness", "linear", "reference")
) -> str:
    """The registry as a fixed-width text table (``python -m teleopt list``)."""
    rows = list_actions() if rows is None else rows
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])
