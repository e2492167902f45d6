"""Every script in examples/ runs in the suite, in its reduced form (``--quick``), so the examples never rot.

Each example's ``main(argv)`` returns what it printed about; these tests check the
claims its docstring makes.  Example 4 is a pytest file for users' CI: it is run
with pytest, in a subprocess, exactly as a user would.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = [pytest.mark.example, pytest.mark.usefixtures("one_thread")]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# "No worse than the baseline" (the same loop without teleopt, same weights, batches and budget), with the
# margins the realistic suite allows for seed noise: test accuracy at most 0.5 percentage point lower (2 test
# digits of 450 in the digits split), a loss at most 5% higher (1% on language models).
ACCURACY_MARGIN = 0.005
LOSS_RATIO = 1.05
LM_LOSS_RATIO = 1.01


def assert_no_worse(final: float, baseline: float, *, higher_is_better: bool, ratio: float = LOSS_RATIO) -> None:
    if higher_is_better:
        assert final >= baseline - ACCURACY_MARGIN, f"ended at {final:.4f}, the baseline at {baseline:.4f}"
    else:
        assert final <= ratio * baseline, f"ended at {final:.4f}, the baseline at {baseline:.4f} (allowed: x{ratio})"


def assert_rollbacks_rare(reports: list) -> None:
    """Fewer than 10% of the accepted teleports were rolled back by the watch (a rollback is no new teleport)."""
    accepted = sum(1 for r in reports if r.accepted and r.path != "watch")
    rolled_back = sum(1 for r in reports if r.path == "watch")
    assert accepted > 0, "no teleport was accepted"
    assert rolled_back < 0.1 * accepted, f"{rolled_back} of {accepted} accepted teleports rolled back"


def test_every_example_is_tested():
    tested = {
        "01_wrap_training_loop.py",
        "02_timm_auto_sites.py",
        "03_torch_optimizer.py",
        "04_ci_property_tests.py",
        "05_discover_and_use.py",
        "06_conserved_quantities.py",
        "07_learn_to_teleport.py",
        "08_hf_trainer.py",
        "09_lightning.py",
        "10_fsdp2.py",
    }
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_01_wrap_training_loop(capsys):
    import teleopt

    result = load("01_wrap_training_loop.py").main(["--quick"])
    optimizer = result["optimizer"]
    assert isinstance(optimizer, teleopt.Teleport) and isinstance(optimizer.base, torch.optim.SGD)
    accepted = [r for r in result["reports"] if r.accepted]
    assert accepted and all(r.objective == "balance" for r in result["reports"] if r.path != "watch")
    for r in accepted:
        # checked on the outputs: the loss did not change beyond float32 rounding (Teleport's default 1e-5)
        assert r.loss_drift is not None and r.loss_drift <= 1e-5
        assert r.objective_after < r.objective_before  # balance lowered the weight norm on the orbit
    # the baseline ran beside it from the same weights and batches: equal until the first teleport (step 50)
    assert result["baseline_history"][0] == result["history"][0]
    assert result["accuracy"] > 0.85 and result["baseline_accuracy"] > 0.85
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)
    assert_no_worse(result["history"][-1][0], result["baseline_history"][-1][0], higher_is_better=False)
    assert_rollbacks_rare(result["reports"])
    printed = capsys.readouterr().out
    assert "baseline test loss / acc" in printed and "accepted" in printed and "rolled back" in printed


def test_02_timm_auto_sites(capsys):
    pytest.importorskip("timm")
    pytest.importorskip("teleopt.detection")
    result = load("02_timm_auto_sites.py").main(["--quick"])
    report, optimizer, scaler = result["report"], result["optimizer"], result["scaler"]
    assert report.coverage > 0.5 and report.continuous_sites
    # sites="auto" searches the exact continuous sites detection found
    assert optimizer.sites and all(s.action.exactness == "exact" and s.action.continuous for s in optimizer.sites)
    assert {s.name for s in optimizer.sites} <= {s.name for s in report.continuous_sites}
    accepted = [r for r in optimizer.reports if r.accepted]
    assert accepted and all(r.loss_drift is not None and r.loss_drift <= 1e-5 for r in accepted)
    assert scaler.is_enabled() and scaler.get_scale() > 0
    # OneCycleLR drove the base optimizer's learning rate through the wrapper
    assert optimizer.base.param_groups[0]["lr"] == pytest.approx(result["scheduler"].get_last_lr()[0])
    printed = capsys.readouterr().out
    assert "coverage" in printed and "positive_rescaling" in printed and "baseline test acc" in printed
    assert all(r.objective == "balance" for r in accepted) and 0 <= result["baseline_accuracy"] <= 1
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)
    assert_rollbacks_rare(optimizer.reports)
    assert "rolled back" in printed


def test_03_torch_optimizer(capsys):
    pytest.importorskip("torch_optimizer")
    module = load("03_torch_optimizer.py")
    results = module.main(["--quick"])
    assert set(results) == {"Lamb", "Yogi"}
    for name, r in results.items():
        assert r["identical"], f"{name}: the run resumed from the checkpoint diverged"
        assert r["lr"] == module.TUNED[120][name]  # both runs at the bare optimizer's tuned learning rate
        accepted = [x for x in r["reports"] if x.accepted]
        assert accepted, f"{name}: no teleport accepted"
        # exp_avg and exp_avg_sq have exact rules under positive rescalings: they were transported
        assert r["decisions"].get("transport", 0) > 0
        assert r["accuracy"] > 0.8
        assert r["penalty"] > 0  # Syre's decay term towards the anchor is live
        # no worse than the bare base optimizer on the same weights and batches; the held-out loss, not the
        # training loss, since Syre's decay towards the anchor is a regulariser (measured: test loss x0.97, x0.96)
        assert_no_worse(r["accuracy"], r["baseline_accuracy"], higher_is_better=True)
        assert_no_worse(r["test_loss"], r["baseline_test_loss"], higher_is_better=False)
        assert_rollbacks_rare(r["reports"])
    printed = capsys.readouterr().out
    assert "baseline (Lamb alone" in printed and "baseline (Yogi alone" in printed and "rolled back" in printed


def test_03_tuned_learning_rates_are_what_the_validation_grid_selects(capsys):
    """``--tune`` at the quick budget picks the table's learning rates from the validation split alone."""
    pytest.importorskip("torch_optimizer")
    module = load("03_torch_optimizer.py")
    from teleopt.datasets import load_digits

    data = load_digits(seed=0)
    held_out = data.x_test.clone()
    data.x_test.fill_(float("nan"))  # the test rows must not enter the choice
    assert module.tune(data, 120) == module.TUNED[120]
    assert torch.isnan(data.x_test).all() and held_out.isfinite().all()
    assert "tune Yogi lr 2e-02: validation loss" in capsys.readouterr().out


