"""Smoke test of benchmarks/bench_ablation.py with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # runs in this process: no imports
    bench_ablation = import_benchmark("bench_ablation")
    return bench_ablation


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_ladder_runs_both_comparisons_and_reports_what_its_runs_measured(
    bench, random_tiny_model, tmp_path, capsys
):
    out, prefix, runs = tmp_path / "ablation.json", tmp_path / "plots" / "abl", tmp_path / "runs"
    args = [
        "--presets",
        "grpo,dapo",
        "--seeds",
        "0,1",
        "--steps",
        "3",
        "--prompts",
        "2",
        "--generations",
        "4",
        "--updates-per-step",
        "2",
        "--eval-every",
        "2",
        "--eval-prompts",
        "6",
        "--eval-k",
        "2",
        "--model",
        str(random_tiny_model),
        "--runs-dir",
        str(runs),
        "--output",
        str(out),
        "--plot",
        str(prefix),
        "--max-length",
        "10",
        "--overlong-buffer",
        "4",
        "--lr",
        "1e-4",
        "--temperature",
        "1.25",
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
    ]
    result = bench.main(args)
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["modes"]["steps"]["rows"] == result["modes"]["steps"]["rows"]
    for mode in ("steps", "budget"):
        assert Path(f"{prefix}_{mode}.png").stat().st_size > 0
    assert "equal gradient steps" in printed and "equal generation budget" in printed
    assert "naive GRPO" in printed and "+ dynamic sampling (DAPO)" in printed
    assert "6 runs (0 already done)" in printed

    # Naive GRPO trains once per seed for both comparisons; DAPO twice.
    assert sorted(p.name for p in (runs / "grpo").iterdir() if p.is_dir()) == ["seed0", "seed1"]
    assert sorted(p.name for p in (runs / "dapo").iterdir() if p.is_dir()) == [
        "seed0-budget",
        "seed0-steps",
        "seed1-budget",
        "seed1-steps",
    ]
    assert result["runs"] == 6
    budget = 3 * 2 * 4
    for seed in (0, 1):
        grpo = json.loads((runs / "grpo" / f"seed{seed}" / "summary.json").read_text())
        assert grpo["steps"] == 3 and grpo["samples_generated"] == budget
        steps = json.loads((runs / "dapo" / f"seed{seed}-steps" / "summary.json").read_text())
        assert steps["steps"] == 3 and steps["samples_generated"] >= budget
        spent = json.loads((runs / "dapo" / f"seed{seed}-budget" / "summary.json").read_text())
        # The budget, not the step count, ended the run: at the first step that reached it
        # (a step may generate several rounds, up to algorithm.max_gen_rounds).
        totals = [
            m["sampling/generated_samples_total"]
            for m in metrics(runs / "dapo" / f"seed{seed}-budget")
            if "sampling/generated_samples_total" in m
        ]
        assert spent["steps"] <= 3 and spent["samples_generated"] == totals[-1] >= budget
        assert all(t < budget for t in totals[:-1])
    steps_rows, budget_rows = (result["modes"][m]["rows"] for m in ("steps", "budget"))
    assert steps_rows["grpo"] == budget_rows["grpo"]
    assert (
        steps_rows["grpo"]["gradient_steps_mean"] == steps_rows["dapo"]["gradient_steps_mean"] == 6
    )
    assert budget_rows["dapo"]["gradient_steps_mean"] <= 6

    # The settings reach every run; held-out accuracy is avg@k over k samples per problem.
    cfg = yaml.safe_load((runs / "dapo" / "seed0-budget" / "config.yaml").read_text())
    assert cfg["train"]["sample_budget"] == budget and cfg["train"]["mini_batch_size"] == 1
    assert cfg["rollout"]["eval_num_generations"] == 2 and cfg["train"]["lr"] == 1e-4
    assert cfg["rollout"]["temperature"] == 1.25 and cfg["rollout"]["eval_temperature"] == 1.0
    assert cfg["data"]["train"] == cfg["data"]["eval"] == "builtin:long_addition"
    assert (
        cfg["rollout"]["max_completion_length"] == 10 and cfg["algorithm"]["overlong_buffer"] == 4
    )
    cfg = yaml.safe_load((runs / "grpo" / "seed0" / "config.yaml").read_text())
    assert cfg["train"]["sample_budget"] == 0

    # Final accuracy: the runs' own summaries, averaged over seeds.
    for mode, found in result["modes"].items():
        finals = [
            json.loads((runs / "dapo" / f"seed{s}-{mode}" / "summary.json").read_text())[
                "accuracy_after"
            ]
            for s in (0, 1)
        ]
        row = found["rows"]["dapo"]
        assert row["final_acc"] == finals
        assert row["final_acc_mean"] == pytest.approx(statistics.fmean(finals))
        assert row["final_acc_std"] == pytest.approx(statistics.stdev(finals))

    # The curves are the logged metrics: per rollout step, and held-out accuracy per evaluation.
    run = runs / "dapo" / "seed1-steps"
    curve = result["modes"]["steps"]["curves"]["dapo"][1]  # seeds in order
    steps = [r for r in metrics(run) if "sampling/generated_samples_total" in r]
    assert curve["per_step"]["samples"] == [r["sampling/generated_samples_total"] for r in steps]
    assert curve["per_step"]["clip_high"] == [r["actor/clip_frac_high"] for r in steps]
    assert curve["per_step"]["all_wrong"] == [r["sampling/all_wrong_frac"] for r in steps]
    assert curve["per_step"]["grad_steps"] == [2.0, 4.0, 6.0]
    evals = {r["step"]: r["val/acc"] for r in metrics(run) if "val/acc" in r}
    assert curve["eval_steps"] == [0, 2, 3] and curve["acc"][1:] == [evals[2], evals[3]]
    assert curve["eval_grad_steps"] == [0.0, 4.0, 6.0]
    # Early / late: the first and last quarter of the rollout steps (here one step each).
    stats = bench.run_stats(curve)
    assert stats["truncated_early"] == steps[0]["response_length/clip_ratio"]
    assert stats["entropy_late"] == steps[-1]["actor/entropy"]
    assert stats["clip_high_max"] == max(r["actor/clip_frac_high"] for r in steps)

    # What the ladder shows is read off the rows.
    found = result["modes"]["steps"]["findings"]
    g, d = steps_rows["grpo"], steps_rows["dapo"]
    assert found["dapo_vs_grpo"]["diff"] == pytest.approx(d["final_acc_mean"] - g["final_acc_mean"])
    apart = d["final_acc_min"] > g["final_acc_max"] or d["final_acc_max"] < g["final_acc_min"]
    assert found["dapo_vs_grpo"]["separated"] == apart
    assert found["entropy_late_symmetric"] == g["entropy_late"]
    assert found["entropy_late_clip_higher"] == d["entropy_late"]

    # A second invocation reuses the finished runs instead of training again.
    stamp = (runs / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns
    bench.main(args)
    assert (runs / "grpo" / "seed0" / "summary.json").stat().st_mtime_ns == stamp
    assert "6 runs (6 already done)" in capsys.readouterr().out


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--presets", "grpo,dapoo"])
    assert "dapoo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--prompts", "16", "--updates-per-step", "3"])
    assert "--updates-per-step 3 must divide --prompts 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--modes", "steps,samples"])
    assert "choose from steps, budget" in capsys.readouterr().err


@pytest.mark.parametrize("in_process", ["0", "1"])
def test_dapo_train_skips_finished_runs_and_restarts_interrupted_ones(
    in_process, tmp_path, monkeypatch
):
    """Both ways of running ``dapo train``: a fresh process, and this one (the smoke tests)."""
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", in_process)
    bench = import_benchmark("bench_ablation")
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text("{}")
    assert bench.dapo_train(done, ["no.such_key=1"], 1, "finished") is False
    assert not (tmp_path / "done.log").exists()  # not run at all

    interrupted = tmp_path / "interrupted"
    (interrupted / "checkpoints").mkdir(parents=True)
    (interrupted / "checkpoints" / "stale.pt").write_text("x")
    argv = ["no.such_key=1", f"output_dir={interrupted}"]  # a config error: dapo exits at once
    with pytest.raises(RuntimeError, match=r"bad run failed \(2\); see .*interrupted\.log"):
        bench.dapo_train(interrupted, argv, 1, "bad run")
    assert not (interrupted / "checkpoints" / "stale.pt").exists()  # started from scratch
    assert "unknown config key" in (tmp_path / "interrupted.log").read_text()


@pytest.mark.parametrize("in_process", ["0", "1"])
def test_run_dapo_returns_a_usage_errors_status_either_way(in_process, tmp_path, monkeypatch):
    """``dapo eval`` without its model exits 2 through argparse: the status, in the log's
    process or this one, not an exception that ends the benchmark."""
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", in_process)
    bench = import_benchmark("bench_ablation")
    log = tmp_path / "eval.log"
    assert bench.run_dapo(["eval", "--k", "2"], 1, log) == 2
    assert "usage" in log.read_text()
