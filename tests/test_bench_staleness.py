"""Smoke test of benchmarks/bench_staleness.py with tiny settings, and its verdicts by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

REWARDS = Path(__file__).with_name("trainer_rewards.py")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # runs in this process: no imports
    return import_benchmark("bench_staleness")


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_variants_cover_each_n_partial_and_uncorrected(bench):
    names = [v.name for v in bench.variants([0, 1, 2, 4], True, [4])]
    assert names == [
        "N0",
        "N1",
        "N1-partial",
        "N2",
        "N2-partial",
        "N4",
        "N4-uncorrected",
        "N4-partial",
    ]
    assert [v.name for v in bench.variants([0, 2], False, [])] == ["N0", "N2"]
    v = bench.Variant(4, corrected=False)
    assert v.overrides() == ["rollout.max_staleness=4", "algorithm.is_cap=null"]
    assert bench.Variant(2, partial=True).overrides() == [
        "rollout.max_staleness=2",
        "rollout.partial_rollouts=true",
    ]


def test_spread_verdicts_by_hand(bench):
    assert bench.spread_verdict([0.10, 0.20], [0.15, 0.30]) == "within"  # ranges overlap
    assert bench.spread_verdict([0.10, 0.20], [0.21, 0.30]) == "above"
    assert bench.spread_verdict([0.10, 0.20], [0.00, 0.09]) == "below"
    assert bench.spread_verdict([0.10], [0.50]) == "within"  # one seed: no spread

    def run(before: float, after: float, grad: float) -> dict:
        nan = math.nan
        return {
            "acc": [before, after],
            "final_acc": after,
            "gradient_steps": grad,
            "gain": after - before,
            "gain_per_100_grad_steps": 100 * (after - before) / grad,
            "stream/staleness_max": 0.0,
        } | dict.fromkeys(
            (*bench.STREAM_SUMS, "stream/staleness_mean", "stream/versions_per_response"), nan
        )

    rows = bench.summarize(
        {
            "N0": [run(0.1, 0.3, 8), run(0.1, 0.4, 8)],  # gains 0.2, 0.3
            "N4-uncorrected": [run(0.1, 0.2, 8), run(0.1, 0.25, 8)],  # 0.1, 0.15
        }
    )
    assert rows["N0"]["gain_mean"] == pytest.approx(0.25)
    assert rows["N0"]["gain_per_100_grad_steps_mean"] == pytest.approx(100 * 0.25 / 8)
    assert rows["N4-uncorrected"]["vs_N0"] == "below"
    assert rows["N4-uncorrected"]["gain_min"] == pytest.approx(0.1)


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tasks", "addition,subtraction"])
    assert "choose from addition, long_addition" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--ns", "1,2"])
    assert "must include 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--prompts", "4", "--updates-per-step", "3"])
    assert "--updates-per-step 3 must divide --prompts 4" in capsys.readouterr().err


@pytest.mark.slow
def test_sweep_trains_each_variant_and_reports_its_metrics(
    bench, random_tiny_model, tmp_path, capsys
):
    out, png, runs = tmp_path / "staleness.json", tmp_path / "plots" / "st.png", tmp_path / "runs"
    args = [
        "--tasks",
        "addition",
        "--ns",
        "0,1",
        "--uncorrected",
        "1",
        "--seeds",
        "0",
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
        str(png),
        "rollout.max_completion_length=10",
        "algorithm.overlong_buffer=4",
        "rollout.partial_chunk_tokens=4",
        "rollout.temperature=1.25",
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
    ]
    result = bench.main(args)
    printed = capsys.readouterr().out
    assert "4 runs (0 already done)" in printed
    assert json.loads(out.read_text())["tasks"] == json.loads(json.dumps(result["tasks"]))
    assert png.stat().st_size > 0
    rows = result["tasks"]["addition"]["rows"]
    assert list(rows) == ["N0", "N1", "N1-uncorrected", "N1-partial"]
    assert "N=1, no correction (is_cap=null)" in printed and "N=1, partial rollouts" in printed

    # Each variant's settings reach its run.
    def cfg(name: str) -> dict:
        return yaml.safe_load((runs / "addition" / name / "seed0" / "config.yaml").read_text())

    assert cfg("N0")["rollout"]["max_staleness"] == 0
    assert cfg("N1")["rollout"]["max_staleness"] == 1 and cfg("N1")["algorithm"]["is_cap"] == 5
    assert cfg("N1-uncorrected")["algorithm"]["is_cap"] is None
    assert cfg("N1-partial")["rollout"]["partial_rollouts"] is True
    assert cfg("N1")["logging"]["eval_every"] == 2 and cfg("N1")["train"]["mini_batch_size"] == 1
    assert cfg("N0")["train"]["lr"] == 1e-4 and cfg("N0")["data"]["eval"] == "builtin:addition"

    # The figures are the runs' own: gain from the summary, staleness from metrics.jsonl.
    for name, row in rows.items():
        run = runs / "addition" / name / "seed0"
        summary = json.loads((run / "summary.json").read_text())
        assert row["gain"] == [
            pytest.approx(summary["accuracy_after"] - summary["accuracy_before"])
        ]
        steps = [r for r in metrics(run) if "actor/updates" in r]
        grad = sum(r["actor/updates"] for r in steps)
        assert row["gradient_steps_mean"] == grad
        if grad:
            assert row["gain_per_100_grad_steps_mean"] == pytest.approx(100 * row["gain"][0] / grad)
        assert row["vs_N0"] == "within"  # one seed: no spread to be beyond
        if name == "N0":
            assert math.isnan(row["stream/staleness_mean"]) and row["staleness_max"] == 0
        else:  # never older than N = 1, and the mean is the logged one
            assert row["staleness_max"] <= 1
            logged = [r["stream/staleness_mean"] for r in steps if "stream/staleness_mean" in r]
            assert row["stream/staleness_mean"] == pytest.approx(sum(logged) / len(logged))
    curve = result["tasks"]["addition"]["curves"]["N1"][0]
    assert curve["eval_steps"] == [0, 2, 3] and curve["eval_grad_steps"][-1] == 6

    # A second invocation reuses the finished runs.
    stamp = (runs / "addition" / "N0" / "seed0" / "summary.json").stat().st_mtime_ns
    bench.main(args)
    assert (runs / "addition" / "N0" / "seed0" / "summary.json").stat().st_mtime_ns == stamp
    assert "4 runs (4 already done)" in capsys.readouterr().out
