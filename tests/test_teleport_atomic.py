"""A teleport is all or nothing: an exception raised anywhere in it leaves every tensor and counter bitwise as before.

The fault-injection harness runs a teleport once under a counting ``TorchFunctionMode`` that labels every torch
function call (every tensor operation, and attribute reads such as ``.grad``) with the phase it runs in (the
engine's phases are named by a subclass: plan, search, apply, verify; "wrapper" before the engine, "commit" after
it up to the report), on a twin built the same way.  It then re-runs the same teleport from the same state once
per injection point (the first and last operation of each phase and points evenly spaced between, plus the entry
and exit of each phase), raising there in turn a ``RuntimeError("simulated OOM")``, a ``torch.OutOfMemoryError`` and a
``KeyboardInterrupt``.  Each time the very exception object must come out of ``step()``/``teleport()``, and the
parameters, gradients, buffers, the wrapper's ``state_dict`` (the base optimizer's state and step counts, the
wrapper's counters, generator, watch), its record, its list of reports and torch's global RNG must be bitwise
what they were.  A rollback that is right leaves the state the next injection starts from identical, so one wrapper
serves all of them; at the end it must still teleport and step exactly as a wrapper that was never interrupted.
:class:`DispatchFaults` does the same one level down, on ATen operations (inside autograd's backward too).

A watch rollback is all or nothing too: the ``step()`` whose gradient sets the watch off is run with faults at
points of its alarm ("wrapper") and of the rollback up to its report ("rollback"), for an inverse watch of one
teleport and of two joined ones, a snapshot watch and Lookahead's slow weights; everything must be bitwise as
before, and the rollback completed afterwards exactly the uninterrupted one.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from teleopt import Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport
from teleopt.teleport.engine import TeleportEngine

pytestmark = pytest.mark.usefixtures("one_thread")

PHASES = ("wrapper", "plan", "search", "apply", "verify", "commit")


class Phases:
    """The phase a teleport is in, and a fault to raise at one phase boundary (``(phase, "enter" | "exit")``)."""

    def __init__(self) -> None:
        self.current = "wrapper"
        self.boundary: tuple[str, str] | None = None
        self.fault: BaseException | None = None

    def _cross(self, phase: str, side: str) -> None:
        if self.boundary == (phase, side) and self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault

    @contextmanager
    def enter(self, phase: str) -> Iterator[None]:
        outer, self.current = self.current, phase
        self._cross(phase, "enter")
        yield
        self._cross(phase, "exit")
        self.current = "commit" if phase == "verify" else outer


class PhasedEngine(TeleportEngine):
    """The teleport engine with its four phases named while they run (what the fault mode labels ops with)."""

    phases: Phases

    def plan(self, sites, request, transaction=None):
        with self.phases.enter("plan"):
            return super().plan(sites, request, transaction)

    def search(self, planned):
        with self.phases.enter("search"):
            return super().search(planned)

    def apply(self, found):
        with self.phases.enter("apply"):
            return super().apply(found)

    def verify(self, applied):
        with self.phases.enter("verify"):
            return super().verify(applied)


class PhasedTeleport(Teleport):
    """A ``Teleport`` whose engine names its phases (``phases``); the hooks mark the end of the teleport."""

    def _make_engine(self):
        assert not self.search.paper_compat
        engine = super()._make_engine()
        phased = PhasedEngine(engine.config, engine.record)
        phased.phases = self.phases = Phases()
        return phased

    def _call_hooks(self, report):
        self.phases.current = "done"
        super()._call_hooks(report)

    def _rollback_watch(self, step):
        self.phases.current = "rollback"  # a watch rollback: from here to its report
        super()._rollback_watch(step)


class _Injector:
    """Counts the operations run in the ``injectable`` phases (their phase, in order) and raises ``fault`` at
    the one numbered ``at``."""

    def __init__(self, phases: Phases, injectable: tuple[str, ...], at: int | None = None, fault: BaseException | None = None):
        super().__init__()
        self.phases, self.injectable, self.at, self.fault = phases, injectable, at, fault
        self.ops: list[str] = []

    def _count(self) -> None:
        if self.phases.current in self.injectable:
            self.ops.append(self.phases.current)
            if len(self.ops) - 1 == self.at and self.fault is not None:
                fault, self.fault = self.fault, None
                raise fault


class Faults(_Injector, TorchFunctionMode):
    """:class:`_Injector` over the torch functions called."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self._count()
        return func(*args, **(kwargs or {}))


