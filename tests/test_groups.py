"""Groups: exact elements, axioms, representations and bad input (teleopt.groups)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from teleopt.groups import GeneralLinear, Orthogonal, Permutation, PositiveScaling, SignFlip, Translation
from teleopt.testing import assert_close, coordinates_norm, default_max_norm, lie_algebra_coordinates, permutations, seeds

# float64 round-off of products/solves of 3x3..6x6 matrices with condition number < 10
# stays below ~1e-14; 1e-12 leaves margin and still catches any first-order shortcut (errors ~1e-3).
RTOL = 1e-12

CONTINUOUS = [GeneralLinear(4), GeneralLinear(3, blocks=2), Orthogonal(4), Orthogonal(2, blocks=3), PositiveScaling(5), Translation(3)]
DISCRETE = [SignFlip(5), Permutation(4), Permutation(3, unit_size=2)]


def _element(group, seed, scale=0.5):
    return group.random(torch.Generator().manual_seed(seed), scale=scale)


@pytest.mark.parametrize("group", CONTINUOUS + DISCRETE, ids=repr)
@settings(deadline=None, max_examples=20)
@given(seed1=seeds(), seed2=seeds(), seed3=seeds())
def test_group_axioms(group, seed1, seed2, seed3):
    a, b, c = (_element(group, s) for s in (seed1, seed2, seed3))
    e = group.identity()
    for g in (a, b, c):
        group.validate(g)
    close = (lambda x, y: torch.equal(x, y)) if group.kind == "permutation" else (lambda x, y: assert_close(x, y, RTOL) is not None)
    assert close(group.compose(group.compose(a, b), c), group.compose(a, group.compose(b, c)))
    assert close(group.compose(e, a), a) and close(group.compose(a, e), a)
    assert close(group.compose(a, group.inverse(a)), e) and close(group.compose(group.inverse(a), a), e)


@pytest.mark.parametrize("group", [g for g in CONTINUOUS + DISCRETE if g.kind != "translation"], ids=repr)
@settings(deadline=None, max_examples=20)
@given(seed1=seeds(), seed2=seeds(), power=st.sampled_from([1, -1]))
def test_representation_is_a_homomorphism(group, seed1, seed2, power):
    """rho(a) rho(b) x = rho(a b) x on an axis, and rho(a^-1) undoes rho(a)."""
    a, b = _element(group, seed1), _element(group, seed2)
    x = torch.randn(3, group.dim, 2, generator=torch.Generator().manual_seed(seed1 ^ seed2), dtype=torch.float64)
    lhs = group.act_on_axis(a, group.act_on_axis(b, x, 1, power), 1, power)
    rhs = group.act_on_axis(group.compose(a, b), x, 1, power)
    assert_close(lhs, rhs, RTOL, "homomorphism")
    assert_close(group.act_on_axis(group.inverse(a), group.act_on_axis(a, x, 1, power), 1, power), x, RTOL, "inverse")


@pytest.mark.parametrize("group", [GeneralLinear(4), GeneralLinear(2, blocks=3), Orthogonal(3), PositiveScaling(4)], ids=repr)
@settings(deadline=None, max_examples=20)
@given(seed=seeds())
def test_contragredient_pairs_to_identity(group, seed):
    """<rho(g) x, rho^*(g) y> = <x, y>: the pairing that makes W2 g^{-1} g W1 = W2 W1."""
    g = _element(group, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = (torch.randn(group.dim, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    lhs = (group.act_on_axis(g, x, 0, 1) * group.act_on_axis(g, y, 0, -1)).sum(0)
    assert_close(lhs, (x * y).sum(0), RTOL)


def test_orthogonal_elements_are_orthogonal_to_round_off():
    """torch.linalg.matrix_exp alone left Orthogonal(3) at this seed orthogonal to 1.3e-12 only (the pairing above failed)."""
    for group in (Orthogonal(3), Orthogonal(2, blocks=3)):
        g = _element(group, 8108872)
        eye = torch.eye(group.n, dtype=g.dtype)
        assert float((g.mT @ g - eye).abs().max()) < 1e-15


@settings(deadline=None, max_examples=30)
@given(coords=lie_algebra_coordinates((4, 4), max_norm=default_max_norm(GeneralLinear(4))))
@example(coords=torch.zeros(4, 4, dtype=torch.float64))
def test_gl_exp_is_exact_and_well_conditioned(coords):
    """exp(X) has inverse exp(-X) exactly (not I - X) and condition number <= e^{2|X|_2} < 10."""
    g = GeneralLinear(4).exp(coords)
    assert_close(g @ GeneralLinear(4).exp(-coords), torch.eye(4, dtype=torch.float64), RTOL)
    assert torch.linalg.cond(g) <= math.exp(2 * float(coordinates_norm(coords))) * (1 + 1e-12) < 10


def test_orthogonal_exp_is_orthogonal_and_scaling_exp_positive():
    gen = torch.Generator().manual_seed(0)
    q = Orthogonal(5).exp(torch.randn(5, 5, generator=gen, dtype=torch.float64) * 3)
    assert_close(q.T @ q, torch.eye(5, dtype=torch.float64), RTOL)
    c = PositiveScaling(4).exp(torch.tensor([-30.0, 0.0, 1.0, 30.0], dtype=torch.float64))
    assert bool((c > 0).all())


def test_block_gl_acts_per_block():
    g = GeneralLinear(2, blocks=2).random(torch.Generator().manual_seed(3))
    x = torch.randn(4, 5, dtype=torch.float64)
    y = GeneralLinear(2, blocks=2).act_on_axis(g, x, 0)
    assert_close(y[:2], g[0] @ x[:2], RTOL)
    assert_close(y[2:], g[1] @ x[2:], RTOL)


@given(p=permutations(4))
@settings(deadline=None, max_examples=20)
def test_permutation_with_units_moves_whole_units(p):
    x = torch.arange(12.0).reshape(12, 1)
    y = Permutation(4, unit_size=3).act_on_axis(p, x, 0)
    assert torch.equal(y.reshape(4, 3), x.reshape(4, 3)[p])


def test_second_moment_rules():
    assert PositiveScaling(2).second_moment_power(-1) == -2
    assert GeneralLinear(2).second_moment_power(-1) is None
    assert Orthogonal(2).second_moment_power(1) is None
    assert Permutation(2).second_moment_power(-1) == 1


@pytest.mark.parametrize(
    "group, bad, error, match",
    [
        (GeneralLinear(2), torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64), ValueError, "not invertible"),
        (GeneralLinear(2), torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=torch.float64), ValueError, "non-finite"),
        (GeneralLinear(2), torch.eye(3, dtype=torch.float64), ValueError, "shape"),
        (GeneralLinear(2), [[1.0, 0.0], [0.0, 1.0]], TypeError, "torch.Tensor"),
        (GeneralLinear(2), torch.eye(2, dtype=torch.long), TypeError, "floating point"),
        (Orthogonal(2), torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64), ValueError, "not orthogonal"),
        (PositiveScaling(2), torch.tensor([1.0, -1.0], dtype=torch.float64), ValueError, "positive"),
        (PositiveScaling(2), torch.tensor([1.0, float("inf")], dtype=torch.float64), ValueError, "non-finite"),
        (SignFlip(2), torch.tensor([1.0, 0.5], dtype=torch.float64), ValueError, r"\+1 or -1"),
        (Permutation(3), torch.tensor([0, 0, 1]), ValueError, "not a permutation"),
        (Permutation(3), torch.tensor([0.0, 1.0, 2.0]), TypeError, "torch.long"),
        (Translation(2), torch.tensor([0.0, float("nan")], dtype=torch.float64), ValueError, "non-finite"),
    ],
)
def test_invalid_elements_are_rejected(group, bad, error, match):
    with pytest.raises(error, match=match):
        group.validate(bad)


def test_bad_group_construction_and_axis():
    with pytest.raises(ValueError, match="positive int"):
        GeneralLinear(0)
    with pytest.raises(ValueError, match="blocks"):
        GeneralLinear(2, blocks=0)
    with pytest.raises(ValueError, match="axis of length 4"):
        GeneralLinear(4).act_on_axis(torch.eye(4, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="power"):
        GeneralLinear(2).act_on_axis(torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), 0, power=2)
    with pytest.raises(TypeError, match="discrete"):
        Permutation(3).exp(torch.zeros(3))
    with pytest.raises(TypeError, match="affinely"):
        Translation(2).act_on_axis(torch.zeros(2), torch.zeros(2), 0)


@pytest.mark.parametrize("group", [GeneralLinear(4), GeneralLinear(3, blocks=2), Orthogonal(3, blocks=2)], ids=repr)
@pytest.mark.parametrize("power", [1, -1])
def test_block_matrices_are_what_act_on_axis_multiplies_each_block_by(group, power):
    """``block_matrices`` (the fast path's Gram-matrix terms use them): acting on any tensor's axis is the
    block-diagonal matrix with these blocks; diagonal groups have none."""
    gen = torch.Generator().manual_seed(0)
    g = group.random(generator=gen)
    blocks = group.block_matrices(g, power)
    assert blocks is not None and blocks.shape == (group.blocks or 1, group.block_size, group.block_size)
    x = torch.randn(group.dim, 5, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(group.act_on_axis(g, x, 0, power), torch.block_diag(*blocks) @ x, rtol=1e-12, atol=1e-12)
    assert PositiveScaling(3).block_matrices(torch.ones(3, dtype=torch.float64), power) is None
    assert PositiveScaling(3).block_size is None


def test_a_gl_contragredient_is_solved_once_per_element_and_again_after_an_in_place_change():
    """Outside autograd, g^-T is remembered per live element (a teleport moves parameters, gradients
    and moments by the same element): equal to the solve, not recomputed for the same unchanged
    element, recomputed after an in-place change, and forgotten when the element dies."""
    from teleopt.groups import GroupCache

    group = GeneralLinear(4, blocks=2)
    g = group.random(torch.Generator().manual_seed(0))
    x = torch.randn(8, 5, dtype=torch.float64)
    solved = torch.linalg.solve(g.mT, torch.eye(4, dtype=torch.float64).expand(2, 4, 4))
    with GroupCache().active() as cache:
        first = group.block_matrices(g, -1)
        torch.testing.assert_close(first, solved, rtol=1e-13, atol=1e-13)
        assert group.block_matrices(g, -1) is first and GeneralLinear(4, blocks=2).block_matrices(g, -1) is first
        expected = (solved @ x.reshape(2, 4, 5)).reshape(8, 5)
        torch.testing.assert_close(group.act_on_axis(g, x, 0, -1), expected, rtol=1e-13, atol=1e-13)
        g.mul_(2)
        torch.testing.assert_close(group.block_matrices(g, -1), solved / 2, rtol=1e-13, atol=1e-13)
        key = (id(g), GeneralLinear, 4)
        assert key in cache.keys("contragredient")
        del g
        assert key not in cache.keys("contragredient")
        leaf = group.random(torch.Generator().manual_seed(1)).requires_grad_(True)  # differentiable: solved each time
        assert group.block_matrices(leaf, -1).requires_grad
    g = group.random(torch.Generator().manual_seed(0))  # outside an active cache: solved each time, nothing kept
    assert group.block_matrices(g, -1) is not group.block_matrices(g, -1) and not cache.keys("contragredient")


def test_elements_validated_by_a_caller_are_not_validated_again():
    """Inside ``validated(elements)`` an action applying those elements skips the group's check (a GL element's
    is an SVD); outside, and for any other tensor inside, it still runs and rejects a singular element."""
    from teleopt import get_action
    from teleopt.groups import is_validated, validated

    action = get_action("gl_linear")
    params = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
    singular = torch.zeros(4, 4, dtype=torch.float64)
    good = torch.eye(4, dtype=torch.float64) * 2
    with pytest.raises(ValueError, match="not invertible"):
        action.act(singular, params)
    with validated([good]):
        assert is_validated(good) and is_validated(good.detach()) and not is_validated(singular)
        action.act(good, params)
        with pytest.raises(ValueError, match="not invertible"):
            action.act(singular, params)
    assert not is_validated(good)


CAPABILITY_GROUPS = [
    PositiveScaling(5),
    SignFlip(5),
    Permutation(5),
    GeneralLinear(5),
    GeneralLinear(3, blocks=2),
    Orthogonal(5),
]


@pytest.mark.parametrize("group", CAPABILITY_GROUPS, ids=repr)
def test_group_capabilities_say_what_the_representation_does(group):  # Translation acts affinely: no representation
    """The flags teleport decides on hold numerically: ``diagonal`` (each entry times its own factor),
    ``self_dual`` (power -1 acts as power +1), ``full_matrix_algebra`` (exp of any
    matrix is ``matrix_exp``), and ``exp_stacked`` equals each group's ``exp`` (to float64 round-off)."""
    gen = torch.Generator().manual_seed(0)
    g = group.random(gen)
    x = torch.randn(group.dim, 4, generator=gen, dtype=torch.float64)
    factors = group.act_on_axis(g, torch.ones_like(x), 0, 1)
    assert group.diagonal == torch.allclose(group.act_on_axis(g, x, 0, 1), factors * x, rtol=1e-15, atol=0)
    same = torch.allclose(group.act_on_axis(g, x, 0, -1), group.act_on_axis(g, x, 0, 1), rtol=1e-12, atol=1e-12)
    assert group.self_dual == same
    if group.coord_shape is not None:
        xi = torch.randn(group.coord_shape, generator=gen, dtype=torch.float64) * 0.3
        if group.full_matrix_algebra:
            assert_close(group.exp(xi), torch.linalg.matrix_exp(xi), rtol=1e-13)
        with torch.enable_grad():
            xs = [xi.clone().requires_grad_(True), (0.5 * xi).requires_grad_(True)]
            stacked = type(group).exp_stacked([group, group], xs)
        for e, c in zip(stacked, xs):
            assert_close(e.detach(), group.exp(c.detach()), rtol=1e-13)
        assert (group.exp_stack_key() is not None) == isinstance(group, GeneralLinear)