@pytest.mark.slow
def test_03_tuned_learning_rates_at_the_full_budget():
    pytest.importorskip("torch_optimizer")
    module = load("03_torch_optimizer.py")
    from teleopt.datasets import load_digits

    assert module.tune(load_digits(seed=0), 400) == module.TUNED[400]


@pytest.mark.slow
def test_03_full_run_is_no_worse_than_the_tuned_bare_optimizer_in_seed_1():
    """The full run at the seed where the untuned learning rate cost 2.0 (Lamb) and 0.7 points (Yogi).

    Measured at the tuned learning rates: Lamb 0.971 vs 0.971, Yogi 0.971 vs 0.969, no rollback. Seed 0 misses
    (Lamb 0.956 vs 0.962, Yogi 0.962 vs 0.969), as the example's docstring says.
    """
    pytest.importorskip("torch_optimizer")
    for r in load("03_torch_optimizer.py").main(["--seed", "1"]).values():
        assert_no_worse(r["accuracy"], r["baseline_accuracy"], higher_is_better=True)
        assert_no_worse(r["test_loss"], r["baseline_test_loss"], higher_is_better=False)
        assert_rollbacks_rare(r["reports"])


def _pytest_example_4(tmp_path: Path, *select: str) -> int:
    """Run examples/04 with pytest in a fresh process, as a user's CI would; returns the number of passed tests."""
    # the checkout first on the path, as for an installed teleopt (also without `pip install -e .`)
    path = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(EXAMPLES / "04_ci_property_tests.py"),
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            *select,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    return int(proc.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])


def test_04_ci_property_tests_pass_under_pytest(tmp_path):
    # reduced form: the model-level property tests and the conformance checks most often broken by a stack
    pytest.importorskip("hypothesis")
    select = "symmetries or member or covector or (drop_in and (transparency or resume or grad_scaler) and -1])"
    assert _pytest_example_4(tmp_path, "-k", select) == 1 + 6 + 1 + 3


@pytest.mark.slow
def test_04_ci_property_tests_all(tmp_path):
    pytest.importorskip("hypothesis")
    assert _pytest_example_4(tmp_path) >= 34  # 2 sites x 3 members, symmetry, covectors and 13 x 2 conformance checks


