"""The user's module inside the wrappers training puts around it.

``DistributedDataParallel``, ``DataParallel`` and ``torch.compile`` wrap a module
without changing its parameters' names below the wrapper; detection and
``Teleport`` work on the module inside (:func:`unwrap`), and hooks that must see
every training forward sit on :func:`hook_target`.
"""

from __future__ import annotations

from torch import nn

__all__ = ["compiled", "unwrap", "hook_target"]

#: wrappers nested deeper than this are left as they are (a guard against cycles)
_MAX_DEPTH = 16


def _parallel(model: nn.Module) -> bool:
    return isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))


def compiled(model: nn.Module) -> bool:
    """Whether ``model`` is the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    return type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel``/``DataParallel`` and ``torch.compile`` wrappers."""
    for _ in range(_MAX_DEPTH):
        if _parallel(model) or compiled(model):
            inner = model.module if _parallel(model) else model._orig_mod
            assert isinstance(inner, nn.Module)  # both wrappers hold a module
            model = inner
        else:
            break
    return model


def hook_target(model: nn.Module) -> nn.Module:
    """The module whose forward hooks see every training forward of ``model``: the outermost
    ``torch.compile`` wrapper if there is one (its hooks run eagerly, outside the compiled
    graph), else the unwrapped module (DDP calls it with the inputs on the right device)."""
    for _ in range(_MAX_DEPTH):
        if compiled(model):
            return model
        if not _parallel(model):
            break
        inner = model.module
        assert isinstance(inner, nn.Module)
        model = inner
    return model
