"""Smoke test of benchmarks/bench_packing.py: tiny shapes, so that it does not rot."""

from __future__ import annotations

import json

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

pytestmark = pytest.mark.slow


def test_bench_packing_times_padded_bucketed_and_packed_updates(tmp_path, capsys) -> None:
    bench = import_benchmark("bench_packing")
    out = tmp_path / "packing.json"
    args = {"hidden": 32, "layers": 2, "heads": 2, "vocab": 300, "prompts": 2, "n": 4}
    args |= {"prompt-len": 8, "min-len": 2, "short-len": 12, "max-len": 40}
    args |= {"long-fraction": 0.25, "micro-batch-tokens": 120, "repeats": 2, "json": out}
    report = bench.main([x for k, v in args.items() for x in (f"--{k}", str(v))])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    lengths = report["response_lengths"]
    assert len(lengths) == 8 and lengths.count(40) == 2 and max(x for x in lengths if x < 40) <= 12
    assert report["logprob_gap"] <= 1e-5  # every side computes the same log-probs
    med = report["median_s"]
    assert report["speedup"] == pytest.approx(med["padded"] / med["packed"])
    assert report["speedup_vs_bucketed"] == pytest.approx(med["bucketed"] / med["packed"])
    assert all(len(t) == 2 and min(t) > 0 for t in report["times_s"].values())
    # packed forwards no padding: fewer positions than buckets, which pad less than whole rows
    forwarded = report["padded_tokens"]
    assert forwarded["packed"] < forwarded["bucketed"] < forwarded["padded"]
    printed = capsys.readouterr().out
    assert "| packed |" in printed and "speed-up of packed" in printed
