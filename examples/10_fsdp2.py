"""Example 10: Teleport and Syre on an FSDP2 (``fully_shard``) model, launched with torchrun.

Every rank runs this script.  Every layer and the root are wrapped with ``fully_shard``,
``Teleport(..., "auto", example_inputs=...)`` finds the model's exact symmetries on an
unsharded copy (gathered once, when it is built), and ``Syre(Teleport(AdamW))`` with
Teleport's defaults (the closed-form balance every 200 steps from step 200; grad-norm
teleports under AdamW's scale-free steps shrink layers, see "Scale-free optimizers" in
docs/teleport.md) trains as usual: each rank computes on its own slice of every
batch, FSDP2 averages the gradients, a scheduled teleport moves each rank's shards
(the CNN's sites are channel rescalings, so only per-channel statistics are
communicated; ``teleopt.sharding.CommunicatedBytes`` counts them) and Syre decays each
shard towards its slice of the same whole-tensor anchor.  At the end the example checks
that every rank holds identical full parameters, saves a distributed checkpoint
(``torch.distributed.checkpoint``), loads it into a fresh model and optimizer and checks
that the resumed run continues exactly, and trains the same loop with the bare AdamW as
the baseline, and prints the difference.

AdamW's learning rate is tuned for the bare AdamW and used by both runs (a tuned
baseline): ``--tune`` trains the bare AdamW for the same budget at each of 2e-3, 5e-3,
1e-2 and 2e-2 from the initial weights of seeds 10, 11 and 12 (none reported below) on
the training images but the last 300, and keeps the least mean cross-entropy on those
300 validation images; the test set is not looked at.  For 400 steps it keeps 5e-3
(validation loss 0.339 / 0.197 / 0.214 / 0.332), for 200 steps (``--quick``) also
5e-3 (0.386; 1e-2 0.437, 2e-2 0.426).  Other budgets are tuned first.

What it gives: at 400 steps on the CPU (gloo), seeds 0 / 1 / 2 (``--seed``), test
accuracy 0.953 / 0.939 / 0.949 against the baseline's 0.949 / 0.916 / 0.963, test loss
x0.968 / x0.856 / x1.014 of the baseline's; 2 teleports per run, both kept (the extra
one at step 200 and the scheduled one right after it).  Seed 2 is 1.3 points (4 test
digits of 297) below the baseline and prints "WORSE".  The tuned rate is not the better
one on the test set: at the earlier lr 1e-2 the bare AdamW scored 0.966 / 0.966 / 0.970
(test loss 0.141 / 0.118 / 0.108), and this run 0.960 / 0.960 / 0.973, worse in seeds
0 and 1.  ``--quick`` (200 steps, balance every 50) ends at 0.912 against 0.909.  At lr
1e-2 no configuration tried was no worse in all three seeds at 400 steps: balance every
50 steps 0.956 / 0.976 / 0.973, ``Balance(fraction=0.5)`` 0.953 / 0.966 / 0.973,
Teleport without Syre 0.960 / 0.966 / 0.973, Syre without teleports 0.963 / 0.966
(seeds 0, 1); earlier, balance every 100 steps 0.953 and grad-norm teleports 0.882 (seed
0).  The example shows the mechanics on shards, not a gain.

Data: scikit-learn's bundled digits (8x8 images, no download); a small CNN
(conv-ReLU-max pool-conv-ReLU-average pool-linear).

Run::

    torchrun --nproc_per_node 2 examples/10_fsdp2.py     # gloo on CPU, NCCL on GPUs
    python examples/10_fsdp2.py [--steps N] [--seed S] [--quick] [--tune]    # runs the torchrun command above itself

Needs: the ``demo`` extra (scikit-learn): ``pip install -e ".[demo]"``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import teleopt  # noqa: E402
from teleopt.checkpoint import load_optimizer_state_dict, optimizer_state_dict  # noqa: E402
from teleopt.sharding import CommunicatedBytes, full  # noqa: E402
from teleopt.teleport import Schedule

# AdamW's learning rate tuned for 400 and 200 (--quick) steps: what ``--tune`` selects (see tune)
TUNED: dict[int, float] = {400: 5e-3, 200: 5e-3}
GRID = (2e-3, 5e-3, 1e-2, 2e-2)
TUNING_SEEDS = (10, 11, 12)  # initial weights for tuning: none of the seeds the docstring reports
VALIDATION = 300  # the last training images: the validation split for tuning (the test set is never looked at)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def shard(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_optimizer(model: nn.Module, example: torch.Tensor, every: int | None, lr: float) -> teleopt.Syre:
    """``sites="auto"`` on the sharded model: detection runs once on an unsharded copy (gathered on every rank).

    ``every=None``: Teleport's default objective and schedule; else a balance teleport every ``every`` steps."""
    base = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    often: dict[str, Any] = {} if every is None else {"objective": "balance", "schedule": Schedule(every=every, warmup=every)}
    teleport = teleopt.Teleport(base, model, "auto", example_inputs=(example,), **often)
    return teleopt.Syre(teleport, gamma=1e-3, decoupled=True, seed=0)


