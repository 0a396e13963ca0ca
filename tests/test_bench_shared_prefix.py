"""Smoke test of benchmarks/bench_shared_prefix.py: the built-in model, tiny workloads."""

from __future__ import annotations

import json

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

pytestmark = pytest.mark.slow


def test_bench_shared_prefix_times_each_workload_with_the_prefix_off_and_on(
    tmp_path, capsys, monkeypatch
):
    from dapo.models.inputs import shared_prefix
    from dapo.rollout import decode
    from dapo.training import forward

    seen: dict[str, set[bool]] = {"engine": set(), "update": set()}

    def recording(where):
        def wrapped(prompts, pass_cost=None):
            n = shared_prefix(prompts, pass_cost)
            seen[where].add(n > 0)
            return n

        return wrapped

    monkeypatch.setattr(decode, "shared_prefix", recording("engine"))
    monkeypatch.setattr(forward, "shared_prefix", recording("update"))
    bench = import_benchmark("bench_shared_prefix")
    out = tmp_path / "prefix.json"
    args = {"model": "tiny", "precision": "fp32", "eval-prompts": 6, "prompts": 2, "n": 2}
    args |= {"max-tokens": 4, "repeats": 2, "threads": 1, "json": out}
    report = bench.main([x for k, v in args.items() for x in (f"--{k}", str(v))])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    # Character tokens: the instruction, then "Add " before each problem's numbers.
    assert report["settings"]["shared_prefix_tokens"] == len(bench.TINY_INSTRUCTION) + 4
    assert set(report["results"]) == {"eval", "generate", "update"}
    for r in report["results"].values():
        assert len(r["off_s"]) == len(r["on_s"]) == 2 and min(r["off_s"] + r["on_s"]) > 0
        assert r["speedup"] == pytest.approx(r["median_off_s"] / r["median_on_s"])
    assert seen == {"engine": {True, False}, "update": {True, False}}  # off, then on
    printed = capsys.readouterr().out
    assert "| eval (6 x 1) |" in printed and "| update (2 x 2) |" in printed
