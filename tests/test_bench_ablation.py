"""Smoke test of benchmarks/bench_ablation.py with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_ablation
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_ablation


def test_ladder_runs_and_reports_what_its_runs_measured(bench, random_tiny_model, tmp_path, capsys):
    out = tmp_path / "ablation.json"
    png = tmp_path / "ablation.png"
    args = [
        "--presets", "grpo,dapo", "--seeds", "0,1", "--budget", "48", "--prompts", "2",
        "--generations", "4", "--updates-per-step", "2", "--eval-every", "2", "--eval-prompts", "6",
        "--model", str(random_tiny_model), "--runs-dir", str(tmp_path / "runs"),
        "--output", str(out), "--plot", str(png),
        "--max-length", "10", "--overlong-buffer", "4", "--lr", "1e-4",
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
    ]
    result = bench.main(args)
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert png.stat().st_size > 0
    assert "naive GRPO" in printed and "+ dynamic sampling (DAPO)" in printed

    for preset in ("grpo", "dapo"):
        finals = []
        for seed in (0, 1):
            summary = json.loads((tmp_path / "runs" / preset / f"seed{seed}" / "summary.json").read_text())
            finals.append(summary["accuracy_after"])
            # The budget, not the step count, ended the run.
            assert 48 <= summary["samples_generated"] < 48 + 8 * 8
        row = result["rows"][preset]
        assert row["final_acc"] == finals
        assert row["final_acc_mean"] == pytest.approx(statistics.fmean(finals))
        assert row["final_acc_std"] == pytest.approx(statistics.stdev(finals))
    # GRPO uses exactly 8 responses per rollout step: 48 / 8 = 6 steps of 2 updates each.
    assert result["rows"]["grpo"]["gradient_steps_mean"] == 12
    rows = [json.loads(x) for x in
            (tmp_path / "runs" / "grpo" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 6
    # The script's own settings reach every run.
    cfg = yaml.safe_load((tmp_path / "runs" / "grpo" / "seed0" / "config.yaml").read_text())
    assert cfg["train"]["lr"] == 1e-4 and cfg["rollout"]["max_completion_length"] == 10
    assert cfg["algorithm"]["overlong_buffer"] == 4 and cfg["train"]["mini_batch_size"] == 1
    # The truncation and clip columns are the per-run means of the logged metrics, over seeds.
    per_run = {}
    for seed in (0, 1):
        lines = (tmp_path / "runs" / "dapo" / f"seed{seed}" / "metrics.jsonl").read_text()
        steps = [json.loads(x) for x in lines.splitlines()]
        per_run[seed] = (
            statistics.fmean(r["response_length/clip_ratio"] for r in steps if "sampling/generated_samples_total" in r),
            statistics.fmean(r["actor/clip_frac_high"] for r in steps if "actor/clip_frac_high" in r),
        )
    row = result["rows"]["dapo"]
    assert row["truncated_frac_mean"] == pytest.approx(statistics.fmean(t for t, _ in per_run.values()))
    assert row["clip_frac_high_mean"] == pytest.approx(statistics.fmean(c for _, c in per_run.values()))

    # steps_to_reach agrees with a direct reading of DAPO's mean curve.
    curves = result["curves"]["dapo"]
    target = result["rows"]["grpo"]["final_acc_mean"]
    steps = sorted(set(curves[0]["steps"]) & set(curves[1]["steps"]))
    mean = [statistics.fmean(c["acc"][c["steps"].index(s)] for c in curves) for s in steps]
    expected = next((s for s, a in zip(steps, mean, strict=True) if a >= target), None)
    assert result["dapo_steps_to_grpo_final"] == expected

    # A second invocation reuses the finished runs instead of training again.
    stamp = (tmp_path / "runs" / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns
    bench.main(args)
    assert (tmp_path / "runs" / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns == stamp


def test_unknown_preset_is_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--presets", "grpo,dapoo"])
    assert "dapoo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--prompts", "16", "--updates-per-step", "3"])
    assert "--updates-per-step 3 must divide --prompts 16" in capsys.readouterr().err