def digits(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm].to(device), y[perm].to(device)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: range, batch: int) -> float:
    """Steps on the rank's slice of each global batch (FSDP2 averages the ranks' gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = torch.zeros(())
    for step in steps:
        start = (step * batch * world) % (len(y) - batch * world)
        idx = slice(start + rank * batch, start + (rank + 1) * batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    return float(loss.detach())


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Test accuracy and loss (every rank evaluates the whole test set), then the shards are freed again."""
    with torch.no_grad():
        logits = model(x)
    teleopt.sharding.reshard(model)
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def tune(args: argparse.Namespace, device: torch.device) -> float:
    """The bare AdamW's learning rate: the least mean validation loss over ``GRID`` and ``TUNING_SEEDS``.

    Trains on the training images but the last ``VALIDATION`` and scores on those (test images untouched).
    """
    x, y, _, _ = digits(device)
    scores = {}
    for lr in GRID:
        losses = []
        for seed in TUNING_SEEDS:
            model = shard(make_model(seed).to(device), device)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            train(model, opt, x[:-VALIDATION], y[:-VALIDATION], range(args.steps), args.batch)
            losses.append(evaluate(model, x[-VALIDATION:], y[-VALIDATION:])[1])
        scores[lr] = sum(losses) / len(losses)
        if dist.get_rank() == 0:
            print(f"tune AdamW lr {lr:.0e}: validation loss {scores[lr]:.4f}", flush=True)
    return min(scores, key=scores.__getitem__)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if dist.get_backend() == "nccl" else torch.device("cpu")
    # a budget without a tuned learning rate is tuned first, as --tune does
    lr = tune(args, device) if args.tune or args.steps not in TUNED else TUNED[args.steps]
    x, y, x_test, y_test = digits(device)
    model = make_model(args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model = shard(model, device)
    opt = make_optimizer(model, x[:4], args.every, lr)
    teleport = opt.base
    assert isinstance(teleport, teleopt.Teleport) and teleport.sites is not None
    half = args.steps // 2
    train(model, opt, x, y, range(half), args.batch)

    # one teleport more, counting what this rank sends (two check forwards gather the shards, as any forward does)
    with CommunicatedBytes() as forward_bytes:
        with torch.no_grad():
            model(x[:32])
    teleopt.sharding.reshard(model)
    opt.zero_grad()
    F.cross_entropy(model(x[:32]), y[:32]).backward()
    with CommunicatedBytes() as teleport_bytes:
        extra = teleport.teleport(batch=(x[:32], y[:32]))

    # checkpoint, then keep training; a fresh model and optimizer resumed from the checkpoint must follow exactly
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = args.checkpoint
    dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state_dict(model, opt)}, checkpoint_id=path)
    final_loss = train(model, opt, x, y, range(half, args.steps), args.batch)
    fresh = shard(make_model(seed=args.seed + 1).to(device), device)
    resumed = make_optimizer(fresh, x[:4], args.every, lr)
    state = {"model": get_model_state_dict(fresh), "optim": optimizer_state_dict(fresh, resumed)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    load_optimizer_state_dict(fresh, resumed, state["optim"])
    train(fresh, resumed, x, y, range(half, args.steps), args.batch)

    params = [full(p).detach() for p in model.parameters()]
    resumed_params = [full(p).detach() for p in fresh.parameters()]
    # identical on every rank: the spread over ranks of every entry is zero
    spread = 0.0
    for p in params:
        hi, lo = p.clone(), p.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        spread = max(spread, float((hi - lo).abs().max()))
    accuracy, test_loss = evaluate(model, x_test, y_test)
    # the baseline: the same loop with the bare AdamW from the same weights
    plain = shard(make_model(args.seed).to(device), device)
    baseline_loss = train(plain, torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.0), x, y, range(args.steps), args.batch)
    baseline_accuracy, baseline_test_loss = evaluate(plain, x_test, y_test)
    reports = teleport.reports
    return {
        "lr": lr,
        "baseline_loss": baseline_loss,
        "baseline_accuracy": baseline_accuracy,
        "baseline_test_loss": baseline_test_loss,
        "test_loss": test_loss,
        "summary": teleport.summary(),
        "sites": [s.name for s in teleport.sites],
        "teleports": [(r.step, r.accepted, r.reason) for r in reports],
        "rolled_back": sum(1 for r in reports if r.path == "watch"),
        "extra_accepted": extra.accepted,
        "teleport_bytes": teleport_bytes.bytes - 2 * forward_bytes.bytes,
        "param_bytes": 4 * n_params,
        "rank_spread": spread,
        "resumed_exactly": all(torch.equal(a, b) for a, b in zip(params, resumed_params)),
        "final_loss": final_loss,
        "accuracy": accuracy,
        "world": dist.get_world_size(),
    }