class DispatchFaults(_Injector, TorchDispatchMode):
    """:class:`_Injector` one level down: the ATen operations (inside composite functions and autograd's backward too)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count()
        return func(*args, **(kwargs or {}))


def _fault(i: int) -> BaseException:
    kinds: list[Callable[[], BaseException]] = [
        lambda: RuntimeError("simulated OOM"),
        lambda: torch.OutOfMemoryError("simulated OOM"),
        KeyboardInterrupt,
    ]
    return kinds[i % 3]()


# ---------------------------------------------------------------------------------------------------- the state


def _capture(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _capture(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_capture(v) for v in value)
    return copy.deepcopy(value)


def state_of(model: nn.Module, opt: Teleport) -> dict[str, Any]:
    """Everything a teleport may touch, copied: parameters, ``.grad``, buffers, the wrapper's ``state_dict`` (the
    base's state and step counts, the wrapper's counters, generator and watch), its record and reports."""
    record = opt.record
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "state_dict": _capture(opt.state_dict()),
        "record": (record.step, record.accepted, record.rollbacks, record.backoff, id(record.watch)),
        "reports": len(opt.reports),
        "torch_rng": torch.get_rng_state(),
    }


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit (tensors by their bytes: -0.0 is not 0.0)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        same = (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


# ---------------------------------------------------------------------------------------------------- the cases


class Attention(nn.Module):
    """One attention block (two heads, ReLU head on top): GL(d_head) on (Q, K) and (V, O), scalings after O."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 4)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        y = (a @ v).transpose(1, 2).reshape(b, t, d)
        return self.head(torch.relu(self.o(y))).mean(1)


@dataclass
class Case:
    """A model, Adam and a ``Teleport`` teleporting at every step from step 2 (a watch running from the last)."""

    name: str
    model: Callable[[], nn.Module]
    shape: tuple[int, ...]
    out: int
    options: dict[str, Any]
    closure: bool = False  # teleport(closure) instead of step() with batch_fn
    points: int = 4  # injection points per phase (first, last, evenly between)
    lookahead: bool = False  # timm's Lookahead(Adam, k=2): the commit phase moves its slow weights


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3))


CASES = [
    Case("mlp scalings, fast path, default watch (snapshot)", mlp, (16, 5), 3, {}),
    Case("mlp scalings, fast path, no watch (rollback by inverse elements)", mlp, (16, 5), 3, {"safety": SafetyConfig(watch_steps=0)}),
    Case("attention GL and scalings, fast path, default watch", Attention, (4, 3, 8), 4, {}),
    Case("mlp scalings, general path", mlp, (16, 5), 3, {"search": SearchConfig(path="general")}, points=3),
    Case("mlp scalings, teleport(closure), no watch", mlp, (16, 5), 3, {"safety": SafetyConfig(watch_steps=0)}, closure=True),
    Case("mlp scalings, Lookahead(Adam), fast path", mlp, (16, 5), 3, {}, points=3, lookahead=True),
]


