"""The reductions behind the fast path's statistics (``teleopt.sharding``) on plain tensors: they are
reordered for speed and must still be the sums they stand for."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from teleopt.sharding import square_sum, sum_over


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    data=st.data(),
)
def test_sum_over_is_the_sum_over_those_dimensions(shape, data):
    """Any set of dimensions (negative ones too), any shape: the same values and shape as ``Tensor.sum``, in
    float64 to round-off (the runs are summed in another order)."""
    ndim = len(shape)
    dims = data.draw(st.lists(st.integers(-ndim, ndim - 1), max_size=ndim, unique_by=lambda d: d % ndim))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(len(dims)), dtype=torch.float64)
    expected = t.sum(dim=dims) if dims else t
    got = sum_over(t, dims)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


def test_sum_over_a_conv_weight_keeps_float32_accuracy():
    """A 512 x 512 x 3 x 3 float32 square summed over all but dimension 1 (a convolution's input channels,
    the fast path's statistic): within float32 round-off of a float64 sum (measured 1.6e-6 relative)."""
    g = torch.randn(512, 512, 3, 3, generator=torch.Generator().manual_seed(0))
    sq = g.square()
    reference = sq.double().sum(dim=(0, 2, 3))
    got = sum_over(sq, [0, 2, 3])
    assert got.dtype == torch.float32
    assert float(((got.double() - reference) / reference).abs().max()) < 1e-5


def test_square_sum_accumulates_each_tensor_in_its_own_precision():
    """float64 tensors exactly as a float64 sum of squares would (to round-off), float32 to its round-off,
    bfloat16 in float32 (not in bfloat16, whose 8 bits would lose the small entries)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(300, 200, generator=gen, dtype=torch.float64)
    b = torch.randn(1000, generator=gen)
    c = torch.cat([torch.full((1,), 100.0), torch.full((4096,), 0.01)]).to(torch.bfloat16)
    exact = float(a.square().sum()) + float(b.double().square().sum()) + float(c.double().square().sum())
    got = square_sum([a, b, c])
    assert abs(got - exact) / exact < 1e-6
    assert abs(square_sum([a]) - float(a.square().sum())) / float(a.square().sum()) < 1e-13