def _report(result: dict[str, Any]) -> None:
    print(f"FSDP2 on {result['world']} ranks; sites ('auto'): {', '.join(result['sites'])}")
    for step, accepted, reason in result["teleports"]:
        print(f"  step {step:4d}: {reason if not accepted else 'teleport accepted'}")
    print(
        f"one teleport sent {result['teleport_bytes']} bytes per rank (its two check forwards excluded); "
        f"the parameters are {result['param_bytes']} bytes"
    )
    print(f"ranks identical: {result['rank_spread'] == 0.0}; DCP resume continued exactly: {result['resumed_exactly']}")
    print(result["summary"])
    print(
        f"Syre(Teleport(AdamW)):  last batch loss {result['final_loss']:.4f}, test loss {result['test_loss']:.4f}, accuracy {result['accuracy']:.3f}"
    )
    print(
        f"baseline (AdamW alone, lr {result['lr']:.0e}): last batch loss {result['baseline_loss']:.4f}, test loss {result['baseline_test_loss']:.4f}, "
        f"accuracy {result['baseline_accuracy']:.3f}"
    )
    gap = result["accuracy"] - result["baseline_accuracy"]
    verdict = "no worse" if gap >= -0.005 else "WORSE"
    print(
        f"against the baseline: test accuracy {gap:+.3f} ({verdict}), test loss x{result['test_loss'] / result['baseline_test_loss']:.3f}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=None, help="balance every this many steps (default: Teleport's schedule)")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights (the same for the baseline)")
    parser.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    parser.add_argument("--world", type=int, default=2, help="processes to start when not launched by torchrun")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "teleopt_example_10"), help="DCP directory")
    parser.add_argument("--quick", action="store_true", help="200 steps, a teleport every 50")
    parser.add_argument("--tune", action="store_true", help="tune AdamW's learning rate first (printing the grid)")
    raw = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(raw)
    if args.quick:
        args.steps, args.every = 200, 50
    if "RANK" not in os.environ:  # not under torchrun: launch it, exactly as a user would
        return _launch(args, raw)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    result = worker(args)
    if dist.get_rank() == 0:
        _report(result)
        if os.environ.get("TELEOPT_EXAMPLE_RESULT"):
            torch.save(result, os.environ["TELEOPT_EXAMPLE_RESULT"])
    dist.barrier()
    dist.destroy_process_group()
    return result


def _launch(args: argparse.Namespace, raw: list[str]) -> dict[str, Any]:
    """``torchrun --standalone --nproc_per_node WORLD`` this script (a free port on localhost); rank 0's result."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}", __file__]
        command += raw + ["--checkpoint", os.path.join(tmp, "checkpoint")]
        env = {**os.environ, "TELEOPT_EXAMPLE_RESULT": out, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        print(done.stdout, end="")
        return torch.load(out, weights_only=False)


if __name__ == "__main__":
    main()
