"""What teleporting costs: the configuration users run, and the bare fast path's step overhead, autograd vs
fast path and memory.

**The default table** times the README's configuration, ``Teleport(base, model, sites,
example_inputs=x[:2], loss_fn=..., batch_fn=...)`` with the library's defaults (the
predicted-decrease cap, the output check on the teleport batch and the watch on), for
its default objective (``"balance"``: the README configuration as written, whose first
scheduled teleport is the checked one timed here) and for ``"grad_norm"`` (the same with
``schedule=Schedule()``), one
thread, CPU process time: one ``teleport(batch=...)`` right after a backward, and next
to it the bare fast path ``teleport()`` (probe check, no caps), each paired with a bare
``step()`` and a training iteration from the same start point, interleaved (medians of
the per-pair ratios), the peak extra memory of one checked teleport and the growth of
``torch.save(state_dict())`` it leaves (``ckpt``: the default watch's record).  Rows:

* ``mlp-10M``: ReLU MLP 1024-2048-2048-1536-10, batch 64 (``--quick``: 16), cross entropy, Adam lr 1e-4;
* ``resnet18``: timm resnet18 at 64x64, batch 8, SGD momentum 0.9 (``sites="auto"``: under
  Adam it keeps no site there);
* ``vit_tiny``: timm vit_tiny at 32x32 with 8x8 patches, batch 8, Adam (attention Q/K and V/O GL sites);
* ``llama-4L``: a 4-layer Llama-architecture causal LM (transformers ``LlamaConfig``, hidden 128,
  vocab 256), batch 4 x 64 tokens, Adam;

and ``objective="balance", every=1`` over a training run (AdamW lr 1e-3, 40 iterations,
``--quick`` 10, each paired with the bare optimizer's, alternating), as run-time growth, on
peft LoRA (r 8, q_proj and v_proj) of a 2-layer Llama and on the 4-layer Llama LM.

**``--bare``** prints the earlier table instead, the fast path without a batch:

Models (CPU, float32, Adam as the base optimizer):

* ``mlp-5678``: the papers' 5-6-7-8 MLP (LeakyReLU 0.1, no biases), batch 4;
* ``mlp-10M``: a ReLU MLP 1024-2048-2048-1536-10 (9.4M parameters), batch 64;
* ``resnet18``: timm resnet18 (``pretrained=False``), batch 8 at 224x224 (``--quick``: 64x64);
* ``vit_tiny``: timm vit_tiny_patch16_224 (``pretrained=False``, 10 classes), batch 8 at
  224x224 (``--quick``: batch 4 at 64x64); its sites are ``find_symmetries``' attention
  Q/K and V/O GL sites (24: 12 blocks x 2, each GL(64) per head), the normalisation
  gains being left out under Adam by ``sites="auto"``.  Attention runs unfused (timm's
  ``fused_attn=False``) in this row: torch's fused CPU attention kernel has no double
  backward, which the autograd path of ratio 3 needs.

Sites: positive rescalings of every hidden layer of the MLPs; for resnet18 the
exact BatchNorm-output rescaling of every BasicBlock (bn1 weight and bias by c,
conv2's input channels by 1/c through the ReLU), made by hand: ``sites="auto"``
leaves normalisation gains out under Adam, which leaves resnet18 no continuous
site (``--auto-sites`` measures that).

Ratios of repeated, interleaved measurements within this run; each time is the
median over the repetitions, and the step overhead is the median of the paired
per-repetition differences (the machines are shared and noisy; pairing and
alternating the order cancel most of the drift):

1. ``step overhead``: ``Teleport.step()`` on a step without teleport vs the bare
   ``optimizer.step()`` (gradients already computed); goal <= 1% overhead.  Also
   shown relative to a whole training iteration (forward, backward, step), and in
   microseconds (``over us``: the absolute goal of <= 10 us on mlp-5678, whose row takes
   500 repetitions, ``--quick``).  ``own`` times the wrapper's own work directly: the time
   the wrapped step spends outside the base's update (timed by the base optimizer's step
   pre- and post-hooks) minus the same for the bare optimizer (torch's step machinery,
   which both pay), free of the noise of subtracting two step times of 10-60 ms; on
   mlp-5678 it also carries the difference of the two updates' own times (the base's
   update inside the wrapper runs a few us faster or slower), so ``over us`` is its figure.
2. ``fast / base``: one fast-path teleport (library defaults: a boundary step, trust
   region log 4, no batch: checked on probe inputs, the 2 example inputs for vit_tiny,
   else the first 8 rows of the last forward's inputs; each from the same weights and
   optimizer state, as teleports back to back without training compound their elements)
   vs one training iteration of the base optimizer and vs ``optimizer.step()`` alone; goals <= 1.5x a
   step on mlp-10M, <= 0.5x an iteration on resnet18 and vit_tiny.  Each teleport is paired
   with a bare step (after its own backward) and an iteration from the same point, in the
   same loop, and the ratios are medians of the per-pair ratios (``step ms`` and ``iter ms``
   are the overhead loop's).
3. ``autograd / fast``: the same objective (gradient norm) and the same number of
   ascent steps (10, no trust region so no early stop) through the model with
   autograd (the general path, double backward on the batch) vs the fast path;
   goal >= 50x.
4. ``peak extra``: the peak of the bytes a teleport allocates on top of what was alive
   when it began (parameters, gradients, optimizer state), as a multiple of the
   parameters' bytes, measured by :class:`LiveBytes` (a dispatch mode that counts every
   new tensor storage until it is freed) with the watch off (``watch_steps=0``, as in
   ratio 2) and with the library default (``watch_steps=10``: the watch keeps the
   teleport's elements, in the checkpoint too), and with ``watch_restore="snapshot"``
   (a copy of every parameter and optimizer state entry); goal <= 1x.  ``kept`` is what stays allocated after the teleport.

Run: ``python benchmarks/teleport_cost.py [--quick] [--bare] [--json out.json] [--device cuda]``
(default table: ``[--objective balance|grad_norm|both] [--rows mlp-10M ...] [--checked]``, the last
leaving out the balance-every-step rows).  With
``--device cuda`` models, batches and optimizer state live on the GPU and every timed interval
waits for the device's queued kernels (``torch.cuda.synchronize``) at both ends.

``--overhead`` measures instead the step overhead on mlp-5678 alone: 2000 (``--quick``; else 10000)
paired repetitions of a bare Adam step and a ``Teleport`` step without teleport, right after a backward
pass and back to back (median and quartiles of the differences; goal <= 10 us).

It then prints the README configuration's step overhead by phase (:func:`measure_phases`: before the first
teleport, the reference-sampling steps before it, a step in the watch window after it, and after the window) on
the realistic suite's MLP 64-256-256-10 (batch 64, SGD momentum and AdamW) and a 2-layer Llama LM (AdamW);
300 (``--quick``; else 2000) paired repetitions per phase on the MLP, a tenth (at least 40) on the LM; goal <= 1%
of an iteration.

``--search`` measures instead, for scaling sites, the default boundary step against 100 steps of
projected ascent (gains and time of 5 consecutive teleports on the digits MLP, mlp-10M and resnet18).

``--scheduled`` measures instead the README configuration's *scheduled* balance teleports through ``step()``
(:func:`measure_scheduled`), on the default table's four rows (``--rows`` picks some): the first teleport of a
balance plan (checked on ``batch_fn``'s batch: the lean move with the output check around it,
``teleopt.teleport.lean_check``, or the engine where the lean path cannot take it) and a later one (the lean
path of ``teleopt.teleport.companion`` where it applies), each in bare steps and iterations, with its peak extra
memory and the path that ran it.

``--balance-run`` prints only the balance-every-step rows of the default table (the run-time growth, its
median per iteration, and how many teleports ran on the lean path of ``teleopt.teleport.companion``).

``--balance`` measures instead one ``objective="balance"`` teleport (closed form)
against one ``AdamW.step()`` and one training iteration on the realistic suite's
MLP 64-256-256-10 and on ``mlp-10M``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import io
import json
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from teleopt import AxisAction, Member, Site, get_action
from teleopt.teleport import SafetyConfig, Schedule, SearchConfig, Teleport

LEAKY = get_action("positive_rescaling", activation="leaky_relu", negative_slope=0.1)
RELU = get_action("positive_rescaling", activation="relu")
BN_OUTPUT = AxisAction(
    "batchnorm_output_rescaling",
    "diagonal",
    (Member("gamma", 0), Member("beta", 0), Member("W_next", 1, -1)),
    reference="Zhao 2026, Ex. 1.2.4, 1.2.7 (BatchNorm output through ReLU)",
)


def mlp_5678() -> tuple[nn.Module, list[Site], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 6, bias=False), nn.LeakyReLU(0.1), nn.Linear(6, 7, bias=False), nn.LeakyReLU(0.1), nn.Linear(7, 8, bias=False)
    )
    sites = [Site(LEAKY, ("0.weight", None, "2.weight")), Site(LEAKY, ("2.weight", None, "4.weight"))]
    return model, sites, (torch.rand(4, 5), torch.rand(4, 8))


def mlp_10m(batch: int, widths: list[int] | None = None) -> tuple[nn.Module, list[Site], tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    widths = widths or [1024, 2048, 2048, 1536, 10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    sites = [Site(RELU, (f"{2 * i}.weight", f"{2 * i}.bias", f"{2 * i + 2}.weight")) for i in range(len(widths) - 2)]
    return model, sites, (torch.randn(batch, widths[0]), torch.randn(batch, widths[-1]))


def resnet18(batch: int, size: int, auto: bool) -> tuple[nn.Module, list[Site] | str, tuple[torch.Tensor, torch.Tensor], str]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    if auto:
        try:
            from teleopt.detection import find_symmetries  # noqa: F401

            return model, "auto", (x, y), "auto (find_symmetries)"
        except ImportError:
            pass
    sites = []
    for name, module in model.named_modules():
        if hasattr(module, "bn1") and hasattr(module, "conv2"):
            sites.append(Site(BN_OUTPUT, (f"{name}.bn1.weight", f"{name}.bn1.bias", f"{name}.conv2.weight")))
    return model, sites, (x, y), f"{len(sites)} hand-made BatchNorm-output rescalings"


def vit_tiny(batch: int, size: int) -> tuple[nn.Module, str, tuple[torch.Tensor, torch.Tensor]]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=size)
    for module in model.modules():  # the autograd path differentiates twice; torch's fused CPU attention
        if hasattr(module, "fused_attn"):  # kernel has no double backward, so both paths use timm's plain one
            module.fused_attn = False
    return model, "auto", (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under this mode and still alive: ``live`` now, ``peak`` the most.

    Every op output whose storage is new (not one of the op's inputs, e.g. an in-place op or a
    view) is counted until the storage is freed (a ``weakref.finalize`` on it).  Tensors alive
    before the mode was entered are not counted, so ``peak`` is the extra memory of what ran
    inside.  Works on any device, the CPU included, where torch keeps no allocator statistics.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._seen:
                continue
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out


def peak_extra_memory(
    model: nn.Module, sites: Any, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, watch: int, restore: str = "inverse"
) -> dict[str, float]:
    """One teleport (after one Adam step) under :class:`LiveBytes`: its peak extra bytes, the
    bytes it leaves allocated and the bytes its watch adds to ``state_dict`` (``ckpt``), as
    multiples of the parameters' bytes (``restore``: the watch's ``SafetyConfig.watch_restore``)."""
    x, y = batch
    example = x[:2] if sites == "auto" else None
    safety = SafetyConfig(watch_steps=watch, watch_restore=restore)
    wrapper = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-4), model, sites, example_inputs=example, safety=safety, schedule=Schedule()
    )
    for _ in range(2):  # one step so that Adam's state exists, then the gradient the teleport reads
        wrapper.zero_grad()
        loss_fn(model(x), y).backward()
        if not _:
            wrapper.step()
    counter = LiveBytes()
    with counter:
        report = wrapper.teleport()
    if not report.accepted:
        raise RuntimeError(f"the teleport whose memory is measured was not accepted: {report.reason}")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # what the wrapper adds to a checkpoint now (its watch: a snapshot, or the elements alone)
    watch = wrapper.state_dict()["teleopt_teleport"].get("watch")
    ckpt = sum(t.numel() * t.element_size() for t in tree_flatten(watch)[0] if isinstance(t, torch.Tensor))
    return {"peak": counter.peak / param_bytes, "kept": counter.live / param_bytes, "ckpt": ckpt / param_bytes}


def regression(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


DEVICE = torch.device("cpu")


def backward_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable) -> Callable[[], None]:
    """A function that computes fresh gradients of ``loss_fn(model(x), y)`` (``.grad`` zeroed first)."""

    def backward() -> None:
        model.zero_grad()
        loss_fn(model(x), y).backward()

    return backward


def _synchronize() -> None:
    """Wait for the device's queued kernels, so a wall-clock interval covers the work it timed."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def timed(fn: Callable[[], Any]) -> float:
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - start


