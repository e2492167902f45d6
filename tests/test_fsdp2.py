"""Syre and Teleport on FSDP2 (``fully_shard``) models: 2 gloo ranks against a single-process run.

Every test spawns two CPU processes on the gloo backend (file:// rendezvous in a
temporary directory, never a fixed port), each with its own data, shards a tiny
MLP with ``fully_shard`` (uneven shards: 5 and 3 rows over 2 ranks), and writes
the gathered full tensors to a file; the test process then repeats the run
without sharding on the concatenated batches (FSDP2 averages the gradients of
the ranks, so a mean loss over the concatenation is the same objective) and
compares.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from teleopt import Site, Syre, get_action
from teleopt.sharding import reshard
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

WORLD = 2
STEPS = 4


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.1), nn.Linear(8, 5), nn.LeakyReLU(0.1), nn.Linear(5, 3))


def _shard(model: nn.Sequential) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_batch(rank, step) for rank in range(WORLD)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    from teleopt.sharding import full

    return full(t).detach().clone()


# ---------------------------------------------------------------------------- syre


def _syre(model: nn.Module, store_anchors: bool = True) -> Syre:
    """Two groups: eq. 7 coupled decay on the first layer, decoupled decay elsewhere; biases included."""
    params = list(model.parameters())
    base = torch.optim.AdamW([{"params": params[:2]}, Syre.param_group(params[2:], decoupled=True)], lr=1e-2, weight_decay=0.0)
    return Syre(base, gamma=0.5, sigma0=1.0, diagonal_eps=0.3, exclude_1d=False, seed=3, store_anchors=store_anchors)


def _syre_train(model: nn.Module, opt: Syre, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()


def _syre_worker(rank: int, _: str) -> dict[str, Any]:
    same = _shard(_mlp())  # the same data on every rank: the averaged gradient is exactly rank 0's
    _syre_train(same, _syre(same), lambda step: _batch(0, step))
    model = _shard(_mlp())
    opt = _syre(model)
    _syre_train(model, opt, lambda step: _batch(rank, step))
    regenerated = _shard(_mlp())  # anchors drawn again in every step, never stored
    _syre_train(regenerated, _syre(regenerated, store_anchors=False), lambda step: _batch(rank, step))
    params = list(model.parameters())
    return {
        "same_data": [_full(p) for p in same.parameters()],
        "regenerated": [_full(p) for p in regenerated.parameters()],
        "params": [_full(p) for p in params],
        "anchors": [_full(opt.anchor(p)) for p in params],
        "diagonals": [_full(opt.diagonal(p)) for p in params[:2]],
        "local_anchor_shapes": [tuple(opt.anchor(p).to_local().shape) for p in params],
        "penalty": float(opt.penalty().detach()),
    }


def test_syre_on_fsdp2_matches_an_unsharded_run(tmp_path):
    """Measured: bitwise with the same data on both ranks; 3.0e-8 max abs with per-rank data (params move 0.056)."""
    out = _spawn("syre", str(tmp_path))
    same = _mlp()
    _syre_train(same, _syre(same), lambda step: _batch(0, step))
    assert all(torch.equal(a, p.detach()) for rank_out in out for a, p in zip(rank_out["same_data"], same.parameters()))
    # regenerating the anchors in every step takes bitwise the steps of stored anchors
    assert all(torch.equal(a, b) for rank_out in out for a, b in zip(rank_out["regenerated"], rank_out["params"]))
    model = _mlp()
    opt = _syre(model)
    _syre_train(model, opt, _global_batch)
    params = list(model.parameters())
    for rank_out in out:
        # anchors and D are the whole-tensor draws, sharded: bitwise the unsharded ones
        assert all(torch.equal(a, opt.anchor(p)) for a, p in zip(rank_out["anchors"], params))
        assert all(torch.equal(d, opt.diagonal(p)) for d, p in zip(rank_out["diagonals"], params[:2]))
        errors = [float((a - p.detach()).abs().max()) for a, p in zip(rank_out["params"], params)]
        assert max(errors) <= 1e-6, errors
        assert rank_out["penalty"] == pytest.approx(float(opt.penalty().detach()), rel=1e-6)
    # each rank holds only its own shard of an anchor, uneven ones too (5 rows over 2 ranks: 3 + 2)
    assert [o["local_anchor_shapes"][2] for o in out] == [(3, 8), (2, 8)]
    assert [o["local_anchor_shapes"][5] for o in out] == [(2,), (1,)]


# ---------------------------------------------------------------------------- teleport

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)
SITES = [Site(LEAKY, ("0.weight", "0.bias", "2.weight")), Site(LEAKY, ("2.weight", "2.bias", "4.weight"))]
PROBE = torch.linspace(-2, 2, 5 * 6).reshape(5, 6)


def _teleport(model: nn.Module, **kwargs: Any) -> Teleport:
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return Teleport(base, model, SITES, loss_fn=_mse, **kwargs, search=SearchConfig(steps=10), objective="grad_norm")


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole parameters, gradients and AdamW state (gathered from the shards: a collective)."""
    params = list(model.parameters())
    return {
        "params": [_full(p) for p in params],
        "grads": [_full(p.grad) for p in params],
        "state": [{k: _full(v) for k, v in sorted(opt.state[p].items())} for p in params],
    }