def test_05_discover_and_use(capsys):
    pytest.importorskip("teleopt.discovery")
    module = load("05_discover_and_use.py")
    result = module.main(["--quick"])
    # Zhao et al. 2024b, Sec. 5.3: the learned generator is the rescaling diag(1, -1) up to scale
    h = result["action"].generators[0]
    rescaling = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=h.dtype)
    assert float((h * rescaling).sum().abs() / (h.norm() * rescaling.norm())) > 0.99
    assert result["ratio"] < 0.1  # the loss varies >= 10x less along learned curves than along random ones
    accepted = [r for r in result["reports"] if r.accepted]
    assert accepted, "the learned site was never teleported along"
    assert all(r.path == "general" and r.loss_drift <= module.LOSS_TOL for r in accepted)
    assert_no_worse(result["loss"], result["baseline_loss"], higher_is_better=False)  # the same SGD loop without teleopt
    assert_rollbacks_rare(result["reports"])
    import teleopt

    assert "learned_block" not in {row["name"] for row in teleopt.list_actions()}  # the example unregisters it again
    printed = capsys.readouterr().out
    assert "registered: learned_block" in printed and "baseline" in printed and "rolled back" in printed


def test_06_conserved_quantities(capsys):
    result = load("06_conserved_quantities.py").main(["--quick"])
    q = result["quantities"]
    # the two ReLU layers' rescalings have Q; their permutations are reported, not skipped
    assert len(q) == 2 and len(q.unavailable) == 2 and all("discrete" in why for why in q.unavailable.values())
    drifts = result["drifts"]
    # Zhao 2026, App. A.4: SGD drifts O(lr^2) per step; momentum and Adam do not follow the gradient flow
    assert max(drifts["SGD"].values()) < 1e-3
    assert min(drifts["SGD+momentum"].values()) > 10 * max(drifts["SGD"].values())
    assert min(drifts["Adam"].values()) > 10 * max(drifts["SGD"].values())
    # teleports move Q on purpose; the monitor keeps those jumps out of the drift
    assert result["jumps"] >= 1 and max(drifts["Teleport(SGD)"].values()) < 1e-3
    # an exact orbit: same function (float64 round-off), different Q
    assert result["output_change"] < 1e-12
    assert max(result["q_along"]) > 2 * min(result["q_along"])
    # Teleport(SGD) against plain SGD from the same weights: no worse, and its teleports stayed
    assert_no_worse(result["losses"]["Teleport(SGD)"], result["losses"]["SGD"], higher_is_better=False)
    assert_rollbacks_rare(result["reports"])
    printed = capsys.readouterr().out
    assert "no Q for hidden_permutation" in printed and "SGD (baseline)" in printed and "rolled back" in printed


def test_07_learn_to_teleport(capsys):
    result = load("07_learn_to_teleport.py").main(["--quick"])
    # meta-training helped on held-out problems; the quick run (3 trajectories) is short: measured 54.829 -> 54.737,
    # deterministic (seeded, one thread)
    assert result["after"] < result["before"]
    assert result["teleport_drift"] <= 1e-10  # exact in float64 (measured ~1e-16)
    assert result["losses"][-1] < result["losses"][0]
    assert "untrained policy (= GD)" in capsys.readouterr().out  # the baseline: gradient descent, printed beside it


def test_08_hf_trainer(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    result = load("08_hf_trainer.py").main(["--quick"])
    teleport, trainer = result["teleport"], result["trainer"]
    # accelerate wrapped the Teleport the Trainer was given; its step still ran every step
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer" and trainer.optimizer.optimizer is teleport
    assert teleport.record.step == 8
    # every 3 steps: at step 0 B = 0 (peft's init) has no balanced point (left alone); then two balance teleports
    assert [(r.step, r.accepted) for r in teleport.reports] == [(0, False), (3, True), (6, True)]
    checked, lean = teleport.reports[1:]
    assert checked.loss_drift is not None and checked.loss_drift <= 1e-5  # checked on the dict probe batch, train mode
    # the plan's first teleport passed its check: the next one takes the lean closed-form path, with no batch
    assert lean.check == "none" and lean.loss_drift is None and "first teleport was checked" in lean.check_detail
    for r in (checked, lean):
        assert {s.action.name for s in r.sites} == {"lora_gl"} and len(r.sites) == 14
        assert r.state_decisions["transport"] == 28  # exp_avg of every A and B, by the covector rule
    # the Trainer's scheduler drove the base optimizer's learning rate through both wrappers
    assert teleport.base.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])
    assert result["syre"].penalty() > 0
    assert all(r["train_loss"] == r["train_loss"] for r in result["results"].values())  # finite, not NaN
    # no worse than the bare AdamW in the same Trainer, same weights and data
    baseline = result["results"]["AdamW (baseline)"]
    for name in ("Teleport(AdamW) balance", "Syre(AdamW)"):
        assert_no_worse(result["results"][name]["eval_loss"], baseline["eval_loss"], higher_is_better=False, ratio=LM_LOSS_RATIO)
    assert_rollbacks_rare(teleport.reports)
    printed = capsys.readouterr().out
    assert "AcceleratedOptimizer around Teleport(AdamW)" in printed and "AdamW (baseline)" in printed and "rolled back" in printed


