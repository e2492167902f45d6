"""Diagonal groups: positive scaling R_{>0}^n and sign flips Z_2^n (Zhao 2026, Ex. 1.2.4, 1.2.5, 1.2.7)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from teleopt.groups.base import BALANCE_RCOND, Group, GroupKind, _check_finite, box_boundary_point

__all__ = ["PositiveScaling", "SignFlip"]


class PositiveScaling(Group):
    """The positive scaling group R_{>0}^n: Zhao 2026, Ex. 1.2.4 (homogeneous activations), 1.2.7.

    Elements are vectors c of positive scales; coordinates are log-scales and
    ``exp`` is the elementwise exponential.
    """

    kind: GroupKind = "diagonal"
    diagonal: ClassVar[bool] = True
    boundary_search_when_convex: ClassVar[bool] = True
    plain_exp: ClassVar[bool] = True
    continuous = True

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.ones(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a * b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return 1.0 / g

    def exp(self, coords: Tensor) -> Tensor:
        self._check_coords(coords)
        return torch.exp(coords)

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        coords = torch.randn(self.element_shape, generator=generator, dtype=torch.float64) * scale
        return self.exp(coords).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not g.is_floating_point():
            raise TypeError(f"scaling elements must be floating point, got {g.dtype}")
        _check_finite(g, "scaling element")
        if bool((g <= 0).any()):
            raise ValueError(f"scaling element must be positive, smallest entry is {float(g.min()):.3e}")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        factor = g.to(device=x.device, dtype=x.dtype) if power == 1 else g.to(device=x.device, dtype=x.dtype) ** power
        shape = [1] * x.ndim
        shape[axis] = self.dim
        return x * factor.reshape(shape)

    def act_on_axis_(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> bool:
        self._check_axis(x, axis)
        factor = (
            g.to(device=x.device, dtype=x.dtype) if power == 1 else g.to(device=x.device, dtype=x.dtype) ** power
        )  # as act_on_axis: bitwise the same
        shape = [1] * x.ndim
        shape[axis] = self.dim
        x.mul_(factor.reshape(shape))
        return True

    def second_moment_power(self, power: float) -> float | None:
        return 2 * power

    has_algebra_action: ClassVar[bool] = True

    def project_coordinates(self, xi: Tensor, radius: float) -> None:
        """Every log-scale |xi_i| <= radius: each scale lies in [e^-radius, e^radius]."""
        xi.clamp_(-radius, radius)

    def boundary_point(self, direction: Tensor, radius: float) -> Tensor | None:
        """r sign(d), the corner of the box trust region (:func:`box_boundary_point`)."""
        return box_boundary_point(direction, radius)

    def exact_coordinates(self, xi: Tensor, dtype: torch.dtype) -> Tensor:
        """For 16-bit floats, each scale rounded toward 1 to a power of two: multiplying a binary float by
        2^k only changes its exponent, so the element and its inverse act without round-off (barring
        overflow, which the teleport's check catches).  Other dtypes keep ``xi``: their round-off is small."""
        if dtype not in (torch.bfloat16, torch.float16):
            return xi
        return torch.trunc(xi / math.log(2)) * math.log(2)

    def algebra_action(self, M: Tensor, x: Tensor, axis: int, power: float) -> Tensor:
        shape = [x.shape[0]] + [1] * (x.ndim - 1)
        shape[axis] = -1
        return x * (power * M.to(device=x.device, dtype=x.dtype)).reshape(shape)

    def square_factor(self, g: Tensor, power: float) -> Tensor | None:
        return g ** (2.0 * power)

    has_balance: ClassVar[bool] = True

    def norm_statistic(self, x: Tensor, axis: int) -> Tensor:
        """Sum of squares of each unit's slice: ||c^p x||^2 = sum_i c_i^(2p) s_i."""
        self._check_axis(x, axis)
        return x.detach().to(torch.float64).movedim(axis, 0).reshape(self.dim, -1).square().sum(1)

    def balance(self, stats: Mapping[float, Tensor], radius: float | None, rcond: float = BALANCE_RCOND) -> Tensor:
        """Log-scales x minimising sum_p sum_i stats[p]_i e^(2 p x_i), unit by unit (each a convex 1-D problem).

        With one writer power p > 0 (mass a) and one reader power -q < 0 (mass b), the closed form
        x = log(q b / (p a)) / (2 (p + q)); for p = q = 1 the scale c = e^x = (b / a)^(1/4) of ENorm
        (Stock et al. 2019), |w_in,i| = |w_out,i| afterwards.  Other mixtures of powers take safeguarded
        Newton steps.  Units whose writer or reader mass is at most ``rcond`` times the largest over the
        units (one side empty, a dead unit) have no minimiser and stay at 0.
        """
        terms = {p: m for p, m in stats.items() if p != 0}
        if not terms:
            return torch.zeros(self.dim, dtype=torch.float64, device=next(iter(stats.values())).device)
        pos = [p for p in terms if p > 0]
        neg = [p for p in terms if p < 0]
        ref = next(iter(terms.values()))
        a = sum((terms[p] for p in pos), torch.zeros_like(ref))
        b = sum((terms[p] for p in neg), torch.zeros_like(ref))
        ok = (a > rcond * a.max()) & (b > rcond * b.max())
        if not bool(ok.any()):
            return torch.zeros_like(ref)
        if len(pos) == 1 and len(neg) == 1:
            p, q = pos[0], -neg[0]
            one = torch.ones_like(ref)
            x = (torch.log(q * torch.where(ok, b, one)) - torch.log(p * torch.where(ok, a, one))) / (2 * (p + q))
        else:
            x = _newton_balance(terms, radius)
        x = torch.where(ok, x, torch.zeros_like(x))
        return x if radius is None else x.clamp(-radius, radius)

    def balance_many(
        self, stats: Sequence[Mapping[float, Tensor]], radius: float | None, rcond: float = BALANCE_RCOND
    ) -> list[Tensor | None]:
        """:meth:`balance` of several sites at once where each has one writer and one reader power, the same for
        all: the masses stacked (sites, units), the same elementwise closed form, each site's ``rcond`` relative
        to its own largest mass (so each row equals its own :meth:`balance` bit for bit)."""
        keys = {tuple(sorted(s)) for s in stats}
        key = next(iter(keys)) if len(keys) == 1 else ()
        if len(stats) < 2 or len(key) != 2 or not key[0] < 0 < key[1] or len({s[key[0]].shape for s in stats}) != 1:
            return super().balance_many(stats, radius, rcond)
        q, p = -key[0], key[1]
        a, b = (torch.stack([s[k] for s in stats]) for k in (p, -q))
        ok = (a > rcond * a.amax(-1, keepdim=True)) & (b > rcond * b.amax(-1, keepdim=True))
        one = torch.ones_like(a)
        x = (torch.log(q * torch.where(ok, b, one)) - torch.log(p * torch.where(ok, a, one))) / (2 * (p + q))
        x = torch.where(ok, x, torch.zeros_like(x))
        return list((x if radius is None else x.clamp(-radius, radius)).unbind(0))


class SignFlip(Group):
    """The sign-flip group Z_2^n for odd activations (Zhao 2026, Ex. 1.2.5).

    Elements are vectors of +-1 in the working dtype.
    """

    kind: GroupKind = "sign"
    diagonal: ClassVar[bool] = True
    self_dual: ClassVar[bool] = True
    continuous = False

    def identity(self, dtype=torch.float64, device=None) -> Tensor:
        return torch.ones(self.dim, dtype=dtype, device=device)

    @staticmethod
    def compose(a: Tensor, b: Tensor) -> Tensor:
        return a * b

    @staticmethod
    def inverse(g: Tensor) -> Tensor:
        return g.clone()

    def random(self, generator=None, scale=1.0, dtype=torch.float64, device=None) -> Tensor:
        bits = torch.randint(0, 2, (self.dim,), generator=generator)
        return (1 - 2 * bits).to(dtype=dtype, device=device)

    def validate(self, g: Tensor) -> None:
        self._check_shape(g)
        if not bool(((g == 1) | (g == -1)).all()):
            raise ValueError("sign-flip element must have entries +1 or -1 only")

    def act_on_axis(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> Tensor:
        self._check_axis(x, axis)
        if float(power) != int(power):
            raise ValueError(f"sign flips need an integer power, got {power}")
        if int(power) % 2 == 0:
            return x
        shape = [1] * x.ndim
        shape[axis] = self.dim
        return x * g.to(device=x.device, dtype=x.dtype).reshape(shape)

    def act_on_axis_(self, g: Tensor, x: Tensor, axis: int, power: float = 1) -> bool:
        self._check_axis(x, axis)
        if float(power) != int(power):
            raise ValueError(f"sign flips need an integer power, got {power}")
        if int(power) % 2:
            shape = [1] * x.ndim
            shape[axis] = self.dim
            x.mul_(g.to(device=x.device, dtype=x.dtype).reshape(shape))
        return True

    def second_moment_power(self, power: float) -> float | None:
        return 2 * power


def _newton_balance(terms: Mapping[float, Tensor], radius: float | None, iterations: int = 50) -> Tensor:
    """argmin_x sum_p m_p e^(2 p x) per unit by Newton steps of at most 1 in x, kept inside the trust region
    (or |x| <= 40 when unbounded; the minimiser of a one-signed sum is at that edge)."""
    bound = 40.0 if radius is None else radius
    ref = next(iter(terms.values()))
    x = torch.zeros_like(ref)
    for _ in range(iterations):
        g = torch.zeros_like(x)
        h = torch.zeros_like(x)
        for p, m in terms.items():
            e = m * torch.exp(2 * p * x)
            g = g + 2 * p * e
            h = h + 4 * p * p * e
        step = torch.where(h > 0, -g / h.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(x)).clamp(-1.0, 1.0)
        x = (x + step).clamp(-bound, bound)
        if float(step.abs().max()) < 1e-12:
            break
    if radius is None:  # a minimiser at the artificial edge is at infinity: leave that unit alone
        x = torch.where(x.abs() >= bound, torch.zeros_like(x), x)
    return x