def timed_teleport(wrapper: Teleport) -> tuple[float, Any]:
    """Seconds of one ``wrapper.teleport()`` and its report."""
    _synchronize()
    start = time.perf_counter()
    report = wrapper.teleport()
    _synchronize()
    return time.perf_counter() - start, report


def measure(
    name: str, model: nn.Module, sites: Any, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, reps: int, general_reps: int
) -> dict[str, Any]:
    model = model.to(DEVICE)
    x, y = batch = tuple(t.to(DEVICE) for t in batch)
    untouched = copy.deepcopy(model)  # the memory of a teleport is measured from the initial weights
    example = x[:2] if sites == "auto" else None
    bare = torch.optim.Adam(model.parameters(), lr=1e-4)
    base = torch.optim.Adam(model.parameters(), lr=1e-4)
    wrapper = Teleport(base, model, sites, example_inputs=example, safety=SafetyConfig(watch_steps=0), schedule=Schedule())
    n_params = sum(p.numel() for p in model.parameters())
    # the time a step spends outside the optimizer's update: each optimizer's step hooks time its update, so
    # the rest (torch's step machinery, and the wrapper's own work) is measured directly, not as the
    # difference of two noisy step times
    inside: dict[int, list[float]] = {id(bare): [], id(base): []}
    for opt in (bare, base):
        opt.register_step_pre_hook(lambda o, *_: inside[id(o)].append(-time.perf_counter()))
        opt.register_step_post_hook(lambda o, *_: inside[id(o)].__setitem__(-1, inside[id(o)][-1] + time.perf_counter()))

    backward = backward_of(model, x, y, loss_fn)

    def iteration(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        return run

    # warm up both optimizers (state initialised), then interleave
    backward()
    bare.step()
    wrapper.step()
    step_bare: list[float] = []
    step_wrapped: list[float] = []
    iters: list[float] = []
    own_bare: list[float] = []
    own_wrapped: list[float] = []

    def step(opt: torch.optim.Optimizer, update: torch.optim.Optimizer, times: list[float], outside: list[float]) -> None:
        times.append(timed(opt.step))
        outside.append(times[-1] - inside[id(update)][-1])  # the step's time outside the update

    for rep in range(reps):
        backward()
        if rep % 2:  # alternate the order: whichever runs second finds the gradients warm in cache
            step(bare, bare, step_bare, own_bare)
            step(wrapper, base, step_wrapped, own_wrapped)
        else:
            step(wrapper, base, step_wrapped, own_wrapped)
            step(bare, bare, step_bare, own_bare)
        iters.append(timed(iteration(bare)))
    t_bare, t_wrapped, t_iter = (statistics.median(v) for v in (step_bare, step_wrapped, iters))
    overhead = statistics.median(w - b for w, b in zip(step_wrapped, step_bare))
    own = statistics.median(w - b for w, b in zip(own_wrapped, own_bare))

    # every timed teleport starts from the same point: teleports back to back, with no training step between
    # them, compound their elements (vit_tiny's GL blocks: the third one's caps bisect, the fourth is rolled back)
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(base.state_dict()))

    scratch = torch.zeros(1 << 24, device=DEVICE)  # 64 MB, twice this CPU's last-level cache

    def restart() -> None:
        """Back to the same point, then the caches flushed: a training step finds the optimizer state as
        the last step left it, not as ``load_state_dict`` has just written it (mlp-10M's bare step:
        14-15 ms right after the load, 19-24 ms in the overhead loop)."""
        model.load_state_dict(start[0])
        # a copy: Optimizer.load_state_dict keeps the given state tensors when dtype and device match, and the
        # teleport's in-place transport of the moments (and a step) would otherwise move the start point itself
        base.load_state_dict(copy.deepcopy(start[1]))
        scratch.add_(1.0)

    # each teleport is paired with a bare step and an iteration from the same point in the same loop: on this
    # shared machine the bare mlp-10M step swung from 14 to 28 ms between runs, and a ratio of medians taken in
    # different loops carried that drift and compared a teleport after a load with a step after none
    fast_times, paired_steps, paired_iters, fast_report = [], [], [], None
    for _ in range(reps):
        restart()
        backward()
        seconds, fast_report = timed_teleport(wrapper)
        fast_times.append(seconds)
        restart()
        backward()
        paired_steps.append(timed(base.step))
        restart()
        paired_iters.append(timed(iteration(base)))
    t_fast = statistics.median(fast_times)

    # same objective and number of ascent steps, no trust region (no early stop): fast vs autograd
    steps = 10
    fast10 = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-4),
        model,
        wrapper.sites,
        safety=SafetyConfig(watch_steps=0, max_predicted_decrease=None),
        search=SearchConfig(steps=steps, trust_region=None, path="fast"),
        schedule=Schedule(),
    )
    general10 = Teleport(
        torch.optim.Adam(model.parameters(), lr=1e-4),
        model,
        wrapper.sites,
        loss_fn=loss_fn,
        safety=SafetyConfig(watch_steps=0, max_predicted_decrease=None, loss_tol=1e-3),
        search=SearchConfig(steps=steps, trust_region=None, path="general"),
        schedule=Schedule(),
    )
    f10, g10 = [], []  # each from the start point too: 500 accepted 10-step teleports in a row blew mlp-5678 up
    for _ in range(reps):
        restart()
        backward()
        f10.append(timed(fast10.teleport))
    for _ in range(general_reps):
        restart()
        backward()
        g10.append(timed(lambda: general10.teleport(batch=(x, y))))
    t_f10, t_g10 = statistics.median(f10), statistics.median(g10)
    return {
        "model": name,
        "params": n_params,
        "sites": len(wrapper.sites or []),
        "step_bare_ms": 1e3 * t_bare,
        "step_wrapped_ms": 1e3 * t_wrapped,
        "step_overhead_pct": 100 * overhead / t_bare,
        "step_overhead_us": 1e6 * overhead,
        "step_overhead_pct_of_iteration": 100 * overhead / t_iter,
        "step_own_us": 1e6 * own,
        "step_outside_bare_us": 1e6 * statistics.median(own_bare),
        "step_own_pct_of_iteration": 100 * own / t_iter,
        "iteration_ms": 1e3 * t_iter,
        "fast_teleport_ms": 1e3 * t_fast,
        "fast_over_iteration": statistics.median(f / i for f, i in zip(fast_times, paired_iters)),
        "fast_over_step": statistics.median(f / b for f, b in zip(fast_times, paired_steps)),
        "paired_step_ms": 1e3 * statistics.median(paired_steps),
        "paired_iteration_ms": 1e3 * statistics.median(paired_iters),
        "fast_gain": fast_report.gain if fast_report is not None else None,
        "fast10_ms": 1e3 * t_f10,
        "general10_ms": 1e3 * t_g10,
        "general_over_fast": t_g10 / t_f10,
        **{f"{k}_watch{w}": v for w in (0, 10) for k, v in peak_extra_memory(copy.deepcopy(untouched), sites, batch, loss_fn, w).items()},
        **{f"{k}_snapshot": v for k, v in peak_extra_memory(copy.deepcopy(untouched), sites, batch, loss_fn, 10, "snapshot").items()},
    }


