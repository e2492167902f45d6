"""The rule table: canonical op name (``teleopt.detection.ops``) -> op rule, one module per op family.

``BUILTIN_RULES`` is the read-only table the library ships; ``RULES`` is the table
the driver dispatches through, which ``register_op_rule`` extends with user rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from teleopt.detection.rules import (
    arithmetic,
    attention,
    layers,
    masks,
    norms,
    pointwise,
    reductions,
    shapes,
)
from teleopt.detection.rules.context import OpRule

__all__ = ["BUILTIN_RULES", "RULES"]


def _merge(*families: Mapping[str, OpRule]) -> dict[str, OpRule]:
    table: dict[str, OpRule] = {}
    for family in families:
        clash = table.keys() & family.keys()
        if clash:
            raise RuntimeError(f"op rules defined twice: {sorted(clash)}")
        table.update(family)
    return table


#: The library's rules by op family (pointwise, arithmetic, reductions and pooling, shapes, layers, norms, attention, masks).
BUILTIN_RULES: Mapping[str, OpRule] = MappingProxyType(
    _merge(pointwise.RULES, arithmetic.RULES, reductions.RULES, shapes.RULES, layers.RULES, norms.RULES, attention.RULES, masks.RULES)
)

#: The table the driver dispatches through: the built-in rules plus user registrations.
RULES: dict[str, OpRule] = dict(BUILTIN_RULES)
