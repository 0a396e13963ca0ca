"""Smoke test of benchmarks/bench_async.py with tiny settings (needs vLLM)."""

from __future__ import annotations

import json

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py
from vllm_check import needs_vllm  # tests/vllm_check.py

pytestmark = pytest.mark.slow


@needs_vllm
def test_bench_async_times_each_mode(tmp_path, capsys):
    bench_async = import_benchmark("bench_async")
    out = tmp_path / "async.json"
    report = bench_async.main(
        [
            "--steps",
            "4",
            "--modes",
            "sync,server-async",
            "--output",
            str(out),
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=2",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    sync, ahead = report["results"]["sync"], report["results"]["server-async"]
    assert len(sync["steps_s"]) == len(ahead["steps_s"]) == 2  # steps 3 and 4
    assert sync["median_async_gen_s"] == 0 and sync["staleness"] == [0, 0]
    # Asynchronous: step 3's first round was generated during step 2's update; step 4 is the
    # last, so nothing is generated ahead of it.
    assert ahead["staleness"] == [1, 1] and ahead["median_async_gen_s"] > 0
    assert sync["speedup_vs_sync"] == 1.0
    assert ahead["speedup_vs_sync"] == pytest.approx(sync["median_step_s"] / ahead["median_step_s"])
    assert "server-async" in capsys.readouterr().out