def mlp_digits() -> tuple[nn.Module, list[Site], tuple[torch.Tensor, torch.Tensor]]:
    """The realistic suite's MLP 64-256-256-10 (ReLU), batch 64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    sites = [Site(RELU, (f"{i}.weight", f"{i}.bias", f"{i + 2}.weight")) for i in (0, 2)]
    return model, sites, (torch.randn(64, 64), torch.randint(0, 10, (64,)))


def measure_balance(
    name: str, model: nn.Module, sites: list[Site], batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, reps: int
) -> dict[str, Any]:
    """One ``objective="balance"`` teleport (closed form, defaults: watch snapshot on, no batch) against one
    ``AdamW.step()`` and one training iteration, interleaved; the weights are re-imbalanced before each
    teleport (random per-layer factors), so every teleport has work to do."""
    model = model.to(DEVICE)
    x, y = (t.to(DEVICE) for t in batch)
    bare = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapper = Teleport(torch.optim.AdamW(model.parameters(), lr=1e-4), model, sites, objective="balance")
    gen = torch.Generator().manual_seed(0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    backward = backward_of(model, x, y, loss_fn)
    backward()
    bare.step()
    wrapper.step()
    steps, iters, teleports, ratios = [], [], [], []
    for _ in range(reps):
        backward()
        steps.append(timed(bare.step))
        iters.append(timed(lambda: (bare.zero_grad(), loss_fn(model(x), y).backward(), bare.step())))
        with torch.no_grad():
            for m in linears:
                m.weight.mul_(float(torch.exp(torch.randn((), generator=gen))))
        backward()
        seconds, report = timed_teleport(wrapper)
        teleports.append(seconds)
        assert report.accepted, report
        ratios.append(report.objective_after / report.objective_before)
    t_step, t_iter, t_tele = (statistics.median(v) for v in (steps, iters, teleports))
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "sites": len(sites),
        "step_ms": 1e3 * t_step,
        "iteration_ms": 1e3 * t_iter,
        "balance_ms": 1e3 * t_tele,
        "balance_over_step": t_tele / t_step,
        "balance_over_iteration": t_tele / t_iter,
        "norm_ratio": statistics.median(ratios),
    }


def search_main(args: argparse.Namespace) -> None:
    """Scaling sites: the default boundary step against 100 projected-Adam ascent steps (``GradientAscent()``),
    ``teleports`` consecutive teleports each (watch off, Adam base), on the digits MLP, mlp-10M and resnet18's
    BatchNorm-output sites: each teleport's gain and the median time."""
    from teleopt.teleport import GradientAscent

    teleports = 5
    rows = []
    problems = [
        ("mlp-64-256", mlp_digits, nn.functional.cross_entropy),
        ("mlp-10M", lambda: mlp_10m(16 if args.quick else 64), regression),
        ("resnet18", lambda: resnet18(4 if args.quick else 8, 64 if args.quick else 224, auto=False)[:3], nn.functional.cross_entropy),
    ]
    for name, make, loss_fn in problems:
        for label, search in (("boundary", None), ("ascent", SearchConfig(strategy=GradientAscent()))):
            model, sites, batch = make()
            model = model.to(DEVICE)
            x, y = (t.to(DEVICE) for t in batch)
            wrapper = Teleport(
                torch.optim.Adam(model.parameters(), lr=1e-4),
                model,
                sites,
                safety=SafetyConfig(watch_steps=0),
                search=search,
                schedule=Schedule(),
            )
            model.zero_grad()
            loss_fn(model(x), y).backward()
            wrapper.step()
            times, gains = [], []
            for _ in range(teleports):
                model.zero_grad()
                loss_fn(model(x), y).backward()
                seconds, report = timed_teleport(wrapper)
                times.append(seconds)
                gains.append(report.gain)
            rows.append({"model": name, "search": label, "teleport_ms": 1e3 * statistics.median(times), "gains": gains})
    print(f"Scaling-site search, {datetime.date.today()}, {machine()}, torch {torch.__version__}")
    head = f"{'model':10} {'search':>8} {'ms':>8}  gains of {teleports} consecutive teleports"
    print(head)
    print("-" * len(head))
    for r in rows:
        gains = " ".join(f"{g:.4g}" if g is not None else "-" for g in r["gains"])
        print(f"{r['model']:10} {r['search']:>8} {r['teleport_ms']:>8.2f}  {gains}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "rows": rows}, f, indent=1)


def overhead_main(args: argparse.Namespace) -> None:
    """The step overhead on the 5-6-7-8 MLP alone, with many repetitions (goal <= 10 us): each repetition
    times a bare Adam step and a ``Teleport`` step without teleport (watch off) in alternating order, each
    right after its own backward pass (``after backward``) or back to back (``warm``), and keeps the
    difference; the median and quartiles of the differences over the repetitions."""
    reps = 2000 if args.quick else 10000
    model, sites, (x, y) = mlp_5678()
    model, x, y = model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)
    bare = torch.optim.Adam(model.parameters(), lr=1e-4)
    wrapper = Teleport(torch.optim.Adam(model.parameters(), lr=1e-4), model, sites, safety=SafetyConfig(watch_steps=0), schedule=Schedule())

    backward = backward_of(model, x, y, regression)
    backward()
    bare.step()
    wrapper.step()
    rows = []
    for label, fresh in (("after backward", True), ("warm", False)):
        diffs, steps = [], []
        for rep in range(reps):
            pair = {}
            for opt in (bare, wrapper) if rep % 2 else (wrapper, bare):
                if fresh:
                    backward()
                pair[id(opt)] = timed(opt.step)
            diffs.append(pair[id(wrapper)] - pair[id(bare)])
            steps.append(pair[id(bare)])
        q1, median, q3 = statistics.quantiles(diffs, n=4)
        rows.append(
            {
                "case": label,
                "bare_step_us": 1e6 * statistics.median(steps),
                "overhead_us": 1e6 * median,
                "q1_us": 1e6 * q1,
                "q3_us": 1e6 * q3,
            }
        )
    print(f"Step overhead on mlp-5678 (Adam, {reps} repetitions), {datetime.date.today()}, {machine()}, torch {torch.__version__}")
    head = f"{'case':15} {'bare step us':>12} {'overhead us':>11} {'quartiles us':>16}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case']:15} {r['bare_step_us']:>12.1f} {r['overhead_us']:>11.1f} {r['q1_us']:>7.1f} - {r['q3_us']:<6.1f}")
    print()
    phases = phases_main(args)
    if args.json:
        with open(args.json, "w") as f:
            record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine()}
            json.dump({**record, "rows": rows, "phases": phases}, f, indent=1)


