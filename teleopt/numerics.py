"""Numerical tolerances and norm-relative comparisons, shared by every layer.

This module is the bottom of teleopt's layering: it imports nothing from teleopt.
All comparisons are norm-relative: ``|actual - expected| <= rtol * |expected|`` in
the Frobenius norm over the whole tensor, so outputs near zero do not fail an exact
symmetry (element-wise rtol does).

Default tolerances (``default_rtol``): exact actions in float64 reach ~1e-15
relative error; with group elements of condition number < 10 and the small
problems used here the error stays below ~1e-13, so ``1e-10`` leaves three orders
of margin while still catching any real violation (a wrong exponent or a
first-order inverse I - T gives errors of order 1e-3 or more).  float32 uses 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["default_rtol", "relative_error", "assert_close", "all_finite_sums", "read_together"]


def default_rtol(dtype: torch.dtype) -> float:
    """Norm-relative tolerance for exact symmetries: 1e-10 in float64, 1e-5 in float32, 1e-2 below."""
    if dtype == torch.float64:
        return 1e-10
    if dtype == torch.float32:
        return 1e-5
    return 1e-2


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """|actual - expected|_F / |expected|_F (absolute error if expected is 0)."""
    diff = (actual.detach() - expected.detach()).to(torch.float64)
    scale = expected.detach().to(torch.float64).norm()
    return float(diff.norm() / scale) if float(scale) > 0 else float(diff.norm())


def assert_close(actual: Tensor | None, expected: Tensor | None, rtol: float, what: str = "tensor") -> float:
    """Assert norm-relative closeness; returns the relative error."""
    if actual is None or expected is None:
        if actual is None and expected is None:
            return 0.0
        raise AssertionError(f"{what}: one of actual/expected is None")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if not bool(torch.isfinite(actual).all()):
        raise AssertionError(f"{what}: has non-finite entries")
    err = relative_error(actual, expected)
    if not err <= rtol:
        diff = (actual.detach() - expected.detach()).abs()
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.ndim else ()
        raise AssertionError(
            f"{what}: relative error {err:.3e} > rtol {rtol:.1e}; worst entry at {idx}: "
            f"actual {float(actual.detach()[idx]):.10g}, expected {float(expected.detach()[idx]):.10g}"
        )
    return err


def read_together(values: Sequence[Tensor]) -> list[Any]:
    """The Python values of 0-dim tensors (in order), read with one device synchronisation per device and kind
    instead of one per tensor (a GPU teleport decides on a few values per site): booleans as ``bool``, numbers
    in float64."""
    out: list[Any] = [None] * len(values)
    groups: dict[tuple[torch.device, bool], list[int]] = {}
    for i, v in enumerate(values):
        if not isinstance(v, Tensor) or (type(v) is not Tensor and not isinstance(v, torch.nn.Parameter)) or v.is_complex():
            raise TypeError(f"read_together reads real values of plain tensors, got {type(v).__name__} {getattr(v, 'dtype', '')}".rstrip())
        if v.numel() != 1:
            raise ValueError(f"read_together reads one value per tensor, got a tensor of shape {tuple(v.shape)}")
        groups.setdefault((v.device, v.dtype == torch.bool), []).append(i)
    with torch.no_grad():
        for (_, flags), index in groups.items():
            parts = [values[i] if values[i].dim() == 0 else values[i].reshape(()) for i in index]
            if not flags:
                parts = [t if t.dtype == torch.float64 else t.to(torch.float64) for t in parts]
            for i, v in zip(index, (parts[0].reshape(1) if len(parts) == 1 else torch.stack(parts)).tolist()):
                out[i] = v
    return out


def all_finite_sums(tensors: Iterable[Tensor]) -> bool:
    """Whether the sum of every tensor is finite: one vectorised pass each, no temporaries, NaN and inf
    propagate through a sum (an overflowing sum of finite entries reads as non-finite), read together
    (:func:`read_together`).  Empty tensors are skipped."""
    return all(read_together([torch.isfinite(t.detach().sum()) for t in tensors if t.numel()]))
