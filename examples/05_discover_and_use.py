"""Example 5: discover a symmetry nobody wrote down, check it, save it, and teleport along it in a larger model.

Zhao et al. 2024b learns a group action a_X(g, theta) and Lie-algebra generators h so
that the loss is invariant to first order (Theorem 3.1).  Here, as in Zhao et al. 2024b
Sec. 5.3, the subnetwork is a block of two scalar linear layers, x -> w2 w1 x, on a
batch of 4 inputs; it is learned on the block's *output* so that, by Zhao et al. 2024b
Prop. 4.1, the symmetry carries over to any network that contains the block.  The
script

1. trains the action with ``teleopt.discover`` (a tqdm bar shows the loss terms);
2. compares the loss along learned orbit curves with random curves of the same
   length (Zhao 2026, Fig. 6.6): a real symmetry keeps the loss flat;
3. saves it to one file, loads it back and registers it next to the known actions;
4. binds it to the matching block inside a larger model (stem -> block -> head) and
   trains that model with ``Teleport`` teleporting along the learned site.  Learned
   actions are approximate, so the teleport's loss check gets an explicit tolerance
   (``SafetyConfig(loss_tol=...)``); a move that breaks it is rolled back.

Needs: nothing beyond teleopt itself (``pip install -e .``).

Run: ``python examples/05_discover_and_use.py [--steps N] [--seed S] [--quick]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import teleopt
from teleopt.discovery import LearnedAction, bind, compare_curves, problems
from teleopt.teleport import SafetyConfig, SearchConfig

LOSS_TOL = 2e-2  # relative loss change a teleport along the learned (approximate) action may cause


class Model(nn.Module):
    """input (3) -> stem -> [block: Linear(1, 1), Linear(1, 1)] -> head (2): the block is where the learned symmetry lives."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 1)
        self.block1 = nn.Linear(1, 1, bias=False)
        self.block2 = nn.Linear(1, 1, bias=False)
        self.head = nn.Linear(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(self.stem(x))))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="discovery steps")
    parser.add_argument("--seed", type=int, default=0, help="the larger model's initial weights and data (both runs)")
    parser.add_argument("--quick", action="store_true", help="200 discovery steps, one teleport (what the test suite runs)")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    train_steps = 20 if args.quick else 300

    # 1. learn the block's symmetry (Zhao et al. 2024b, Sec. 5.3: the rescaling w1 -> c w1, w2 -> w2 / c)
    problem = problems.two_layer(k=4, target="output")
    action = teleopt.discover(problem, steps=steps, seed=0, name="learned_block")
    print(f"learned generator (in theta = (w1, w2) coordinates):\n{action.generators[0]}")

    # 2. is it a symmetry?  loss along learned orbits vs random curves of the same length
    comparison = compare_curves(action, problem.sampler, num_samples=20 if args.quick else 100)
    ratio = 1.0 / comparison.invariance_ratio
    print(f"loss variation along learned curves / along random curves: {ratio:.2e}")

    # 3. one file; load and register it next to the known actions
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "learned_block.pt"
        action.save(path)
        teleopt.register_action(LearnedAction.load(path, name="learned_block"))
    try:
        registered = teleopt.get_action("learned_block")
        print(f"registered: {registered.name} ({registered.exactness}, {registered.group_name})")

        # 4. bind it to the block of a larger model and teleport along it while training
        torch.manual_seed(args.seed)
        model = Model().double()
        baseline_model = Model().double()
        baseline_model.load_state_dict(model.state_dict())  # the baseline: the same loop without teleopt
        site = bind(registered, model, ["block1.weight", "block2.weight"], data_input="block1")
        gen = torch.Generator().manual_seed(args.seed + 1)
        x = torch.randn(64, 3, generator=gen, dtype=torch.float64)
        y = torch.randn(64, 2, generator=gen, dtype=torch.float64)
        loss_fn = nn.functional.mse_loss

        def teleport_batch() -> tuple[torch.Tensor, torch.Tensor]:
            rows = torch.randint(64, (4,), generator=gen)  # the action was learned on batches of 4
            return x[rows], y[rows]

        optimizer = teleopt.Teleport(
            torch.optim.SGD(model.parameters(), lr=0.05),
            model,
            [site],
            every=20,
            loss_fn=loss_fn,
            batch_fn=teleport_batch,
            safety=SafetyConfig(loss_tol=LOSS_TOL),
            search=SearchConfig(
                steps=5, trust_region=0.5
            ),  # |log c| <= 0.5 a teleport: at log 4 (the default) 5 of 15 blew up and were rolled back
        )
        baseline_sgd = torch.optim.SGD(baseline_model.parameters(), lr=0.05)
        for _ in range(train_steps):
            for net, opt in ((model, optimizer), (baseline_model, baseline_sgd)):
                opt.zero_grad()
                loss_fn(net(x), y).backward()
                opt.step()
        with torch.no_grad():
            final, baseline = loss_fn(model(x), y).item(), loss_fn(baseline_model(x), y).item()
        print(f"final training loss {final:.4f} (baseline: the same SGD loop without teleopt, {baseline:.4f})")
        print(optimizer.summary())
        for r in optimizer.reports:
            drift = "-" if r.loss_drift is None else f"{r.loss_drift:.1e}"
            print(f"  step {r.step}: {r.reason.split(';')[0]}; loss drift on the teleport batch {drift}")
    finally:
        teleopt.unregister_action("learned_block")
    return {"action": action, "ratio": ratio, "reports": list(optimizer.reports), "site": site, "loss": final, "baseline_loss": baseline}


if __name__ == "__main__":
    main()
