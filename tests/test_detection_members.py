"""Member layouts that detection needs (outer/inner blocks, grouped channels, parts of one tensor).

Each layout is checked the way users check any action, with ``teleopt.testing``:
invariance of a small model that uses the layout, the group axioms and gradient
transport against autograd, all in float64 (exact actions: relative error
<= 1e-10, the kit's default; they reach ~1e-15).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings

from teleopt import AxisAction, Member
from teleopt.actions.attention import multi_head_attention
from teleopt.actions.base import ExampleProblem
from teleopt.testing import (
    assert_close,
    assert_gradient_transport,
    assert_group_axioms,
    assert_invariant,
    check_action,
    group_elements,
    seeds,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _flatten_problem(channels_last: bool, act):
    """x (k, n, S) -> act(W1 x + b1) per position -> flatten (channel-major or position-major) -> W2."""

    def make(gen, dtype, k=5, n=3, C=4, S=3, m=2):
        W1, b1, W2 = _randn(gen, C, n), _randn(gen, C), _randn(gen, m, C * S)
        X = _randn(gen, k, n, S)

        def fn(p, x):
            w1, bias, w2 = p
            h = act(torch.einsum("cn,kns->kcs", w1, x) + bias[:, None])  # (k, C, S)
            if channels_last:
                h = h.transpose(1, 2)  # (k, S, C): flatten index s * C + c
            return h.reshape(h.shape[0], -1) @ w2.T

        return ExampleProblem((W1, b1, W2), X, fn)

    return make


LAYOUTS = [
    ("diagonal", torch.relu, False),
    ("diagonal", torch.relu, True),
    ("general", lambda z: z, False),
    ("general", lambda z: z, True),
    ("permutation", torch.tanh, False),
    ("permutation", torch.tanh, True),
]


@pytest.mark.parametrize("group,act,channels_last", LAYOUTS)
def test_flattened_reader_with_outer_or_inner_blocks(group, act, channels_last):
    S = 3
    reader = Member("W2", 1, -1, outer=S) if channels_last else Member("W2", 1, -1, inner=S)
    action = AxisAction("flatten", group, (Member("W1", 0), Member("b1", 0), reader)).with_example(_flatten_problem(channels_last, act))
    worst = check_action(action, seed=3, trials=4)
    assert worst["invariance"] <= 1e-10


def test_outer_inner_layout_is_the_row_major_block_structure():
    # the part viewed as (outer, n, inner): entry o * n * inner + i * inner + j moves with i
    m = Member("t", 0, outer=2, inner=3)
    t = torch.arange(2 * 4 * 3, dtype=torch.float64)
    assert m.axis_length(t) == 4
    perm = torch.tensor([2, 0, 3, 1])
    out = m.transform(t, lambda part, axis: part.index_select(axis, perm))
    expected = t.reshape(2, 4, 3)[:, perm, :].reshape(-1)
    assert torch.equal(out, expected)


def _grouped_problem(transposed: bool):
    """Positive scaling of the channels a grouped (transposed) convolution reads or writes."""

    def make(gen, dtype, k=4, n=3, C=6, G=3, O=6, L=5):
        W1, b1 = _randn(gen, C, n), _randn(gen, C)
        W2 = _randn(gen, C, O // G, 2) if transposed else _randn(gen, O, C // G, 2)
        X = _randn(gen, k, n, L)

        def fn(p, x):
            w1, bias, w2 = p
            h = torch.relu(torch.einsum("cn,knl->kcl", w1, x) + bias[:, None])
            conv = F.conv_transpose1d if transposed else F.conv1d
            return conv(h, w2, groups=G)

        return ExampleProblem((W1, b1, W2), X, fn)

    return make


def test_grouped_convolution_input_channels():
    action = AxisAction(
        "grouped_reader",
        "diagonal",
        (Member("W1", 0), Member("b1", 0), Member("W2", 1, -1, groups=3)),
    ).with_example(_grouped_problem(transposed=False))
    assert check_action(action, seed=5, trials=4)["invariance"] <= 1e-10


def test_grouped_layout_matches_the_channel_index_of_each_group():
    G, O, per = 3, 6, 2  # weight (O, C/G): channel g * per + j of row o lives in group g = o // (O // G)
    w = torch.randn(O, per, 5, dtype=torch.float64)
    c = torch.rand(G * per, dtype=torch.float64) + 0.5
    out = Member("w", 1, -1, groups=G).transform(w, lambda part, axis: part / c.reshape([-1] + [1] * (part.ndim - axis - 1)))
    expected = w.clone()
    for o in range(O):
        g = o // (O // G)
        expected[o] = w[o] / c[g * per : (g + 1) * per, None]
    assert torch.allclose(out, expected, rtol=0, atol=1e-15)


def test_grouped_transposed_convolution_output_channels():
    # transposed conv weight (C_in, O/G, k): output channel g * O/G + j is column j of the rows of group g
    def make(gen, dtype, k=4, C=6, G=3, O=6, L=5, m=2):
        W2 = _randn(gen, C, O // G, 2)
        b2 = _randn(gen, O)
        W3 = _randn(gen, m, O, 1)
        X = _randn(gen, k, C, L)

        def fn(p, x):
            w2, bias, w3 = p
            h = torch.relu(F.conv_transpose1d(x, w2, bias, groups=G))
            return F.conv1d(h, w3)

        return ExampleProblem((W2, b2, W3), X, fn)

    action = AxisAction("grouped_writer", "diagonal", (Member("W2", 1, 1, groups=3), Member("b2", 0), Member("W3", 1, -1))).with_example(
        make
    )
    assert check_action(action, seed=6, trials=4)["invariance"] <= 1e-10


def _fused_qkv_problem(num_heads: int, d_model: int = 6, d_head: int = 3):
    """Self-attention with one fused (3 H d, d_model) projection, as timm's Attention."""
    hd = num_heads * d_head

    def make(gen, dtype):
        s = 1 / math.sqrt(d_model)
        Wqkv, bqkv, Wo = _randn(gen, 3 * hd, d_model) * s, _randn(gen, 3 * hd), _randn(gen, d_model, hd) * s
        x = _randn(gen, 2, 5, d_model)

        def fn(p, x):
            w, b, wo = p
            parts = (w[:hd], b[:hd], w[hd : 2 * hd], b[hd : 2 * hd], w[2 * hd :], b[2 * hd :], wo)
            return multi_head_attention(parts, x, num_heads)

        return ExampleProblem((Wqkv, bqkv, Wo), x, fn)

    return make


