"""teleopt.testing: property-based tests of loss invariance, for our suite and yours.

Install with the ``testing`` extra (``pip install teleopt[testing]``).  It gives

* hypothesis strategies for group elements (``strategies``): bounded Lie algebra
  coordinates, permutations, sign patterns, integer seeds for ``torch.Generator``;
* assertions (``assertions``): output/loss invariance, the group axioms and
  gradient transport against autograd (Zhao 2026, Prop. 4.5.1), norm-relative,
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

from typing import TYPE_CHECKING

from teleopt._lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

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
