"""Which prompts a run generates: algorithm.skip_uniform_prompts in the trainer (skipped
prompts are never generated, rounds stay full, resume, metrics) and data.curriculum."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from vllm_check import needs_vllm  # tests/vllm_check.py

from dapo.config import load_config
from dapo.producer.prompt_history import PromptHistory, should_skip
from dapo.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
REWARDS = Path(__file__).with_name("trainer_rewards.py")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def twelve_prompts(tmp_path_factory) -> Path:
    """12 distinct prompts with answers 3..14: under `by_answer_class` a third always
    right, a third always wrong (difficulty that persists), a third mixed."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [
        {"prompt": f"Add {i}+3. End with Answer: <sum>\n", "answer": str(i + 3), "level": i % 3}
        for i in range(12)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(model: Path, data: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            f"data.train={data}",
            "data.answer_key=answer",
            "train.steps=8",
            "train.prompts_per_step=4",
            "train.mini_batch_size=4",
            "rollout.num_generations=4",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=2",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            f"reward.functions=[{{name: '{REWARDS}:by_answer_class'}}]",
            *extra,
        ]
    )


def metric_rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "sampling/generated_groups" in r]


ASYNC = pytest.param(
    ["rollout.engine=vllm", "rollout.max_staleness=1"],
    id="async",
    marks=[pytest.mark.slow, needs_vllm],
)


@pytest.mark.parametrize("rollout", [pytest.param([], id="sync"), ASYNC])
def test_skipped_prompts_are_never_generated_and_rounds_stay_full(
    random_tiny_model, twelve_prompts, tmp_path, rollout
):
    """async: the next step's rounds are drawn (and skipped) by the producer while the
    trainer trains, from the history of every step scored before them, as a synchronous run
    would."""
    cfg = config(
        random_tiny_model,
        twelve_prompts,
        tmp_path / "run",
        "algorithm.skip_uniform_prompts=true",
        *rollout,
    )
    trainer = Trainer(cfg, log=lambda _: None)
    # What the engine is asked to generate, and every draw from the prompt stream with the
    # prompt's streak at that moment, from a history the test keeps itself from the scores.
    engine_prompts: list[list[int]] = []
    draws: list[tuple[int, int, int]] = []  # (position, index, streak)
    mine = PromptHistory()
    requested: list[tuple[int, int]] = []  # (prompts asked for, prompts returned)
    selector = trainer.rollouts.prompts
    generate, score, next_index, next_prompts = (
        trainer.rollouts.engine.generate,
        trainer.rollouts.scorer.score,
        selector.stream._next,
        selector.next,
    )

    def record_generate(prompt_ids, params):
        engine_prompts.extend(list(p) for p in prompt_ids)
        return generate(prompt_ids, params)

    def record_score(groups, records, step, **kwargs):
        scored = score(groups, records, step, **kwargs)
        for g in scored:
            mine.record(g.record.uid, g.correct)
        return scored

    def record_draw():
        position = selector.stream.position
        index = next_index()
        draws.append((position, index, mine.streak(trainer.rollouts.train_records[index].uid)))
        return index

    def record_request(k, skipped):
        taken = next_prompts(k, skipped)
        requested.append((k, len(taken)))
        return taken

    trainer.rollouts.engine.generate, trainer.rollouts.scorer.score = record_generate, record_score
    selector.stream._next, selector.next = record_draw, record_request
    trainer.run()

    cap = cfg.algorithm.skip_max_prob
    uid = [r.uid for r in trainer.rollouts.train_records]
    expected = [
        trainer.rollouts.train_ids[i]
        for pos, i, streak in draws
        if not should_skip(cfg.seed, pos, uid[i], streak, cap)
    ]
    assert engine_prompts == expected  # exactly the draws the rule did not skip, in order
    skipped = len(draws) - len(expected)
    assert skipped > 5, "the test needs skipped prompts"
    assert all(k == n for k, n in requested)  # every round got as many prompts as asked
    rows = metric_rows(tmp_path / "run")
    assert sum(r["sampling/skipped_prompts"] for r in rows) == skipped
    for r in rows:  # a step served from the carried-over surplus alone draws nothing
        drawn = r["sampling/skipped_prompts"] + r["sampling/generated_groups"]
        assert r["sampling/skip_rate"] == pytest.approx(
            r["sampling/skipped_prompts"] / max(1, drawn)
        )
    # The trainer's own history is the one the test rebuilt from the scores.
    assert selector.history.state_dict() == mine.state_dict()


@pytest.mark.slow
def test_skipping_spends_less_generation_per_trained_group(
    random_tiny_model, twelve_prompts, tmp_path
):
    """With difficulty that persists, the run with skipping generates fewer groups for
    the same 8 x 4 trained ones."""
    generated = {}
    for skip in (False, True):
        out = tmp_path / f"skip_{skip}"
        cfg = config(
            random_tiny_model, twelve_prompts, out, f"algorithm.skip_uniform_prompts={skip}"
        )
        Trainer(cfg, log=lambda _: None).run()
        rows = metric_rows(out)
        generated[skip] = sum(r["sampling/generated_groups"] for r in rows)
        assert ("sampling/skip_rate" in rows[0]) == skip  # the metrics only when it is on
    assert generated[True] < 0.8 * generated[False], generated