def _mlp_64(seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The realistic suite's mlp_sgd / mlp_adamw model: ReLU MLP 64-256-256-10, a batch of 64, class labels."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    gen = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(64, 64, generator=gen), torch.randint(0, 10, (64,), generator=gen))


def measure_phases(
    name: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, optimizer: Callable, reps: int
) -> list[dict[str, Any]]:
    """The non-teleport ``step()`` overhead of the README's configuration (``Teleport(base, model, "auto",
    example_inputs=x[:2], loss_fn=..., batch_fn=...)``, default objective and schedule) against the bare optimizer
    on a copy of the model, in four phases of a run: ``before`` the first teleport, ``sampling`` (the
    ``REFERENCE_STEPS`` steps before a scheduled teleport, which read the gradient norm), ``watch`` (a step in the
    watch window after an accepted teleport) and ``after`` it.  Each repetition runs a backward and a ``step()``
    of each optimizer, alternating which goes first, and keeps the difference of the two steps' times; the wrapper's
    step counter (and watch) is set to the phase before each of its steps, so every phase gets ``reps`` steps.
    Medians; ``of iter``: the overhead over the bare iteration (backward and step); ``passes_us``: the same
    difference for the forward and backward passes (the wrapper's forward pre-hooks run there)."""
    x, y = (t.to(DEVICE) for t in batch)
    models = {"bare": model.to(DEVICE), "wrapped": copy.deepcopy(model).to(DEVICE)}
    opts = {k: optimizer([p for p in m.parameters() if p.requires_grad]) for k, m in models.items()}
    wrapper = Teleport(opts["wrapped"], models["wrapped"], "auto", example_inputs=(x[:2],), loss_fn=loss_fn, batch_fn=lambda: (x, y))
    opts["wrapped"] = wrapper

    def backward(kind: str) -> None:
        opts[kind].zero_grad()
        loss_fn(models[kind](x), y).backward()

    for kind in opts:
        backward(kind)
        opts[kind].step()
    record, first = wrapper.record, wrapper.schedule.warmup
    record.step = first  # one scheduled teleport (the engine's checked one, the first of its balance plan)
    backward("wrapped")
    wrapper.step()
    watch = record.watch
    if watch is None:
        raise RuntimeError(f"{name}: the scheduled teleport opened no watch ({wrapper.reports[-1].reason})")

    def at(phase: str) -> None:
        record.step = {"before": first // 2, "sampling": first - 2, "watch": watch.teleport_step + 1, "after": first + first // 2}[phase]
        record.watch = dataclasses.replace(watch, strikes=0) if phase == "watch" else None

    rows = []
    for phase in ("before", "sampling", "watch", "after"):
        diffs, iters, passes = [], [], []
        for rep in range(reps):
            step: dict[str, float] = {}
            seconds: dict[str, float] = {}
            for kind in ("bare", "wrapped") if rep % 2 else ("wrapped", "bare"):
                if kind == "wrapped":
                    at(phase)
                seconds[kind] = timed(lambda kind=kind: backward(kind))
                step[kind] = timed(opts[kind].step)
            diffs.append(step["wrapped"] - step["bare"])
            passes.append(seconds["wrapped"] - seconds["bare"])
            iters.append(seconds["bare"] + step["bare"])
        if record.rollbacks:
            raise RuntimeError(f"{name}: the watch rolled back in the {phase} phase; its steps are not a watched step's")
        overhead, iteration = statistics.median(diffs), statistics.median(iters)
        rows.append(
            {
                "model": name,
                "phase": phase,
                "iteration_ms": 1e3 * iteration,
                "overhead_us": 1e6 * overhead,
                "overhead_pct_of_iteration": 100 * overhead / iteration,
                "passes_us": 1e6 * statistics.median(passes),
            }
        )
    return rows


def phases_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The README configuration's step overhead by phase, on the 64-256-256-10 MLP (SGD momentum, AdamW) and on a
    2-layer Llama LM (AdamW); one thread."""
    torch.set_num_threads(1)
    reps = 300 if args.quick else 2000
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    rows = measure_phases("mlp_sgd", *_mlp_64(), nn.functional.cross_entropy, sgd, reps)
    rows += measure_phases("mlp_adamw", *_mlp_64(), nn.functional.cross_entropy, adamw, reps)
    model, _, batch = _llama(2, lora=False)
    rows += measure_phases("llama-2L LM", model, batch, lm_loss, adamw, max(reps // 10, 40))
    print(f"Step overhead of the README configuration by phase, {torch.get_num_threads()} thread(s)")
    head = f"{'model':12} {'phase':9} {'iter ms':>8} {'overhead us':>11} {'of iter':>8} {'fwd+bwd us':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:12} {r['phase']:9} {r['iteration_ms']:>8.3f} {r['overhead_us']:>11.1f} {r['overhead_pct_of_iteration']:>7.2f}% {r['passes_us']:>10.1f}"
        )
    print("overhead: median of paired differences of Teleport.step() and the bare step() after a backward each; goal <= 1% of iter")
    print("fwd+bwd: the same for the forward and backward passes (the wrapper's forward pre-hooks: probe inputs, precision)")
    return rows


def balance_main(args: argparse.Namespace) -> None:
    reps = 5 if args.quick else 11
    rows = [measure_balance("mlp-64-256", *mlp_digits(), nn.functional.cross_entropy, reps * 4)]
    rows.append(measure_balance("mlp-10M", *mlp_10m(16 if args.quick else 64), regression, reps))
    print(f"Balance teleport cost, {datetime.date.today()}, {machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    head = f"{'model':10} {'params':>9} {'sites':>5} {'step ms':>8} {'iter ms':>8} {'balance ms':>10} {'bal/step':>8} {'bal/iter':>8} {'N after/before':>14}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:10} {r['params']:>9} {r['sites']:>5} {r['step_ms']:>8.2f} {r['iteration_ms']:>8.2f} {r['balance_ms']:>10.2f} "
            f"{r['balance_over_step']:>8.1f} {r['balance_over_iteration']:>8.2f} {r['norm_ratio']:>14.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


# ---------------------------------------------------------------- the configuration users run (the default table)


def _vit_8(batch: int) -> tuple[nn.Module, str, tuple[torch.Tensor, torch.Tensor]]:
    """timm vit_tiny at 32x32 with 8x8 patches (16 tokens), 10 classes."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8)
    return model, "auto", (torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)))


