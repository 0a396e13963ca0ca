"""benchmarks/bench_code_sandbox.py: a small run reports rates, the overhead and a slow group."""

from __future__ import annotations

import json
import sys

import pytest
from benchmark_modules import import_benchmark

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
)


def test_bench_code_sandbox_reports_rates_overhead_and_a_slow_group(tmp_path):
    out = tmp_path / "code.json"
    report = import_benchmark("bench_code_sandbox").main(
        ["--programs", "6", "--parallel", "3", "--slow", "3", "--json", str(out)]
    )
    r = report["result"]
    assert r["sandbox"]["programs_per_s"] > 0 and r["unisolated"]["programs_per_s"] > 0
    assert r["sandbox"]["latency_ms"] > 0 and r["scorer_programs_per_s"] > 0
    assert r["overhead_ms_per_program"] == pytest.approx(
        r["sandbox"]["latency_ms"] - r["unisolated"]["latency_ms"]
    )
    assert 1.0 <= r["slow_group"]["seconds"] < 1.9  # three at the limit cost about one
    assert json.loads(out.read_text())["commit"] == report["commit"]
