"""Smoke test of benchmarks/bench_utilisation.py: a tiny model, two small rollout steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_utilisation.py"

# The tiny shape the test runs, and its sizes worked out by hand.
HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 32, 2, 4, 48, 128
PROMPTS, GENERATIONS, MAX_TOKENS, STEPS = 2, 3, 6, 2
# Per layer: q, k, v, o (32 x 32 each) + gate, up, down (32 x 48 each) = 4096 + 4608.
BODY_PARAMS = LAYERS * (4 * 32 * 32 + 3 * 32 * 48)  # 17408
# + the (tied) embedding 128 x 32, two RMSNorms per layer and the final one (32 each).
ALL_PARAMS = BODY_PARAMS + 128 * 32 + (2 * LAYERS + 1) * 32  # 21664


def token_forward(keys: int, logits: bool) -> int:
    """Forward FLOPs of one token that attends to ``keys`` keys (QK^T and AV: 2 x 2 x d
    per key per layer), with the output projection when its logits are computed."""
    return 2 * BODY_PARAMS + LAYERS * 4 * HIDDEN * keys + (2 * HIDDEN * VOCAB if logits else 0)


def hand_count(prompt_lens: list[int], response_lens: list[list[int]]) -> tuple[int, int]:
    """Generation and training FLOPs, token by token."""
    gen = train = 0
    for p, group in zip(prompt_lens, response_lens, strict=True):
        # Prefill: token i sees i + 1 keys; only the last position's logits are used.
        gen += sum(token_forward(i + 1, i == p - 1) for i in range(p))
        for r in group:
            # Response tokens 1 .. r-1 are fed back (the last one is not), each after the
            # prompt and the response tokens before it.
            gen += sum(token_forward(p + j, True) for j in range(1, r))
    return gen, train


def hand_count_training(
    prompt_lens: list[int], response_lens: list[list[int]], shared: bool
) -> int:
    """Training FLOPs (forward + backward = 3 forwards), token by token."""
    train = 0
    for p, group in zip(prompt_lens, response_lens, strict=True):
        if shared:  # the prompt once; its last position's logits predict response token 0
            train += 3 * sum(token_forward(i + 1, i == p - 1) for i in range(p))
        for r in group:
            if shared:  # response tokens 0 .. r-2 as inputs, after the prompt's cache
                train += 3 * sum(token_forward(p + j + 1, True) for j in range(r - 1))
            else:  # prompt + response; positions p-1 .. p+r-2 predict the response tokens
                n = p + r
                train += 3 * sum(token_forward(i + 1, p - 1 <= i < n - 1) for i in range(n))
    return train


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench_util") / "utilisation.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--json",
        str(out),
        "--threads",
        "1",
        "--hidden",
        str(HIDDEN),
        "--layers",
        str(LAYERS),
        "--heads",
        str(HEADS),
        "--intermediate",
        str(INTERMEDIATE),
        "--vocab",
        str(VOCAB),
        "--prompts",
        str(PROMPTS),
        "--generations",
        str(GENERATIONS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--steps",
        str(STEPS),
        "--peak-size",
        "256",
        "--peak-repeats",
        "3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MFU" in proc.stdout and "median" in proc.stdout
    return json.loads(out.read_text())


def test_report_metadata(report: dict) -> None:
    assert report["date"]
    assert report["machine"]["torch"] and report["machine"]["threads"] == 1
    assert report["commit"] and report["commit"] != "unknown"  # a git checkout
    assert report["settings"]["prompts"] == PROMPTS
    assert report["model"]["params"] == ALL_PARAMS
    assert report["model"]["body_params"] == BODY_PARAMS
    assert report["old_logprob_forward"] is False  # one update per rollout step
    assert report["shared_prompt_forward"] is True  # the trainer's default
    peak = report["peak"]
    assert peak["gflops"] == max(peak["before"]["gflops"], peak["after"]["gflops"]) > 0


def test_flops_match_hand_count(report: dict) -> None:
    assert len(report["steps"]) == STEPS
    for s in report["steps"]:
        assert len(s["prompt_lens"]) == PROMPTS and all(p > 0 for p in s["prompt_lens"])
        lens = [r for group in s["response_lens"] for r in group]
        assert len(lens) == PROMPTS * GENERATIONS
        assert all(1 <= r <= MAX_TOKENS for r in lens)
        # The token counts agree with the trainer's own metric.
        assert sum(lens) / len(lens) == pytest.approx(s["response_length_mean"])
        gen = hand_count(s["prompt_lens"], s["response_lens"])[0]
        train = hand_count_training(s["prompt_lens"], s["response_lens"], shared=True)
        assert (s["gen_flops"], s["train_flops"]) == (gen, train)
        assert s["total_flops"] == gen + train > 0
        assert s["updates"] == 1 and s["skipped_updates"] == 0


def test_mfu_is_flops_over_time_over_peak(report: dict) -> None:
    peak = report["peak"]["gflops"] * 1e9
    for s in report["steps"]:
        for part, seconds in (("gen", "gen_s"), ("train", "train_s"), ("total", "step_s")):
            assert s[seconds] > 0
            flops = s["total_flops" if part == "total" else f"{part}_flops"]
            assert s[f"mfu_{part}"] == pytest.approx(flops / s[seconds] / peak, rel=1e-9)
            assert 0 < s[f"mfu_{part}"] < 1
        assert s["step_s"] >= s["gen_s"] + s["train_s"]
    summary = report["summary"]
    later = report["steps"][1:]
    for key in ("mfu_gen", "mfu_train", "mfu_total", "step_s"):
        assert summary[key] == pytest.approx(sorted(s[key] for s in later)[len(later) // 2])


def test_training_flops_without_the_shared_prompt() -> None:
    """The whole-sequence count (train.shared_prompt_forward=false), against the hand count."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_utilisation as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    shape = bench.Shape(
        hidden=HIDDEN,
        layers=LAYERS,
        heads=HEADS,
        kv_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        intermediate=INTERMEDIATE,
        vocab=VOCAB,
    )
    prompts, responses = [5, 3], [[1, 4, 6], [2, 2, 5]]
    for shared in (False, True):
        assert bench.training_flops(shape, prompts, responses, False, shared) == (
            hand_count_training(prompts, responses, shared)
        )
    assert bench.training_flops(shape, prompts, responses, False, True) < (
        bench.training_flops(shape, prompts, responses, False, False)
    )
