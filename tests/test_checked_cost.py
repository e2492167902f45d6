"""What a checked teleport's round-off bound costs: decompositions the search already made are not made again.

``GeneralLinear.roundoff_amplification`` (the bound of ``within_roundoff``) needs ||Y^T X||_* and, for a symmetric
boundary point, its eigendecomposition: the point's own (remembered by ``boundary_point`` in the active
``GroupCache``) and a Cholesky factor of the writers' Gram matrix replace two ``eigh`` per site, with the same
values (float64, agreement to 1e-12 relative: both are backward-stable decompositions of 4 x 4 blocks).
"""

from __future__ import annotations

from unittest import mock

import torch

from teleopt.groups import GroupCache
from teleopt.groups.matrix import GeneralLinear


def _stats(group: GeneralLinear, gen: torch.Generator, rank: int = 12) -> dict[float, torch.Tensor]:
    X = torch.randn(12, rank, generator=gen, dtype=torch.float64)
    Y = torch.randn(12, 30, generator=gen, dtype=torch.float64)
    return {1.0: group.norm_statistic(X, 0), -1.0: group.norm_statistic(Y, 0)}


def _direction(gen: torch.Generator) -> torch.Tensor:
    d = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    return d + d.mT  # symmetric: the gradient norm's 2 (B - A)


def test_the_bound_of_a_boundary_point_makes_no_eigendecomposition_of_its_own():
    gen = torch.Generator().manual_seed(0)
    group = GeneralLinear(4, blocks=3)
    stats, one = _stats(group, gen), torch.ones(3, dtype=torch.float64)
    with GroupCache().active():
        point = group.boundary_point(_direction(gen), 0.5)
        assert point is not None
        with mock.patch("torch.linalg.eigh", wraps=torch.linalg.eigh) as eigh:
            cached = group.roundoff_amplification(stats, point)(one)
    assert eigh.call_count == 0
    fresh = group.roundoff_amplification(stats, point.clone())(one)  # no cache: its own eigh of the point and of A
    torch.testing.assert_close(cached, fresh, rtol=1e-12, atol=0)


def test_a_semidefinite_gram_matrix_gives_the_same_bound_as_a_definite_one_nearby():
    gen = torch.Generator().manual_seed(1)
    group = GeneralLinear(4, blocks=3)
    stats = _stats(group, gen, rank=2)  # rank 2 < 4: no Cholesky factor, the eigendecomposition's root instead
    xi = _direction(gen)
    one = torch.ones(3, dtype=torch.float64)
    singular = group.roundoff_amplification(stats, xi)(one)
    nearby = {1.0: stats[1.0] + 1e-13 * torch.eye(4, dtype=torch.float64), -1.0: stats[-1.0]}
    torch.testing.assert_close(singular, group.roundoff_amplification(nearby, xi)(one), rtol=1e-6, atol=0)
