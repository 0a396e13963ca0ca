"""Smoke test of benchmarks/bench_async.py with tiny settings (needs vLLM), and its modes."""

from __future__ import annotations

import json

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py
from ranks import forked_popen  # tests/ranks.py
from vllm_check import needs_vllm  # tests/vllm_check.py


def test_modes_name_engine_staleness_and_partial_rollouts(capsys):
    bench_async = import_benchmark("bench_async")
    assert bench_async.parse_mode("server-4") == {"engine": "vllm-server", "n": 4, "partial": False}
    assert bench_async.parse_mode("vllm-2p") == {"engine": "vllm", "n": 2, "partial": True}
    assert bench_async.parse_mode("server-async") == bench_async.parse_mode("server-1")
    assert bench_async.parse_mode("sync") == bench_async.parse_mode("vllm-0")
    assert bench_async.parse_mode("server-x") is None
    assert bench_async.mode_overrides(bench_async.parse_mode("server-2p")) == [
        "rollout.engine=vllm-server",
        "rollout.max_staleness=2",
        "rollout.partial_rollouts=true",
    ]
    with pytest.raises(SystemExit):
        bench_async.main(["--modes", "server-0,hf-1"])
    assert "unknown ['hf-1']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_async.main(["--modes", "server-0,server-4", "--steps", "6"])
    assert "--steps 6 must be at least 7" in capsys.readouterr().err


@pytest.mark.slow
@needs_vllm
def test_bench_async_times_each_mode(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # the trainers in this process: no imports
    bench_async = import_benchmark("bench_async")
    # The servers forked from a process that has imported vLLM (tests/ranks.py).
    monkeypatch.setattr(bench_async, "SERVER_POPEN", forked_popen)
    out = tmp_path / "async.json"
    report = bench_async.main(
        [
            "--steps",
            "5",
            "--modes",
            "server-0,server-1p",
            "--output",
            str(out),
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "rollout.partial_chunk_tokens=4",
            "algorithm.overlong_buffer=2",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    sync, ahead = report["results"]["server-0"], report["results"]["server-1p"]
    assert (sync["n"], ahead["n"], ahead["partial"]) == (0, 1, True)
    # Steps 3-5 synchronously; with N = 1 the last step (generated ahead) is dropped too.
    assert len(sync["steps_s"]) == 3 and len(ahead["steps_s"]) == 2
    assert sync["staleness_max"] == 0 and ahead["staleness_max"] <= 1
    assert sync["median_weight_sync_s"] > 0 and sync["median_gen_s"] > 0
    assert sync["speedup_vs_sync"] == 1.0
    assert ahead["speedup_vs_sync"] == pytest.approx(sync["median_step_s"] / ahead["median_step_s"])
    assert ahead["steps_per_min"] == pytest.approx(60 / ahead["median_step_s"])
    assert report["shape"] == {
        "prompts": 2,
        "group": 2,
        "prompt_len": 8,
        "max_len": 8,
        "chunk_tokens": 4,
    }
    assert "server-1p" in capsys.readouterr().out
