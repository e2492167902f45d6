"""``register_op_rule``: teach detection an op it does not know (a user function, a custom op, a layer type).

Detection fails closed: an op without a rule freezes every axis it touches.  A
registration names the op (a ``call_function`` target, a ``Tensor`` method name or
a leaf module type) and its rule: a built-in rule by name, a
:func:`~teleopt.detection.rules.pointwise.pointwise_rule`, or any
``rule(ctx: RuleContext) -> None``.  User rules are sealed by the driver: tensor
arguments and outputs they leave unmentioned are frozen, and parameters they do not
use are never moved for this op.
"""

from __future__ import annotations

import difflib
import itertools
from typing import Any

import torch
from torch import nn

from teleopt.detection.ops import builtin_op, set_custom_op, user_op
from teleopt.detection.rules.context import OpRule
from teleopt.detection.rules.table import BUILTIN_RULES, RULES

__all__ = ["register_op_rule", "OpRuleHandle"]

_ids = itertools.count(1)


class OpRuleHandle:
    """Undoes one :func:`register_op_rule` with :meth:`remove` (as torch's ``RemovableHandle``); a context manager too.

    Removing restores what the target had before (a built-in rule, an earlier
    registration, or nothing).  ``remove`` is idempotent.
    """

    def __init__(self, target: Any, op: str, previous: str | None, key: str | None) -> None:
        self.target = target
        self.op = op
        self._previous = previous
        self._key = key  # the table entry this registration added (callable rules)
        self._removed = False

    @property
    def active(self) -> bool:
        """Whether this registration is the one detection uses for its target now."""
        return not self._removed and user_op(self.target) == self.op

    def remove(self) -> None:
        """Unregister: detection treats the target as it did before this registration."""
        if self._removed:
            return
        if user_op(self.target) == self.op:
            previous = self._previous if self._previous is None or self._previous in RULES else None
            set_custom_op(self.target, previous)
        if self._key is not None:
            RULES.pop(self._key, None)
        self._removed = True

    def __enter__(self) -> OpRuleHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed" if self._removed else "overridden"
        return f"OpRuleHandle({_describe(self.target)} -> {self.op!r}, {state})"


