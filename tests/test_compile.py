"""``torch.compile`` of the optimizer step, as torch documents it (``torch.compile(fn)`` with ``fn`` calling
``opt.step()``), with the wrappers around the base optimizer.

* A ``Teleport`` step that does not teleport adds no graph break of its own: ``torch._dynamo.explain``
  counts 0 breaks, as for the bare ``Adam``.
* A ``Syre`` step has exactly one: torch's own, the ``graph_break()`` that ``torch.optim``'s
  ``_use_grad_for_differentiable`` puts around every ``step`` (pytorch issue 104053); with the anchor
  decay traced before the base step, that break separates two graphs.  None is in teleopt's code.
* The compiled steps update the parameters as the eager ones do.

Teleporting steps run their Python engine (search, check) and are best left eager; a compiled step that
teleports still runs correctly (graph breaks), only slowly to compile.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import teleopt

pytestmark = pytest.mark.filterwarnings("ignore")  # dynamo's notes on lru_cache'd helpers it traces through

Factory = Callable[[nn.Module, torch.Tensor], torch.optim.Optimizer]


def _adam(model: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))  # a tensor lr: no recompile per value


def _teleport(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    return teleopt.Teleport(_adam(model), model, "auto", example_inputs=(x,), loss_fn=F.cross_entropy, every=1000)


def _syre(model: nn.Module, x: torch.Tensor) -> torch.optim.Optimizer:
    return teleopt.Syre(_adam(model), gamma=0.01, exclude_1d=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _setup(make: Factory, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A model and optimizer after 12 eager steps (the step-0 teleport's watch window has closed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    x, y = torch.randn(32, 8, device=device), torch.randint(0, 4, (32,), device=device)
    opt = make(model, x)

    def backward() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()

    for _ in range(12):
        backward()
        opt.step()
    backward()
    return model, opt, backward


def _user_frames(reason) -> list[str]:
    return [f"{f.filename}:{f.name}" for f in reason.user_stack]


@pytest.mark.parametrize(("make", "breaks"), [(lambda m, x: _adam(m), 0), (_teleport, 0), (_syre, 1)], ids=["adam", "teleport", "syre"])
@pytest.mark.parametrize("device", DEVICES)
def test_graph_breaks_of_a_compiled_step(make, breaks, device):
    _, opt, _ = _setup(make, device)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(lambda: opt.step())()
    assert explained.graph_break_count == breaks
    for reason in explained.break_reasons:  # only torch.optim's own no_grad break
        assert _user_frames(reason)[-1].endswith("torch/optim/optimizer.py:_use_grad"), _user_frames(reason)


@pytest.mark.parametrize("make", [_teleport, _syre], ids=["teleport", "syre"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_step_updates_as_the_eager_one(make, device):
    model, opt, backward = _setup(make, device)
    state = copy.deepcopy((model.state_dict(), opt.state_dict()))  # state_dict() holds references
    eager = []
    for _ in range(3):
        opt.step()
        eager.append([p.detach().clone() for p in model.parameters()])
        backward()

    model.load_state_dict(state[0])
    opt.load_state_dict(state[1])
    backward()
    torch._dynamo.reset()
    step = torch.compile(lambda: opt.step(), backend="aot_eager")
    for expected in eager:
        step()
        for p, e in zip(model.parameters(), expected):
            # float32 round-off: the bare Adam itself differs by 9e-8 compiled vs eager; a missing anchor
            # decay (gamma * lr * (w - anchor), about 1e-4 here) or a skipped step would be far above this
            torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-6)
        backward()
