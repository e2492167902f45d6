"""The resume matrix on FSDP2 (``fully_shard``, gloo on CPU): 1, 2 and 4 ranks, bitwise.

The cells of ``tests/test_resume.py`` (teleports at 2 and 9, a 4-step watch, blow-ups inside both
windows, saved one step after a teleport and between windows) on a sharded model: each rank trains on
its own batches, saves through teleopt's ``optimizer_state_dict`` and through torch's own
``get_state_dict`` (plain, and flattened as torchtitan does; all with ``dcp.save``), goes on, and resumes a fresh sharded model and optimizer
(other initial weights) from each checkpoint with ``dcp.load`` and ``load_optimizer_state_dict`` /
``set_state_dict``.  The resumed parameters, optimizer state and ``Teleport`` records must equal the
live run's on every rank, bitwise.  One process group per test runs its cells (Adam, SGD with momentum,
and ``Syre(Teleport(AdamW))``; both save points; the three loaders): the default suite runs the cells
saved inside a watch window (every base on 1 rank, Adam and Syre on 2); the others and all 4-rank
cells are marked slow (4 processes on the 2 CI cores take minutes).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_resume import BASES, SAVE_POINTS, STEPS, auto_sites, batch, mlp, optimizer, record, teleport_of
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

KINDS = ("helpers", "dcp", "dcp_flat")  # teleopt's functions; torch's, plain and flattened (torchtitan)
CELLS = (("adam", False), ("sgd_momentum", False), ("adamw", True))  # AdamW under Syre(Teleport(...))


def _shard(model: nn.Sequential) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, rank)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def _full(t: Any) -> Any:
    from teleopt.sharding import full

    return full(t).detach().clone() if isinstance(t, torch.Tensor) else t


def _everything(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole parameters and optimizer state (gathered), and the Teleport record."""
    return {
        "params": [_full(p) for p in model.parameters()],
        "state": [{k: _full(v) for k, v in sorted(opt.state.get(p, {}).items())} for p in model.parameters()],
        "record": record(opt),
    }


def _save(kind: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from teleopt.checkpoint import optimizer_state_dict

    if kind == "helpers":
        dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}, checkpoint_id=path)
    else:  # torchtitan flattens the optimizer state dict
        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=kind == "dcp_flat"))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(kind: str, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> tuple[Any, ...]:
    """Load; returns the record right after torch's initialising step (it must not count)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from teleopt.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    if kind == "helpers":
        state = {"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}
        fresh = record(opt)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        load_optimizer_state_dict(model, opt, state["optim"])
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=kind == "dcp_flat")
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        fresh = record(opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    return fresh


def _resume_worker(rank: int, out_dir: str, cells: list[tuple[str, bool, int]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for base, syre, save_at in cells:
            model = _shard(mlp())
            opt = optimizer(model, base, syre, auto_sites())
            _train(model, opt, range(save_at + 1), rank)
            mid_watch = teleport_of(opt).record.watch is not None
            for kind in KINDS:
                _save(kind, model, opt, os.path.join(out_dir, f"{base}-{save_at}-{kind}"))
            _train(model, opt, range(save_at + 1, STEPS), rank)
            live = _everything(model, opt)
            for kind in KINDS:
                fresh_model = _shard(mlp(seed=1))
                resumed = optimizer(fresh_model, base, syre, auto_sites())
                fresh = _load(kind, fresh_model, resumed, os.path.join(out_dir, f"{base}-{save_at}-{kind}"))
                resumed_watch = teleport_of(resumed).record.watch is not None
                _train(fresh_model, resumed, range(save_at + 1, STEPS), rank)
                results[f"{base}-{save_at}-{kind}"] = {
                    "mid_watch": (mid_watch, resumed_watch),
                    "fresh": fresh,
                    "live": live,
                    "resumed": _everything(fresh_model, resumed),
                }
    return results


def _worker(rank: int, world: int, init_file: str, out_dir: str, cells: list[tuple[str, bool, int]]) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a collective one rank never joins fails the test, not CI
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        result = _resume_worker(rank, out_dir, cells)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # gloo aborts a rank that tears down while its peer is still inside a collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # the result is written; skip gloo's C++ destructors (tests/test_fsdp2.py)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


ALL = [(base, syre, save_at) for base, syre in CELLS for save_at in SAVE_POINTS]
MID_WATCH = [(base, syre, SAVE_POINTS[0]) for base, syre in CELLS]
MID_WATCH_2 = [cell for cell in MID_WATCH if cell[0] != "sgd_momentum"]


@pytest.mark.parametrize(
    ("world", "cells"),
    [  # the default suite: every base saved mid-watch on 1 rank, Adam and Syre on 2 (the heavier cells: slow)
        pytest.param(1, MID_WATCH, id="1-mid_watch"),
        pytest.param(2, MID_WATCH_2, id="2-mid_watch"),
        pytest.param(1, [c for c in ALL if c not in MID_WATCH], id="1-rest", marks=pytest.mark.slow),
        pytest.param(2, [c for c in ALL if c not in MID_WATCH_2], id="2-rest", marks=pytest.mark.slow),
        pytest.param(4, ALL, id="4-all", marks=pytest.mark.slow),  # 4 processes: minutes on 2 shared cores
    ],
)
def test_fsdp2_runs_resume_bitwise_through_teleopt_and_torch_checkpoint_functions(tmp_path, world, cells):
    """Adam, SGD momentum, Syre(Teleport(AdamW)) x saved mid-watch (step 3) and between windows (step 7) x
    teleopt's and torch's functions, on ``world`` gloo ranks: every rank's resumed run is the live run."""
    mp.spawn(_worker, args=(world, os.path.join(tmp_path, "init"), str(tmp_path), cells), nprocs=world, join=True)
    out = [torch.load(os.path.join(tmp_path, f"rank{rank}.pt"), weights_only=False) for rank in range(world)]
    assert len(out[0]) == len(KINDS) * len(cells) and {base for base, _ in CELLS} <= set(BASES)
    for rank_out in out:
        for cell, r in rank_out.items():
            mid_watch, resumed_watch = r["mid_watch"]
            assert mid_watch == resumed_watch == (int(cell.split("-")[1]) == SAVE_POINTS[0]), cell
            assert r["fresh"][:3] == (0, 0, 0), (cell, "torch's initialising step counted", r["fresh"])
            assert r["live"]["record"][2] == 2, (cell, "both watches fire", r["live"]["record"])
            assert _equal(r["live"], r["resumed"]), cell
    for rank_out in out[1:]:  # every rank holds the same whole parameters
        assert all(_equal(rank_out[c]["live"]["params"], out[0][c]["live"]["params"]) for c in rank_out)