@pytest.mark.parametrize("heads", [1, 2])
def test_parts_of_one_tensor_compose_fused_qkv(heads):
    d = 3
    hd = heads * d
    members = (
        Member("qkv.weight[q]", 0, 1, start=0, stop=hd, tensor="qkv.weight"),
        Member("qkv.bias[q]", 0, 1, start=0, stop=hd, tensor="qkv.bias"),
        Member("qkv.weight[k]", 0, -1, start=hd, stop=2 * hd, tensor="qkv.weight"),
        Member("qkv.bias[k]", 0, -1, start=hd, stop=2 * hd, tensor="qkv.bias"),
    )
    action = AxisAction("qk", "general", members, blocks=heads if heads > 1 else None).with_example(_fused_qkv_problem(heads))
    problem = action.example(torch.Generator().manual_seed(0))
    # the site binds each part to the same tensor: pass it once per member
    W, b, Wo = problem.params
    params = (W, b, W, b)

    def fn(p, x):
        return problem.fn((p[0], p[1], Wo), x)

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g1, g2 = action.random_element(params, gen, 0.5), action.random_element(params, gen, 0.5)
        moved = action.act(g1, params)
        assert moved[0] is moved[2] and moved[1] is moved[3], "parts of one tensor must return the composed tensor"
        assert torch.equal(moved[0][2 * hd :], W[2 * hd :])  # the v rows are not part of the site
        assert_invariant(action, g1, params, fn, problem.data)
        assert_group_axioms(action, params, g1, g2)
        # gradients of the one tensor, given once per part, come back composed (Zhao 2026, eq. 4.19)
        here = _grads(problem, W, b, Wo)
        there = _grads(problem, moved[0], moved[1], Wo)
        transported = action.transport_gradient(g1, (here[0], here[1], here[0], here[1]))
        assert_close(
            torch.cat([transported[0].flatten(), transported[1].flatten()]), torch.cat([there[0].flatten(), there[1].flatten()]), 1e-10
        )


