"""The orthogonal matrices that fix the all-ones vector: the rotations LayerNorm commutes with.

LayerNorm subtracts the mean, x -> C x with C = I - 1 1^T / n, then divides by the
norm of C x.  An orthogonal Q with Q 1 = 1 (hence Q^T 1 = 1) commutes with C and keeps
||C x||, so LayerNorm(Q x) = diag(g) Q z + b with z the normalised centred input
(Ashkboos et al. 2024a, SliceGPT, Sec. 3: the stream must be centred before a full
rotation; teleopt keeps it uncentred and restricts the rotation instead).  The group is
{H diag(1, R) H^T : R in O(n - 1)} for an orthonormal H whose first column is 1/sqrt(n);
its Lie algebra is the skew matrices A with A 1 = 0, i.e. C A C for A skew.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from teleopt.groups.base import _check_finite
from teleopt.groups.matrix import Orthogonal

__all__ = ["OrthogonalFixingOnes"]


def _centring(n: int, like: Tensor) -> Tensor:
    return torch.eye(n, dtype=like.dtype, device=like.device) - 1.0 / n


class OrthogonalFixingOnes(Orthogonal):
    """O(n) elements Q with Q 1 = 1 (no blocks): ``exp(A) = matrix_exp(C skew(A) C)``, C the centring matrix.

    Coordinates, identity, composition, inverse (transpose) and representations are
    :class:`~teleopt.groups.Orthogonal`'s; ``exp`` and the algebra action project the
    coordinates onto the subalgebra {A skew, A 1 = 0}, so every element fixes the
    all-ones vector, and ``validate`` checks that it does.
    """

    def __init__(self, n: int) -> None:
        super().__init__(n)
        if n < 2:
            raise ValueError(f"n must be at least 2 for rotations fixing the all-ones vector, got {n}")

    def exp_stack_key(self) -> Hashable | None:
        return None

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        c = _centring(self.n, coords)
        return super().exp(c @ coords @ c)

    def _algebra_matrix(self, M: Tensor, power: float) -> Tensor:
        c = _centring(self.n, M)
        return c @ ((M - M.mT) / 2) @ c

    def validate(self, g: Tensor) -> None:
        super().validate(g)
        err = float((g.sum(-1) - 1).abs().max())
        limit = self.n * torch.finfo(g.dtype).eps ** 0.5
        if err > limit:
            raise ValueError(f"element does not fix the all-ones vector: max |Q 1 - 1| = {err:.3e} > {limit:.1e}")
        _check_finite(g, "element")
