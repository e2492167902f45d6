"""Float64 checks of models that cast to float32 inside their forward.

Models written for half-precision training compute some steps in float32 whatever their
dtype (transformers' RMSNorm: ``hidden_states.to(torch.float32)``; rotary tables:
``.float()``).  In the float64 copy that certification and detection run, those casts
are downcasts: they round the check to float32 (relative errors near 1e-7 where an
exact symmetry should reach 1e-15).  Within :func:`keep_float64`, a cast of a float64
tensor to float32 keeps float64, so the copy computes the model's arithmetic in float64
throughout.  Some float32 values start from integers: transformers' rotary table casts
the integer positions with ``.float()`` and multiplies them with the inverse
frequencies, a float64 buffer in the copy; a matrix product of a float64 and a float32
operand (which raises outside the mode) computes in float64.  Every other call runs
unchanged, so a float32 model runs as it would without the mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["keep_float64"]

_CASTS = (Tensor.to, Tensor.float, Tensor.type)
_PRODUCTS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, Tensor.bmm, torch.mm, Tensor.mm)


def _widened(value: Any) -> Any:
    return torch.float64 if value is torch.float32 else value


def _mixed(args: tuple[Any, ...]) -> bool:
    """The arguments hold a float64 and a float32 tensor."""
    dtypes = {a.dtype for a in args if isinstance(a, Tensor)}
    return torch.float64 in dtypes and torch.float32 in dtypes


class keep_float64(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Context manager: casts of float64 tensors to float32 keep float64 (see module docs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS and _mixed(args):
            args = tuple(a.double() if isinstance(a, Tensor) and a.dtype == torch.float32 else a for a in args)
        if func in _CASTS and args and isinstance(args[0], Tensor) and args[0].dtype == torch.float64:
            if func is Tensor.float:
                return args[0]
            args = (args[0], *(_widened(a) for a in args[1:]))
            kwargs = {k: _widened(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
