"""The symmetric group S_n on units (Zhao 2026, Ex. 1.2.9, 1.2.10) and the additive group R^n (Ex. 1.2.8)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from teleopt.groups.base import Group, GroupKind, _check_finite, _check_size, box_boundary_point

__all__ = ["Permutation", "Translation"]


class Permutation(Group):
    """The symmetric group S_n acting on n blocks of an axis (Zhao 2026, Ex. 1.2.9, 1.2.10, 1.2.12).

    An element is an index tensor ``p`` (a permutation of ``range(n)``) acting by
    ``x -> x[p]`` along the axis, i.e. (p . x)_i = x_{p_i}; in the papers'
    notation p = pi^{-1}.  With ``unit_size=d`` each of the n units is a chunk of d
    consecutive entries (attention heads): the axis has length n * d.
    """

    kind: GroupKind = "permutation"
    self_dual: ClassVar[bool] = True
    continuous = False

    def __init__(self, n: int, unit_size: int = 1) -> None:
        super().__init__(n)
        _check_size(unit_size, "unit_size")
        self.unit_size = unit_size

    @property
    def dim(self) -> int:
        return self.n * self.unit_size

    def _config(self) -> tuple:
        return (self.n,) if self.unit_size == 1 else (self.n, self.unit_size)

    @property
    def element_shape(self) -> tuple[int, ...]:
        return (self.n,)

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.arange(self.n, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return b[a]

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return torch.argsort(g)

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        return torch.randperm(self.n, generator=generator).to(device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if g.dtype != torch.long:
            raise TypeError(f"permutation elements must be torch.long index tensors, got {g.dtype}")
        if not torch.equal(torch.sort(g.cpu()).values, torch.arange(self.n)):
            raise ValueError(f"element is not a permutation of range({self.n}): {g.tolist()}")

    def _expanded(self, g: Tensor) -> Tensor:
        d = self.unit_size
        if d == 1:
            return g
        return (g[:, None] * d + torch.arange(d, device=g.device)).reshape(-1)

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        index = self._expanded(g).to(x.device)
        axis %= x.ndim
        if axis == 0 or x.ndim == 1:
            return x.index_select(axis, index)
        # columns of a row-major tensor: index_select gathers them on one thread, gather uses all
        shape = [1] * x.ndim
        shape[axis] = -1
        return torch.gather(x, axis, index.view(shape).expand(x.shape))

    def second_moment_power(self, power: float) -> float | None:
        return 1


class Translation(Group):
    """The additive group (R^n, +) of softmax translations (Zhao 2026, Ex. 1.2.8).

    Elements are vectors; composition is addition and ``exp`` is the identity map.
    It acts affinely, so it has no linear representation on an axis: actions that
    use it (see ``teleopt.actions.softmax``) add the element themselves.
    """

    kind: GroupKind = "translation"
    continuous = True

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.zeros(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a + b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return -g

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return coords

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        return (torch.randn(self.element_shape, generator=generator, dtype=torch.float64) * scale).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"translation elements must be floating point, got {g.dtype}")
        _check_finite(g, "translation element")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        raise TypeError("the translation group acts affinely; it has no linear representation on an axis")

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Every |xi_i| <= radius."""
        xi.clamp_(-radius, radius)

    def boundary_point(self, direction: Tensor, radius: float) -> Tensor | None:
        """r sign(d), the corner of the box trust region (:func:`box_boundary_point`)."""
        return box_boundary_point(direction, radius)
