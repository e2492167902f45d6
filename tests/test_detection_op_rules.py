"""register_op_rule: detection follows a user op once it is told how axes flow through it.

Each model puts an op detection has no rule for between two linear layers: a
function kept as one call by ``torch.fx.wrap``, a ``torch.library`` custom op, a
Tensor method, or a module type whose ``forward`` torch.fx cannot trace.  Before
registration the op freezes the hidden units on both sides (no site ties the
layers); after it, the sites the op allows appear, and each is exact: a random
group element leaves the float64 outputs unchanged to the kit's default 1e-10 in
train and eval mode.  Every registration is undone by its handle in a fixture, so
none leaks into another test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import teleopt
from teleopt.detection import (
    OpRuleHandle,
    RuleContext,
    find_symmetries,
    pointwise_rule,
    register_op_rule,
)
from teleopt.detection.ops import custom_module_types, user_op
from teleopt.detection.rules import BUILTIN_RULES, RULES
from teleopt.detection.verify import assert_site_invariant, randomize_


@torch.fx.wrap
def squareplus(x: torch.Tensor) -> torch.Tensor:
    """(x + sqrt(x^2 + 4)) / 2: smooth, not positively homogeneous, commutes with permutations."""
    return (x + torch.sqrt(x * x + 4)) / 2


@torch.fx.wrap
def leaky(x: torch.Tensor) -> torch.Tensor:
    """A leaky ReLU written by hand: positively homogeneous of degree 1."""
    return torch.where(x > 0, x, 0.2 * x)


@torch.fx.wrap
def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last axis: permutations of the features pass, scaling does not."""
    return x / x.norm(dim=-1, keepdim=True)


@torch.fx.wrap
def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