def _llama(layers: int, lora: bool) -> tuple[nn.Module, Any, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny Llama-architecture causal LM (transformers ``LlamaConfig``: hidden 128, 4 heads, 2 KV heads, vocab
    256), batch 4 x 64 tokens; with ``lora`` wrapped by peft LoRA (r 8 on q_proj and v_proj), its pairs the sites."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=128,
    )
    model: nn.Module = transformers.LlamaForCausalLM(cfg)
    sites: Any = "auto"
    if lora:
        import peft

        from teleopt.integrations.peft import lora_sites

        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
        sites = lora_sites(model).sites
    ids = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    return model, sites, (ids[:, :-1], ids[:, 1:])


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a causal LM's logits against the shifted tokens."""
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Process (CPU) seconds of ``fn()`` (wall seconds on a GPU, after its queued kernels) and its result."""
    _synchronize()
    clock = time.perf_counter if DEVICE.type == "cuda" else time.process_time
    start = clock()
    out = fn()
    _synchronize()
    return clock() - start, out


def measure_checked(
    name: str,
    model: nn.Module,
    sites: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable,
    optimizer: Callable,
    reps: int,
    objective: str = "balance",
) -> dict[str, Any]:
    """The README's configuration, ``Teleport(base, model, sites, example_inputs=x[:2], loss_fn, batch_fn)`` with
    the library's defaults (caps, check and watch on): one ``teleport(batch=...)`` right after a backward (checked
    and capped), and next to it ``teleport()`` (without a batch argument), each paired with a bare ``step()`` and a
    training iteration from the same start point, interleaved; and the peak extra memory of one checked teleport
    (:class:`LiveBytes`, in multiples of the parameters' bytes) and the growth of the saved ``state_dict()`` it
    leaves (the same multiple).  ``objective="balance"`` is the README configuration as written (nothing else
    given: the default objective, whose first scheduled teleport is this checked one); ``"grad_norm"`` adds
    ``schedule=Schedule()`` (manual), which makes the gradient norm the objective."""
    model = model.to(DEVICE)
    x, y = (t.to(DEVICE) for t in batch)
    base = optimizer([p for p in model.parameters() if p.requires_grad])
    extra = {} if objective == "balance" else {"schedule": Schedule(), "objective": objective}
    wrapper = Teleport(base, model, sites, example_inputs=(x[:2],), loss_fn=loss_fn, batch_fn=lambda: (x, y), **extra)
    if wrapper.objective.name != objective:
        raise RuntimeError(f"the {objective} row runs objective {wrapper.objective.name!r}")

    def iteration() -> None:
        base.zero_grad()
        loss_fn(model(x), y).backward()
        base.step()

    for _ in range(2):
        iteration()
    start = (copy.deepcopy(model.state_dict()), copy.deepcopy(base.state_dict()))

    def restart(backward: bool = True) -> None:
        model.load_state_dict(start[0])
        base.load_state_dict(copy.deepcopy(start[1]))  # a copy: the transport moves the moments in place
        wrapper.record.watch = None  # the last teleport's watch is not this one's
        if backward:
            base.zero_grad()
            loss_fn(model(x), y).backward()

    checked, fast, steps, iters, reports = [], [], [], [], []
    for rep in range(reps):
        for kind in ("checked", "fast", "step", "iteration") if rep % 2 else ("iteration", "step", "fast", "checked"):
            restart(kind != "iteration")
            if kind == "checked":
                seconds, report = cpu_timed(lambda: wrapper.teleport(batch=(x, y)))
                checked.append(seconds)
                reports.append(report)
            elif kind == "fast":
                fast.append(cpu_timed(wrapper.teleport)[0])
            elif kind == "step":
                steps.append(cpu_timed(base.step)[0])
            else:
                iters.append(cpu_timed(iteration)[0])
    restart()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    before = saved_bytes(wrapper.state_dict())
    counter = LiveBytes()
    with counter:
        report = wrapper.teleport(batch=(x, y))
    growth = saved_bytes(wrapper.state_dict()) - before
    return {
        "model": name,
        "objective": objective,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "sites": len(wrapper.sites or []),
        "optimizer": type(base).__name__,
        "step_ms": 1e3 * statistics.median(steps),
        "iteration_ms": 1e3 * statistics.median(iters),
        "checked_ms": 1e3 * statistics.median(checked),
        "checked_over_step": statistics.median(c / s for c, s in zip(checked, steps)),
        "checked_over_iteration": statistics.median(c / i for c, i in zip(checked, iters)),
        "fast_ms": 1e3 * statistics.median(fast),
        "fast_over_step": statistics.median(f / s for f, s in zip(fast, steps)),
        "accepted": sum(r.accepted for r in reports),
        "teleports": len(reports),
        "reasons": sorted({r.reason for r in reports}),
        "shrink": statistics.median(r.shrink for r in reports),
        "peak_extra": counter.peak / param_bytes,
        "peak_accepted": report.accepted,
        "state_dict_growth": growth / param_bytes,
    }


def measure_scheduled(
    name: str,
    model: nn.Module,
    sites: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable,
    optimizer: Callable,
    reps: int,
) -> dict[str, Any]:
    """The README configuration's *scheduled* balance teleports as users run them: ``step()`` at a due step of
    ``Teleport(base, model, sites, example_inputs=x[:2], loss_fn=..., batch_fn=...)`` (defaults: balance every
    200 steps from step 200), trained from initialisation to step 400.  ``first``: the teleport at step 200,
    from the point before it (the companion's plan dropped before each, so it is built again and the teleport
    is checked on ``batch_fn``'s batch, lean or by the engine); ``later``: the one at step 400, from the point before it
    (200 steps after the first: lean where the plan applies, else the engine again).  Each is timed as the
    whole ``step()``, paired with a bare ``base.step()`` and an iteration (from the second point), in
    alternating order; its cost is the paired difference (the teleport's share of the step), in bare steps
    and iterations (medians).  Peak extra memory: the teleport part of ``step()`` (``scheduled_teleports``) under
    :class:`LiveBytes`, in multiples of the trainable parameters' bytes."""
    from teleopt.teleport.companion import BalanceCompanion
    from teleopt.teleport.scheduled import scheduled_teleports

    model = model.to(DEVICE)
    x, y = (t.to(DEVICE) for t in batch)
    base = optimizer([p for p in model.parameters() if p.requires_grad])
    wrapper = Teleport(base, model, sites, example_inputs=(x[:2],), loss_fn=loss_fn, batch_fn=lambda: (x, y))
    schedule, record, companion = wrapper.schedule, wrapper.record, BalanceCompanion.of(wrapper)
    due = {"first": schedule.warmup, "later": schedule.warmup + schedule.every}
    if wrapper.objective.name != "balance":
        raise RuntimeError(f"{name}: the README configuration runs objective {wrapper.objective.name!r}")

    # the run as users have it: trained through the first scheduled teleport (the engine's, checked) to the second
    points: dict[str, dict[int, torch.Tensor]] = {}
    while record.step < due["later"]:
        if record.step == due["first"]:
            points["first"] = _saved(model, base)
        base.zero_grad()
        loss_fn(model(x), y).backward()
        wrapper.step()
    points["later"] = _saved(model, base)

    def iteration() -> None:
        base.zero_grad()
        loss_fn(model(x), y).backward()
        base.step()

    def restart(kind: str) -> None:
        """Back to the point before the first or the second scheduled teleport (the bare rows: the second), in
        place (``Optimizer.load_state_dict`` would make new param groups, and the plan would be built anew)."""
        kind = "first" if kind == "engine" else kind  # the first teleport with the companion off
        with torch.no_grad():
            point = points.get(kind, points["later"])
            for t in _state_tensors(model, base):
                t.copy_(point[id(t)])
        record.watch, record.step = None, due.get(kind, due["later"])
        if kind == "first":  # a new plan: its first teleport is checked
            companion.plan, companion.key = None, None
        if kind != "iteration":
            base.zero_grad()
            loss_fn(model(x), y).backward()

    times: dict[str, list[float]] = {"first": [], "engine": [], "later": [], "step": [], "iteration": []}
    checks: dict[str, list[str]] = {"first": [], "engine": [], "later": []}
    paths: dict[str, list[str]] = {"first": [], "engine": [], "later": []}  # lean (unchecked), lean+check or engine

    def engine_step() -> None:  # the first teleport as the engine runs it (the companion off)
        companion.enabled = False
        try:
            wrapper.step()
        finally:
            companion.enabled = True

    for rep in range(reps):
        kinds = ("engine", "first", "later", "step", "iteration")  # "later" after "first": its plan is verified
        for kind in kinds if rep % 2 else kinds[::-1]:
            restart(kind)
            count = len(wrapper.reports)
            run = engine_step if kind == "engine" else wrapper.step if kind in checks else base.step if kind == "step" else iteration
            times[kind].append(cpu_timed(run)[0])
            if kind in checks:
                report = wrapper.reports[-1] if len(wrapper.reports) > count else None
                checks[kind].append("no teleport" if report is None else f"{report.check}, {report.reason}")
                paths[kind].append("none" if report is None else _path(report))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    peaks = {}
    for kind in ("engine", "first", "later"):  # "later" after "first": its plan is verified
        restart(kind)
        counter = LiveBytes()
        companion.enabled = kind != "engine"
        with counter, torch.no_grad():
            scheduled_teleports(wrapper, None)
        companion.enabled = True
        peaks[kind] = counter.peak / param_bytes
    out: dict[str, Any] = {
        "model": name,
        "optimizer": type(base).__name__,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "sites": len(wrapper.sites or []),
        "reps": reps,
        "step_ms": 1e3 * statistics.median(times["step"]),
        "iteration_ms": 1e3 * statistics.median(times["iteration"]),
    }
    out["first_over_engine"] = statistics.median(
        (f - s) / (e - s) for f, e, s in zip(times["first"], times["engine"], times["step"])
    )  # paired: the same repetition's bare step
    for kind in ("first", "engine", "later"):
        extra = [t - s for t, s in zip(times[kind], times["step"])]
        out |= {
            f"{kind}_ms": 1e3 * statistics.median(extra),
            f"{kind}_over_step": statistics.median(e / s for e, s in zip(extra, times["step"])),
            f"{kind}_over_iteration": statistics.median(e / i for e, i in zip(extra, times["iteration"])),
            f"{kind}_lean": sum(c.startswith("none,") for c in checks[kind]),
            f"{kind}_lean_checked": paths[kind].count("lean+check"),
            f"{kind}_paths": sorted(set(paths[kind])),
            f"{kind}_accepted": sum(c.endswith(", accepted") for c in checks[kind]),
            f"{kind}_reports": sorted(set(checks[kind])),
            f"{kind}_peak_extra": peaks[kind],
        }
    return out


def _path(report: Any) -> str:
    """Which path ran a scheduled teleport: ``"lean"`` (unchecked), ``"lean+check"`` (a plan's first, checked
    around the lean move: ``teleopt.teleport.lean_check``) or ``"engine"``."""
    if report.check == "none" and report.check_detail.startswith("lean balance"):
        return "lean"
    return "lean+check" if report.check_detail.startswith("lean balance, checked") else "engine"


def _saved(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """Copies of :func:`_state_tensors` by the id of the live tensor."""
    return {id(t): t.detach().clone() for t in _state_tensors(model, optimizer)}


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's parameters and buffers and the optimizer's state tensors (what a training step changes)."""
    state = [v for p in model.parameters() for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [*model.parameters(), *model.buffers(), *state]


def print_scheduled(rows: list[dict[str, Any]]) -> None:
    """The scheduled-teleport table: the first teleport of a plan and a later one, per model."""
    head = (
        f"{'model':9} {'optimizer':9} {'params':>9} {'sites':>5} {'step ms':>8} {'iter ms':>8} {'first ms':>9} {'/step':>6} "
        f"{'/iter':>6} {'peak':>6} {'later ms':>9} {'/step':>6} {'/iter':>6} {'peak':>6} {'lean':>5} {'accepted':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:9} {r['optimizer']:9} {r['params']:>9} {r['sites']:>5} {r['step_ms']:>8.2f} {r['iteration_ms']:>8.2f} "
            f"{r['first_ms']:>9.2f} {r['first_over_step']:>6.2f} {r['first_over_iteration']:>6.2f} {r['first_peak_extra']:>5.2f}x "
            f"{r['later_ms']:>9.2f} {r['later_over_step']:>6.2f} {r['later_over_iteration']:>6.2f} {r['later_peak_extra']:>5.2f}x "
            f"{r['later_lean']:>2}/{r['reps']:<2} {r['first_accepted'] + r['later_accepted']:>4}/{2 * r['reps']:<3}"
        )
    print(
        "first: step() at the first due step of a balance plan (checked on batch_fn's batch: lean with the check around it, "
        "or the engine where the lean path cannot take it); later: the next scheduled one (lean: check 'none'); ms: the "
        "step's time minus a paired bare base.step() (CPU process time, medians)"
    )
    print("peak: the teleport part of step() (scheduled_teleports) under LiveBytes, in multiples of the trainable parameters' bytes")
    for r in rows:
        print(
            f"  {r['model']}: first {r['first_reports']} via {r.get('first_paths')}; later {r['later_reports']} via {r.get('later_paths')}"
        )
    print("engine: the same first teleport with the companion off (the engine, as before the lean check), paired")
    for r in rows:
        if "engine_ms" in r:
            print(
                f"  {r['model']}: engine {r['engine_ms']:.2f} ms, {r['engine_over_step']:.2f} steps, {r['engine_over_iteration']:.2f} "
                f"iterations, peak {r['engine_peak_extra']:.2f}x; first / engine {r['first_over_engine']:.2f} (paired median)"
            )


def scheduled_main(args: argparse.Namespace) -> None:
    """Only the scheduled-teleport rows (one thread): the README configuration's first and later balance teleports
    through ``step()`` on the default table's four models."""
    torch.set_num_threads(1)
    reps = 3 if args.quick else 7
    rows = [
        measure_scheduled(name, *make(), loss_fn, optimizer, reps)
        for name, make, loss_fn, optimizer in _problems(args.quick)
        if args.rows is None or name in args.rows
    ]
    print(
        f"Scheduled balance teleports, the README configuration, {datetime.date.today()}, {machine()}, torch {torch.__version__}, 1 thread"
    )
    print_scheduled(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "torch": torch.__version__}
            json.dump({**record, "scheduled": rows}, f, indent=1)


def saved_bytes(state: dict[str, Any]) -> int:
    """Bytes of ``torch.save(state)``: what a checkpoint of this state dict writes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.tell()


def measure_balance_run(
    name: str, model: nn.Module, sites: Any, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, steps: int
) -> dict[str, Any]:
    """A training run with ``Teleport(AdamW, objective="balance", every=1)`` (library defaults otherwise) against
    the bare AdamW on a copy of the model, iteration by iteration, in alternating order: the run's time growth."""
    x, y = (t.to(DEVICE) for t in batch)
    models = {"bare": model.to(DEVICE), "balance": copy.deepcopy(model).to(DEVICE)}
    opts: dict[str, torch.optim.Optimizer] = {
        k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for k, m in models.items()
    }
    opts["balance"] = Teleport(opts["balance"], models["balance"], sites, objective="balance", every=1, example_inputs=(x[:2],))
    times: dict[str, list[float]] = {"bare": [], "balance": []}

    def iteration(kind: str) -> None:
        opts[kind].zero_grad()
        loss_fn(models[kind](x), y).backward()
        opts[kind].step()

    for kind in ("bare", "balance"):
        iteration(kind)
    for rep in range(steps):
        for kind in ("bare", "balance") if rep % 2 else ("balance", "bare"):
            times[kind].append(cpu_timed(lambda kind=kind: iteration(kind))[0])
    reports = opts["balance"].reports  # type: ignore[attr-defined]
    return {
        "model": name,
        "params": sum(p.numel() for p in models["bare"].parameters() if p.requires_grad),
        "sites": len(opts["balance"].sites or []),  # type: ignore[attr-defined]
        "iteration_ms": 1e3 * statistics.median(times["bare"]),
        "balance_iteration_ms": 1e3 * statistics.median(times["balance"]),
        "growth_pct": 100 * (sum(times["balance"]) / sum(times["bare"]) - 1),
        "growth_median_pct": 100 * (statistics.median(times["balance"]) / statistics.median(times["bare"]) - 1),
        "accepted": sum(r.accepted for r in reports),
        "teleports": len(reports),
        "lean": sum(r.check == "none" for r in reports),  # run on the lean path (teleopt.teleport.companion)
    }


def print_balance(balance: list[dict[str, Any]]) -> None:
    """The balance-every-step table."""
    head = (
        f"{'balance every step':18} {'params':>9} {'sites':>5} {'iter ms':>8} {'with balance':>12} {'run time growth':>15} "
        f"{'median growth':>13} {'accepted':>8} {'lean':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in balance:
        print(
            f"{r['model']:18} {r['params']:>9} {r['sites']:>5} {r['iteration_ms']:>8.2f} {r['balance_iteration_ms']:>12.2f} "
            f"{r['growth_pct']:>14.1f}% {r['growth_median_pct']:>12.1f}% {r['accepted']:>4}/{r['teleports']:<3} {r['lean']:>5}"
        )
    print("run time growth: total CPU time of the run with balance over the bare run's; lean: teleports on the lean path")


def balance_run_main(args: argparse.Namespace) -> None:
    """Only the balance-every-step rows of the default table (one thread)."""
    torch.set_num_threads(1)
    steps = 10 if args.quick else 40
    balance = [measure_balance_run("lora llama-2L", *_llama(2, lora=True), lm_loss, steps)]
    balance.append(measure_balance_run("llama-4L LM", *_llama(4, lora=False), lm_loss, steps))
    print(f"Balance every step, {datetime.date.today()}, {machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print_balance(balance)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "torch": torch.__version__}
            json.dump({**record, "balance": balance}, f, indent=1)


Problem = tuple[str, Callable[[], tuple[nn.Module, Any, tuple[torch.Tensor, torch.Tensor]]], Callable, Callable]


def _problems(quick: bool) -> list[Problem]:
    """The default table's rows: name, builder (model, sites, batch), loss and base optimizer."""
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-4)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)  # noqa: E731

    def mlp() -> tuple[nn.Module, str, tuple[torch.Tensor, torch.Tensor]]:
        model, _, batch = mlp_10m(16 if quick else 64)
        return model, "auto", (batch[0], batch[1].argmax(1))

    return [
        ("mlp-10M", mlp, nn.functional.cross_entropy, adam),
        ("resnet18", lambda: resnet18(8, 64, auto=True)[:3], nn.functional.cross_entropy, sgd),
        ("vit_tiny", lambda: _vit_8(8), nn.functional.cross_entropy, adam),
        ("llama-4L", lambda: _llama(4, lora=False), lm_loss, adam),
    ]


def users_main(args: argparse.Namespace) -> None:
    """The default table: the README's configuration on four models (its default objective, balance, and the
    gradient norm), and balance every step on two."""
    import timm  # noqa: F401  (the image rows)

    reps = 3 if args.quick else 7
    objectives = ("balance", "grad_norm") if args.objective == "both" else (args.objective,)
    rows = [
        measure_checked(name, *make(), loss_fn, optimizer, reps, objective)
        for name, make, loss_fn, optimizer in _problems(args.quick)
        if args.rows is None or name in args.rows
        for objective in objectives
    ]
    steps = 10 if args.quick else 40
    balance = []
    if not args.checked:
        balance = [measure_balance_run("lora llama-2L", *_llama(2, lora=True), lm_loss, steps)]
        balance.append(measure_balance_run("llama-4L LM", *_llama(4, lora=False), lm_loss, steps))
    print(
        f"Teleport cost, the README configuration, {datetime.date.today()}, {machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print_checked(rows)
    if balance:
        print_balance(balance)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), "torch": torch.__version__}
            json.dump({**record, "rows": rows, "balance": balance}, f, indent=1)


def print_checked(rows: list[dict[str, Any]]) -> None:
    """The checked-teleport table, one row per model and objective."""
    head = (
        f"{'model':9} {'objective':17} {'optimizer':9} {'params':>9} {'sites':>5} {'step ms':>8} {'iter ms':>8} {'checked ms':>10} "
        f"{'/step':>6} {'/iter':>6} {'no-arg ms':>9} {'/step':>6} {'accepted':>8} {'shrink':>6} {'peak extra':>10} {'ckpt':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        label = "balance (default)" if r["objective"] == "balance" else r["objective"]
        print(
            f"{r['model']:9} {label:17} {r['optimizer']:9} {r['params']:>9} {r['sites']:>5} {r['step_ms']:>8.2f} {r['iteration_ms']:>8.2f} "
            f"{r['checked_ms']:>10.2f} {r['checked_over_step']:>6.2f} {r['checked_over_iteration']:>6.2f} {r['fast_ms']:>9.2f} "
            f"{r['fast_over_step']:>6.2f} {r['accepted']:>4}/{r['teleports']:<3} {r['shrink']:>6.3f} {r['peak_extra']:>9.2f}x "
            f"{100 * r['state_dict_growth']:>5.1f}%"
        )
    print(
        "checked: teleport(batch=...) with loss_fn and batch_fn (caps, check and watch on); balance (default): the README "
        "configuration as written (an explicit call: lean with the output check, as a plan's first scheduled teleport; see --scheduled); "
        "grad_norm: with schedule=Schedule()"
    )
    print("no-arg: teleport() without a batch argument (it draws batch_fn's batch: checked and capped too)")
    print("peak extra: one checked teleport's peak of new tensor bytes (LiveBytes), in multiples of the trainable parameters' bytes")
    print("ckpt: growth of torch.save(state_dict()) after that teleport (the default watch), in % of the trainable parameters' bytes")


def machine() -> str:
    """The processor and, when the benchmark runs on a GPU, its name."""
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return f"{torch.cuda.get_device_name(DEVICE)} ({cpu})" if DEVICE.type == "cuda" else cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches and images, fewer repetitions")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument(
        "--auto-sites",
        action="store_true",
        help="resnet18 with sites='auto' (under Adam it leaves out the BatchNorm gains: no sites)",
    )
    parser.add_argument("--balance", action="store_true", help="only: one balance teleport vs one step, MLP 64-256-256-10 and mlp-10M")
    parser.add_argument(
        "--balance-run", action="store_true", help="only: the balance-every-step rows of the default table (LoRA llama-2L, llama-4L LM)"
    )
    parser.add_argument(
        "--scheduled",
        action="store_true",
        help="only: the README configuration's scheduled balance teleports through step(), the first of a plan (engine) and a later one (lean)",
    )
    parser.add_argument("--search", action="store_true", help="only: scaling sites, the default boundary step vs 100 ascent steps")
    parser.add_argument("--overhead", action="store_true", help="only: the step overhead on mlp-5678, thousands of paired repetitions")
    parser.add_argument(
        "--bare",
        action="store_true",
        help="the bare fast path's table (no batch: no caps; step overhead, autograd vs fast, memory with the watch) "
        "instead of the default README configuration's",
    )
    parser.add_argument(
        "--image-batch",
        type=int,
        default=None,
        help="batch of the resnet18 and vit_tiny rows (default 8, --quick 4): the output check runs on up to 8 rows "
        "whatever the batch, so at small batches its two forwards are most of a teleport",
    )
    parser.add_argument(
        "--objective",
        choices=("balance", "grad_norm", "both"),
        default="both",
        help="the checked rows' objective: balance (the README configuration's default), grad_norm, or both (default)",
    )
    parser.add_argument("--rows", nargs="+", default=None, help="only these checked rows (mlp-10M resnet18 vit_tiny llama-4L)")
    parser.add_argument("--checked", action="store_true", help="only the checked rows of the default table (no balance-every-step run)")
    parser.add_argument("--device", default="cpu", help="where models, batches and optimizer state live (e.g. cuda); default cpu")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.balance:
        balance_main(args)
        return
    if args.balance_run:
        balance_run_main(args)
        return
    if args.scheduled:
        scheduled_main(args)
        return
    if args.search:
        search_main(args)
        return
    if args.overhead:
        overhead_main(args)
        return
    if not args.bare:
        torch.set_num_threads(1)
        users_main(args)
        return
    reps = 5 if args.quick else 11
    general_reps = 1 if args.quick else 3
    rows = []
    model, sites, batch = mlp_5678()
    rows.append(measure("mlp-5678", model, sites, batch, regression, reps * 100, general_reps * 10))
    model, sites, batch = mlp_10m(16 if args.quick else 64)
    rows.append(measure("mlp-10M", model, sites, batch, regression, reps, general_reps))
    image_batch = args.image_batch or (4 if args.quick else 8)
    model, sites, batch, how = resnet18(image_batch, 64 if args.quick else 224, auto=args.auto_sites)
    rows.append(measure("resnet18", model, sites, batch, nn.functional.cross_entropy, reps, general_reps))
    rows[-1]["site_source"] = how
    model, sites, batch = vit_tiny(image_batch, 64 if args.quick else 224)
    rows.append(measure("vit_tiny", model, sites, batch, nn.functional.cross_entropy, max(3, reps // 2), general_reps))

    head = f"{'model':9} {'params':>9} {'sites':>5} {'step ms':>9} {'wrapped':>9} {'overhead':>9} {'over us':>8} {'of iter':>8} {'own us':>8} {'own/iter':>8} {'iter ms':>9} {'fast ms':>9} {'fast/iter':>9} {'fast/step':>9} {'10-step fast':>12} {'10-step autograd':>16} {'autograd/fast':>13} {'peak extra':>10} {'kept':>5} {'default peak':>12} {'kept':>5} {'ckpt':>5} {'snapshot peak':>12} {'kept':>5}"
    print(f"Teleport cost, {datetime.date.today()}, {machine()}, torch {torch.__version__}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:9} {r['params']:>9} {r['sites']:>5} {r['step_bare_ms']:>9.3f} {r['step_wrapped_ms']:>9.3f} {r['step_overhead_pct']:>8.1f}% {r['step_overhead_us']:>8.1f} {r['step_overhead_pct_of_iteration']:>7.2f}% "
            f"{r['step_own_us']:>8.1f} {r['step_own_pct_of_iteration']:>7.3f}% {r['iteration_ms']:>9.2f} {r['fast_teleport_ms']:>9.2f} {r['fast_over_iteration']:>9.2f} {r['fast_over_step']:>9.2f} {r['fast10_ms']:>12.2f} {r['general10_ms']:>16.1f} {r['general_over_fast']:>13.0f} "
            f"{r['peak_watch0']:>9.2f}x {r['kept_watch0']:>4.1f}x {r['peak_watch10']:>11.2f}x {r['kept_watch10']:>4.1f}x {r['ckpt_watch10']:>4.2f}x {r['peak_snapshot']:>11.2f}x {r['kept_snapshot']:>4.2f}x"
        )
    print(f"resnet18 sites: {rows[2]['site_source']}; vit_tiny sites: find_symmetries (attention GL)")
    print(
        "own us: the wrapper's own time in a step without teleport: the time its step spends outside the base's update"
        " (timed by the base's step hooks) minus the same for the bare optimizer, paired median"
    )
    print(
        "peak extra / kept: memory of one teleport in multiples of the parameters' bytes (watch off; default watch on:"
        ' its elements; watch_restore="snapshot"); ckpt: what the default watch adds to state_dict (its elements)'
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "machine": machine(),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