@torch.no_grad()
def _probe(model: nn.Module) -> torch.Tensor:
    out = model(PROBE)
    reshard(model)  # FSDP2 keeps the root unsharded after a forward pass without backward
    return out


def _teleport_worker(rank: int, _: str) -> dict[str, Any]:
    model = _shard(_mlp())
    batches = iter(range(100))
    opt = _teleport(model, every=2, batch_fn=lambda: _batch(rank, 50 + next(batches)))
    for step in range(STEPS):  # scheduled teleports at steps 0 and 2, loss checked on the rank's batch
        x, y = _batch(rank, step)
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
    x, y = _batch(rank, 10)
    opt.zero_grad()
    _mse(model(x), y).backward()
    before, out_before = _snapshot(model, opt), _probe(model)
    report = opt.teleport(batch=(x, y))
    after, out_after = _snapshot(model, opt), _probe(model)
    refused = {}
    for what, kwargs in {"auto": {"sites": "auto"}, "general": {"sites": SITES, "search": SearchConfig(path="general")}}.items():
        try:
            Teleport(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs, schedule=Schedule())
            refused[what] = "no error"
        except ValueError as error:
            refused[what] = str(error)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    hsdp = fully_shard(_mlp(), mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))  # HSDP
    tensor_parallel = nn.Linear(6, 4)
    tensor_parallel.weight = nn.Parameter(distribute_tensor(tensor_parallel.weight.detach(), init_device_mesh("cpu", (WORLD,)), [Shard(1)]))
    for what, layout in {"hsdp": hsdp, "tensor_parallel": tensor_parallel}.items():
        try:
            Teleport(torch.optim.SGD(layout.parameters(), lr=0.1), layout, [], schedule=Schedule())
            refused[what] = "no error"
        except ValueError as error:
            refused[what] = str(error)
    from teleopt.sharding import CommunicatedBytes

    with CommunicatedBytes() as counted:  # what a rank sends: the input of each collective, once
        dist.all_reduce(torch.ones(5))
        full_first = model[0].weight.full_tensor()  # (8, 6) over 2 ranks: 4 rows of 6 float32 each
    assert full_first.shape == (8, 6)
    sent = (counted.bytes, dict(counted.calls))
    from teleopt.teleport.distributed import check_identical

    try:  # the guard the engine runs on the elements notices ranks that disagree
        check_identical([torch.ones(3), torch.full((2,), float(rank))], "test tensors")
        mismatch = "not caught"
    except RuntimeError as error:
        mismatch = str(error)
    check_identical([torch.ones(3), torch.zeros(2)], "test tensors")  # and passes identical ones
    # the balance objective (weight norms: no gradient) on the shards: its statistics are reduced there too
    balanced = _shard(_mlp(seed=2))
    bal = Teleport(torch.optim.AdamW(balanced.parameters(), lr=1e-2), balanced, SITES, objective="balance", loss_fn=_mse)
    bal_before = [_full(p) for p in balanced.parameters()]
    bal_batch = _batch(rank, 20)
    _mse(balanced(bal_batch[0]), bal_batch[1]).backward()  # FSDP2 teleports read .grad (the caps use it)
    bal_report = bal.teleport(batch=bal_batch)
    # an objective differentiated through the shards: the SGD-momentum step's predicted decrease
    pre_model = _shard(_mlp(seed=3))
    pre = Teleport(torch.optim.SGD(pre_model.parameters(), lr=1e-2, momentum=0.9), pre_model, SITES, objective="preconditioned_norm")
    _mse(pre_model(bal_batch[0]), bal_batch[1]).backward()
    pre_report = pre.teleport(batch=bal_batch)
    return {
        "sent": sent,
        "preconditioned": (pre_report.accepted, pre_report.reason, pre_report.elements),
        "balance": (bal_report.accepted, bal_report.reason, bal_report.elements, bal_before, [_full(p) for p in balanced.parameters()]),
        "mismatch": mismatch,
        "refused": refused,
        "scheduled": [(r.step, r.accepted, r.reason) for r in opt.reports[:-1]],
        "accepted": report.accepted,
        "reason": report.reason,
        "elements": report.elements,
        "before": before,
        "after": after,
        "out_before": out_before,
        "out_after": out_after,
        "batch": (x, y),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_teleport_on_fsdp2_moves_every_shard_consistently(tmp_path, monkeypatch):
    out = _spawn("teleport", str(tmp_path))
    for rank_out in out:
        # what needs the functional (unsharded) model is refused clearly
        refused = rank_out["refused"]
        assert all("FSDP2" in refused[what] and "fast path only" in refused[what] for what in ("auto", "general")), refused
        # layouts other than FSDP2's are refused, naming what is supported
        assert "2-D device mesh" in refused["hsdp"] and "1-D mesh, Shard(0)" in refused["hsdp"], refused
        assert "Shard(dim=1)" in refused["tensor_parallel"] and "outside any fully_shard" in refused["tensor_parallel"], refused
        assert "differ across ranks" in rank_out["mismatch"]
        # CommunicatedBytes: an all-reduce of 5 floats and the all-gather of a 4 x 6 shard, nothing else
        assert rank_out["sent"] == (5 * 4 + 4 * 6 * 4, {"allreduce_": 1, "all_gather_into_tensor": 1}), rank_out["sent"]
        assert [accepted for _, accepted, _ in rank_out["scheduled"]] == [True, True], rank_out["scheduled"]
        assert rank_out["accepted"], rank_out["reason"]
        # the sharded model computes the same function after the teleport
        assert _rel(rank_out["out_after"], rank_out["out_before"]) <= 1e-5
        assert max(_rel(a, b) for a, b in zip(rank_out["after"]["params"], rank_out["before"]["params"])) > 1e-2  # it moved
    # both ranks applied the same group elements, bitwise
    assert out[0]["elements"].keys() == out[1]["elements"].keys()
    assert all(torch.equal(out[0]["elements"][k], out[1]["elements"][k]) for k in out[0]["elements"])
    # a single-process teleport of the same whole model, gradients and state, on rank 0's batch
    before = out[0]["before"]
    model = _mlp()
    opt = _teleport(model)
    with torch.no_grad():
        for p, value, grad, state in zip(model.parameters(), before["params"], before["grads"], before["state"]):
            p.copy_(value)
            p.grad = grad.clone()
            opt.state[p] = {k: v.clone() for k, v in state.items()}
    # on the global batch: the sharded teleport's caps compare with the loss averaged over ranks
    global_batch = tuple(torch.cat([rank_out["batch"][i] for rank_out in out]) for i in range(2))
    # sharded, the predicted-decrease cap simulates the optimizer's update (no reduced decrease on shards); so does
    # this reference, so that its bisection takes the same decisions bit for bit
    from teleopt.teleport.fast_path import FastEvaluator

    monkeypatch.setattr(FastEvaluator, "decrease_bound", lambda self, elements: None)
    report = opt.teleport(batch=global_batch)
    assert report.accepted, report.reason
    assert all(torch.equal(report.elements[k], out[0]["elements"][k]) for k in report.elements)
    after = out[0]["after"]
    errors = {
        "params": max(float((a - p.detach()).abs().max()) for a, p in zip(after["params"], model.parameters())),
        "grads": max(float((a - p.grad).abs().max()) for a, p in zip(after["grads"], model.parameters())),
        "state": max(float((v - opt.state[p][k]).abs().max()) for s, p in zip(after["state"], model.parameters()) for k, v in s.items()),
    }
    assert max(errors.values()) <= 1e-6, errors
    # balance: the same elements and weights as one process balancing the same whole weights
    accepted, reason, elements, bal_before, bal_after = out[0]["balance"]
    assert accepted, reason
    assert all(torch.equal(a, b) for a, b in zip(bal_after, out[1]["balance"][4]))  # ranks identical
    model = _mlp(seed=2)
    assert all(torch.equal(a, p.detach()) for a, p in zip(bal_before, model.parameters()))
    single = Teleport(torch.optim.AdamW(model.parameters(), lr=1e-2), model, SITES, objective="balance", loss_fn=_mse)
    x, y = _global_batch(20)
    _mse(model(x), y).backward()
    report = single.teleport(batch=(x, y))
    assert report.accepted, report.reason
    for k in elements:
        torch.testing.assert_close(elements[k], report.elements[k], rtol=1e-6, atol=0)
    assert max(_rel(a, p.detach()) for a, p in zip(bal_after, model.parameters())) <= 1e-6
    assert max(_rel(a, b) for a, b in zip(bal_after, bal_before)) > 1e-2  # it moved
    # preconditioned_norm under SGD momentum: its search differentiates the decrease summed over the shards
    accepted, reason, elements = out[0]["preconditioned"]
    assert accepted, reason
    model = _mlp(seed=3)
    single = Teleport(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), model, SITES, objective="preconditioned_norm")
    _mse(model(x), y).backward()
    report = single.teleport(batch=(x, y))
    assert report.accepted, report.reason
    for k in elements:
        torch.testing.assert_close(elements[k], report.elements[k], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------- checkpoints


def _stacked(model: nn.Module, **kwargs: Any) -> Syre:
    """Syre(Teleport(AdamW)): anchors as per-parameter state, Teleport's counters at the top level."""
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    return Syre(Teleport(base, model, SITES, every=3, **kwargs, search=SearchConfig(steps=10)), gamma=0.5, sigma0=1.0, seed=3)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()


def _teleports(opt: Syre) -> tuple[int, int]:
    record = opt.base.record  # type: ignore[attr-defined]
    return record.step, record.accepted


def _checkpoint_worker(rank: int, out_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from teleopt.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(rank, step)

    path = os.path.join(out_dir, "checkpoint")
    model = _shard(_mlp())
    opt = _stacked(model)
    _train(model, opt, range(3), batch)  # a teleport at step 0
    dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}, checkpoint_id=path)
    saved = _teleports(opt)
    _train(model, opt, range(3, 6), batch)  # a teleport at step 3
    fresh = _shard(_mlp(seed=1))  # other weights: everything must come from the checkpoint
    resumed = _stacked(fresh)
    state = {"model": get_model_state_dict(fresh), "optim": optimizer_state_dict(fresh, resumed)}
    fresh_record = _teleports(resumed)  # torch's initialising step did not go through the wrappers
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    load_optimizer_state_dict(fresh, resumed, state["optim"])
    loaded = _teleports(resumed)
    _train(fresh, resumed, range(3, 6), batch)
    return {
        "records": (fresh_record, saved, loaded, _teleports(opt), _teleports(resumed)),
        "uninterrupted": [_full(p) for p in model.parameters()],
        "resumed": [_full(p) for p in fresh.parameters()],
        "anchors": [_full(resumed.anchor(p)) for p in list(fresh.parameters())[::2]],
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.load in one process, as meant
def test_dcp_checkpoint_of_the_wrappers_resumes_exactly_on_two_ranks_and_on_one(tmp_path):
    """Measured: the 2-rank resume is bitwise the uninterrupted run; the 1-process resume is 9.3e-10 max abs from it
    (the weights moved 6.2 from their initial values: two accepted teleports)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from teleopt.checkpoint import load_optimizer_state_dict, optimizer_state_dict

    out = _spawn("checkpoint", str(tmp_path))
    for rank_out in out:
        fresh, saved, loaded, end, resumed_end = rank_out["records"]
        assert fresh == (0, 0) and loaded == saved == (3, 1) and resumed_end == end == (6, 2)
        assert all(torch.equal(a, b) for a, b in zip(rank_out["resumed"], rank_out["uninterrupted"]))
    # world size 2 -> 1: the sharded checkpoint loads into an unsharded model in one process
    import torch.distributed.checkpoint as dcp

    model = _mlp(seed=1)
    opt = _stacked(model)
    state = {"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=os.path.join(tmp_path, "checkpoint"))
    set_model_state_dict(model, state["model"])
    load_optimizer_state_dict(model, opt, state["optim"])
    assert _teleports(opt) == (3, 1)
    assert all(torch.equal(a, opt.anchor(p)) for a, p in zip(out[0]["anchors"], list(model.parameters())[::2]))
    _train(model, opt, range(3, 6), _global_batch)
    assert _teleports(opt) == (6, 2)
    errors = [float((a - p.detach()).abs().max()) for a, p in zip(out[0]["uninterrupted"], model.parameters())]
    assert max(errors) <= 1e-6, errors


# ---------------------------------------------------------------------------- a CNN and a transformer, 2 and 4 ranks


class _Block(nn.Module):
    """A pre-norm transformer block: two-head attention with separate q, k, v, o and a ReLU MLP."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no key bias: its gradient is zero up to round-off (softmax over keys ignores q . b_k), and AdamW turns
        # that round-off into lr-sized steps that differ between a sharded and an unsharded run
        self.q, self.k, self.v, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class _TinyTransformer(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.block = _Block(dim, heads)
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(dim=1))


def _model(kind: str) -> tuple[nn.Module, list[Site], Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]]:
    """A seeded model, its exact fast-path sites (detected on the unsharded model) and its data."""
    from teleopt import find_symmetries
    from teleopt.teleport.fast_path import fast_path_eligible

    torch.manual_seed(0)
    if kind == "cnn":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(2, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 24, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(24, 3),
        )
        shape: tuple[int, ...] = (2, 4, 4)
    elif kind == "vit_gl":  # timm's ViT: fused qkv, whose q, k and v rows the attention GL sites act on
        import timm

        model = timm.create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            num_classes=3,
            img_size=8,
            patch_size=4,
            depth=1,
            embed_dim=32,
            num_heads=2,
            qkv_bias=False,  # a key bias has a round-off gradient that AdamW turns into steps (see _Block)
        )
        shape = (3, 8, 8)
    else:  # "transformer_gl_wide": twice the width and heads, the same 8 x 8 GL blocks
        model = _TinyTransformer(32, 4) if kind.endswith("wide") else _TinyTransformer()
        shape = (5, 4)

    # the GL-on-shards runs are float64: a float32 check of a GL teleport is often inconclusive (3e-5 against
    # 1e-5 on 4 ranks), and a sharded model has no float64 re-run, so such a teleport is rolled back
    dtype = torch.float64 if kind.startswith("transformer_gl") or kind == "vit_gl" else torch.float32
    model = model.to(dtype)

    def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(4, *shape, generator=gen, dtype=dtype), torch.randn(4, 3, generator=gen, dtype=dtype)

    sites = [s for s in find_symmetries(model, (data(0, 0)[0],)).sites if fast_path_eligible(s)]
    if kind.startswith("transformer_gl") or kind == "vit_gl":  # as sites="auto" under AdamW: no LayerNorm-affine rescalings
        sites = [s for s in sites if "norm" not in s.name]
    return model, sites, data


