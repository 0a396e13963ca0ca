"""Smoke test of ``benchmarks/bench_trl.py`` with tiny settings, so that it does not rot: the
driver and both sides in this process (``DAPO_BENCH_IN_PROCESS=1``); a side in a fresh process
is checked on its failure path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py


def test_bench_trl_smoke(tmp_path: Path, monkeypatch, capsys) -> None:
    pytest.importorskip(
        "trl", reason="trl is not installed (benchmark-only extra: pip install -e '.[bench]')"
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")
    monkeypatch.chdir(tmp_path)
    bench = import_benchmark("bench_trl")
    out = tmp_path / "trl.json"
    argv = [
        "--steps",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--prompts",
        "4",
        "--generations",
        "4",
        "--max-completion-length",
        "16",
        "--output",
        str(out),
    ]
    bench.main(argv)
    assert "throughput ratio" in capsys.readouterr().out

    report = json.loads(out.read_text())
    results = report["results"]
    for side in ("ours", "trl"):
        r = results[side]
        assert r["median_step_s"] > 0
        assert r["peak_rss_mb"] > 0
        assert r["kept_steps"] == 1  # 2 steps, the first dropped as warm-up
        (run,) = r["runs"]
        assert len(run["step_s"]) == 2
        assert all(s > 0 for s in run["step_s"])
    expected = results["trl"]["median_step_s"] / results["ours"]["median_step_s"]
    assert report["throughput_ratio"] == pytest.approx(expected)
    assert report["settings"]["prompts_per_step"] == 4
    assert report["machine"]["trl"] is not None  # installed, and its version recorded


def test_a_side_in_a_fresh_process_that_fails_names_itself_and_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "0")
    bench = import_benchmark("bench_trl")
    args = bench.parse_args(["--threads", "1"])
    args.steps = 1  # which the worker's own argument check refuses
    with pytest.raises(RuntimeError, match=r"the ours worker failed \(exit 2\):\n.*--steps"):
        bench.spawn("ours", args, tmp_path, 0)
