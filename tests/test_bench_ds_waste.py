"""Smoke test of benchmarks/bench_ds_waste.py with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


def test_waste_of_a_dapo_run(random_tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_ds_waste
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out, png = tmp_path / "waste.json", tmp_path / "waste.png"
    result = bench_ds_waste.main([
        "--steps", "4", "--model", str(random_tiny_model), "--runs-dir", str(tmp_path / "runs"),
        "--output", str(out), "--plot", str(png),
        "train.prompts_per_step=4", "train.mini_batch_size=4", "rollout.num_generations=4",
        "rollout.max_completion_length=10", "algorithm.overlong_buffer=4",
        # A third of the answers are always right, a third always wrong: uniform groups.
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
    ])
    assert "| runs/dapo |" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"].keys() == result["runs"].keys()
    assert png.stat().st_size > 0

    run = tmp_path / "runs" / "dapo"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sampling/generated_groups" in r]
    total = result["runs"]["runs/dapo"]["total"]
    # Generated responses agree with the trainer's own running count.
    assert total["generated"] == rows[-1]["sampling/generated_samples_total"]
    assert total["uniform"] > 0  # the reward made uniform groups, and they were dropped
    # Every generated response either trained, was dropped, or is the surplus left at the end:
    # 4 steps x 4 prompts x 4 responses trained.
    trained = 4 * 4 * 4
    assert total["generated"] == trained + total["uniform"] + total["final_surplus"]
    assert total["wasted_share"] == pytest.approx(
        (total["uniform"] + total["final_surplus"]) / total["generated"])
    assert total["discard_surplus_share"] >= total["uniform_share"]


def test_a_step_served_from_the_surplus_alone(tmp_path):
    """A rollout step can train only on groups carried over, generating nothing: the plot
    and the totals must take it (the 5-seed ladder's DAPO runs have such steps)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_ds_waste
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    step = {"all_correct": 0, "all_wrong": 0, "train_acc": 0.5}
    steps = [
        {**step, "step": 1, "generated": 32, "uniform": 8, "all_correct": 8, "carried_over": 8},
        {**step, "step": 2, "generated": 0, "uniform": 0, "carried_over": 0},
        {**step, "step": 3, "generated": 24, "uniform": 4, "all_wrong": 4, "carried_over": 4},
    ]
    result = bench_ds_waste.analyse({"run": steps})
    total = result["runs"]["run"]["total"]
    assert total["generated"] == 56 and total["uniform"] == 12
    assert total["wasted_share"] == pytest.approx((12 + 4) / 56)  # dropped + final surplus
    png = tmp_path / "waste.png"
    bench_ds_waste.plot(result, png)
    assert png.stat().st_size > 0
