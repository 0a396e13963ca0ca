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


def test_bench_shared_prefix_compares_the_decode_step_with_and_without_the_prefix_s_one_copy(
    tmp_path, capsys, monkeypatch
):
    from dapo.rollout import attention, llama_step

    # The tiny workloads are below the break-even: lowered so that "on" attends through it.
    monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", 1)
    bench = import_benchmark("bench_shared_prefix")
    args = {"model": "tiny", "precision": "fp32", "eval-prompts": 4, "prompts": 2, "n": 2}
    args |= {"max-tokens": 3, "repeats": 1, "threads": 1, "json": tmp_path / "c.json"}
    argv = ["--compare", "cascade", *(x for k, v in args.items() for x in (f"--{k}", str(v)))]
    report = bench.main(argv)
    assert set(report["results"]) == {"eval", "generate"}  # the update does not use it
    layers = 4  # builtin:tiny's: the count is per layer and decode step
    for r in report["results"].values():
        assert len(r["off_s"]) == len(r["on_s"]) == 1 and min(r["off_s"] + r["on_s"]) > 0
        assert r["cascades"]["off"] == 0
        assert r["cascades"]["on"] > 0 and r["cascades"]["on"] % layers == 0
    assert attention.CASCADE_MIN_ROW_SLOTS == 1  # restored, and the counting taken out
    assert llama_step.cascade is attention.cascade and attention.cascade.__name__ == "cascade"
    printed = capsys.readouterr().out
    assert "comparing: cascade" in printed and "| each row's copy of the prefix, s |" in printed
