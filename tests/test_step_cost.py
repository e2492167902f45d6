"""What ``Teleport.step()`` does outside the base optimizer's update on a step without a teleport, counted.

Timing is noisy on a shared machine; the kind of work is not.  A dispatch mode counts the tensor operations
(each one a kernel launch, most an allocation, ``aten._local_scalar_dense`` a host sync) the wrapper runs
between ``step()`` being called and the base's update, and after it (the base's instance step hooks pause the
count).  A quiet step (no teleport due, none watched, no reference sampled) runs none; a step in the watch
window after a teleport, or a reference-sampling step before one, reads the gradient norm with a fixed number of
operations, however many parameter tensors the model has (one fused ``_foreach_norm``, one stack, no host sync
through the dispatcher: the norms come back in one ``tolist``).  A quiet step's Python is counted too: the
calls into teleopt's own functions, which on a quiet step only hand the update to the base.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_balance_companion import lora_like
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import teleopt
from teleopt.teleport import Schedule, Teleport

pytestmark = pytest.mark.usefixtures("one_thread")


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations run while ``active`` (the base's step hooks switch it off around its update)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.active = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active and func.namespace != "profiler":  # torch's step label, which the bare optimizer runs too
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _mlp(hidden: int) -> nn.Sequential:
    """A ReLU MLP with ``hidden`` hidden layers: 2 * (hidden + 1) parameter tensors."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.ReLU()]
    for _ in range(hidden - 1):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def _wrapper(model: nn.Module, optimizer: str) -> tuple[Teleport, tuple[torch.Tensor, torch.Tensor]]:
    """The README's configuration: ``"auto"`` sites, ``loss_fn`` and ``batch_fn``, the default objective and
    schedule (balance every 200 steps from step 200), the default watch."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.AdamW(model.parameters())
    wrapper = Teleport(base, model, "auto", example_inputs=(x[:2],), loss_fn=nn.functional.cross_entropy, batch_fn=lambda: (x, y))
    return wrapper, (x, y)


def _backward(model: nn.Module, wrapper: Teleport, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    wrapper.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()


def _own_ops(model: nn.Module, wrapper: Teleport, batch: tuple[torch.Tensor, torch.Tensor]) -> Counter[str]:
    """The aten operations of one ``wrapper.step()`` outside its base's update (after a backward)."""
    _backward(model, wrapper, batch)
    counter = _OpCounter()
    pre = wrapper.base.register_step_pre_hook(lambda *_: setattr(counter, "active", False))
    post = wrapper.base.register_step_post_hook(lambda *_: setattr(counter, "active", True))
    try:
        with counter:
            wrapper.step()
    finally:
        pre.remove()
        post.remove()
    return counter.ops


def _watched(hidden: int, optimizer: str) -> tuple[nn.Module, Teleport, tuple[torch.Tensor, torch.Tensor]]:
    """A wrapper one step after its first scheduled teleport (accepted: its watch open)."""
    model = _mlp(hidden)
    wrapper, batch = _wrapper(model, optimizer)
    first = wrapper.schedule.warmup
    assert isinstance(wrapper.schedule, Schedule) and first > 0
    _backward(model, wrapper, batch)
    wrapper.step()
    wrapper.record.step = first
    _backward(model, wrapper, batch)
    wrapper.step()
    assert wrapper.record.watch is not None, wrapper.reports[-1].reason
    return model, wrapper, batch


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_quiet_step_runs_no_tensor_operation_outside_the_base_update(optimizer: str) -> None:
    model = _mlp(3)
    wrapper, batch = _wrapper(model, optimizer)
    for step in (0, 1, 100, 194):  # before the first teleport, not yet sampling its reference
        wrapper.record.step = step
        assert _own_ops(model, wrapper, batch) == Counter(), f"step {step}"
    _, wrapper, batch = _watched(3, optimizer)
    wrapper.record.step = wrapper.record.watch.until + 1  # type: ignore[union-attr]
    wrapper.record.watch = None  # after the window
    assert _own_ops(model, wrapper, batch) == Counter()


