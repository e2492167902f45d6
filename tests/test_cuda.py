"""The CUDA path: teleports, Syre and FSDP2 on a GPU agree with the CPU and stay exact.

Every test here needs a CUDA device and is skipped without one (CI has none; these
run where a GPU is lent, e.g. ``python -m pytest tests/test_cuda.py``).  The
16-bit and ``torch.compile`` tests of ``test_low_precision.py`` and
``test_compile.py`` also take a ``cuda`` parameter that skips the same way.

Tolerances: float64 matrix products on the GPU and the CPU add in different
orders, so the same teleport lands within ~1e-13 relative (a 20-step ascent
amplifies the 1e-16 differences by its conditioning); 1e-9 leaves margin and
still catches any device-dependent error (a wrong transport is 1e-3 or more).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_fsdp2 import _model, _models_optimizer, _mse, _shard_all
from test_teleport_fast_path import data, mlp, mse, rescaling_sites
from torch import nn
from torch.nn import functional as F

import teleopt
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _teleported(device: str, **kwargs: Any) -> tuple[float, float, list[torch.Tensor], Any]:
    """One gradient-norm teleport of the float64 5-6-7-3 MLP on ``device`` (``Teleport`` keywords ``kwargs``):
    loss before/after, parameters, report."""
    model = mlp(0).to(device)
    x, y = (t.to(device) for t in data())
    opt = Teleport(torch.optim.SGD(model.parameters(), lr=0.01), model, rescaling_sites(), loss_fn=mse, **kwargs, schedule=Schedule())
    mse(model(x), y).backward()
    with torch.no_grad():
        before = float(mse(model(x), y))
    report = opt.teleport(batch=(x, y))
    with torch.no_grad():
        after = float(mse(model(x), y))
    return before, after, [p.detach().cpu() for p in model.parameters()], report


def test_a_fast_teleport_on_the_gpu_lands_where_the_cpu_one_does():
    cpu_before, _, cpu_params, cpu_report = _teleported("cpu", search=SearchConfig(steps=20))
    before, after, params, report = _teleported("cuda", search=SearchConfig(steps=20))
    assert report.accepted and cpu_report.accepted, (report.reason, cpu_report.reason)
    assert report.path == "fast" and report.grad_norm_after > report.grad_norm_before
    assert abs(after - before) <= 1e-12 * abs(before)  # exact symmetry, float64 round-off
    assert abs(before - cpu_before) <= 1e-12 * abs(before)
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_a_general_path_teleport_on_the_gpu_is_exact():
    """Autograd through the model on the batch (``path="general"``): the same exactness on the GPU."""
    before, after, _, report = _teleported("cuda", search=SearchConfig(path="general", steps=5))
    assert report.accepted and report.path == "general", report.reason
    assert report.grad_norm_after > report.grad_norm_before
    assert abs(after - before) <= 1e-12 * abs(before)


def _resnet() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10, channels=(8, 16, 16, 16)).double()


@pytest.mark.parametrize("make", [_resnet, lambda: _vit().double()], ids=["resnet", "vit"])
def test_detection_on_the_gpu_finds_and_certifies_what_it_does_on_the_cpu(make):
    """``find_symmetries`` (tracing, rules, certification by random group elements at the range's edge) on a
    GPU copy of a timm model: the same sites, kinds and certification verdicts as on the CPU."""
    from teleopt import find_symmetries

    model = make()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reports = [find_symmetries(m, (x.to(device),)) for m, device in ((model, "cpu"), (copy.deepcopy(model).cuda(), "cuda"))]
    cpu, gpu = ([(s.name, s.action.exactness) for s in r.sites] for r in reports)
    assert cpu and gpu == cpu


def _vit() -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16, patch_size=4, depth=2)


def test_a_timm_vit_trains_with_teleport_and_syre_on_the_gpu():
    """``sites="auto"`` (attention GL sites; fused attention on CUDA), teleports every 2 steps under
    Syre(Teleport(AdamW)): every teleport accepted or declined by the library's own rules, its outputs
    unchanged within the check tolerance, and parameters and optimizer state never leave the GPU."""
    model = _vit().cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16, device="cuda", generator=gen), torch.randint(0, 10, (8,), device="cuda", generator=gen)
    with pytest.warns(UserWarning, match="leaves out"):  # LayerNorm gains under an adaptive optimizer
        teleport = Teleport(
            torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0),
            model,
            "auto",
            example_inputs=(x[:2],),
            loss_fn=F.cross_entropy,
            every=2,
        )
    opt = teleopt.Syre(teleport, gamma=0.01, sigma0=1.0, seed=0)
    assert teleport.sites and all("attention" in s.name for s in teleport.sites)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert teleport.reports and any(r.accepted for r in teleport.reports)
    for r in teleport.reports:
        if r.accepted:
            assert r.check_error is not None and r.check_passed, r  # float32: or passed its float64 re-run
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(p.is_cuda for p in model.parameters())
    assert all(v.is_cuda for s in teleport.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def test_syre_draws_the_same_anchors_on_the_gpu_as_on_the_cpu():
    """Anchors come from a CPU generator seeded per parameter: a CUDA run decays towards the same points."""
    runs = []
    for device in ("cpu", "cuda"):
        model = mlp(0).to(device)
        x, y = (t.to(device) for t in data())
        opt = teleopt.Syre(torch.optim.SGD(model.parameters(), lr=0.05), gamma=0.5, sigma0=1.0, seed=7, exclude_1d=False)
        for _ in range(3):
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
        runs.append([p.detach().cpu() for p in model.parameters()])
    for p, q in zip(*runs):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- FSDP2 on one GPU (NCCL)


KINDS = ("cnn", "transformer", "transformer_gl")


def _fsdp2_worker(rank: int, init_file: str, out_file: str) -> None:
    import faulthandler

    from teleopt.sharding import full

    faulthandler.dump_traceback_later(240, exit=True)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        result: dict[str, Any] = {}
        from teleopt.sharding import shard_placement_fn

        for kind in KINDS:
            model, sites, data = _model(kind)
            rows = shard_placement_fn(model, sites) if kind == "transformer_gl" else None  # GL sites on the shards
            model = _shard_all(model.cuda(), rows)
            result[kind] = _train(model, sites, data)
            result[kind]["final"] = [full(p).detach().cpu() for p in model.parameters()]
            result[kind]["placements"] = sorted({str(p.placements) for p in model.parameters()})
        torch.save(result, out_file)
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _train(model: nn.Module, sites: list, data: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Four steps of the FSDP2 tests' Syre(Teleport(AdamW)) (teleports at steps 0 and 2) on the GPU."""
    calls = iter(range(100))
    opt = _models_optimizer(model, sites, lambda: tuple(t.cuda() for t in data(0, 50 + next(calls))))
    for step in range(4):
        x, y = (t.cuda() for t in data(0, step))
        opt.zero_grad()
        _mse(model(x), y).backward()
        opt.step()
    return {"reports": [(r.step, r.accepted, r.reason) for r in opt.base.reports], "final": [p.detach().cpu() for p in model.parameters()]}


def test_fsdp2_on_one_gpu_with_nccl_teleports_like_the_unsharded_model(tmp_path):
    """A single-rank NCCL mesh on one GPU (the GPU path of the FSDP2 tests, which run on gloo in CI): the CNN
    (diagonal sites: the on-shards route), the transformer (GL sites on row-sharded weights: gathered) and the
    float64 transformer with column-sharded q/k/v weights (GL sites on the shards) teleport and decay as the
    same model unsharded on the same GPU, within 1e-5 (float32) and 1e-10 (float64)."""
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_fsdp2_worker, args=(str(tmp_path / "init"), out), nprocs=1, join=True)
    sharded = torch.load(out, weights_only=False)
    for kind in KINDS:
        expected = ["(Shard(dim=0),)", "(Shard(dim=1),)"] if kind == "transformer_gl" else ["(Shard(dim=0),)"]
        assert sharded[kind]["placements"] == expected, sharded[kind]["placements"]
        model, sites, data = _model(kind)
        plain = _train(model.cuda(), sites, data)
        assert sharded[kind]["reports"] == plain["reports"]
        assert any(accepted for _, accepted, _ in plain["reports"]), plain["reports"]
        errors = [float((a - b).abs().max()) for a, b in zip(sharded[kind]["final"], plain["final"])]
        assert max(errors) <= (1e-10 if kind == "transformer_gl" else 1e-5), (kind, errors)  # float64 / float32


