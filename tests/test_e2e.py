"""A shortened default run end to end: builtin:tiny, the dapo preset, before/after accuracy,
metrics, summary, dashboard, checkpoints, resume.

Builds (or reuses) the cached warmed-up ``builtin:tiny``: about two minutes the first time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo.cli import main
from dapo.metrics import read_metrics

pytestmark = pytest.mark.slow

COMMON = [
    "data.max_eval_prompts=200",
    "logging.tensorboard=true",
    "checkpoint.save_every=4",
    "seed=0",
]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("e2e") / "run"
    assert main(["train", f"output_dir={out}", "train.steps=16", *COMMON]) == 0
    return out


def test_short_default_run_writes_everything_and_learns(short_run: Path) -> None:
    summary = json.loads((short_run / "summary.json").read_text())
    for key in ("accuracy_before", "accuracy_after", "wall_seconds", "steps"):
        assert key in summary
    assert summary["steps"] == 16
    assert summary["health"] == []  # the default run raises no health warning
    # The warmed-up model starts well above zero and well below perfect ...
    assert 0.1 < summary["accuracy_before"] < 0.7
    # ... and 16 rollout steps of DAPO already improve held-out accuracy (fixed seed).
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.03

    rows = [r for r in read_metrics(short_run) if "reward/acc" in r]
    assert [r["step"] for r in rows] == list(range(1, 17))
    for key in (
        "reward/mean",
        "reward/acc",
        "response_length/mean",
        "response_length/max",
        "response_length/clip_ratio",
        "actor/entropy",
        "actor/gen_prob",
        "actor/clip_frac_low",
        "actor/clip_frac_high",
        "actor/ppo_kl",
        "actor/grad_norm",
        "actor/lr",
        "sampling/all_correct_frac",
        "sampling/all_wrong_frac",
        "sampling/gen_rounds",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
        "perf/step_s",
    ):
        assert key in rows[0], key
    # Dynamic sampling is on in the dapo preset: nothing uniform trains.
    assert all(r["sampling/gen_rounds"] >= 1 for r in rows)

    png = (short_run / "dashboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert any((short_run / "tensorboard").iterdir())
    ckpts = sorted(p.name for p in (short_run / "checkpoints").iterdir())
    assert ckpts == ["step_000012", "step_000016"]  # keep_last=2

    # The final policy loads with plain transformers and generates with its own tokenizer.
    final = short_run / "final_model"
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    ids = tok("Add 12+34 column by column. End with: Answer: <sum>\n", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=30, do_sample=False, eos_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Answer:" in text


def test_resume_continues_from_the_checkpoint(short_run: Path, tmp_path: Path) -> None:
    """Stop after 8 steps, resume to 16: same metrics as the uninterrupted run."""
    out = tmp_path / "resumed"
    assert main(["train", f"output_dir={out}", "train.steps=8", "evaluate=false", *COMMON]) == 0
    assert (
        main(
            [
                "train",
                f"output_dir={out}",
                "train.steps=16",
                "resume=true",
                "evaluate=false",
                *COMMON,
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 16
    resumed = [r for r in read_metrics(out) if "reward/acc" in r]
    assert [r["step"] for r in resumed] == list(range(1, 17))
    full = {r["step"]: r for r in read_metrics(short_run) if "reward/acc" in r}
    for r in resumed[8:]:
        for key in ("reward/acc", "reward/mean", "response_length/mean", "actor/entropy"):
            assert r[key] == pytest.approx(full[r["step"]][key], rel=1e-4, abs=1e-6), (
                r["step"],
                key,
            )
