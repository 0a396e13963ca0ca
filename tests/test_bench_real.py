"""Smoke test of benchmarks/bench_real.py with a tiny model in place of SmolLM2, so that it
does not rot: the comparison trains each variant with its settings, reports what its runs
logged, and the time report reads the runs' perf metrics."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

ROOT = Path(__file__).resolve().parents[1]
REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # runs in this process: no imports
    bench_real = import_benchmark("bench_real")
    return bench_real


def test_the_example_is_what_the_benchmark_trains_by_default(bench):
    assert bench.CONFIG == ROOT / "examples" / "chat_addition.yaml"
    cfg = yaml.safe_load(bench.CONFIG.read_text())
    assert cfg["model"]["name_or_path"] == "builtin:smollm2"
    assert cfg["data"]["train"] == cfg["data"]["eval"] == "builtin:chat_addition"
    # Several updates per rollout step, so that clip-higher has something to clip.
    assert cfg["train"]["prompts_per_step"] > cfg["train"]["mini_batch_size"]


def test_compare_trains_each_variant_and_reports_its_runs(
    bench, random_tiny_model, tmp_path, capsys
):
    config = tmp_path / "tiny.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(random_tiny_model)},
                "data": {"train": "builtin:addition", "eval": "builtin:addition"},
                "rollout": {"num_generations": 4, "max_completion_length": 10},
                "algorithm": {"overlong_buffer": 4},
                "train": {"prompts_per_step": 2, "mini_batch_size": 1, "lr": 1e-3},
                # Mixed groups whatever the (random) model answers: dynamic sampling fills its batch.
                "reward": {"num_workers": 0, "functions": [{"name": f"{REWARDS}:by_answer_class"}]},
            }
        )
    )
    runs, out, png = tmp_path / "runs", tmp_path / "cmp.json", tmp_path / "cmp.png"
    result = bench.main(
        [
            "compare",
            "--seeds",
            "0,1",
            "--steps",
            "2",
            "--eval-prompts",
            "4",
            "--config",
            str(config),
            "--threads",
            "1",
            "--runs-dir",
            str(runs),
            "--output",
            str(out),
            "--plot",
            str(png),
        ]
    )
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())["rows"]  # NaN (no clip in a step) != NaN: compare parts
    assert png.stat().st_size > 0 and written.keys() == result["rows"].keys()
    assert [r["final_acc"] for r in written.values()] == [
        r["final_acc"] for r in result["rows"].values()
    ]
    assert "naive GRPO" in printed and "DAPO without clip-higher" in printed
    assert "DAPO - naive GRPO" in printed

    rows = result["rows"]
    # Equal gradient steps: 2 rollout steps x 2 updates for every variant.
    assert {r["gradient_steps_mean"] for r in rows.values()} == {4}
    for name, (_, preset, _) in bench.VARIANTS.items():
        summaries = [
            json.loads((runs / name / f"seed{s}" / "summary.json").read_text()) for s in (0, 1)
        ]
        assert [s["preset"] for s in summaries] == [preset, preset]
        finals = [s["accuracy_after"] for s in summaries]
        assert rows[name]["final_acc"] == finals
        assert rows[name]["final_acc_mean"] == pytest.approx(statistics.fmean(finals))
        assert rows[name]["acc_before"] == [s["accuracy_before"] for s in summaries]
    cfg = yaml.safe_load((runs / "dapo_no_clip_higher" / "seed1" / "config.yaml").read_text())
    assert cfg["algorithm"]["clip_high"] == 0.2 and cfg["algorithm"]["dynamic_sampling"] is True
    assert cfg["data"]["max_eval_prompts"] == 4 and cfg["seed"] == 1
    cfg = yaml.safe_load((runs / "dapo" / "seed0" / "config.yaml").read_text())
    assert cfg["algorithm"]["clip_high"] == 0.28
    # A signal's late value is the mean of the logged metric over the last quarter (1 step).
    logged = [
        json.loads(x)
        for x in (runs / "dapo" / "seed0" / "metrics.jsonl").read_text().splitlines()
        if "actor/entropy" in x
    ]
    seed0 = result["curves"]["dapo"][0]["per_step"]
    assert seed0["entropy"] == [r["actor/entropy"] for r in logged]
    assert seed0["clip_high"] == [r["actor/clip_frac_high"] for r in logged]

    # A finished comparison is not trained again.
    again = bench.main(
        [
            "compare",
            "--seeds",
            "0",
            "--steps",
            "2",
            "--eval-prompts",
            "4",
            "--config",
            str(config),
            "--runs-dir",
            str(runs),
            "--output",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert again["rows"]["grpo"]["final_acc"] == rows["grpo"]["final_acc"][:1]
    assert "seed 0:" not in capsys.readouterr().out

    # The time report: medians of the logged perf metrics after the first step.
    report = bench.main(["time", str(runs / "grpo" / "seed0")])
    (b,) = report["runs"]
    assert b["steps"] == 2 and b["updates_per_step"] == 2
    assert b["gen_s"] == pytest.approx(logged_perf(runs / "grpo" / "seed0", "perf/gen_s"))
    assert b["responses_per_step"] == 2 * 4  # no dynamic sampling: prompts x G
    assert "| generation |" in capsys.readouterr().out


def logged_perf(run: Path, key: str) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r][1]  # the second step (the first is left out)
