"""The property-test kit catches broken actions, and bad inputs get clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import teleopt
from teleopt.actions import DataDependentGLLstsq, GLLinear, PositiveRescaling
from teleopt.groups import GeneralLinear
from teleopt.testing import (
    assert_close,
    assert_gradient_transport,
    assert_invariant,
    check_action,
    group_elements,
    lie_algebra_coordinates,
    sign_patterns,
)


def _far_element(action, params, seed=1):
    """A fixed element well away from the identity (scale 0.5 in coordinates)."""
    return action.random_element(params, torch.Generator().manual_seed(seed), 0.5)


class WrongExponent(PositiveRescaling):
    """ReLU rescaling with W2 scaled by g^-2 instead of g^-1."""

    def __init__(self):
        super().__init__("relu")
        self.members = (self.members[0], self.members[1], type(self.members[2])("W2", 1, -2.0))


class FirstOrderInverseGL(GeneralLinear):
    """GL whose contragredient uses I - T for (I + T)^-1: the papers' shortcut."""

    def _contragredient(self, g, cols):
        eye = torch.eye(g.shape[-1], dtype=g.dtype)
        return (2 * eye - g).mT @ cols


class FirstOrderGLAction(GLLinear):
    def group(self, params):
        return FirstOrderInverseGL(self.axis_length(params))


@pytest.mark.parametrize("broken", [WrongExponent(), FirstOrderGLAction()], ids=["wrong-exponent", "I-T-inverse"])
def test_kit_catches_broken_actions(broken):
    problem = broken.example(torch.Generator().manual_seed(0))
    g = _far_element(broken, problem.params)
    with pytest.raises(AssertionError, match="invariance of the output: relative error"):
        assert_invariant(broken, g, problem.params, problem.fn, problem.data)
    with pytest.raises(AssertionError):
        check_action(broken)


def test_kit_catches_wrong_gradient_transport():
    class NoTransport(GLLinear):
        def transport_gradient(self, g, grads):
            return grads  # pretends J = I

    action = NoTransport()
    problem = action.example(torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="gradient transport"):
        assert_gradient_transport(action, _far_element(action, problem.params), problem.params, problem.loss, problem.data)


def test_first_order_inverse_fails_even_for_small_elements_within_tolerance():
    """With coordinates of norm 1e-3 the I - T error is ~1e-6, far above the 1e-10 budget."""
    action = FirstOrderGLAction()
    problem = action.example(torch.Generator().manual_seed(0))
    g = action.exp(1e-3 * torch.randn(5, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64), problem.params)
    with pytest.raises(AssertionError):
        assert_invariant(action, g, problem.params, problem.fn, problem.data)


def test_failure_message_shows_worst_entry():
    a = torch.zeros(3, 4, dtype=torch.float64)
    b = a.clone()
    b[2, 1] = 1.0
    with pytest.raises(AssertionError, match=r"worst entry at \(2, 1\): actual 0, expected 1"):
        assert_close(a, b, 1e-10, "demo")


@settings(deadline=None, max_examples=10)
@given(sign_patterns(6))
def test_sign_pattern_strategy(s):
    assert s.shape == (6,) and bool(((s == 1) | (s == -1)).all())


@settings(deadline=None, max_examples=10)
@given(lie_algebra_coordinates((3, 3), max_norm=0.7))
def test_coordinate_strategy_respects_bound(x):
    assert float(torch.linalg.matrix_norm(x, ord=2)) <= 0.7 + 1e-12


@pytest.mark.parametrize("name", [row["name"] for row in teleopt.list_actions()])
@settings(deadline=None, max_examples=5)
@given(data=st.data())
def test_group_elements_strategy_for_every_registered_action(name, data):
    """The strategy yields valid elements for every registered action's group."""
    action = teleopt.get_action(name)
    params = action.example(torch.Generator().manual_seed(0)).params
    action.validate_element(data.draw(group_elements(action, params)), params)


# -- bad input ------------------------------------------------------------------------------


