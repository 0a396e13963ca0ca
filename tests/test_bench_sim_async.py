"""benchmarks/sim_async.py against cases computed by hand, and a smoke run of each mode."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

sim = import_benchmark("sim_async")

# One engine, 4 responses of exactly 10 tokens admitted together, 0.1 s per decode
# iteration whatever the batch: generating a batch takes 1.0 s.
CONSTANT = sim.Params(
    name="constant",
    prompts=2,
    group=2,
    prompt_len=4,
    mean_len=10,
    p99_len=10,
    max_len=10,
    instances=1,
    max_seqs=4,
    decode_base_s=0.1,
    decode_seq_s=0.0,
    prefill_tok_s=0.0,
    train_fixed_s=0.5,
    train_tok_s=0.0,
    sync_s=0.1,
    chunk_tokens=5,
)
# Long-tailed lengths (99th percentile 8x the mean) on two engines that hold 8 sequences.
TAILED = replace(
    CONSTANT,
    name="tailed",
    prompts=8,
    group=4,
    prompt_len=16,
    mean_len=100,
    p99_len=800,
    max_len=1000,
    instances=2,
    max_seqs=8,
    decode_base_s=0.01,
    decode_seq_s=0.001,
    prefill_tok_s=1e-5,
    train_fixed_s=2.0,
    sync_s=0.2,
    chunk_tokens=32,
)


def test_synchronous_step_is_generation_plus_update_plus_push():
    for partial in (False, True):
        assert sim.simulate(CONSTANT, 0, partial=partial).step_s == pytest.approx(1.0 + 0.5 + 0.1)
    # Scoring (the producer's time after the last response) adds to it.
    assert sim.simulate(replace(CONSTANT, producer_s=0.2), 0).step_s == pytest.approx(1.8)
    # The batch effect: 0.1 + 0.01 x 4 active sequences per iteration, 10 iterations.
    batched = replace(CONSTANT, decode_seq_s=0.01)
    assert sim.simulate(batched, 0).step_s == pytest.approx(10 * 0.14 + 0.6)
    # Prefill: 4 prompt tokens x 2 prompts (a group shares its prompt) at 0.05 s a token.
    prefilled = replace(CONSTANT, prefill_tok_s=0.05)
    assert sim.simulate(prefilled, 0).step_s == pytest.approx(0.4 + 1.6)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_streaming_step_is_the_longer_side_plus_the_push(n):
    # Training the longer side: max(gen, train + sync) = 1.5 + 0.2.
    slow_train = replace(CONSTANT, train_fixed_s=1.5, sync_s=0.2)
    for partial in (False, True):
        r = sim.simulate(slow_train, n, partial=partial)
        assert r.step_s == pytest.approx(1.7)
        assert r.max_staleness <= n
    # Generation the longer side: the push pauses generation, so gen + sync = 1.0 + 0.1.
    for partial in (False, True):
        assert sim.simulate(CONSTANT, n, partial=partial).step_s == pytest.approx(1.1)


def test_no_batch_starts_more_than_n_versions_behind():
    fast_gen = replace(CONSTANT, train_fixed_s=3.0)  # the producer runs ahead to the bound
    for n in (1, 2, 4):
        for continuous in (False, True):
            r = sim.simulate(fast_gen, n, continuous=continuous)
            assert r.max_staleness == n


def test_partial_rollouts_are_never_slower_on_long_tails_with_a_request_level_producer():
    sync = statistics.fmean(sim.simulate(TAILED, 0, seed=s).step_s for s in range(3))
    for n in (1, 2, 4, 8):
        whole = [sim.simulate(TAILED, n, continuous=True, seed=s).step_s for s in range(3)]
        part = [
            sim.simulate(TAILED, n, partial=True, continuous=True, seed=s).step_s for s in range(3)
        ]
        assert all(p < w for p, w in zip(part, whole, strict=True)), (n, part, whole)
        assert statistics.fmean(part) < sync


def test_lengths_follow_the_lognormal_of_the_given_mean_and_tail():
    p = replace(TAILED, max_len=10**9)
    xs = sorted(sim.lengths(p, random.Random(0), 50_000))
    assert statistics.fmean(xs) == pytest.approx(100, rel=0.03)
    assert xs[int(0.99 * len(xs))] == pytest.approx(800, rel=0.05)
    assert max(sim.lengths(TAILED, random.Random(0), 5000)) == 1000  # cut at max_len
    assert set(sim.lengths(CONSTANT, random.Random(0), 10)) == {10}
    with pytest.raises(ValueError, match="no log-normal has that tail"):
        sim.lengths(replace(TAILED, p99_len=100 * 100), random.Random(0), 1)


def test_a_subset_of_engines_keeps_the_step_time():
    # 4 identical engines, each with a quarter of the batch: simulating 1 of them with its
    # quarter gives the same step (the trainer still trains the whole batch's tokens).
    four = replace(CONSTANT, prompts=8, instances=4, train_fixed_s=0.1, train_tok_s=0.01)
    one = replace(four, sim_instances=1)
    tokens = 8 * 2 * (10 + 4)
    expected = 1.0 + 0.1 + 0.01 * tokens + 0.1
    assert sim.simulate(four, 0).step_s == pytest.approx(expected)
    assert sim.simulate(one, 0).step_s == pytest.approx(expected)


def cpu_report(n1_step: float) -> dict:
    """A bench_async report: synchronous server steps of 1.2 s (0.55 s generating 10-token
    responses, 0.05 s scoring, 0.6 s update and push, of which 0.04 s the push)."""
    sync = {
        "engine": "vllm-server",
        "n": 0,
        "partial": False,
        "median_step_s": 1.2,
        "median_gen_s": 0.55,
        "median_train_s": 0.6,
        "median_weight_sync_s": 0.04,
        "median_response_length": 10.0,
        "median_response_length_max": 10.0,
    }
    return {
        "shape": {"prompts": 2, "group": 4, "prompt_len": 8, "max_len": 10, "chunk_tokens": 4},
        "results": {
            "server-0": sync,
            "server-1": {**sync, "n": 1, "median_step_s": n1_step},
            "vllm-1": {**sync, "engine": "vllm", "n": 1},  # not a server run: not predicted
        },
    }


def test_cpu_calibration_reproduces_the_synchronous_step_and_predicts_n1_by_hand():
    p = sim.calibrated_cpu(cpu_report(0.65))
    assert (p.sync_s, p.producer_s) == (0.04, pytest.approx(0.05))
    assert p.train_fixed_s == pytest.approx(0.56)
    assert sim.simulate(p, 0).step_s == pytest.approx(1.2)  # 0.55 + 0.05 + 0.56 + 0.04
    # N = 1: generation and scoring (0.6 s) against the update and the push (0.6 s); the
    # push falls within the scoring, when the engine is free.
    assert sim.simulate(p, 1).step_s == pytest.approx(0.6)
    rows = sim.calibration(cpu_report(0.65))
    assert [r["mode"] for r in rows] == ["server-0", "server-1"]
    n1 = rows[1]
    assert n1["measured_speedup"] == pytest.approx(1.2 / 0.65)
    assert n1["predicted_speedup"] == pytest.approx(1.2 / 0.6)
    assert n1["error"] == pytest.approx(0.65 / 0.6 - 1) and n1["within"]
    far = sim.calibration(cpu_report(1.0))[1]
    assert not far["within"] and far["error"] == pytest.approx(1.0 / 0.6 - 1)
    assert "NO" in sim.calibration_table([far])


def test_a_report_without_a_synchronous_server_run_is_refused():
    report = cpu_report(0.65)
    del report["results"]["server-0"]
    with pytest.raises(ValueError, match="no synchronous rollout-server run"):
        sim.calibrated_cpu(report)


def test_smoke_dapo_32b(tmp_path, capsys):
    out = tmp_path / "sim.json"
    result = sim.main(["--dapo-32b", "--ns", "0,2", "--steps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = result["dapo_32b"]["rows"]
    assert [r["n"] for r in rows] == [0, 2]
    assert rows[0]["whole"]["speedup"] == 1.0 and rows[1]["whole"]["speedup"] > 1.0
    assert rows[1]["partial"]["max_staleness"] <= 2
    assert "2.35x" in printed and "2.77x" in printed and "colocated synchronous" in printed
    assert json.loads(out.read_text())["dapo_32b"]["rows"] == json.loads(json.dumps(rows))
    assert not math.isnan(result["dapo_32b"]["colocated_sync_step_s"])


def test_smoke_calibrate_cpu(tmp_path, capsys):
    path = tmp_path / "stream_speed.json"
    path.write_text(json.dumps(cpu_report(0.65)))
    result = sim.main(["--calibrate-cpu", str(path), "--ns", "0,1,4", "--steps", "4"])
    printed = capsys.readouterr().out
    assert "within 15% of the measurement: yes" in printed
    assert [r["n"] for r in result["cpu"]["rows"]] == [0, 1, 4]
    assert result["calibration"][1]["predicted_step_s"] == pytest.approx(0.6)
