"""Smoke test of benchmarks/bench_ds_waste.py with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.slow


def test_waste_of_a_dapo_run(random_tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench_ds_waste = import_benchmark("bench_ds_waste")
    out, png = tmp_path / "waste.json", tmp_path / "waste.png"
    result = bench_ds_waste.main(
        [
            "--steps",
            "4",
            "--model",
            str(random_tiny_model),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--output",
            str(out),
            "--plot",
            str(png),
            "train.prompts_per_step=4",
            "train.mini_batch_size=4",
            "rollout.num_generations=4",
            "rollout.max_completion_length=10",
            "algorithm.overlong_buffer=4",
            # A third of the answers are always right, a third always wrong: uniform groups.
            f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
        ]
    )
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
        (total["uniform"] + total["final_surplus"]) / total["generated"]
    )
    assert total["discard_surplus_share"] >= total["uniform_share"]


def test_a_step_served_from_the_surplus_alone(tmp_path):
    """A rollout step can train only on groups carried over, generating nothing: the plot
    and the totals must take it (the 5-seed ladder's DAPO runs have such steps)."""
    bench_ds_waste = import_benchmark("bench_ds_waste")
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


def _bench():
    _prompt_outcomes = import_benchmark("_prompt_outcomes")
    bench_ds_waste = import_benchmark("bench_ds_waste")
    return bench_ds_waste, _prompt_outcomes


SMALL = [
    "train.prompts_per_step=4",
    "train.mini_batch_size=4",
    "rollout.num_generations=4",
    "rollout.max_completion_length=10",
    "algorithm.overlong_buffer=4",
    f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
]


def test_outcomes_of_a_run(random_tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench, _ = _bench()
    out = tmp_path / "outcomes.json"
    result = bench.main(
        [
            "--outcomes",
            "--steps",
            "3",
            "--model",
            str(random_tiny_model),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--output",
            str(out),
            *SMALL,
        ]
    )
    rows, a = result["rows"], result["outcomes"]
    assert "oracle: uniform share" in capsys.readouterr().out
    assert json.loads(out.read_text())["outcomes"]["groups"] == len(rows) == a["groups"]
    # by_answer_class: answers divisible by 3 always right, remainder 1 always wrong.
    for r in rows:
        assert r["size"] == 4 and r["class"] in (0, 1, 2)
    # Revisits counted independently.
    seen, again = set(), 0
    for r in rows:
        again += r["uid"] in seen
        seen.add(r["uid"])
    assert a["revisit_share"] == pytest.approx(again / len(rows))
    assert a["distinct_prompts"] == len(seen)
    for o in a["oracle"].values():  # an oracle never does worse than not skipping
        assert o["uniform_share"] <= a["uniform_share_late"] + 0.02


def test_oracle_bound_by_hand():
    _, o = _bench()
    # Half the prompts always right (p = 1), half at p = 1/2; groups of 2. A group of a
    # p = 1/2 prompt is uniform with probability 1/2. Skipping the p = 1 prompts with
    # probability 1/2 keeps 0.25 + 0.5 of the draws, uniform (0.25 + 0.25) / 0.75 of them.
    weights = [0.0] * 101
    weights[100], weights[50] = 0.5, 0.5
    best = o.oracle_skip_bound(weights, size=2, cap=0.5)
    assert best["uniform_share"] == pytest.approx(0.5 / 0.75)
    assert best["skipped"] == pytest.approx(0.25)
    assert best["generated_per_trained"] == pytest.approx(3.0)


def test_mixture_of_pass_rates_recovers_a_binomial():
    _, o = _bench()
    counts = [k for k in range(5) for _ in range(round(1000 * math.comb(4, k) / 16))]  # p = 1/2
    weights = o.mixture_of_pass_rates(counts, 4, iters=500)
    mean = sum(w * j / 100 for j, w in enumerate(weights))
    assert mean == pytest.approx(0.5, abs=0.02) and sum(weights) == pytest.approx(1.0)


def test_simulated_skipping_spends_less_and_still_explores():
    _, o = _bench()
    small = dict(solved=0.3, impossible=0.3, prompts=60, per_step=5, size=4, steps=60)
    off = o.simulate(skip=False, **small)
    on = o.simulate(skip=True, **small)
    assert on["generated_per_trained_late"] < 0.8 * off["generated_per_trained_late"]
    assert off["persistent_generated_share_late"] == 1.0
    assert 0.0 < on["persistent_generated_share_late"] < 0.5  # skipped mostly, still visited


def test_compare_skip_against_plain_dynamic_sampling(
    random_tiny_model, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench, _ = _bench()
    out = tmp_path / "compare.json"
    result = bench.main(
        [
            "--compare",
            "off,skip",
            "--seeds",
            "0",
            "--steps",
            "3",
            "--model",
            str(random_tiny_model),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--output",
            str(out),
            *SMALL,
            "data.max_eval_prompts=4",
        ]
    )
    table = capsys.readouterr().out
    assert "| off | 1 |" in table and "| skip | 1 |" in table
    for variant in ("off", "skip"):
        figures = result["variants"][variant]["seed0"]
        run = tmp_path / "runs" / variant / "seed0"
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "sampling/generated_groups" in r]
        generated = sum(r["sampling/generated_groups"] for r in rows) * 4
        assert figures["generated_per_trained"] == pytest.approx(generated / (3 * 4 * 4))
        assert 0.0 <= figures["accuracy_after"] <= 1.0 and figures["process_seconds"] > 0
    assert result["variants"]["off"]["seed0"]["skip_rate_late"] == 0.0
    assert json.loads(out.read_text())["overrides"]["skip"] == [
        "algorithm.skip_uniform_prompts=true"
    ]
