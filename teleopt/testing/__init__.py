"""teleopt.testing: property-based tests of loss invariance, for our suite and yours.

Install with the ``testing`` extra (``pip install teleopt[testing]``).  It gives

* hypothesis strategies for group elements (``strategies``): bounded Lie algebra
  coordinates, permutations, sign patterns, integer seeds for ``torch.Generator``;
* assertions (``assertions``): output/loss invariance, the group axioms and
  gradient transport against autograd (papers/001 Prop. 4.5.1), norm-relative,
  with messages that show the worst entry; ``check_action`` runs them all;
* a ``pytest11`` plugin (``plugin``) with fixtures, loaded lazily.

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

from teleopt.testing.assertions import (
    assert_close,
    assert_gradient_transport,
    assert_group_axioms,
    assert_invariant,
    check_action,
    default_rtol,
    relative_error,
)
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

__all__ = [
    "assert_close",
    "assert_gradient_transport",
    "assert_group_axioms",
    "assert_invariant",
    "check_action",
    "default_rtol",
    "relative_error",
    "coordinates_norm",
    "default_max_norm",
    "generators",
    "group_elements",
    "lie_algebra_coordinates",
    "permutations",
    "seeds",
    "sign_patterns",
]