def test_bad_parameter_tuples():
    action = teleopt.get_action("gl_linear")
    W1, b1, W2 = action.example().params
    g = action.identity((W1, b1, W2))
    with pytest.raises(ValueError, match="expected 3 parameter tensors"):
        action.act(g, (W1, W2))
    with pytest.raises(ValueError, match="axis length"):
        action.act(g, (W1, b1, W2[:, :-1]))
    with pytest.raises(ValueError, match="required"):
        action.act(g, (W1, b1, None))
    with pytest.raises(TypeError, match="tuple of tensors"):
        action.act(g, W1)
    with pytest.raises(TypeError, match="floating point"):
        action.act(g, (W1.long(), b1, W2))
    with pytest.raises(ValueError, match="not invertible"):
        action.act(torch.zeros_like(g), (W1, b1, W2))
    bad = g.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        action.act(bad, (W1, b1, W2))


def test_data_dependent_actions_need_data_and_small_batches():
    for name in ("data_dependent_gl", "data_dependent_gl_lstsq", "nonlinear_gl"):
        action = teleopt.get_action(name)
        problem = action.example()
        g = action.identity(problem.params)
        with pytest.raises(ValueError, match="data-dependent action"):
            action.act(g, problem.params)
    dd = teleopt.get_action("data_dependent_gl")
    p = dd.example().params
    with pytest.raises(ValueError, match="too large for an exact action"):
        dd.act(dd.identity(p), p, torch.randn(20, p[0].shape[1], dtype=torch.float64))
    with pytest.raises(ValueError, match="must have shape"):
        dd.act(dd.identity(p), p, torch.randn(2, p[0].shape[1] + 1, dtype=torch.float64))
    ls = teleopt.get_action("data_dependent_gl_lstsq")
    p = ls.example().params
    big = torch.randn(p[0].shape[0] + 3, p[0].shape[1], dtype=torch.float64)
    with pytest.raises(ValueError, match="too large for an exact action"):
        ls.act(ls.identity(p), p, big)
    relaxed = DataDependentGLLstsq(strict=False)
    g = relaxed.random_element(p, torch.Generator().manual_seed(0), 0.5)
    with pytest.warns(UserWarning, match="least-squares residual"):
        relaxed.act(g, p, big)
    nl = teleopt.get_action("nonlinear_gl")
    p = nl.example().params
    with pytest.raises(ValueError, match="single sample only"):
        nl.act(nl.identity(p), p, torch.randn(3, p[1].shape[1], dtype=torch.float64))


def test_bad_action_definitions():
    from teleopt import AxisAction, Member

    with pytest.raises(ValueError, match="group must be one of"):
        AxisAction("x", "affine", [Member("A", 0)])
    with pytest.raises(ValueError, match="power"):
        AxisAction("x", "general", [Member("A", 0, 2)])
    with pytest.raises(ValueError, match="unique"):
        AxisAction("x", "diagonal", [Member("A", 0), Member("A", 1)])
    with pytest.raises(ValueError, match="start and stop"):
        Member("A", 0, start=1)
    with pytest.raises(ValueError, match="not positively homogeneous"):
        PositiveRescaling("gelu")
    with pytest.raises(ValueError, match="not odd"):
        teleopt.actions.SignFlipAction("relu")
    with pytest.raises(ValueError, match="not invertible"):
        teleopt.actions.DataDependentGL("relu")
    with pytest.raises(ValueError, match="unknown activation"):
        teleopt.actions.DataDependentGL("swishy")
    with pytest.raises(ValueError, match="approximate"):
        check_action(teleopt.get_action("batchnorm_scaling"))


def test_plugin_does_not_import_torch_or_hypothesis():
    code = "import sys, teleopt.testing.plugin; print('torch' in sys.modules, 'hypothesis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_plugin_fixtures(torch_generator, float64):
    assert torch.get_default_dtype() == torch.float64 == float64
    again = torch.Generator().manual_seed(torch_generator.initial_seed())
    assert torch.equal(torch.randn(3, generator=torch_generator), torch.randn(3, generator=again))
