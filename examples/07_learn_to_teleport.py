"""Example 7: learn a teleport policy on small problems, then use it on a model.

Zhao 2026 (*Symmetry in Neural Networks*), Sec. 5.5, Algorithm 3: two meta-learned
networks choose, from the gradient, an update f_t and a group element g_t, and the
parameters move by w <- g_t . (w + f_t).  This example

1. meta-trains a ``teleopt.TeleportPolicy`` (coordinate-wise LSTMs, so the size of
   the problems does not matter) on random two-layer LeakyReLU problems
   (``TwoLayerProblems``), with a tqdm progress bar;
2. saves it and loads it back (``torch.load(weights_only=True)`` underneath);
3. trains an ordinary ``nn.Sequential`` of a different size with it
   (``LearnedTeleportOptimizer``), and checks that a teleport the policy chose
   leaves the loss unchanged in float64.

Needs: nothing beyond teleopt itself (``pip install -e .``).

Run: ``python examples/07_learn_to_teleport.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
from torch import nn

import teleopt
from teleopt.learned_teleport import LearnedTeleportOptimizer, TwoLayerProblems, rollout
from teleopt.registry import get_action


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter meta-training trajectories")
    args = parser.parse_args(argv)
    trajectories, steps = (3, 15) if args.quick else (30, 100)

    # 1. meta-train on small random problems (the thesis' are 20 x 20; any size works)
    sampler = TwoLayerProblems(n=10, h=10, m=10, k=10)
    torch.manual_seed(0)
    policy = teleopt.TeleportPolicy(update="lstm", teleport=True, base_lr=1e-3)
    held_out = [sampler(torch.Generator().manual_seed(100 + i)) for i in range(3)]
    before = sum(rollout(policy, p, steps)[-1] for p in held_out) / 3
    teleopt.meta_train(policy, sampler, trajectories=trajectories, steps=steps, lr_update=1e-3, lr_group=1e-3)
    after = sum(rollout(policy, p, steps)[-1] for p in held_out) / 3
    print(f"held-out loss after {steps} steps: untrained policy (= GD) {before:.3f}, trained {after:.3f}")

    # 2. save and load (weights only)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "policy.pt")
        policy.save(path)
        policy = teleopt.TeleportPolicy.load(path)

    # 3. use it on a model of another size, in float64
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.LeakyReLU(0.1), nn.Linear(16, 5, bias=False)).double()
    x, y = torch.randn(32, 12, dtype=torch.float64), torch.randn(32, 5, dtype=torch.float64)
    site = teleopt.Site(get_action("positive_rescaling"), ("0.weight", None, "2.weight"))
    opt = LearnedTeleportOptimizer(model, [site], policy)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.linalg.norm(model(x) - y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
    # a teleport alone: the policy's element for the current gradient, applied to the model
    opt.zero_grad()
    loss = torch.linalg.norm(model(x) - y)
    loss.backward()
    tensors = dict(model.named_parameters())
    with torch.no_grad():
        (g,) = policy.elements([site], tensors, {n: p.grad for n, p in tensors.items()}, opt.state)
        site.apply_(model, g)
        drift = abs(float(torch.linalg.norm(model(x) - y)) - float(loss)) / float(loss)
    print(f"model 12-16-5: loss {losses[0]:.3f} -> {losses[-1]:.3f}; a policy teleport changed the loss by {drift:.1e} (relative)")
    return {"before": before, "after": after, "losses": losses, "teleport_drift": drift}


if __name__ == "__main__":
    main()