@pytest.mark.slow
def test_a_resumed_run_skips_as_the_uninterrupted_one(random_tiny_model, twelve_prompts, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compare_runs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    skip = ("algorithm.skip_uniform_prompts=true", "checkpoint.save_every=3")
    whole, part = tmp_path / "whole", tmp_path / "part"
    Trainer(config(random_tiny_model, twelve_prompts, whole, *skip), log=lambda _: None).run()
    Trainer(
        config(random_tiny_model, twelve_prompts, part, *skip, "train.steps=3"), log=lambda _: None
    ).run()
    resumed = Trainer(
        config(random_tiny_model, twelve_prompts, part, *skip, "resume=true"), log=lambda _: None
    )
    resumed.run()
    assert json.loads((part / "summary.json").read_text())["resumed_from_step"] == 3
    a, b = compare_runs.load(whole), compare_runs.load(part)
    assert len(a) == 8 and sum(r["sampling/skipped_prompts"] for r in a[3:]) > 0
    assert compare_runs.differences(a, b, compare_runs.TIMING, tol=0.0) == []


def test_skip_key_shares_one_history_between_rows(random_tiny_model, twelve_prompts, tmp_path):
    """With algorithm.skip_key=level the 12 prompts share 3 histories, one per level."""
    cfg = config(
        random_tiny_model,
        twelve_prompts,
        tmp_path / "run",
        "algorithm.skip_uniform_prompts=true",
        "algorithm.skip_key=level",
        "train.steps=2",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    trainer.run()
    history = trainer.rollouts.prompts.history
    assert trainer.rollouts.prompts.keys == [str(i % 3) for i in range(12)]
    assert len(history) == 3
    # Level 0 (answers divisible by 3) is always right: its streak counts all its groups.
    assert history.streak("0") == history.groups("0") > 1


def _prompts_by_step(trainer: Trainer) -> dict[int, list[list[int]]]:
    """Record the prompts the engine is asked to generate, by rollout step."""
    seen: dict[int, list[list[int]]] = {}
    generate = trainer.rollouts.engine.generate

    def record(prompt_ids, params):
        seen.setdefault(trainer.step, []).extend(list(p) for p in prompt_ids)
        return generate(prompt_ids, params)

    trainer.rollouts.engine.generate = record
    return seen


@pytest.mark.slow
def test_easy_first_by_a_difficulty_field(random_tiny_model, twelve_prompts, tmp_path):
    """The pool starts with the easiest quarter (3 prompts, all of level 0) and holds
    every level from step 4 (data.curriculum_steps) on."""
    cfg = config(
        random_tiny_model,
        twelve_prompts,
        tmp_path / "run",
        "data.curriculum=easy_first",
        "data.difficulty_key=level",
        "data.curriculum_start=0.25",
        "data.curriculum_steps=4",
        "algorithm.dynamic_sampling=false",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    seen = _prompts_by_step(trainer)
    trainer.run()
    level = {tuple(ids): i % 3 for i, ids in enumerate(trainer.rollouts.train_ids)}
    levels = {step: {level[tuple(p)] for p in prompts} for step, prompts in seen.items()}
    assert levels[0] == {0} and len({tuple(p) for p in seen[0]}) <= 3
    assert set().union(*(levels[s] for s in range(4, 8))) == {0, 1, 2}
    assert trainer.rollouts.prompts.history is None  # a difficulty field needs no history


@pytest.mark.slow
def test_easy_first_by_measured_pass_rate(random_tiny_model, twelve_prompts, tmp_path):
    """Without a difficulty field the pool is ranked by the pass rates measured so far:
    prompts always solved come first, prompts never solved last."""
    cfg = config(
        random_tiny_model,
        twelve_prompts,
        tmp_path / "run",
        "data.curriculum=easy_first",
        "data.curriculum_start=0.5",
        "algorithm.dynamic_sampling=false",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    pools: list[tuple[list[int], int, list]] = []  # (order, size, pass rates then)
    use_pool, history = trainer.rollouts.prompts.stream.use_pool, trainer.rollouts.prompts.history

    def record_pool(order, size):
        pools.append(
            (list(order), size, [history.pass_rate(r.uid) for r in trainer.rollouts.train_records])
        )
        use_pool(order, size)

    trainer.rollouts.prompts.stream.use_pool = record_pool
    seen = _prompts_by_step(trainer)
    trainer.run()
    order, size, rates = pools[-1]
    known = [i for i in order if rates[i] is not None]
    assert len(known) > 3 and 1.0 in rates and 0.0 in rates
    assert [rates[i] for i in known] == sorted((rates[i] for i in known), reverse=True)
    # Each step generated only prompts of that step's pool.
    for step, prompts in seen.items():
        order, size, _ = pools[step]
        pool = {tuple(trainer.rollouts.train_ids[i]) for i in order[:size]}
        assert {tuple(p) for p in prompts} <= pool
