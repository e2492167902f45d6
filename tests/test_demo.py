"""``python -m teleopt demo``: the quick mode runs end to end and shows what the README says it shows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import teleopt
from teleopt.cli import main
from teleopt.demo import feature_rank, run_demo


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    threads = torch.get_num_threads()
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the demo runs on one thread and gives the caller's setting back
    printed = capsys.readouterr().out
    result = json.loads((out / "demo.json").read_text())
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    runs = {(r["task"], r["name"]): r for r in result["runs"]}
    assert result["settings"]["steps"] == {"regression": 300, "digits": 300}
    assert len(runs) == 12
    balance = runs[("digits", "SGD+mom lr 1e-2 + balance")]["metrics"]
    assert balance["teleports"] >= 4  # every 50 steps from step 50 over 300 steps, checked and kept
    for (_task, name), r in runs.items():
        assert name in printed  # every run is a row of the printed table
        assert len(r["steps"]) == len(r["train_loss"]) == len(r["seconds"]) and r["steps"][-1] == 300
        assert all(b >= a for a, b in zip(r["seconds"], r["seconds"][1:]))
        assert f"{r['metrics']['train_loss']:.4g}" in printed
        if name.endswith("Teleport"):
            # exactly one scheduled teleport, accepted: the post-condition found the loss unchanged
            assert r["metrics"]["teleports"] == 1
    for opt in ("GD lr 1e-4", "AdaGrad lr 0.1"):
        # Zhao 2026, Sec. 4.6.1: one teleport at step 5 reaches the baseline's final loss in far fewer steps
        teleported = runs[("regression", f"{opt} + Teleport")]["metrics"]
        assert teleported["steps_to_target"] is not None and teleported["steps_to_target"] < 150
        assert teleported["train_loss"] < runs[("regression", opt)]["metrics"]["train_loss"]
    # Ziyin et al. 2025: decay towards zero lowers the rank of the first layer's features; towards the anchor it does not
    zero = runs[("digits", "lr 1e-2, decay 0.1 to zero")]["metrics"]
    anchored = runs[("digits", "lr 1e-2, Syre 0.1")]["metrics"]
    assert anchored["feature_rank"] == 64 and zero["feature_rank"] < anchored["feature_rank"]
    assert anchored["test_accuracy"] > zero["test_accuracy"]


def test_demo_bad_input(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        run_demo(steps=5)
    with pytest.raises(ValueError, match="seed"):
        run_demo(seed=-1)
    with pytest.raises(ValueError, match="tasks"):
        run_demo(tasks=("mnist",))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "3"], "--steps must be >= 10, got 3"),
        (["demo", "--threads", "0"], "--threads must be >= 1, got 0"),
        (["demo", "--seed", "x"], "--seed must be an integer"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--quick", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_cli_rejects_bad_arguments_before_training(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_checks_out_before_training(tmp_path, capsys):
    """--out naming a file fails at parse time, not after a minute of training."""
    a_file = tmp_path / "taken"
    a_file.write_text("")
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(a_file)])
    assert "exists and is not a folder" in capsys.readouterr().err


def test_cli_help_and_version_do_not_import_torch():
    code = (
        "import sys, contextlib, io\n"
        "from teleopt.cli import main\n"
        "for argv in (['--help'], ['--version'], ['demo', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    print(argv[0], out.getvalue().splitlines()[0])\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "False", "parsing the command line imported torch"
    assert f"teleopt {teleopt.__version__}" in result.stdout
    assert lines[0].startswith("--help usage: teleopt")


def test_cli_without_a_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_demo_regression_only_is_deterministic():
    a = run_demo(steps=20, seed=3, progress=False, tasks=("regression",))
    b = run_demo(steps=20, seed=3, progress=False, tasks=("regression",))
    assert [r.train_loss for r in a.runs] == [r.train_loss for r in b.runs]
    assert {r.task for r in a.runs} == {"regression"}
    assert "GD lr 1e-4 + Teleport" in a.table()


def test_feature_rank_sees_collapse_but_not_rescaling():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(500, 8, generator=g, dtype=torch.float64)
    assert feature_rank(z) == 8
    # per-unit positive rescalings (what a teleport does to a layer) change no function, and no rank
    scales = torch.logspace(-3, 3, 8, dtype=torch.float64)
    assert feature_rank(z * scales) == 8
    collapsed = torch.cat([z[:, :3], z[:, :3] @ torch.randn(3, 5, generator=g, dtype=torch.float64)], 1)
    assert feature_rank(collapsed) == 3
    dead = z.clone()
    dead[:, 5:] = 0.0
    assert feature_rank(dead) == 5