def test_the_output_check_seeds_the_gpu_generator_too():
    """A model with dropout on the GPU: the check's two forwards see the same dropout masks (it seeds every
    device when the model is not CPU-only), so an exact teleport in train mode passes its check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4)).double().cuda()
    x, y = torch.randn(32, 8, dtype=torch.float64, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    opt = Teleport(
        torch.optim.SGD(model.parameters(), lr=0.01), model, "auto", loss_fn=F.cross_entropy, safety=SafetyConfig(), schedule=Schedule()
    )
    F.cross_entropy(model(x), y).backward()
    report = opt.teleport(batch=(x, y))
    assert report.accepted, report.reason
    assert report.check_error is not None and report.check_error <= 1e-12


def _gl_teleported(device: str) -> tuple[Any, list[torch.Tensor], float]:
    """One default teleport of the GL(16) site of a float64 linear 12-16-10 network on ``device``: report,
    parameters, relative change of the outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Linear(16, 10, bias=False)).double().to(device)
    x, y = torch.randn(32, 12, dtype=torch.float64).to(device), torch.randn(32, 10, dtype=torch.float64).to(device)
    site = teleopt.Site(teleopt.get_action("gl_linear"), ("0.weight", "0.bias", "1.weight"))
    opt = Teleport(torch.optim.Adam(model.parameters(), lr=1e-3), model, [site], example_inputs=x[:8], schedule=Schedule())
    before = model(x).detach()
    F.mse_loss(model(x), y).backward()
    report = opt.teleport()
    change = float((model(x).detach() - before).norm() / before.norm())
    return report, [p.detach().cpu() for p in model.parameters()], change


