"""A lean balance teleport moves each GL lane's parameters, gradients and moments with one batched product.

Every-step balance costs what its kernels cost: a lane's parameter parts, gradient parts and transported moments
are stacked once and multiplied by their block matrices in one batched product (not one product per kind), and
the moved values stay those of the engine (``tests/test_balance_companion.py`` compares them).  Float64.
"""

from __future__ import annotations

import pytest
import torch

from teleopt.groups.expm import expm_pair_horner


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 0.05, 0.5, 3.0])
def test_the_horner_exponential_pair_is_the_matrix_exponential_and_its_inverse(scale: float) -> None:
    # the same Taylor degree and scaling as expm_pair (below float64's unit round-off relative to exp(X)), so
    # both agree with matrix_exp to a few ulps; 3.0 takes the squaring branch
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 7, generator=gen, dtype=torch.float64)
    x = scale * x / x.norm(dim=(-2, -1), keepdim=True)
    plus, minus = expm_pair_horner(x, float(x.abs().sum(-2).amax()))
    ref = torch.linalg.matrix_exp(x)
    assert float((plus - ref).abs().max() / ref.abs().max()) <= 2e-14
    assert float((minus @ plus - torch.eye(7, dtype=torch.float64)).abs().max()) <= 5e-14
    with pytest.raises(ValueError, match="batch"):
        expm_pair_horner(x[0], 1.0)