@torch.library.custom_op("teleopt_test::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@cube.register_fake
def _cube_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Softsign(nn.Module):
    """x / (1 + |x|) behind a check on the values: torch.fx cannot trace it (shapes it could)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(torch.isnan(x).any()):
            raise ValueError("nan input")
        return x / (1 + x.abs())


def _act(kind: str, h: torch.Tensor) -> torch.Tensor:
    """The op under test, called by its global name (torch.fx.wrap patches the names of this module)."""
    if kind == "squareplus":
        return squareplus(h)
    if kind == "leaky":
        return leaky(h)
    if kind == "unit_rows":
        return unit_rows(h)
    if kind == "cube":
        return cube(h)
    if kind == "sinc":
        return h.sinc()
    if kind == "relu":
        return torch.relu(h)
    raise ValueError(kind)


class Sandwich(nn.Module):
    """Linear -> op under test -> Linear -> ReLU -> Linear."""

    def __init__(self, kind: str, d_in: int = 4, hidden: int = 6, d_out: int = 3) -> None:
        super().__init__()
        self.kind = kind
        self.l1, self.l2, self.l3 = nn.Linear(d_in, hidden), nn.Linear(hidden, 5), nn.Linear(5, d_out)
        self.act = Softsign() if kind == "softsign" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = self.act(h) if self.act is not None else _act(self.kind, h)
        return self.l3(torch.relu(self.l2(h)))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.gate, self.l2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(gated(self.l1(x), self.gate(x)))


HIDDEN = frozenset({"l1.weight", "l1.bias", "l2.weight"})


@pytest.fixture(autouse=True)
def _no_leaks():
    """Registrations made by a test are gone after it (the rule table is the built-in one)."""
    targets = (squareplus, leaky, unit_rows, gated, torch.ops.teleopt_test.cube, torch.relu, "sinc", Softsign)
    assert RULES.keys() == BUILTIN_RULES.keys() and not any(user_op(t) for t in targets)
    yield
    assert RULES.keys() == BUILTIN_RULES.keys(), "a test left a registration behind"
    assert not any(user_op(t) for t in targets) and not custom_module_types(), "a test left a registration behind"


@pytest.fixture
def register():
    """register_op_rule whose handles are removed (newest first) when the test ends."""
    handles: list[OpRuleHandle] = []

    def _register(*args, **kwargs) -> OpRuleHandle:
        handle = register_op_rule(*args, **kwargs)
        handles.append(handle)
        return handle

    yield _register
    for handle in reversed(handles):
        handle.remove()


def _model(kind: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = randomize_(Sandwich(kind).double(), torch.Generator().manual_seed(seed))
    return model, torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _sites(report, action: str) -> set[frozenset[str]]:
    return {frozenset(s.tensor_names) for s in report.sites if s.action.name == action}


def _assert_exact(model: nn.Module, report, x: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(0)
    for site in report.sites:
        g = site.action.random_element(site.tensors(model), gen, 0.5)
        assert_site_invariant(model, site, g, x)  # float64: relative error <= 1e-10, train and eval


def _frozen_between_l1_and_l2(report) -> bool:
    return not any(HIDDEN <= names for action in ("hidden_permutation", "positive_rescaling") for names in _sites(report, action))


def test_a_pointwise_function_is_followed_once_registered(register):
    model, x = _model("squareplus")
    before = find_symmetries(model, x)
    assert any(e.kind == "op" and "squareplus has no detection rule" in e.reason for e in before.skipped)
    assert _frozen_between_l1_and_l2(before)

    register(squareplus, "pointwise")
    after = find_symmetries(model, x)
    assert not any("squareplus" in e.reason for e in after.skipped)
    assert HIDDEN in _sites(after, "hidden_permutation")
    assert HIDDEN not in _sites(after, "positive_rescaling")  # squareplus is not homogeneous
    _assert_exact(model, after, x)


def test_a_homogeneous_function_passes_positive_scaling(register):
    model, x = _model("leaky")
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))
    register(leaky, pointwise_rule(degree=1))
    report = find_symmetries(model, x)
    assert HIDDEN in _sites(report, "positive_rescaling")
    assert HIDDEN in _sites(report, "hidden_permutation")
    _assert_exact(model, report, x)


def test_a_torch_library_custom_op_with_its_degree(register):
    model, x = _model("cube")
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))
    register(cube, pointwise_rule(degree=3))  # (c x)^3 = c^3 x^3: the next layer's columns take c^-3
    report = find_symmetries(model, x)
    scaling = next(s for s in report.sites if s.action.name == "positive_rescaling" and set(s.tensor_names) == HIDDEN)
    powers = {m.tensor_key: m.power for m in scaling.action.members}
    assert powers == {"l1.weight": 1.0, "l1.bias": 1.0, "l2.weight": -3.0}
    _assert_exact(model, report, x)


def test_the_op_packet_of_a_custom_op_can_be_registered_too(register):
    model, x = _model("cube")
    register(torch.ops.teleopt_test.cube, "pointwise")
    report = find_symmetries(model, x)
    assert HIDDEN in _sites(report, "hidden_permutation") and HIDDEN not in _sites(report, "positive_rescaling")


def test_a_tensor_method(register):
    model, x = _model("sinc")
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))
    register("sinc", "pointwise")
    report = find_symmetries(model, x)
    assert HIDDEN in _sites(report, "hidden_permutation")
    _assert_exact(model, report, x)


def test_an_untraceable_module_type_becomes_a_leaf_with_a_rule(register):
    model, x = _model("softsign")
    before = find_symmetries(model, x)
    assert any(e.kind == "module" and e.where == "act" for e in before.skipped)  # kept opaque
    assert _frozen_between_l1_and_l2(before)
    register(Softsign, "pointwise")
    report = find_symmetries(model, x)
    assert not any(e.where == "act" for e in report.skipped)
    assert HIDDEN in _sites(report, "hidden_permutation")
    _assert_exact(model, report, x)


def test_a_general_rule_states_relations_per_group_kind(register):
    def unit_rows_rule(ctx: RuleContext) -> None:
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        for i in range(len(ctx.meta(out))):
            ctx.unify(("permutation",), (x, i), (out, i))  # the other kinds are left out: blocked

    model, x = _model("unit_rows")
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))
    register(unit_rows, unit_rows_rule)
    report = find_symmetries(model, x)
    assert HIDDEN in _sites(report, "hidden_permutation")
    assert HIDDEN not in _sites(report, "positive_rescaling")
    _assert_exact(model, report, x)


def _gated_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = randomize_(Gated().double(), torch.Generator().manual_seed(0))
    return model, torch.randn(8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def test_what_a_user_rule_leaves_out_stays_frozen(register):
    def scales_with_x(ctx: RuleContext) -> None:  # x * sigmoid(gate): degree 1 in x, gate fixed
        x, out = ctx.tensor(ctx.node.args[0]), ctx.output()
        for i in range(len(ctx.meta(out))):
            ctx.unify(("diagonal",), (x, i), (out, i))  # says nothing about gate

    model, x = _gated_model()
    register(gated, scales_with_x)
    report = find_symmetries(model, x)
    assert HIDDEN in _sites(report, "positive_rescaling")
    assert not any("gate.weight" in s.tensor_names for s in report.sites)  # the gate's axes were sealed, not left free
    _assert_exact(model, report, x)


def test_pointwise_rule_refuses_an_op_with_a_second_tensor_argument(register):
    model, x = _gated_model()
    register(gated, pointwise_rule(degree=1))  # permuting x alone would change x * sigmoid(gate)
    report = find_symmetries(model, x)
    assert any("is for ops whose other arguments are not tensors" in e.reason for e in report.skipped)
    assert not any("l1.weight" in s.tensor_names for s in report.sites)
    _assert_exact(model, report, x)


def test_a_failing_user_rule_fails_closed(register):
    def broken(ctx: RuleContext) -> None:
        raise KeyError("boom")

    model, x = _model("squareplus")
    register(squareplus, broken)
    report = find_symmetries(model, x)
    assert any("its rule failed: KeyError" in e.reason for e in report.skipped)
    assert _frozen_between_l1_and_l2(report)


def test_remove_restores_the_fail_closed_behaviour():
    model, x = _model("squareplus")
    handle = register_op_rule(squareplus, "pointwise")
    assert handle.active and "squareplus" in repr(handle)
    assert HIDDEN in _sites(find_symmetries(model, x), "hidden_permutation")
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))
    with register_op_rule(squareplus, "pointwise"):  # a context manager as well
        assert HIDDEN in _sites(find_symmetries(model, x), "hidden_permutation")
    assert _frozen_between_l1_and_l2(find_symmetries(model, x))


def test_a_callable_rule_leaves_the_table_when_removed():
    handle = register_op_rule(squareplus, lambda ctx: None)
    assert len(RULES) == len(BUILTIN_RULES) + 1
    handle.remove()
    assert RULES.keys() == BUILTIN_RULES.keys()


def test_overwriting_a_builtin_rule_and_restoring_it(register):
    model, x = _model("relu")
    assert HIDDEN in _sites(find_symmetries(model, x), "positive_rescaling")
    with pytest.raises(ValueError, match="already has the built-in rule 'relu'.*overwrite=True"):
        register_op_rule(torch.relu, "pointwise")
    handle = register(torch.relu, "pointwise", overwrite=True)  # treat it as a generic activation
    report = find_symmetries(model, x)
    assert HIDDEN not in _sites(report, "positive_rescaling") and HIDDEN in _sites(report, "hidden_permutation")
    handle.remove()
    assert HIDDEN in _sites(find_symmetries(model, x), "positive_rescaling")


def test_registering_twice_needs_overwrite_and_remove_restores_the_first(register):
    model, x = _model("leaky")
    register(leaky, "pointwise")
    with pytest.raises(ValueError, match="already has a registered rule"):
        register_op_rule(leaky, "relu")
    second = register(leaky, "relu", overwrite=True)
    assert HIDDEN in _sites(find_symmetries(model, x), "positive_rescaling")
    second.remove()
    report = find_symmetries(model, x)
    assert HIDDEN not in _sites(report, "positive_rescaling") and HIDDEN in _sites(report, "hidden_permutation")


@pytest.mark.parametrize(
    ("target", "rule", "kwargs", "error", "match"),
    [
        (nn.Linear(2, 2), "pointwise", {}, TypeError, r"module type, not an instance.*type\(m\)"),
        (int, "pointwise", {}, TypeError, "subclass of torch.nn.Module"),
        (nn.Module, "pointwise", {}, TypeError, "subclass of torch.nn.Module"),
        (3.5, "pointwise", {}, TypeError, "target must be a function"),
        ("not a name", "pointwise", {}, ValueError, "Tensor method name"),
        (squareplus, "pointwize", {}, ValueError, "no built-in rule named 'pointwize'; did you mean 'pointwise'"),
        (squareplus, 3, {}, TypeError, "rule must be a built-in rule name or a callable"),
        (squareplus, nn.ReLU, {}, TypeError, "rule must be a built-in rule name or a callable"),
        (squareplus, "pointwise", {"overwrite": "yes"}, TypeError, "overwrite must be a bool"),
    ],
)
def test_bad_registrations_raise(target, rule, kwargs, error, match):
    with pytest.raises(error, match=match):
        register_op_rule(target, rule, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"linear": True}, ValueError, "linear op is homogeneous of degree 1"),
        ({"degree": 0}, ValueError, "degree must be nonzero"),
        ({"degree": "2"}, TypeError, "degree must be a finite number"),
        ({"degree": float("nan")}, TypeError, "degree must be a finite number"),
        ({"arg": -1}, TypeError, "arg must be a non-negative int"),
    ],
)
def test_bad_pointwise_rules_raise(kwargs, error, match):
    with pytest.raises(error, match=match):
        pointwise_rule(**kwargs)


def test_register_op_rule_is_public():
    assert teleopt.register_op_rule is register_op_rule
    assert "register_op_rule" in teleopt.__all__
