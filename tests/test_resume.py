"""A resumed run continues bit for bit: teleopt's checkpoints and torch's own functions, inside a watch window and not.

Every cell trains a small ReLU MLP under ``Teleport`` (sites ``"auto"``, teleports at steps 2 and 9, a
4-step watch), saves after step ``save_at``, keeps training the live run, and resumes a fresh model and
optimizer (other initial weights: everything must come from the checkpoint) from the saved files.  A
batch with targets 100x larger at step 5 (inside the first watch) and step 11 (inside the second) blows
the gradient up, so the watch rolls the teleport back in every run.  The resumed parameters, optimizer
state and records must equal the live run's, bitwise.

Paths: ``state_dict`` through ``torch.save``/``torch.load(weights_only=True)``; teleopt's
``optimizer_state_dict``/``load_optimizer_state_dict`` with ``dcp.save``/``dcp.load``; torch's own
``get_state_dict``/``set_state_dict`` with ``dcp.save``/``dcp.load``, plain and with torchtitan's
``flatten_optimizer_state_dict=True`` (the wrapper's counters and watch travel in what torch keeps, and
torch's learning-rate-0 initialising step is not a training step).  The
multi-rank cells (FSDP2, gloo) are in ``tests/test_resume_fsdp2.py``.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from teleopt import Site, Syre
from teleopt.teleport import SafetyConfig, Schedule, Teleport

STEPS = 13
TELEPORTS = [2, 9]
BLOW_UPS = (5, 11)  # inside the watch windows of the teleports at 2 and 9
SAVE_POINTS = (3, 7)  # one step after the first teleport (inside its window), and between the windows


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 3, generator=gen)
    return x, y * 100 if step in BLOW_UPS else y


BASES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


@functools.cache
def auto_sites() -> tuple[Site, ...]:
    """The sites ``"auto"`` finds on :func:`mlp` (detected once: the multi-rank cells reuse them)."""
    model = mlp()
    opt = optimizer(model, "adam")
    train(model, opt, range(TELEPORTS[0] + 1))
    return tuple(teleport_of(opt).sites or ())


def optimizer(model: nn.Module, base: str, syre: bool = False, sites: Any = "auto", **safety: Any) -> torch.optim.Optimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt: torch.optim.Optimizer = Teleport(
            BASES[base](model.parameters()),
            model,
            sites if sites == "auto" else list(sites),
            example_inputs=batch(0)[0][:4],
            safety=SafetyConfig(watch_steps=4, **safety),
            schedule=Schedule(at=TELEPORTS),
        )
    if not syre:
        return opt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # AdamW's own decay besides the anchors': meant here
        return Syre(opt, gamma=1e-3, seed=5)


def teleport_of(opt: torch.optim.Optimizer) -> Teleport:
    while not isinstance(opt, Teleport):
        opt = opt.base  # type: ignore[attr-defined]
    return opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int = 0) -> None:
    for step in steps:
        x, y = batch(step, rank)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def record(opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    r = teleport_of(opt).record
    return r.step, r.accepted, r.rollbacks, r.backoff, None if r.watch is None else (r.watch.until, r.watch.teleport_step)


def differences(a: nn.Module, oa: torch.optim.Optimizer, b: nn.Module, ob: torch.optim.Optimizer) -> list[str]:
    """What differs between two runs (empty: bitwise equal)."""
    out = [f"param {n}" for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(p, q)]
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state.get(p, {}), ob.state.get(q, {})
        if sorted(sa) != sorted(sb):
            out.append(f"state keys {sorted(sa)} != {sorted(sb)}")
        out += [f"state {k}" for k in sa if k in sb and not torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k]))]
    if record(oa) != record(ob):
        out.append(f"record {record(oa)} != {record(ob)}")
    return out


def save_torch(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def load_torch(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])


def save_helpers(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from teleopt.checkpoint import optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}, checkpoint_id=path)


def load_helpers(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from teleopt.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    state = {"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    load_optimizer_state_dict(model, opt, state["optim"])


def save_dcp(model: nn.Module, opt: torch.optim.Optimizer, path: str, flatten: bool = False) -> None:
    """torch's own functions, as accelerate's FSDP2 path (``flatten=False``) and torchtitan (``flatten=True``,
    ``StateDictOptions(flatten_optimizer_state_dict=True)``) call them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_dcp(model: nn.Module, opt: torch.optim.Optimizer, path: str, flatten: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    before = record(opt)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)  # a fresh optimizer: torch steps it once at lr 0
    assert record(opt) == before, "torch's initialising step counted as a training step"
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


PATHS = {
    "torch_save": (save_torch, load_torch),
    "helpers": (save_helpers, load_helpers),
    "dcp": (save_dcp, load_dcp),
    "dcp_flat": (functools.partial(save_dcp, flatten=True), functools.partial(load_dcp, flatten=True)),
}


def resume_differences(base: str, save_at: int, path: str, tmp: str, syre: bool = False, **safety: Any) -> list[str]:
    """Train, save after step ``save_at``, finish; resume a fresh run from the file and finish it; what differs."""
    save, load = PATHS[path]
    model = mlp()
    opt = optimizer(model, base, syre, **safety)
    train(model, opt, range(save_at + 1))
    mid_watch = teleport_of(opt).record.watch is not None
    save(model, opt, tmp)
    train(model, opt, range(save_at + 1, STEPS))
    assert mid_watch == (save_at == SAVE_POINTS[0]) and teleport_of(opt).record.rollbacks == 2, "both watches fire"
    fresh = mlp(seed=1)
    resumed = optimizer(fresh, base, syre, **safety)
    load(fresh, resumed, tmp)
    assert (teleport_of(resumed).record.watch is not None) == mid_watch
    train(fresh, resumed, range(save_at + 1, STEPS))
    return differences(model, opt, fresh, resumed)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("base", list(BASES))
def test_a_resumed_run_continues_bitwise_inside_a_watch_window_and_outside(tmp_path, base, path):
    """Saved one step after a teleport (step 3: the watch from step 2 fires at 5 after the resume) and
    between windows (step 7): both resumed runs roll back where the live run does, bitwise."""
    for save_at in SAVE_POINTS:
        assert resume_differences(base, save_at, path, str(tmp_path / f"{save_at}")) == [], (base, path, save_at)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("path", list(PATHS))
def test_syre_around_teleport_resumes_bitwise(tmp_path, path):
    """``Syre(Teleport(AdamW))``: the anchors as per-parameter state, Teleport's record in the first param group."""
    for save_at in SAVE_POINTS:
        assert resume_differences("adamw", save_at, path, str(tmp_path / f"{save_at}"), syre=True) == [], (path, save_at)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_torchs_initialising_step_runs_no_teleport_and_counts_nothing_but_a_users_lr_0_step_counts():
    """torch's ``get_state_dict`` steps a fresh optimizer once at learning rate 0 with zero gradients to create
    its state: with a teleport due at every step and a ``batch_fn``, that step draws no batch, teleports not and
    counts not (the base's state exists afterwards).  The same step taken by the user is a training step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    drawn = []
    for caller in ("torch", "user"):
        model = mlp()
        base = torch.optim.Adam(model.parameters(), lr=0.0)
        opt = Teleport(base, model, list(auto_sites()), every=1, batch_fn=lambda: drawn.append(1) or batch(0))
        if caller == "torch":
            get_state_dict(model, opt)
            assert (opt.record.step, opt.reports, drawn) == (0, [], []) and len(base.state) == 6
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()
            assert opt.record.step == 1 and len(opt.reports) == 1 and drawn == [1]
