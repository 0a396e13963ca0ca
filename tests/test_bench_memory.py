"""Smoke test of ``benchmarks/bench_memory.py`` on a tiny model shape, so that it does not rot: the
driver and its sides in this process (``DAPO_BENCH_IN_PROCESS=1``), and one part in a fresh one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "1")  # each side in this process: no imports
    return import_benchmark("bench_memory")


SHAPE = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--mlp", "64"]


def test_bench_memory_smoke(bench, tmp_path: Path, monkeypatch, capsys) -> None:
    sides = ["fp32", "bf16-mixed", "bf16-mixed+ckpt"]
    if importlib.util.find_spec("trl") is not None:
        sides.append("trl")
    out = tmp_path / "memory.json"
    monkeypatch.chdir(tmp_path)
    bench.main(
        [
            "--threads",
            "1",
            "--prompts",
            "2",
            "--generations",
            "2",
            "--max-completion-length",
            "6",
            *SHAPE,
            "--vocab",
            "4000",
            "--sides",
            ",".join(sides),
            "--output",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert list(report["results"]) == sides
    for side, r in report["results"].items():
        assert r["peak_mb"] >= r["before_mb"] > 0, side
        assert r["step_s"] > 0 and len(r["lengths"]) == 4, side
    assert report["settings"]["model"]["hidden"] == 32
    if "trl" in sides:
        ratio = (
            report["results"]["bf16-mixed+ckpt"]["peak_mb"] / report["results"]["trl"]["peak_mb"]
        )
        assert report["ckpt_over_trl"] == ratio
        assert "bf16-mixed+ckpt peak / TRL peak" in stdout


def test_each_side_runs_in_a_fresh_process_outside_the_smoke_test(tmp_path, monkeypatch):
    """Without ``DAPO_BENCH_IN_PROCESS`` the script runs its parts as fresh processes (here
    the model build: the saved model loads)."""
    monkeypatch.setenv("DAPO_BENCH_IN_PROCESS", "0")
    bench = import_benchmark("bench_memory")
    args = bench.parse_args(["--threads", "1", *SHAPE, "--vocab", "300"])
    bench._python(args, tmp_path / "build.log", "--build", str(tmp_path / "model"))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "model").hidden_size == 32


def test_bench_memory_long_responses_records_each_side_and_skips_past_the_limit(
    bench, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--long-responses``: one update per side and length; a length predicted past
    ``--long-limit-mb`` from the side's two previous ones is recorded as skipped."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed (a benchmark-only extra)")
    out = tmp_path / "long.json"
    monkeypatch.chdir(tmp_path)
    argv = ["--threads", "1", *SHAPE, "--vocab", "3000", "--long-responses", "8,16,32"]
    bench.main([*argv, "--long-limit-mb", "1", "--long-count", "2", "--output", str(out)])
    report = json.loads(out.read_text())
    records = report["long"]
    assert [(r["side"], r["tokens"]) for r in records] == [
        (side, n) for n in (8, 16, 32) for side in ("dapo", "trl")
    ]
    for r in records[:4]:
        assert r["peak_mb"] > 0 and r["seconds"] > 0, r
    for r in records[4:]:  # two measured lengths predict the third past the 1 MB limit
        assert r["peak_mb"] is None and r["skipped"].startswith("predicted"), r
    assert report["settings"]["responses"] == 2
    assert set(report["summary"]) >= {"dapo", "trl"}
    assert "| dapo | 8 |" in capsys.readouterr().out


def test_the_longest_fit_is_read_off_the_line_through_the_last_two_points(bench) -> None:
    longest_fit = bench.long.longest_fit
    assert longest_fit([(1000, 5000.0), (2000, 6000.0)], 16000.0) == pytest.approx(12000.0)
    assert longest_fit([(1000, 5000.0)], 16000.0) is None
    assert longest_fit([(1000, 5000.0), (2000, 4000.0)], 16000.0) is None  # not growing