def build(case: Case) -> tuple[nn.Module, PhasedTeleport, Callable[[], Any]]:
    """The case after three steps (the one at step 2 teleported, its watch running), gradients of step 3 in
    ``.grad``; returns the model, the wrapper and what runs the teleport under test."""
    torch.manual_seed(0)
    model = case.model().double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*case.shape, generator=gen, dtype=torch.float64)
    y = torch.randn(case.shape[0], case.out, generator=gen, dtype=torch.float64)
    loss_fn = nn.functional.mse_loss
    base: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if case.lookahead:
        from timm.optim import Lookahead

        base = Lookahead(base, k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sites left out of "auto" detection
        opt = PhasedTeleport(
            base,
            model,
            "auto",
            example_inputs=x[:4],
            loss_fn=loss_fn,
            batch_fn=lambda: (x, y),
            **case.options,
            schedule=Schedule(when=lambda step: step >= 2),
        )

    def closure() -> Tensor:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    closure()
    assert opt.record.accepted == 1 and (opt.record.watch is not None) == (opt.safety.watch_steps > 0)
    return model, opt, (lambda: opt.teleport(closure)) if case.closure else opt.step


def injection_points(ops: list[str], per_phase: int, phases: tuple[str, ...] = PHASES) -> list[int]:
    """The first and last op of each phase and ``per_phase - 2`` evenly spaced between (all ops if fewer)."""
    points: list[int] = []
    for phase in phases:
        index = [i for i, p in enumerate(ops) if p == phase]
        if len(index) <= per_phase:
            points += index
        elif index:
            points += sorted({index[round(j * (len(index) - 1) / (per_phase - 1))] for j in range(per_phase)})
    return points


def inject(case: Case, per_phase: int, mode: type[Faults] | type[DispatchFaults] = Faults) -> dict[str, int]:
    """The harness (module docs) with faults raised by ``mode``; returns the injection points tried per phase
    (boundaries under "boundaries")."""
    model, opt, teleport = build(case)
    phases = opt.phases
    injectable = PHASES[1:] if case.closure else PHASES  # before the engine, a closure is the user's own code
    twin_model, twin, twin_teleport = build(case)  # counted on a twin: the wrapper under test stays as it is
    counter = mode(twin.phases, injectable)
    twin.phases.current = "wrapper"
    with counter:
        twin_teleport()
    assert twin.reports[-1].accepted, twin.reports[-1].reason
    assert set(counter.ops) >= {"plan", "search", "apply", "verify"}, "a teleport runs every phase"
    before = state_of(model, opt)  # (the global RNG as the twin left it)
    points = injection_points(counter.ops, per_phase)
    tried = {p: sum(counter.ops[i] == p for i in points) for p in PHASES}
    counts = {p: counter.ops.count(p) for p in PHASES}
    print(f"{case.name}: ops per phase {counts}")
    faults: list[tuple[str, Callable[[BaseException], Any]]] = []
    for at in points:
        faults.append((f"op {at} ({counter.ops[at]})", lambda fault, at=at: mode(phases, injectable, at, fault)))
    for phase in ("plan", "search", "apply", "verify"):
        for side in ("enter", "exit"):
            faults.append((f"{side} {phase}", lambda fault, b=(phase, side): _Boundary(phases, b, fault)))
    tried["boundaries"] = 8
    for n, (where, arm) in enumerate(faults):
        fault = _fault(n)
        phases.current = "wrapper"
        with pytest.raises(type(fault)) as info, arm(fault):
            teleport()
        assert info.value is fault, f"{case.name}, {where}: another exception came out: {info.value!r}"
        diff = differences(before, state_of(model, opt))
        assert not diff, f"{case.name}, fault {type(fault).__name__} at {where}: changed {diff[:6]}"
    # still usable: the interrupted wrapper teleports and steps exactly as one never interrupted
    phases.current, n = "wrapper", len(opt.reports)
    teleport()
    assert opt.reports[n].accepted, opt.reports[n].reason
    opt.step()
    twin.step()
    after, expected = state_of(model, opt), state_of(twin_model, twin)
    after.pop("record"), expected.pop("record")  # the watch by identity
    assert not differences(expected, after)
    assert (opt.record.step, opt.record.accepted) == (twin.record.step, twin.record.accepted)
    return tried


@contextmanager
def _Boundary(phases: Phases, boundary: tuple[str, str], fault: BaseException) -> Iterator[None]:
    phases.boundary, phases.fault = boundary, fault
    try:
        yield
    finally:
        phases.boundary, phases.fault = None, None


# ---------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_exception_anywhere_in_a_teleport_leaves_everything_bitwise_as_before(case: Case) -> None:
    tried = inject(case, case.points)
    assert all(tried[p] >= 1 for p in ("plan", "search", "apply", "verify")), tried
    print(f"{case.name}: injection points per phase {tried}")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[CASES[0].name, CASES[3].name])
