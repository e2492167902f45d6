"""Typed access to the arguments of a traced call (``node.args`` / ``node.kwargs``).

torch.fx records each argument as spelled at the call site, positionally or by
keyword, as an ``Argument``: a union of traced values (``fx.Node``), numbers,
strings, slices and containers of them.  Rules read an argument by position *or*
keyword and state the type they need; any other value raises ``TypeError``,
which the rule driver reports and turns into frozen axes (detection fails closed).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx as fx
from torch.fx.node import Argument

__all__ = ["Argument", "positional", "arg", "tensor_arg", "optional_tensor_arg", "int_arg", "float_arg", "dims_arg", "ints", "nodes_in"]


def arg(node: fx.Node, i: int, name: str, default: Argument = None) -> Argument:
    """Argument ``i`` of the call, else keyword ``name``, else ``default``."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def positional(node: fx.Node, fn: Callable[..., Any]) -> None:
    """Rewrite ``node`` so that keyword arguments naming leading positional parameters of ``fn`` are positional.

    ``module(input=x)`` and ``F.dropout(input=x, p=0.1)`` become ``module(x)`` and
    ``F.dropout(x, 0.1)``: rules may then read the input as ``node.args[0]``.  A gap
    before a keyword argument is filled with the parameter's default; without one
    (or without a signature) the call is left as it is.
    """
    if not node.kwargs:
        return
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # a builtin without a signature: its first parameter is its input
        params = [inspect.Parameter("input", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    kwargs = dict(node.kwargs)
    last = max((i for i, p in enumerate(params) if p.name in kwargs), default=-1)
    args = list(node.args)
    for p in params[len(args) : last + 1]:
        if p.name in kwargs:
            args.append(kwargs.pop(p.name))
        elif p.default is not inspect.Parameter.empty:
            args.append(p.default)
        else:
            return
    node.args, node.kwargs = tuple(args), kwargs


def _wrong(node: fx.Node, name: str, value: object, expected: str) -> TypeError:
    return TypeError(f"argument {name!r} of {node.name} is {type(value).__name__}, expected {expected}")


def tensor_arg(node: fx.Node, i: int, name: str) -> fx.Node:
    """A traced value (a tensor the graph computes or reads); anything else raises ``TypeError``."""
    value = arg(node, i, name)
    if not isinstance(value, fx.Node):
        raise _wrong(node, name, value, "a traced tensor")
    return value


def optional_tensor_arg(node: fx.Node, i: int, name: str) -> fx.Node | None:
    """A traced value, or ``None`` when the argument is absent or ``None`` (an optional bias)."""
    value = arg(node, i, name)
    if value is None or isinstance(value, fx.Node):
        return value
    raise _wrong(node, name, value, "a traced tensor or None")


def int_arg(node: fx.Node, i: int, name: str, default: int | None = None) -> int:
    """A python ``int`` (a dimension, a group count); a traced value or a missing one raises ``TypeError``."""
    value = arg(node, i, name, default)
    if not isinstance(value, int):
        raise _wrong(node, name, value, "an int")
    return value


def float_arg(node: fx.Node, i: int, name: str, default: float | None = None) -> float:
    """A python number (an eps, a probability), returned as given."""
    value = arg(node, i, name, default)
    if not isinstance(value, (int, float)):
        raise _wrong(node, name, value, "a number")
    return value


def ints(value: Argument, what: str = "value") -> list[int]:
    """An int or a sequence of ints as a list; anything else raises ``TypeError``."""
    items = [value] if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(v, int) for v in items):
        raise TypeError(f"{what} must be an int or a sequence of ints, got {value!r}")
    return items


def dims_arg(node: fx.Node, i: int, name: str) -> list[int] | None:
    """Reduction dimensions: ``None`` for all (absent, ``None`` or empty), else a list of ints."""
    value = arg(node, i, name)
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return None
    return ints(value, f"argument {name!r} of {node.name}")


def nodes_in(value: object) -> Iterator[fx.Node]:
    """Every traced value inside an argument (nested lists, tuples and dicts)."""
    if isinstance(value, fx.Node):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from nodes_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from nodes_in(v)
