"""Smoke test of benchmarks/bench_distill.py with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


def test_the_three_arms_run_and_report_steps_to_rls_accuracy(
    random_tiny_model, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # runs in this process: no imports
    bench = import_benchmark("bench_distill")
    out, png, runs = tmp_path / "distill.json", tmp_path / "distill.png", tmp_path / "runs"
    args = [
        # One seed: averaging over seeds is bench_ablation's and bench_real's (tested there).
        *("--seeds", "0", "--steps", "2", "--prompts", "2", "--generations", "2"),
        *("--updates-per-step", "1", "--eval-every", "1", "--eval-prompts", "4", "--eval-k", "1"),
        *("--max-length", "8", "--overlong-buffer", "4"),
        *("--student", str(random_tiny_model)),
        # The teacher: the same model after one DAPO rollout step (its final model).
        *("--teacher-base", str(random_tiny_model), "--teacher-steps", "1"),
        *("--runs-dir", str(runs), "--output", str(out), "--plot", str(png)),
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
        "algorithm.overlong_filter=false",
    ]
    result = bench.main(args)
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert png.stat().st_size > 0
    assert set(result["rows"]) == {"rl", "distill", "both"}
    assert "RL alone (DAPO)" in printed and "distillation alone" in printed
    # Equal gradient steps: every arm made steps x updates-per-step updates.
    for arm, row in result["rows"].items():
        assert row["gradient_steps"] == 2.0, arm
        for c in result["curves"][arm]:
            assert c["eval_grad_steps"] == [0.0, 1.0, 2.0]
            assert c["eval_wall_s"][0] == 0.0 and c["eval_wall_s"][-1] > 0.0
    # Each arm's "steps to RL's final accuracy" is read off its own mean curve.
    target = result["rl_final_acc"]
    rl = result["curves"]["rl"]
    mean = [sum(r["acc"][i] for r in rl) / len(rl) for i in range(3)]
    reached = next((x for x, y in zip([0.0, 1.0, 2.0], mean, strict=True) if y >= target), None)
    assert result["rows"]["rl"]["steps_to_rl_final"] == reached
    # The distillation runs used the teacher and no reward; the measured models are recorded.
    rows = [
        json.loads(x)
        for x in (runs / "distill" / "seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["distill/teacher_share"] == 1.0 for r in rows if "distill/teacher_share" in r)
    assert set(result["before"]) == {"teacher", "student"}
    teacher = runs / "teacher" / "final_model"
    assert result["settings"]["teacher"] == str(teacher) and (teacher / "config.json").exists()