def test_a_fault_inside_an_aten_operation_leaves_everything_bitwise_as_before(case: Case) -> None:
    # one level below torch functions: ATen ops inside composite functions and inside autograd's backward
    tried = inject(case, 3, DispatchFaults)
    assert all(tried[p] >= 1 for p in ("plan", "search", "apply", "verify")), tried
    print(f"{case.name}: ATen injection points per phase {tried}")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_dense_sweep_of_faults_leaves_everything_bitwise_as_before(case: Case) -> None:
    tried = inject(case, 40)
    print(f"{case.name}: injection points per phase {tried}")


def test_a_fault_after_the_search_puts_back_the_gradients_the_plan_computed_and_the_generator() -> None:
    # without .grad, the fast path's plan computes it from the batch; the curvature objective draws its random
    # orbit curves from the wrapper's generator: both are replaced, not written in place, and both go back
    torch.manual_seed(0)
    model = mlp().double()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=gen, dtype=torch.float64), torch.randn(16, 3, generator=gen, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = PhasedTeleport(
            torch.optim.SGD(model.parameters(), lr=1e-2),
            model,
            "auto",
            objective="curvature",
            example_inputs=x[:4],
            loss_fn=nn.functional.mse_loss,
        )
    before = state_of(model, opt)
    assert all(p.grad is None for p in model.parameters())
    fault = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as info, _Boundary(opt.phases, ("search", "exit"), fault):
        opt.teleport(batch=(x, y))
    assert info.value is fault
    assert not differences(before, state_of(model, opt))
    report = opt.teleport(batch=(x, y))  # what the fault undid: the same teleport, completed
    assert report.reason != "" and all(p.grad is not None for p in model.parameters())
    assert differences(before["state_dict"], state_of(model, opt)["state_dict"])  # the generator moved on


def test_a_wrapper_interrupted_mid_teleport_trains_on_exactly_like_one_never_interrupted() -> None:
    case = CASES[1]  # no watch: the apply moves members in place, the rollback needs the transaction's copies
    model, opt, _ = build(case)
    twin_model, twin, _ = build(case)
    counter = Faults(twin.phases, PHASES)
    twin.phases.current = "wrapper"
    with counter:
        twin.step()
    applies = [i for i, p in enumerate(counter.ops) if p == "apply"]
    middle = applies[len(applies) // 2]
    fault = KeyboardInterrupt()
    opt.phases.current = "wrapper"
    with pytest.raises(KeyboardInterrupt), Faults(opt.phases, PHASES, middle, fault):
        opt.step()
    gen = torch.Generator().manual_seed(2)
    for m, o in ((model, opt), (twin_model, twin)):
        if o is opt:
            o.step()  # the step that was interrupted, now whole
        for _ in range(4):  # teleports at every step, then the base's update
            x = torch.randn(*case.shape, generator=gen.manual_seed(3), dtype=torch.float64)
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    a, b = state_of(model, opt), state_of(twin_model, twin)
    a.pop("record"), b.pop("record")
    assert not differences(b, a)
    assert [r.reason for r in opt.reports] == [r.reason for r in twin.reports]


def test_a_fault_in_a_paper_compat_teleport_leaves_everything_bitwise_as_before() -> None:
    # the papers' first-order engine replaces search, apply and verify by its own loop: a fault anywhere in it
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6, bias=False), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=False)).double()
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 5, generator=gen, dtype=torch.float64), torch.randn(8, 7, generator=gen, dtype=torch.float64)
    site = Site(
        get_action("data_dependent_gl", activation="leaky_relu", negative_slope=0.1), ("0.weight", None, "2.weight"), data_input="0"
    )
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        model,
        [site],
        loss_fn=nn.functional.mse_loss,
        search=SearchConfig(paper_compat=True, steps=3),
        schedule=Schedule(),
    )
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    phases = Phases()  # one phase, "wrapper": the whole teleport() call
    counter = Faults(phases, ("wrapper",))
    twin = copy.deepcopy((model, opt))
    with counter:
        twin[1].teleport(batch=(x, y))
    assert twin[1].reports[-1].accepted
    before = state_of(model, opt)
    points = injection_points(counter.ops, 12)
    for n, at in enumerate(points):
        fault = _fault(n)
        with pytest.raises(type(fault)) as info, Faults(phases, ("wrapper",), at, fault):
            opt.teleport(batch=(x, y))
        assert info.value is fault
        assert not differences(before, state_of(model, opt)), f"fault at op {at} of {len(counter.ops)}"
    assert opt.teleport(batch=(x, y)).accepted


