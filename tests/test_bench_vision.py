"""Smoke test of benchmarks/bench_vision.py: tiny workloads, the report's shape and sums."""

from __future__ import annotations

import json

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

pytestmark = pytest.mark.slow


def test_bench_vision_times_each_part_with_and_without_images(tmp_path, capsys, monkeypatch):
    from dapo.models import vision

    seen = []  # whether each forward of the engine or trainer was given image features
    real = vision.token_inputs

    def recording(*args):
        out = real(*args)
        seen.append("inputs_embeds" in out)
        return out

    from dapo.rollout import decode
    from dapo.training import forward

    monkeypatch.setattr(decode, "token_inputs", recording)
    monkeypatch.setattr(forward, "token_inputs", recording)
    bench = import_benchmark("bench_vision")
    out = tmp_path / "vision.json"
    args = ["--prompts", "2", "--n", "2", "--max-tokens", "4", "--repeats", "2", "--json", str(out)]
    report = bench.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report["results"]) == {"generate", "old_logprobs", "update"}
    for r in report["results"].values():
        assert len(r["visual_s"]) == len(r["text_s"]) == 2 and min(r["visual_s"] + r["text_s"]) > 0
        assert r["ratio"] == pytest.approx(r["median_visual_s"] / r["median_text_s"])
    step = report["step"]
    assert step["visual"] == pytest.approx(
        sum(r["median_visual_s"] for r in report["results"].values())
    )
    assert report["settings"]["image_tokens"] == 16
    assert True in seen and False in seen  # the visual side had images, the text side none
    assert "| step |" in capsys.readouterr().out
