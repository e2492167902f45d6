"""Float64 checks of models that cast to float32 inside their forward.

Models written for half-precision training compute some steps in float32 whatever their
dtype (transformers' RMSNorm: ``hidden_states.to(torch.float32)``; rotary tables:
``.float()``).  In the float64 copy that certification and detection run, those casts
are downcasts: they round the check to float32 (relative errors near 1e-7 where an
exact symmetry should reach 1e-15).  Some casts start from integers: transformers'
rotary table casts the integer positions with ``.float()`` and multiplies them with the
inverse frequencies, a float64 buffer in the copy (a mixed-dtype matmul raises).  Within
:func:`keep_float64`, a cast to float32 of a float64 or a non-floating tensor gives
float64, so the copy computes the model's arithmetic in float64 throughout; every other
call runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["keep_float64"]

_CASTS = (Tensor.to, Tensor.float, Tensor.type)


def _widened(value: Any) -> Any:
    return torch.float64 if value is torch.float32 else value


def _widens(t: Tensor) -> bool:
    """A float32 cast of ``t`` keeps float64: ``t`` is float64, or not floating (integers, booleans)."""
    return t.dtype == torch.float64 or not (t.is_floating_point() or t.is_complex())


class keep_float64(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Context manager: casts of float64 tensors to float32 keep float64 (see module docs)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and args and isinstance(args[0], Tensor) and _widens(args[0]):
            if func is Tensor.float:
                return args[0] if args[0].dtype == torch.float64 else args[0].double()
            args = (args[0], *(_widened(a) for a in args[1:]))
            kwargs = {k: _widened(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)