def _own_python_calls(model: nn.Module, wrapper: Teleport, batch: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    """The teleopt functions one ``wrapper.step()`` calls (after a backward), in order, by name."""
    _backward(model, wrapper, batch)
    package = str(Path(teleopt.__file__).parent)
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        wrapper.step()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_quiet_step_asks_the_schedule_once_and_hands_the_update_to_the_base(optimizer: str) -> None:
    """Past the first step of a quiet stretch (which finds where it ends), a quiet step is the ``no_grad`` wrapper,
    ``step``, one ``Schedule.quiet`` (two integer comparisons) and the base's update: no ``due``/``soon``/group
    scan per step (15 teleopt calls before the quiet path, 6 with it)."""
    model = _mlp(3)
    wrapper, batch = _wrapper(model, optimizer)
    wrapper.record.step = 100
    _own_python_calls(model, wrapper, batch)  # the first: the base creates its state (the slow path: torch's own?)
    assert "_open_window" in _own_python_calls(model, wrapper, batch)  # the second finds the quiet stretch (to 195)
    for _ in range(3):
        calls = _own_python_calls(model, wrapper, batch)
        assert calls == ["without_grad", "step", "quiet", "_step_base", "_step_without_global_hooks", "_between_instance_hooks"], calls
    assert wrapper.record.step == 105


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_watched_step_reads_the_gradient_norm_in_the_same_few_operations_for_any_model(optimizer: str) -> None:
    counts = {}
    for hidden in (1, 6):  # 4 and 14 parameter tensors
        model, wrapper, batch = _watched(hidden, optimizer)
        counts[hidden] = _own_ops(model, wrapper, batch)
        assert wrapper.record.watch is not None and wrapper.record.rollbacks == 0
    assert counts[1] == counts[6]
    assert sum(counts[6].values()) <= 3, counts[6]  # _foreach_norm and stack (a sparse gradient adds its values)
    assert counts[6]["_local_scalar_dense"] == 0  # the norms reach the host in one read, not one .item() each


def test_a_reference_sampling_step_reads_the_gradient_norm_in_the_same_few_operations() -> None:
    counts = {}
    for hidden in (1, 6):
        model = _mlp(hidden)
        wrapper, batch = _wrapper(model, "sgd")
        wrapper.record.step = wrapper.schedule.warmup - 2  # within REFERENCE_STEPS of the first teleport
        counts[hidden] = _own_ops(model, wrapper, batch)
        assert len(wrapper.record.recent) == 1
    assert counts[1] == counts[6] and sum(counts[6].values()) <= 3, counts


class _NormReads(TorchDispatchMode):
    """Counts the ``_foreach_norm`` calls whose inputs include every tensor of ``watched`` (a full ||grad|| read)."""

    def __init__(self, watched: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {id(t) for t in watched}
        self.full_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is torch.ops.aten._foreach_norm and self.watched <= {id(t) for t in args[0]}:
            self.full_reads += 1
        return func(*args, **(kwargs or {}))


def _mse_backward(model: nn.Module, wrapper: Teleport, x: torch.Tensor, y: torch.Tensor) -> None:
    wrapper.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()


def test_balance_every_step_reads_the_full_gradient_norm_once_per_step() -> None:
    """With ``every=1`` the watch of the last teleport is open on every step: its read of ||grad||^2 is the lean
    balance's ||grad||^2 before its move (not read a second time); the report and the watch reference agree."""
    model, sites, x, y = lora_like()  # LoRA-like pairs and a ReLU head: the lean path's sites
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    wrapper = Teleport(base, model, sites, objective="balance", every=1, example_inputs=x[:2])
    for _ in range(3):  # the plan's first teleport is checked; the next ones are lean and unchecked
        _mse_backward(model, wrapper, x, y)
        wrapper.step()
    assert wrapper.record.watch is not None and wrapper.reports[-1].check == "none"
    _mse_backward(model, wrapper, x, y)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    expected = sum(float(g.double().square().sum()) for g in grads)  # type: ignore[union-attr]
    reads = _NormReads(grads)  # type: ignore[arg-type]
    with reads:
        wrapper.step()
    report = wrapper.reports[-1]
    assert report.accepted and report.check == "none" and reads.full_reads == 1
    assert report.grad_norm_before**2 == pytest.approx(expected, rel=1e-12)  # float64 model: round-off only
    assert wrapper.record.read is None  # cleared before the base's update: no later step or teleport reuses it


def test_a_second_teleport_in_the_same_step_reads_the_moved_gradients_again() -> None:
    """With ``batches=2`` the second lean balance of a step starts from the first one's transported gradients: its
    ||grad|| before is the first's after, not the watch's read from before both."""
    model, sites, x, y = lora_like()
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    wrapper = Teleport(
        base,
        model,
        sites,
        objective="balance",
        schedule=Schedule(every=1, batches=2),
        example_inputs=x[:2],
        batch_fn=lambda: (x, y),
        loss_fn=nn.functional.mse_loss,
    )
    for _ in range(4):
        _mse_backward(model, wrapper, x, y)
        wrapper.step()
    first, second = wrapper.reports[-2:]
    assert first.step == second.step and first.accepted and second.accepted and second.check == "none"
    assert first.grad_norm_after != first.grad_norm_before  # the first move changed the gradients
    assert second.grad_norm_before == pytest.approx(first.grad_norm_after, rel=1e-10)