def test_a_gl_teleport_of_a_gpu_model_searches_on_the_host_and_lands_where_the_cpu_one_does():
    """GL sites' search (Gram matrices, exp, solves, the boundary step's SVD) runs on the CPU for a CUDA
    model, and the elements move the GPU tensors: the same element, gain and parameters as the same
    teleport on the CPU, and the outputs unchanged."""
    cpu_report, cpu_params, _ = _gl_teleported("cpu")
    report, params, change = _gl_teleported("cuda")
    assert report.accepted and cpu_report.accepted, (report.reason, cpu_report.reason)
    (element,) = report.elements.values()
    assert element.device.type == "cpu"  # chosen on the host
    torch.testing.assert_close(element, next(iter(cpu_report.elements.values())), rtol=1e-9, atol=1e-12)
    assert report.gain == pytest.approx(cpu_report.gain, rel=1e-9) and report.gain > 1
    assert change <= 1e-12
    for p, q in zip(params, cpu_params):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_rollbacks_by_the_inverse_elements_on_the_gpu():
    """On the GPU: a wrong rescaling (not a symmetry) rolled back with the watch off copies nothing when its
    elements are powers of two (the default boundary step's 4, 1/4, 1), and the parameters come back bit
    for bit; an accepted teleport under ``watch_restore="inverse"`` and its watch's inverse move give the
    parameters back bit for bit too, with the outputs unchanged."""
    from test_teleport_wrapper import _wrong_rescaling

    from teleopt.functional import as_batch
    from teleopt.teleport.safety import InverseSnapshot
    from teleopt.teleport.watch import InverseMove

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.LeakyReLU(0.1), nn.Linear(6, 3)).cuda()
    x, y = torch.randn(16, 5).cuda(), torch.randn(16, 3).cuda()
    bad = teleopt.Site(_wrong_rescaling(), ("0.weight", "0.bias", "2.weight"))
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model,
        [bad],
        loss_fn=F.mse_loss,
        safety=SafetyConfig(watch_steps=0),
        schedule=Schedule(),
    )
    F.mse_loss(model(x), y).backward()
    before = copy.deepcopy(model.state_dict())
    copies = []
    init = InverseSnapshot.__init__

    def recording(self, *a, **k):
        init(self, *a, **k)
        copies.append(self.copies)

    InverseSnapshot.__init__ = recording  # type: ignore[method-assign]
    try:
        report = opt.teleport(batch=(x, y))
    finally:
        InverseSnapshot.__init__ = init  # type: ignore[method-assign]
    assert not report.accepted and copies == [False], (report.reason, copies)
    assert all(torch.equal(v, before[n]) for n, v in model.state_dict().items())

    leaky = teleopt.get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)
    good = [teleopt.Site(leaky, ("0.weight", "0.bias", "2.weight"))]
    opt = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model,
        good,
        example_inputs=x[:8],
        safety=SafetyConfig(watch_restore="inverse"),
        schedule=Schedule(),
    )
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    outputs, before = model(x).detach(), copy.deepcopy(model.state_dict())
    assert opt.teleport().accepted
    watch = opt.record.watch
    assert watch is not None and isinstance(watch.snapshot, InverseMove)
    assert watch.snapshot.restore(as_batch((x[:8], None)), 0) == 0.0
    assert all(torch.equal(v, before[n]) for n, v in model.state_dict().items())
    assert torch.equal(model(x).detach(), outputs)
