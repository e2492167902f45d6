"""teleopt.testing: property-based tests of loss invariance, for our suite and yours.

Install with the ``testing`` extra (``pip install teleopt[testing]``).  It gives

* hypothesis strategies for group elements (``strategies``): bounded Lie algebra
  coordinates, permutations, sign patterns, integer seeds for ``torch.Generator``;
* assertions (``assertions``): output/loss invariance, the group axioms and
  gradient transport against autograd (papers/001 Prop. 4.5.1), norm-relative,
  with messages that show the worst entry; ``check_action`` runs them all;
* a conformance suite for ``torch.optim`` wrappers (``conformance``:
  ``WrapperConformance``, ``check_wrapper``; CONVENTIONS.md section 3);
* a ``pytest11`` plugin (``plugin``) with fixtures; it imports torch lazily.

Names are imported lazily (PEP 562) so that loading the plugin stays cheap.

Example::

    from hypothesis import given, settings
    from teleopt import get_action
    from teleopt.testing import assert_invariant, group_elements

    action = get_action("positive_rescaling", activation="relu")
    problem = action.example()

    @settings(deadline=None, max_examples=25)
    @given(group_elements(action, problem.params))
    def test_relu_rescaling(g):
        assert_invariant(action, g, problem.params, problem.fn, problem.data)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it (add new public names here)
_LAZY = {
    **dict.fromkeys(
        (
            "assert_close",
            "assert_gradient_transport",
            "assert_group_axioms",
            "assert_invariant",
            "check_action",
            "default_rtol",
            "relative_error",
        ),
        "teleopt.testing.assertions",
    ),
    **dict.fromkeys(
        (
            "coordinates_norm",
            "default_max_norm",
            "generators",
            "group_elements",
            "lie_algebra_coordinates",
            "permutations",
            "seeds",
            "sign_patterns",
        ),
        "teleopt.testing.strategies",
    ),
    **dict.fromkeys(("WrapperConformance", "check_wrapper"), "teleopt.testing.conformance"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'teleopt.testing' has no attribute {name!r}")
    importlib.import_module("teleopt.actions")  # registers the known actions
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from teleopt.testing.assertions import (
        assert_close,
        assert_gradient_transport,
        assert_group_axioms,
        assert_invariant,
        check_action,
        default_rtol,
        relative_error,
    )
    from teleopt.testing.conformance import WrapperConformance, check_wrapper
    from teleopt.testing.strategies import (
        coordinates_norm,
        default_max_norm,
        generators,
        group_elements,
        lie_algebra_coordinates,
        permutations,
        seeds,
        sign_patterns,
    )
