"""AlgoPerf's performance profiles over suite results (benchmarks/realistic/profiles.py), on hand-built runs."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.realistic.profiles import load, main, profile, score, workload_times


def _run(arm: str, seed: int, val: list[float], step_s: float = 0.01, teleports: list[list[float]] | None = None) -> dict:
    steps = [100 * (i + 1) for i in range(len(val))]
    return {
        "arm": arm,
        "seed": seed,
        "best_val_loss": min(val),
        "median_step_seconds": step_s,
        "teleport_events": teleports or [],
        "curve": {"step": steps, "val_loss": val, "seconds": [s * step_s for s in steps]},
    }


def _config(name: str, runs: list[dict]) -> dict:
    return {"config": name, "runs": runs}


def _workload_a() -> dict:
    # baseline best per seed 1.0, 0.9, 0.8: the target is their median 0.9
    runs = [
        _run("baseline", 0, [2.0, 1.5, 1.0]),  # never reaches 0.9
        _run("baseline", 1, [2.0, 0.9, 0.9]),  # step 200
        _run("baseline", 2, [0.85, 0.8, 0.8]),  # step 100
        _run("fast", 0, [0.9, 0.8, 0.8]),  # step 100
        _run("fast", 1, [0.9, 0.8, 0.8], teleports=[[50, 0.5], [250, 9.9]]),  # step 100 + 0.5 s of teleport before it
        _run("fast", 2, [2.0, 2.0, 2.0]),  # never
    ]
    return _config("a", runs)


def test_target_is_the_baselines_median_best_and_times_count_teleports_before_the_target():
    w = workload_times(_workload_a())
    assert w.target == pytest.approx(0.9)
    # modelled seconds: the baseline's iteration time x (steps x overhead + teleport seconds / own iteration time)
    assert w.per_seed["baseline"] == [None, pytest.approx(2.0), pytest.approx(1.0)]
    assert w.per_seed["fast"] == [pytest.approx(1.0), pytest.approx(1.5), None]  # the teleport at 250 comes after
    assert w.median["baseline"] == pytest.approx(2.0) and w.median["fast"] == pytest.approx(1.5)
    assert w.ratios() == {"baseline": pytest.approx(4 / 3), "fast": pytest.approx(1.0)}


def test_a_median_over_seeds_that_misses_is_infinite_and_scores_nothing():
    runs = [_run("baseline", s, [1.0, 0.5]) for s in range(3)] + [_run("slow", s, [2.0, 2.0 if s else 0.4]) for s in range(3)]
    w = workload_times(_config("b", runs))
    assert w.per_seed["slow"] == [pytest.approx(2.0), None, None]
    assert math.isinf(w.median["slow"]) and math.isinf(w.ratios()["slow"])
    assert profile([w], "slow", [1.0, 100.0]) == [0.0, 0.0]
    assert score([w], "slow") == 0.0 and score([w], "baseline") == 1.0


def test_profile_and_score_over_two_workloads():
    a = workload_times(_workload_a())  # baseline ratio 4/3, fast 1
    runs = [_run("baseline", s, [1.0, 0.5]) for s in range(3)] + [_run("fast", s, [1.0, 1.0, 0.5]) for s in range(3)]
    b = workload_times(_config("b", runs))  # baseline reaches 0.5 at step 200, fast at 300: fast ratio 1.5
    ws = [a, b]
    assert profile(ws, "baseline", [1.0, 1.2, 4 / 3, 4.0]) == [0.5, 0.5, 1.0, 1.0]
    assert profile(ws, "fast", [1.0, 1.4, 1.5]) == [0.5, 0.5, 1.0]
    # area under a step function on [1, 4] over 3: each workload adds (4 - r) / (2 * 3)
    assert score(ws, "baseline") == pytest.approx(((4 - 4 / 3) + (4 - 1)) / 6)
    assert score(ws, "fast") == pytest.approx(((4 - 1) + (4 - 1.5)) / 6)
    with pytest.raises(ValueError, match="tau_max"):
        score(ws, "fast", tau_max=1.0)


def test_cli_compares_arms_run_everywhere_and_writes_finite_json(tmp_path, capsys):
    first = tmp_path / "one.json"
    second = tmp_path / "two.json"
    extra = [_run("only_here", s, [0.1]) for s in range(3)]
    first.write_text(json.dumps({"configs": [_config("a", _workload_a()["runs"] + extra)]}))
    runs = [_run("baseline", s, [1.0, 0.5]) for s in range(3)] + [_run("fast", s, [1.0, 2.0]) for s in range(3)]
    second.write_text(json.dumps({"configs": [_config("b", runs)]}))
    out = tmp_path / "p.json"
    assert main([str(first), str(second), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "left out (not run on every workload): only_here" in printed
    data = json.loads(out.read_text())  # strict JSON: an infinite time is null
    assert data["arms"] == ["baseline", "fast"]
    assert data["workloads"][1]["median"]["fast"] is None
    assert data["scores"]["baseline"] == pytest.approx(((4 - 4 / 3) + 3) / 6)
    with pytest.raises(ValueError, match="not run on every workload"):
        main([str(first), str(second), "--arms", "only_here"])
    with pytest.raises(ValueError, match="appears twice"):
        load([first, first])


def test_a_workload_without_baseline_is_an_error():
    with pytest.raises(ValueError, match="no baseline"):
        workload_times(_config("c", [_run("fast", 0, [1.0])]))


def test_rename_compares_one_configuration_run_under_two_names(tmp_path, capsys):
    path = tmp_path / "one.json"
    runs = [_run("baseline", s, [1.0, 0.5]) for s in range(3)] + [_run("same_as_default", s, [0.5, 0.5]) for s in range(3)]
    path.write_text(json.dumps({"configs": [_config("a", runs)]}))
    assert main([str(path), "--rename", "same_as_default=default"]) == 0
    assert "  default " in capsys.readouterr().out
    with pytest.raises(ValueError, match="OLD=NEW"):
        main([str(path), "--rename", "nonsense"])


def test_the_target_can_be_another_arms_median_best():
    # the arm "fast" reaches 0.8 (median best); the baseline never does
    w = workload_times(_workload_a(), target_arm="fast")
    assert w.target == pytest.approx(0.8)
    assert w.per_seed["baseline"] == [None, None, pytest.approx(2.0)]
    assert w.per_seed["fast"] == [pytest.approx(2.0), pytest.approx(2.5), None]
    with pytest.raises(ValueError, match="target arm 'nope'"):
        workload_times(_workload_a(), target_arm="nope")


def test_a_missing_or_foreign_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load([tmp_path / "missing.json"])
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a suite JSON"):
        load([foreign])