def _grads(problem, W, b, Wo):
    W, b = W.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    return torch.autograd.grad(problem.loss((W, b, Wo), problem.data), (W, b))


_HEADS, _D = 2, 3
_VO = AxisAction(
    "vo",
    "general",
    (
        Member("qkv.weight", 0, 1, start=2 * _HEADS * _D, stop=3 * _HEADS * _D),
        Member("qkv.bias", 0, 1, start=2 * _HEADS * _D, stop=3 * _HEADS * _D),
        Member("proj.weight", 1, -1),
    ),
    blocks=_HEADS,
)
_TEMPLATE = _fused_qkv_problem(_HEADS)(torch.Generator().manual_seed(0), torch.float64)


@settings(deadline=None, max_examples=10)
@given(seed=seeds(), g=group_elements(_VO, _TEMPLATE.params))
@example(seed=0, g=_VO.identity(_TEMPLATE.params))
def test_value_output_gl_on_a_slice_of_fused_qkv(seed, g):
    problem = _fused_qkv_problem(_HEADS)(torch.Generator().manual_seed(seed), torch.float64)
    assert_invariant(_VO, g, problem.params, problem.fn, problem.data)
    assert_gradient_transport(_VO, g, problem.params, problem.loss, problem.data)


def test_second_moments_follow_layouts_for_scaling():
    action = AxisAction("s", "diagonal", (Member("w", 1, -1, groups=2), Member("v", 0, 1, inner=2)))
    w, v = torch.rand(4, 3, dtype=torch.float64), torch.rand(12, dtype=torch.float64)
    c = torch.rand(6, dtype=torch.float64) + 0.5
    sq_w, sq_v = action.transport_second_moment(c, (w, v))
    gw, gv = action.transport_gradient(c, (w.sqrt(), v.sqrt()))
    assert torch.allclose(sq_w, gw**2) and torch.allclose(sq_v, gv**2)


def test_config_round_trip_keeps_layouts():
    members = (
        Member("a", 0, 1, start=0, stop=4, tensor="w"),
        Member("b", 0, -1, start=4, stop=8, tensor="w"),
        Member("c", 1, -1, outer=2, inner=3),
    )
    action = AxisAction("x", "general", members, blocks=2)
    again = AxisAction.from_config(action.config())
    assert again.members == action.members and again.blocks == 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(outer=0), "outer must be a positive int"),
        (dict(inner=-1), "inner must be a positive int"),
        (dict(groups=2, start=0, stop=2), "groups > 1"),
        (dict(groups=2, axis=0), "groups > 1"),
        (dict(tensor=""), "tensor must be a non-empty string"),
    ],
)
def test_bad_member_layouts_raise(kwargs, match):
    args = dict(name="m", axis=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Member(**args)


def test_grouped_members_need_an_elementwise_group():
    with pytest.raises(ValueError, match="elementwise group"):
        AxisAction("x", "general", (Member("w", 1, -1, groups=2),))


def test_overlapping_parts_of_one_tensor_raise():
    with pytest.raises(ValueError, match="overlap"):
        AxisAction("x", "general", (Member("a", 0, start=0, stop=4, tensor="w"), Member("b", 0, -1, start=2, stop=6, tensor="w")))
    with pytest.raises(ValueError, match="overlap"):
        AxisAction("x", "diagonal", (Member("a", 0, tensor="w"), Member("b", 0, -1, start=2, stop=6, tensor="w")))


def test_indivisible_layouts_raise_on_use():
    action = AxisAction("x", "diagonal", (Member("w", 0, inner=4),))
    with pytest.raises(ValueError, match="not divisible"):
        action.random_element((torch.ones(6),))
    grouped = AxisAction("y", "diagonal", (Member("w", 1, groups=4),))
    with pytest.raises(ValueError, match="groups=4"):
        grouped.random_element((torch.ones(6, 2),))