def register_op_rule(target: Any, rule: str | OpRule, *, overwrite: bool = False) -> OpRuleHandle:
    """Teach :func:`~teleopt.detection.find_symmetries` how axes flow through an op it has no rule for.

    Parameters
    ----------
    target:
        The op as it appears in the traced graph: a function called in ``forward``
        that torch.fx keeps as one call (decorated with ``torch.fx.wrap``), a
        ``torch.library`` custom op (``torch.ops.ns.name``, one of its overloads, or
        the object ``torch.library.custom_op`` returned), a ``Tensor`` method name
        (``"cumsum"``), or an ``nn.Module`` subclass: modules of exactly that type are
        then kept as leaves (not traced through) and given the rule.
    rule:
        How axes flow through it.  A built-in rule by op name, for an op that computes
        what that op computes with the same arguments (functions) or attributes
        (modules): ``"pointwise"`` (elementwise, not homogeneous: only permutations
        pass, Zhao 2026, Ex. 1.2.9), ``"relu"`` (positively homogeneous of degree 1,
        Ex. 1.2.4), ``"identity"`` (passes every group), ``"linear"``,
        ``"layer_norm"``, ... (the keys of ``teleopt.detection.rules.BUILTIN_RULES``).
        Or ``pointwise_rule(degree=..., linear=..., arg=...)``.  Or any callable
        ``rule(ctx)`` taking a :class:`~teleopt.detection.rules.RuleContext`: it reads
        the node's tensors (``ctx.tensor(arg)``, ``ctx.output()``, ``ctx.param(module,
        "weight", role)``) and states relations for the group kinds ``"general"``,
        ``"diagonal"``, ``"permutation"`` (``ctx.unify(kinds, (x, i), (out, j),
        power)``: rho_out = rho_x ** power; ``ctx.block(kinds, (x, i), why)``).
    overwrite:
        Replace the rule the target already has (built-in or registered); without it
        that is a ``ValueError``.

    Returns
    -------
    OpRuleHandle
        ``handle.remove()`` (or ``with register_op_rule(...):``) restores the previous
        rule.

    Raises
    ------
    TypeError
        ``target`` is not a callable, method name or ``nn.Module`` subclass (a module
        *instance*, say), ``rule`` is neither a name nor a callable, ``overwrite`` is
        not a bool.
    ValueError
        ``rule`` names no built-in rule, or ``target`` already has a rule and
        ``overwrite`` is False.

    A rule states facts; detection trusts them.  Every axis a user rule leaves
    unmentioned stays frozen (fail closed), so a rule that says too little loses
    sites but never breaks invariance; one that says too much does.  Check the sites
    with ``teleopt.testing`` (or ``teleopt.detection.verify``) on your model.

    Example
    -------
    >>> @torch.fx.wrap
    ... def squareplus(x):  # (x + sqrt(x^2 + 4)) / 2: smooth, not homogeneous
    ...     return (x + torch.sqrt(x * x + 4)) / 2
    >>> handle = register_op_rule(squareplus, "pointwise")  # hidden units may be permuted
    >>> report = find_symmetries(model, x)                 # doctest: +SKIP
    >>> handle.remove()
    """
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {type(overwrite).__name__}")
    target = _normalise_target(target)
    op, key = _resolve_rule(rule, target)
    existing = user_op(target) or builtin_op(target)
    if existing is not None and not overwrite:
        where = "a registered rule" if user_op(target) is not None else f"the built-in rule {existing!r}"
        raise ValueError(f"{_describe(target)} already has {where}; pass overwrite=True to replace it")
    if key is not None:
        RULES[key] = rule  # type: ignore[assignment]  # callable, checked in _resolve_rule
    previous = set_custom_op(target, op)
    return OpRuleHandle(target, op, previous, key)


def _normalise_target(target: Any) -> Any:
    if isinstance(target, nn.Module):
        raise TypeError(
            f"target must be a module type, not an instance: register type(m) ({type(target).__name__}); "
            "every module of exactly that type gets the rule"
        )
    if isinstance(target, str):
        if not target.isidentifier():
            raise ValueError(f"a method target must be a Tensor method name, got {target!r}")
        return target
    if isinstance(target, type):
        if not issubclass(target, nn.Module) or target is nn.Module:
            raise TypeError(f"a type target must be a subclass of torch.nn.Module, got {target.__name__}")
        return target
    packet = getattr(getattr(target, "_opoverload", None), "overloadpacket", None)  # torch.library.custom_op's object
    if isinstance(packet, torch._ops.OpOverloadPacket):
        return packet
    if not callable(target):
        raise TypeError(
            f"target must be a function, a torch op, a Tensor method name or an nn.Module subclass, got {type(target).__name__}"
        )
    return target


def _resolve_rule(rule: Any, target: Any) -> tuple[str, str | None]:
    """(op name the target maps to, new table key or None)."""
    if isinstance(rule, str):
        if rule not in BUILTIN_RULES:
            near = difflib.get_close_matches(rule, list(BUILTIN_RULES), n=3)
            hint = f"; did you mean {', '.join(map(repr, near))}?" if near else f"; known: {', '.join(sorted(BUILTIN_RULES))}"
            raise ValueError(f"no built-in rule named {rule!r}{hint}")
        return rule, None
    if not callable(rule) or isinstance(rule, type):
        raise TypeError(f"rule must be a built-in rule name or a callable rule(ctx), got {type(rule).__name__}")
    key = f"user{next(_ids)}:{_describe(target)}"
    return key, key


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return f"Tensor.{target}"
    return str(getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or target)