class _NamedFaults(Faults):
    """:class:`Faults` that also records the name of every torch function it counts."""

    names: list[str]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.phases.current in self.injectable:
            self.names.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs)


def _near(a: Any, b: Any, rel: float, where: str = "") -> list[str]:
    """:func:`differences`, with floating-point tensors equal when within ``rel`` of their largest entry."""
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.is_floating_point() and a.shape == b.shape and a.dtype == b.dtype:
        scale = max(float(a.abs().max()), float(b.abs().max())) if a.numel() else 0.0
        return [] if float((a - b).abs().max() if a.numel() else 0.0) <= rel * scale else [where]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in _near(a[k], b[k], rel, f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _near(x, y, rel, f"{where}[{i}]")]
    return differences(a, b, where)


def test_a_fault_in_a_lean_balance_teleport_leaves_everything_as_before() -> None:
    # objective="balance", every=1 on LoRA pairs and a scaling: after its plan's checked teleport, a teleport runs
    # on the lean path (teleopt.teleport.companion).  A fault before its writes leaves everything bitwise as it was;
    # one after the first copy (in a GL lane's moment product made at the write, or before the in-place products)
    # moves the copied tensors back by the inverse elements (to round-off); counters, reports and the watch are
    # bitwise as before either way.
    from test_balance_companion import lora_like, wrapped

    model, opt, step = wrapped(lora_like, lean=True)
    for _ in range(4):
        step()
    assert opt.reports[-1].check == "none", [(r.check, r.reason) for r in opt.reports]
    _, _, x, y = lora_like()
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    phases = Phases()  # one phase, "wrapper": the whole teleport() call
    counter = _NamedFaults(phases, ("wrapper",))
    counter.names = []
    twin = copy.deepcopy((model, opt))  # a copy builds its own plan: its first teleport is the engine's, checked
    for p, q in zip(model.parameters(), twin[0].parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    assert twin[1].teleport().check != "none"
    twin[1].innermost.step()  # off the balanced point again (the counted teleport moves)
    with counter:
        report = twin[1].teleport()
    assert report.accepted and report.check == "none", report.reason
    first_write = counter.names.index("_foreach_copy_")
    # the writes are the teleport's last operations: the copies, the GL lanes' moments moved kind by kind and
    # copied, the in-place products (then teleport()'s own no_grad exits, the report handed out)
    last = len(counter.names) - 2
    assert counter.names[last:] == ["_foreach_mul_", "_set_grad_enabled"] and "_foreach_copy_" in counter.names[first_write + 1 :]
    before = state_of(model, opt)
    writes = range(first_write, last + 1)
    points = sorted({p for p in injection_points(counter.ops, 16) if p <= last} | set(writes))
    for n, at in enumerate(points):
        fault = _fault(n)
        with pytest.raises(type(fault)) as info, Faults(phases, ("wrapper",), at, fault):
            opt.teleport()
        assert info.value is fault
        after = state_of(model, opt)
        if at <= first_write:
            assert not differences(before, after), f"fault at op {at} ({counter.names[at]}): {differences(before, after)[:6]}"
        else:
            assert not _near(before, after, 1e-12), f"fault at op {at} ({counter.names[at]}): {_near(before, after, 1e-12)[:6]}"
    assert opt.teleport().accepted


# ---------------------------------------------------------------------------------------------------- watch rollbacks

#: a watch rollback runs inside ``step()``: the alarm ("wrapper") and the rollback up to its report
ROLLBACK_PHASES = ("wrapper", "rollback")

ROLLBACK_CASES = [
    Case("mlp scalings, inverse watch", mlp, (16, 5), 3, {"safety": SafetyConfig(watch_restore="inverse")}),
    Case("mlp scalings, inverse watch of two teleports", mlp, (16, 5), 3, {"safety": SafetyConfig(watch_restore="inverse")}),
    Case("attention GL and scalings, snapshot watch", Attention, (4, 3, 8), 4, {"safety": SafetyConfig(watch_restore="snapshot")}),
    Case("mlp scalings, Lookahead(Adam), inverse watch", mlp, (16, 5), 3, {}, lookahead=True),
]


def build_rollback(case: Case) -> tuple[nn.Module, PhasedTeleport]:
    """:func:`build`'s wrapper (two teleports under watch for "two teleports"), gradients 1000x their size in
    ``.grad``: its next ``step()`` rolls the watch back (the squared norm beyond 100x its reference)."""
    model, opt, step = build(case)
    if "two teleports" in case.name:
        step()  # the teleport at step 3 joins the watch of the one at step 2
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(*case.shape, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.randn(case.shape[0], case.out, generator=gen, dtype=torch.float64)).backward()
    assert opt.record.watch is not None and len(opt.record.watch.chain) == (2 if "two teleports" in case.name else 1)
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(1e3)
    return model, opt


def inject_rollback(case: Case, per_phase: int, mode: type[Faults] | type[DispatchFaults] = Faults) -> dict[str, int]:
    """:func:`inject` for a watch rollback: faults at ``per_phase`` points of each of ``ROLLBACK_PHASES`` of the
    ``step()`` that rolls back; returns the injection points tried per phase."""
    model, opt = build_rollback(case)
    twin_model, twin = build_rollback(case)
    counter = mode(twin.phases, ROLLBACK_PHASES)
    twin.phases.current = "wrapper"
    with counter:
        twin.step()
    assert twin.reports[-1].path == "watch" and twin.record.watch is None, twin.reports[-1].reason
    before = state_of(model, opt)
    points = injection_points(counter.ops, per_phase, ROLLBACK_PHASES)
    for n, at in enumerate(points):
        fault = _fault(n)
        opt.phases.current = "wrapper"
        with pytest.raises(type(fault)) as info, mode(opt.phases, ROLLBACK_PHASES, at, fault):
            opt.step()
        assert info.value is fault, f"{case.name}, op {at}: another exception came out: {info.value!r}"
        diff = differences(before, state_of(model, opt))
        assert not diff, f"{case.name}, fault {type(fault).__name__} at op {at} ({counter.ops[at]}): changed {diff[:6]}"
    opt.phases.current = "wrapper"
    opt.step()  # the interrupted rollback, now whole: exactly the uninterrupted one
    assert opt.reports[-1].reason == twin.reports[-1].reason
    after, expected = state_of(model, opt), state_of(twin_model, twin)
    after.pop("record"), expected.pop("record")
    assert not differences(expected, after), differences(expected, after)[:6]
    assert (opt.record.step, opt.record.rollbacks, opt.record.backoff) == (twin.record.step, twin.record.rollbacks, twin.record.backoff)
    tried = {p: sum(counter.ops[i] == p for i in points) for p in ROLLBACK_PHASES}
    print(f"{case.name}: ops per phase { {p: counter.ops.count(p) for p in ROLLBACK_PHASES} }, injection points {tried}")
    return tried


@pytest.mark.parametrize("case", ROLLBACK_CASES, ids=[c.name for c in ROLLBACK_CASES])
def test_an_exception_anywhere_in_a_watch_rollback_leaves_everything_bitwise_as_before(case: Case) -> None:
    tried = inject_rollback(case, 12)
    assert tried["rollback"] >= 12 and tried["wrapper"] >= 2, tried


def test_a_fault_inside_an_aten_operation_of_a_watch_rollback_leaves_everything_bitwise_as_before() -> None:
    tried = inject_rollback(ROLLBACK_CASES[1], 8, DispatchFaults)
    assert tried["rollback"] >= 8, tried


@pytest.mark.slow
@pytest.mark.parametrize("case", ROLLBACK_CASES, ids=[c.name for c in ROLLBACK_CASES])
def test_a_dense_sweep_of_faults_in_a_watch_rollback_leaves_everything_bitwise_as_before(case: Case) -> None:
    inject_rollback(case, 10**6)  # every operation