def _shard_all(model: nn.Module, placement: Callable[[nn.Parameter], Any] | None = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for m in model.children():  # each layer / transformer block its own unit (attention reads out_proj's weight itself)
        if any(p.requires_grad for p in m.parameters()):
            fully_shard(m, shard_placement_fn=placement)
    fully_shard(model, shard_placement_fn=placement)
    return model


def _models_optimizer(model: nn.Module, sites: list[Site], batch_fn: Callable[[], Any]) -> Syre:
    """Syre(Teleport(AdamW)): teleports every 2 steps and the anchor decay of every parameter.

    The watch restores a snapshot: a rolled-back teleport's steps since are discarded, where the default
    inverse move would keep them and AdamW amplifies the ranks' round-off (2e-4 apart from one process instead
    of 1e-7); this test compares sharding.  The default patience: over 6 steps the CNN's teleport at step 0 is
    rolled back at step 1 (105x), and the transformer's teleports at steps 0 and 2, joined in one watch, at
    step 4 (147x), on every rank as in one process."""
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    safety = SafetyConfig(watch_restore="snapshot")
    teleport = Teleport(base, model, sites, loss_fn=_mse, every=2, batch_fn=batch_fn, safety=safety, search=SearchConfig(steps=10))
    return Syre(teleport, gamma=0.1, sigma0=1.0, seed=3)


def _models_worker(rank: int, _: str, kinds: tuple[str, ...] = ("cnn", "transformer"), rows: bool = False) -> dict[str, Any]:
    """``rows``: the weights GL sites act on by rows sharded along their columns
    (:func:`teleopt.sharding.shard_placement_fn`), so their teleports stay on the shards."""
    from teleopt.sharding import CommunicatedBytes, shard_placement_fn

    world = dist.get_world_size()
    result: dict[str, Any] = {}
    for kind in kinds:
        model, sites, data = _model(kind)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model = _shard_all(model, shard_placement_fn(model, sites) if rows else None)
        placements = {n: str(p.placements) for n, p in model.named_parameters()}
        with pytest.warns(UserWarning) if kind != "cnn" else contextlib.nullcontext():  # LayerNorm sites left out
            auto = Teleport(torch.optim.AdamW(model.parameters()), model, "auto", example_inputs=(data(rank, 0)[0],), schedule=Schedule())
        auto_sites = [s.name for s in auto.sites or []]
        calls = iter(range(100))
        opt = _models_optimizer(model, sites, lambda data=data, calls=calls: data(rank, 50 + next(calls)))
        teleport = opt.base
        assert isinstance(teleport, Teleport)
        after_teleports = []
        for step in range(6):  # teleports every 2 steps, rollbacks by the watch
            x, y = data(rank, step)
            opt.zero_grad()
            _mse(model(x), y).backward()
            opt.step()
            if teleport.reports and teleport.reports[-1].step == step:
                after_teleports.append([_full(p) for p in model.parameters()])
        final = [_full(p) for p in model.parameters()]
        x, y = data(rank, 10)
        opt.zero_grad()
        _mse(model(x), y).backward()
        reshard(model)
        with CommunicatedBytes() as forward_bytes:  # what one check forward costs (FSDP's own all-gathers)
            with torch.no_grad():
                model(x)
            reshard(model)
        with CommunicatedBytes() as teleport_bytes:
            report = teleport.teleport(batch=(x, y))
        result[kind] = {
            "sites": [s.name for s in sites],
            "auto_sites": auto_sites,
            "reports": [(r.step, r.accepted, r.reason) for r in teleport.reports],
            "after_teleports": after_teleports,
            "final": final,
            "accepted": report.accepted,
            "reason": report.reason,
            "teleport_bytes": teleport_bytes.bytes,
            "forward_bytes": forward_bytes.bytes,
            "param_bytes": param_bytes,
            "calls": dict(teleport_bytes.calls),
            "world": world,
            "placements": placements,
        }
    return result


def _like_one_process(runs: list[dict[str, Any]], kind: str, world: int) -> list[int]:
    """Assert that the ranks' runs of ``kind`` agree with each other and with one process on the global
    batches (the same teleports and rollbacks, parameters within 1e-5, ``sites="auto"`` as unsharded);
    returns each rank's bytes sent by one teleport besides its two check forwards."""
    assert runs[0]["sites"], f"{kind}: no site detected"
    scheduled = [(step, accepted) for step, accepted, _ in runs[0]["reports"][:-1]]  # the last: the explicit one
    assert (0, True) in scheduled, runs[0]["reports"]
    for run in runs:
        assert [(step, accepted) for step, accepted, _ in run["reports"]] == [(step, accepted) for step, accepted, _ in runs[0]["reports"]]
        assert run["accepted"], run["reason"]
    for i in range(len(runs[0]["after_teleports"])):  # every rank holds identical full parameters, bitwise
        assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0]["after_teleports"][i], run["after_teleports"][i]))
    # one process, the same model, sites and schedule, on the global batches
    model, sites, data = _model(kind)
    # sites="auto" on the sharded model (detected on an unsharded copy) picks what it picks unsharded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        auto = Teleport(torch.optim.AdamW(model.parameters()), model, "auto", example_inputs=(data(0, 0)[0],), schedule=Schedule())
    assert all(run["auto_sites"] == [s.name for s in auto.sites or []] for run in runs), (runs[0]["auto_sites"], auto.sites)
    assert runs[0]["auto_sites"]

    def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [data(rank, step) for rank in range(world)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    calls = iter(range(100))
    opt = _models_optimizer(model, sites, lambda: global_batch(50 + next(calls)))
    for step in range(6):
        x, y = global_batch(step)
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
    assert [(r.step, r.accepted) for r in opt.base.reports] == scheduled  # the same teleports, watch and rollbacks
    errors = [float((a - p.detach()).abs().max()) for a, p in zip(runs[0]["final"], model.parameters())]
    # the reductions add in another order over ranks: float32 round-off, amplified by AdamW's normalisation of
    # small gradients (up to about 1e-6 seen); float64 runs agree to about 3e-13
    tol = 1e-10 if runs[0]["final"][0].dtype == torch.float64 else 1e-5
    assert max(errors) <= tol, (kind, errors)
    # a teleport's own communication: everything it sends but its two check forwards (FSDP's all-gathers)
    return [run["teleport_bytes"] - 2 * run["forward_bytes"] for run in runs]


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_cnn_and_transformer_teleport_like_one_process(tmp_path, world):
    """FSDP2 on every layer of a small CNN and a one-block transformer, 2 and 4 gloo ranks: ``sites="auto"`` on the
    sharded model finds what it finds unsharded; Syre(Teleport(AdamW)) with the exact fast-path sites, teleports
    scheduled every 2 steps with the default watch; every rank identical after each teleport, the run matches one
    process on the global batches (the same teleports and rollbacks, parameters within 1e-5), and a teleport's own
    communication is measured (CNN: 2.4-3.3 kB per rank against 30.5 kB of parameters; the transformer's GL sites
    on FSDP2's default row sharding, gathered: 13-22 kB against 9.4 kB)."""
    out = _spawn("models", str(tmp_path), world)
    for kind in ("cnn", "transformer"):
        runs = [rank_out[kind] for rank_out in out]
        own = _like_one_process(runs, kind, world)
        if kind == "cnn":  # diagonal sites on the shards: per-unit statistics, never the parameters
            assert max(own) <= 0.25 * runs[0]["param_bytes"], (own, runs[0]["param_bytes"], runs[0]["calls"])
        else:  # GL attention sites on row-sharded weights: the site members, gradients and AdamW moments gathered whole
            assert min(own) >= runs[0]["param_bytes"] // world, (own, runs[0]["param_bytes"])


@pytest.mark.parametrize("world", [2, 4])
def test_gl_sites_stay_on_the_shards_with_column_sharded_weights(tmp_path, world):
    """The transformer sharded with ``teleopt.sharding.shard_placement_fn`` (q, k, v weights, which the attention
    GL sites act on by rows, sharded along their columns): its teleports stay on the shards, sending per site
    the k x k Gram matrices of each head (O(k^2)), the biases the sites act on (O(units)) and the element
    check, not the weights, and still match one process."""
    out = _spawn("transformer_rows", str(tmp_path), world)
    own, params = {}, {}
    for kind in ("transformer_gl", "transformer_gl_wide"):
        runs = [rank_out[kind] for rank_out in out]
        placements = runs[0]["placements"]
        assert all(placements[f"block.{n}.weight"] == "(Shard(dim=1),)" for n in ("q", "k", "v")), placements
        assert placements["block.o.weight"] == "(Shard(dim=0),)"  # acted on by columns: the default layout serves
        own[kind], params[kind] = max(_like_one_process(runs, kind, world)), runs[0]["param_bytes"]
    # gathered, one teleport sent more than all the parameters (13-22 kB against 9.4 kB, above); here less
    # (6.6 kB on 2 ranks, mostly the elements' broadcast and the caps' scalars), and doubling the width (twice
    # the heads, the same 8 x 8 blocks: 35 kB of parameters) adds about 1 kB, a fraction of the parameters
    assert own["transformer_gl"] < params["transformer_gl"], (own, params)
    added = own["transformer_gl_wide"] - own["transformer_gl"]
    assert added < 0.25 * (params["transformer_gl_wide"] - params["transformer_gl"]) // world, (own, params)


def test_a_timm_vit_with_fused_qkv_teleports_on_the_shards(tmp_path):
    """timm's ViT (one block, fused qkv) sharded with ``shard_placement_fn``: the Q/K and V/O GL sites act on
    row slices of the column-sharded qkv weight (and proj's columns), reduced and moved on the shards; the run
    matches one process (the Q/K site's linearised direction is near singular at initialisation: without
    ``BOUNDARY_RTOL`` its boundary point followed round-off and the runs parted)."""
    out = _spawn("vit_rows", str(tmp_path), WORLD)
    runs = [rank_out["vit_gl"] for rank_out in out]
    placements = runs[0]["placements"]
    assert placements["blocks.0.attn.qkv.weight"] == "(Shard(dim=1),)", placements
    assert placements["blocks.0.attn.proj.weight"] == "(Shard(dim=0),)"
    own = _like_one_process(runs, "vit_gl", WORLD)
    assert max(own) < 0.5 * runs[0]["param_bytes"], (own, runs[0]["param_bytes"], runs[0]["calls"])  # gathered: 0.78x (90 kB)


def test_shard_placement_fn_shards_row_acted_weights_along_columns_and_refuses_other_inputs():
    """Only the weights a matrix group acts on by rows get ``Shard(1)``: not the output projection (columns),
    biases or the rescaled MLP; something that is not a site is a clear ``TypeError``."""
    from torch.distributed.tensor import Shard

    from teleopt.sharding import shard_placement_fn

    model, sites, _ = _model("transformer_gl")
    fn = shard_placement_fn(model, sites)
    column = {n for n, p in model.named_parameters() if fn(p) == Shard(1)}
    assert column == {"block.q.weight", "block.k.weight", "block.v.weight"}, column
    with pytest.raises(TypeError, match="Site objects"):
        shard_placement_fn(model, ["block.q.weight"])


def test_unsharded_copy_keeps_names_ties_and_leaves_the_original_alone():
    """``unsharded_copy`` (for detection on FSDP2 models) on an ordinary module: the same names, tied weights
    and repeated modules stay one object, buffers and the non-persistent set are the copy's own."""
    from teleopt.sharding import unsharded_copy

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight
            self.again = self.head
            self.register_buffer("scratch", torch.zeros(2), persistent=False)
            self.register_forward_hook(lambda *_: None)

    model = Tied()
    twin = unsharded_copy(model)
    assert type(twin) is Tied and [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert twin.head.weight is twin.emb.weight and twin.again is twin.head  # ties kept
    assert twin.emb.weight is not model.emb.weight and torch.equal(twin.emb.weight, model.emb.weight)
    assert twin.scratch is not model.scratch and not twin._forward_hooks and model._forward_hooks
    twin.register_buffer("extra", torch.zeros(1), persistent=False)
    assert "extra" not in model._non_persistent_buffers_set


# ---------------------------------------------------------------------------- spawning

SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "syre": _syre_worker,
    "teleport": _teleport_worker,
    "checkpoint": _checkpoint_worker,
    "models": _models_worker,
    "transformer_rows": lambda rank, out: _models_worker(rank, out, ("transformer_gl", "transformer_gl_wide"), rows=True),
    "vit_rows": lambda rank, out: _models_worker(rank, out, ("vit_gl",), rows=True),
}


def _worker(rank: int, world: int, init_file: str, out_dir: str, scenario: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)  # a collective one rank never joins fails the test, not CI
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        result = SCENARIOS[scenario](rank, out_dir)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # gloo aborts a rank that tears down while its peer is still inside a collective: meet first
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Interpreter teardown can abort a rank inside gloo's or the device mesh's C++ destructors
    # (CI saw SIGABRT after both ranks had met at the barrier; tests/test_teleport_distributed.py):
    # the result is written, so leave without running them.  Failures above still reach mp.spawn.
    os._exit(0)


def _spawn(scenario: str, out_dir: str, world: int = WORLD) -> list[dict[str, Any]]:
    """Run ``SCENARIOS[scenario](rank, out_dir)`` on ``world`` gloo ranks (rendezvous file in ``out_dir``); results by rank."""
    mp.spawn(_worker, args=(world, os.path.join(out_dir, "init"), out_dir, scenario), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(world)]
