"""The base optimizers the wrapper conformance suite runs on (one table drives every check).

Each :class:`BaseOptimizer` says how to build the optimizer and the learning rates
its smoke-convergence check uses; ``requires`` names an optional package.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["BaseOptimizer", "BASE_OPTIMIZERS", "available_bases"]


@dataclass(frozen=True)
class BaseOptimizer:
    """A base optimizer for the suite.

    ``make(param_groups, lr)`` builds it; ``lr`` is used on the regression problem,
    ``rosenbrock_lr`` for ``rosenbrock_steps`` steps on Rosenbrock's function, which
    the bare optimizer must bring below ``rosenbrock_tol`` times its starting value.
    ``requires`` names a module that must be importable (else the base is unavailable).
    """

    name: str
    make: Callable[[list[dict[str, Any]], float], Optimizer]
    lr: float
    rosenbrock_lr: float
    rosenbrock_steps: int
    rosenbrock_tol: float = 1e-2
    requires: str | None = None

    def available(self) -> bool:
        """Whether ``requires`` (if any) is importable."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def _yogi(groups: list[dict[str, Any]], lr: float) -> Optimizer:
    import torch_optimizer

    return torch_optimizer.Yogi(groups, lr=lr)


BASE_OPTIMIZERS: dict[str, BaseOptimizer] = {
    base.name: base
    for base in (
        BaseOptimizer("sgd_momentum", lambda g, lr: torch.optim.SGD(g, lr=lr, momentum=0.9), 0.05, 4e-4, 800),
        BaseOptimizer("adagrad", lambda g, lr: torch.optim.Adagrad(g, lr=lr), 0.1, 2.0, 800),
        BaseOptimizer("adam", lambda g, lr: torch.optim.Adam(g, lr=lr), 0.01, 0.1, 600),
        BaseOptimizer("adamw_foreach", lambda g, lr: torch.optim.AdamW(g, lr=lr, foreach=True), 0.01, 0.05, 800),
        BaseOptimizer("yogi", _yogi, 0.01, 0.1, 800, requires="torch_optimizer"),
    )
}


def available_bases() -> list[str]:
    """Names in ``BASE_OPTIMIZERS`` whose requirements are installed."""
    return [name for name, base in BASE_OPTIMIZERS.items() if base.available()]
