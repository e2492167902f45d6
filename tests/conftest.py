"""Fixtures shared by the whole suite.

Reproducibility: hypothesis loads its built-in ``ci`` profile when the ``CI``
environment variable is set (``.ci/run`` sets it): derandomised, no example
database, and a failure prints a ``@reproduce_failure`` blob, so a red CI run
replays bit for bit with ``CI=true python -m pytest <test id>``.  Training tests
seed their own ``torch.Generator``s.

Detection runs in strict mode (``TELEOPT_DETECTION_STRICT=1``): a built-in rule
that raises fails the test instead of being reported and frozen.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

os.environ.setdefault("TELEOPT_DETECTION_STRICT", "1")  # a built-in detection rule that raises fails the test


HEADS, DIM = 4, 32


class SeparateQKVAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v, o projections (as in a hand-written GPT) and a
    linear head on the mean over tokens: ``HEADS`` heads of width ``DIM // HEADS``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, HEADS, DIM // HEADS).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS), dim=-1)
        return self.head(self.o((att @ v).transpose(1, 2).reshape(b, t, DIM))).mean(1)


@contextmanager
def products_raise(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside: ``torch._foreach_mul_`` raises ``RuntimeError("injected")`` (a fault in the lean path's in-place
    products) and the block must raise it; on leaving, the real kernel is back.

    The one fault injection of the lean writes' tests: ``with products_raise(monkeypatch): opt.step()``.
    """

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "_foreach_mul_", fail)
        with pytest.raises(RuntimeError, match="injected"):
            yield


def steps_then_backward(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """``steps`` full-batch MSE training steps, then one more backward: ``.grad`` is the gradient a teleport reads."""
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as module ``benchmarks.<name>`` (once per session).

    The one way tests load a benchmark script: ``from conftest import load_benchmark``.

    The benchmark folder is on ``sys.path`` while the script's own imports run, so
    benchmarks that share a helper module (``syre_common``) load as they do when run
    as scripts.
    """
    key = f"benchmarks.{name}"
    if key in sys.modules:
        return sys.modules[key]
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark script {path}")
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        sys.modules[key] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(key, None)
        raise
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's tests with one intra-op thread, then restore the setting.

    The suite's models are tiny: on a shared 2-core CI machine extra OpenMP threads
    only add contention (measured: 62 ms vs 1.5 s per discovery step with 2 threads
    on a loaded machine).  Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