def test_09_lightning(capsys):
    pytest.importorskip("lightning")
    result = load("09_lightning.py").main(["--quick"])
    first, resumed = result["first"], result["model"]
    # Lightning called Syre(Teleport(AdamW)).step every batch; the checkpoint restored the teleport counters
    assert result["steps_before"] == first.teleport.record.step > 0
    assert resumed.teleport.record.step == 2 * result["steps_before"]
    assert [r.step for r in resumed.teleport.reports] and min(r.step for r in resumed.teleport.reports) >= result["steps_before"]
    accepted = [r for r in result["reports"] if r.accepted]
    checked = [r for r in accepted if r.check != "none"]  # the others ran lean after their plan's checked teleport
    assert checked and all(r.loss_drift is not None and r.loss_drift <= 1e-5 for r in checked)
    assert all(r.check_detail.startswith("lean balance") for r in accepted if r.check == "none")
    assert resumed.syre.penalty() > 0
    assert result["accuracy"] > 0.5
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)  # the bare AdamW
    assert_rollbacks_rare(result["reports"])
    printed = capsys.readouterr().out
    assert "resumed at step" in printed and "baseline (AdamW alone" in printed and "rolled back" in printed


def test_10_fsdp2_under_torchrun(capsys):
    """The example launches ``torchrun --standalone --nproc_per_node 2`` itself (gloo on CPU), as a user would."""
    result = load("10_fsdp2.py").main(["--quick"])
    assert result["world"] == 2 and result["sites"]
    assert any(accepted for _, accepted, _ in result["teleports"]) and result["extra_accepted"]
    assert result["rank_spread"] == 0.0  # every rank holds bitwise the same full parameters
    assert result["resumed_exactly"]  # DCP save, fresh model and optimizer, load: the same trajectory bitwise
    # channel rescalings stay on the shards: a teleport sends per-channel statistics, not the parameters
    assert 0 < result["teleport_bytes"] <= 0.25 * result["param_bytes"], result
    assert result["lr"] == load("10_fsdp2.py").TUNED[200]  # both runs at the bare AdamW's tuned learning rate
    assert result["accuracy"] > 0.9  # measured 0.912 (200 steps)
    # no worse than the bare AdamW on the same shards, weights and batches; no teleport rolled back
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)
    assert_no_worse(result["test_loss"], result["baseline_test_loss"], higher_is_better=False)
    accepted = sum(1 for _, ok, _ in result["teleports"] if ok)
    assert accepted and result["rolled_back"] < 0.1 * accepted
    printed = capsys.readouterr().out
    assert "ranks identical: True" in printed and "baseline (AdamW alone, lr" in printed and "rolled back" in printed


@pytest.mark.slow
def test_10_full_run_is_no_worse_than_the_tuned_adamw_alone_in_seed_0():
    """The full run at the tuned learning rate (measured: 0.953 vs 0.949, test loss x0.968; at lr 1e-2 it lost)."""
    result = load("10_fsdp2.py").main(["--seed", "0"])
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)
    assert_no_worse(result["test_loss"], result["baseline_test_loss"], higher_is_better=False)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="measured at seed 2, 400 steps: test accuracy 0.949 vs 0.963 (4 digits of 297)")
def test_10_full_run_is_no_worse_than_the_tuned_adamw_alone_in_seed_2():
    """The seed the tuned run still loses in (the docstring's figures): this fails until it doesn't."""
    result = load("10_fsdp2.py").main(["--seed", "2"])
    assert_no_worse(result["accuracy"], result["baseline_accuracy"], higher_is_better=True)
