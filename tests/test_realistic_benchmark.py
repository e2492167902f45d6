"""Smoke run of the realistic suite (benchmarks/realistic): every configuration, every arm, 1 seed, minimum steps.

Runs ``python -m benchmarks.realistic --quick`` in a subprocess (the suite is a package
folder and sets its own torch thread count) and checks the JSON schema, the targets,
the teleport accounting and that the verdicts are computed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("timm")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["mlp_sgd", "mlp_adamw", "cnn_adamw", "vit_adamw", "lora_adamw"]
ARMS = [
    "baseline",
    "teleport_default",
    "teleport_once",
    "teleport_once_allsites",
    "teleport_every200",
    "balance_every",
    "balance_every200",
    "balance_every_allsites",
    "weight_decay",
    "syre_default",
    "syre_sigma1",
]
TELEPORT_ARMS = [a for a in ARMS if a.startswith(("teleport", "balance"))]
SCHEDULED = [a for a in TELEPORT_ARMS if a != "teleport_default"]
STATS = {"median", "min", "max", "q1", "q3", "n"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("realistic")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.realistic", "--quick", "--json", str(out / "r.json"), "--no-progress", "--threads", "1"]
        + ["--configs", *CONFIGS, "--arms", *ARMS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "r.json").read_text()), proc.stdout, out


def test_quick_run_covers_every_configuration_and_arm(quick):
    result, stdout, out = quick
    assert [c["config"] for c in result["configs"]] == CONFIGS
    assert {"benchmark", "date", "machine", "settings", "configs", "verdict", "seconds"} <= set(result)
    for c in result["configs"]:
        assert c["arms"] == ARMS and list(c["summary"]) == ARMS
        assert c["lr"] in c["lr_grid"] and c["seeds"] == 1
        assert len(c["runs"]) == len(ARMS)
        for s in c["summary"].values():
            for key in (
                "final_train_loss",
                "best_val_loss",
                "test_loss",
                "test_acc",
                "steps_to_T1",
                "seconds_to_T2",
                "speedup_Vbest",
                "teleports_accepted",
                "teleport_cost_iters",
                "dead_units",
                "feature_rank",
            ):
                assert STATS <= set(s[key]), key
            assert s["divergences"] in (0, 1)
        assert (out / f"realistic_{c['config']}.png").is_file()
        assert c["config"] in stdout


def test_targets_and_teleport_accounting(quick):
    result, _, _ = quick
    for c in result["configs"]:
        runs = {r["arm"]: r for r in c["runs"]}
        base = runs["baseline"]
        # the baseline reaches its own targets, T2 no later than its last step
        assert base["steps_to_T2"] is not None and base["steps_to_T2"] <= base["steps"]
        assert base["steps_to_T1"] is not None and base["speedup_Vbest"] == pytest.approx(1.0)
        assert base["sites"] is None and base["teleports_accepted"] == 0
        # every Teleport arm ran detection (sites="auto" under AdamW leaves out the normalisation-affine sites
        # whose other weights are not scale-invariant); the scheduled ones attempted a teleport
        for arm in TELEPORT_ARMS:
            assert runs[arm]["sites"] is not None
        for arm in ("teleport_once_allsites", "balance_every_allsites"):
            assert runs[arm]["sites"] > 0
        for arm in SCHEDULED:
            r = runs[arm]
            if arm.startswith("balance") and r["steps"] <= 50:
                continue  # balance's default schedule starts at step 50, after the quick runs' last step
            assert r["teleports_accepted"] + r["teleports_declined"] + r["teleports_rolled_back"] >= 1
            if r["sites"]:
                assert r["teleport_seconds"] > 0 and r["teleport_cost_iters"] > 0
        # every arm of a seed starts from the same initialisation
        assert runs["weight_decay"]["curve"]["train_loss"][0] == pytest.approx(base["curve"]["train_loss"][0])


def test_verdicts_are_computed(quick):
    result, stdout, _ = quick
    for c in result["configs"]:
        v = c["verdict"]
        assert isinstance(v["default_never_worse"]["pass"], bool)
        assert isinstance(v["wins"]["pass"], bool)
        if c["collapse"]:
            assert isinstance(v["syre_collapse"]["pass"], bool)
    o = result["verdict"]
    assert not o["complete"] and isinstance(o["wins_pass"], bool)  # the language models ran apart
    assert "verdict over 5 configuration(s)" in stdout


def test_merge_recomputes_the_table_and_verdict(quick, tmp_path):
    result, _, out = quick
    merged = tmp_path / "merged.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.realistic", "--merge", str(out / "r.json"), "--json", str(merged), "--no-plot"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(merged.read_text())
    assert [c["config"] for c in again["configs"]] == CONFIGS
    assert again["verdict"] == result["verdict"]


LM_CONFIGS = ["llama_lm", "llama_lora"]
LM_ARMS = ["baseline", "teleport_default", "balance_every1", "syre_default", "cautious_wd", "balora"]


def test_language_model_workloads_tune_lr_and_decay_and_run_their_own_baselines(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.realistic", "--quick", "--json", str(tmp_path / "lm.json"), "--no-progress", "--no-plot"]
        + ["--threads", "1", "--configs", *LM_CONFIGS, "--arms", *LM_ARMS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "lm.json").read_text())
    by_name = {c["config"]: c for c in result["configs"]}
    assert list(by_name) == LM_CONFIGS
    lm, lora = by_name["llama_lm"], by_name["llama_lora"]
    # Cautious Weight Decay is every LM's comparison; BaLoRA needs LoRA pairs and is tuned as a baseline of its own
    assert lm["arms"] == [a for a in LM_ARMS if a != "balora"] and lora["arms"] == LM_ARMS
    assert set(lora["tuned_arms"]) == {"balora"}
    for c in (lm, lora):
        assert c["language_model"] and c["val_ratio"] == 1.01 and c["base_weight_decay"] in c["wd_grid"]
        for r in c["runs"]:
            assert 0.0 <= r["test_acc"] <= 1.0  # a next-byte accuracy over every position of every window
    # from scratch the first loss is uniform's log 256; the fine-tune starts from the English pre-training
    assert all(r["curve"]["val_loss"][0] == pytest.approx(5.545, abs=0.3) for r in lm["runs"])
    assert all(r["curve"]["val_loss"][0] < 5.545 - 1.0 for r in lora["runs"])
    assert result["verdict"]["wins_needed"].endswith("2 language-model configurations")


def test_balanced_lora_projection_keeps_the_product_and_balances_the_pair():
    from benchmarks.realistic.lm import balanced_lora_projection

    torch = pytest.importorskip("torch")
    nn = torch.nn
    g = torch.Generator().manual_seed(0)
    layer = nn.Module()
    layer.lora_A = nn.ModuleDict({"default": nn.Linear(12, 3, bias=False)})
    layer.lora_B = nn.ModuleDict({"default": nn.Linear(3, 7, bias=False)})
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.randn(3, 12, generator=g))
        layer.lora_B["default"].weight.copy_(0.01 * torch.randn(7, 3, generator=g))
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    product = (B @ A).detach().double()
    balanced_lora_projection(layer)
    assert torch.allclose((B @ A).double(), product, rtol=0, atol=1e-6 * float(product.abs().max()))
    gram_a, gram_b = (A @ A.T).double(), (B.T @ B).double()
    assert torch.allclose(gram_a, gram_b, atol=1e-5 * float(gram_a.abs().max()))
