"""What a new user met on the multi-turn and failure paths: the
prompt length is measured as the model sees it (tool schemas included), a multi-turn run on
a model without a chat template is refused before the model is built, and a run in which
every sample fails stops, naming the failing component, instead of finishing quietly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dapo
from dapo.config import ConfigError, load_config
from dapo.environments import ChatRenderer, EnvironmentPool, load_environment
from dapo.errors import DataError, TrainingError
from dapo.rollout import Group, SamplingParams
from dapo.rollout.episodes import run_episodes
from dapo.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
ENVS = Path(__file__).with_name("sample_environments.py")
QUIET = [
    "logging.tensorboard=false",
    "logging.dashboard=false",
    "logging.console=false",
    "checkpoint.save_every=0",
    "checkpoint.save_final_model=false",
]


def long_tool(numbers: list[int]) -> int:
    """Add numbers. This docstring is long on purpose: a tool's schema is part of the prompt
    the model reads, and a long description can push the rendered prompt far past the prompt
    limit. The description goes on and on and on about adding numbers, carrying digits,
    aligning columns, checking results, and why adding numbers is useful to know about.

    Args:
        numbers: The numbers to add, as a list of integers of any size, positive or negative.
    """
    return sum(numbers)


# A template that ignores tools=, as SmolLM2's does: dapo then describes the tools in a
# system message (Hermes form, the whole JSON schema), which is where prompts grew unseen.
NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)


def tool_config(model: Path, tokenizer: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"model.tokenizer={tokenizer}",
            f"output_dir={out}",
            "data.train=builtin:calculator",
            "evaluate=false",
            f"rollout.tools=[{Path(__file__).resolve()}:long_tool]",
            "rollout.max_turns=2",
            "rollout.max_completion_length=60",
            "algorithm.overlong_buffer=8",
            "train.steps=1",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            *QUIET,
            *extra,
        ]
    )


@pytest.mark.slow
def test_the_prompt_limit_measures_the_tools_schemas(tool_model, tmp_path) -> None:
    """Item 1: with a tool whose schema is long, the rendered opening is what
    data.max_prompt_length limits: prompts that fit without the tools but not with them are
    dropped, and when none fits the error says so before anything trains."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model)
    tok.chat_template = NO_TOOLS_TEMPLATE
    tok_dir = tmp_path / "tokenizer"
    tok.save_pretrained(tok_dir)
    spec = load_environment(None, [long_tool])
    with pytest.warns(Warning, match="ignores tools"):
        renderer = ChatRenderer(tok, spec.schemas)
    messages = [{"role": "user", "content": "Add 653092+71216+5052."}]  # 22 characters, as all
    with_tools = len(renderer.opening(messages))
    plain = len(ChatRenderer(tok).opening(messages))
    assert with_tools > plain + 300  # the schema is most of the prompt

    cfg = tool_config(tool_model, tok_dir, tmp_path / "a", f"data.max_prompt_length={plain + 80}")
    with pytest.warns(Warning), pytest.raises(DataError, match="as the model sees them") as err:
        Trainer(cfg, log=lambda _: None)
    assert "tools' schemas" in str(err.value) and "data.max_prompt_length" in str(err.value)

    cfg = tool_config(tool_model, tok_dir, tmp_path / "b", f"data.max_prompt_length={with_tools}")
    with pytest.warns(Warning):
        trainer = Trainer(cfg, log=lambda _: None)
    try:  # every calculator prompt has 22 characters: each opening is exactly at the limit
        assert {len(ids) for ids in trainer.rollouts.train_ids} == {with_tools}
        assert len(trainer.rollouts.train_records) == 20000
    finally:
        trainer.close()


class LongOpening:
    """Opens with a long message for prompts mentioning 7, a short one otherwise."""

    def reset(self, record):
        text = record["prompt"]
        return [{"role": "user", "content": text * 20 if "7" in text else text}]

    def step(self, text):
        return [], 1.0, True


class _Engine:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, prompts, params):
        self.prompts.extend(prompts)
        return [Group(p, [[1]] * params.n, [[0.0]] * params.n, [False] * params.n) for p in prompts]


def test_an_opening_from_reset_over_the_limit_ends_its_episodes(tok) -> None:
    """Item 1: reset's opening is measured too; an episode whose opening is over the limit
    ends as env_failure (masked, counted) and is never generated for."""
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pool = EnvironmentPool(load_environment(LongOpening), num_workers=0)
    engine = _Engine()
    records = [{"prompt": "1+2="}, {"prompt": "7+2="}]
    with pytest.warns(Warning, match="over data.max_prompt_length=20"):
        groups = run_episodes(
            engine,
            tok,
            records,
            SamplingParams(n=2, max_tokens=8),
            pool,
            max_turns=1,
            max_prompt_length=20,
        )
    pool.close()
    ends = [[e["end"] for e in g.episode_stats] for g in groups]
    assert ends == [["done", "done"], ["env_failure", "env_failure"]]
    assert "over data.max_prompt_length=20" in groups[1].episode_stats[0]["failure"]
    assert all(len(p) <= 20 for p in engine.prompts) and len(engine.prompts) == 1


def test_a_model_without_chat_template_is_refused_before_it_is_built(monkeypatch, tmp_path):
    """Item 9: `rollout.tools` on builtin:tiny (no chat template) is refused before the model
    is built or loaded, and the message names the built-in model that can do it."""

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the check")

    monkeypatch.setattr("dapo.training.loading.resolve_model_path", no_build)
    cfg = load_config(
        overrides=[
            f"output_dir={tmp_path}",
            "data.train=builtin:calculator",
            "rollout.environment=calculator",
            "rollout.max_turns=3",
            *QUIET,
        ]
    )
    with pytest.raises(ConfigError, match="builtin:tiny-tool") as err:
        Trainer(cfg, log=lambda _: None)
    assert "'builtin:tiny'" in str(err.value) and "chat template" in str(err.value)


def test_a_model_directory_without_chat_template_is_refused_before_the_policy_loads(
    random_tiny_model, monkeypatch, tmp_path
) -> None:
    """Item 9: for a model directory the tokenizer alone is loaded and checked first."""

    def no_load(*args, **kwargs):
        raise AssertionError("the policy was loaded before the check")

    monkeypatch.setattr("dapo.training.learner.Learner.from_config", no_load)
    cfg = load_config(
        overrides=[
            f"model.name_or_path={random_tiny_model}",
            f"output_dir={tmp_path}",
            "data.train=builtin:calculator",
            f"rollout.environment={ENVS}:Counter",
            "rollout.max_turns=2",
            *QUIET,
        ]
    )
    with pytest.raises(ConfigError, match="builtin:tiny-tool"):
        Trainer(cfg, log=lambda _: None)


SMALL = {
    "train.steps": 6,
    "train.prompts_per_step": 2,
    "train.mini_batch_size": 2,
    "rollout.num_generations": 2,
    "rollout.max_completion_length": 24,
    "algorithm.overlong_buffer": 4,
    "algorithm.max_gen_rounds": 1,
    "evaluate": False,
    "reward.num_workers": 0,
    "logging.tensorboard": False,
    "logging.console": False,
    "checkpoint.save_every": 1,
    "checkpoint.save_final_model": False,
}


@pytest.mark.slow
def test_a_run_whose_every_reward_fails_stops_naming_the_function(random_tiny_model, tmp_path):
    """Item 7: a reward that returns None for every response stops the run after
    train.max_failed_steps steps, naming the function and its error; the counts are per step
    with a running total."""

    def broken(response: str, ground_truth: str):
        return None

    out = tmp_path / "run"
    with pytest.warns(Warning), pytest.raises(TrainingError) as err:
        dapo.train(
            model=str(random_tiny_model),
            output_dir=str(out),
            reward_funcs=broken,
            preset="grpo",  # no dynamic sampling: every step updates on zero advantages
            **SMALL,
        )
    text = str(err.value)
    assert "every sample of the last 3 rollout steps failed" in text
    assert (
        ".broken' returned None, not a finite number" in text
        and "train.max_failed_steps=3" in text
        and "resume=true" in text
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/failures" in r]
    assert [r["reward/failures"] for r in steps] == [4.0, 4.0]  # the third raised
    assert [r["reward/failures_total"] for r in steps] == [4.0, 8.0]


@pytest.mark.slow
def test_a_run_with_some_failures_goes_on_and_its_summary_counts_them(
    random_tiny_model, tmp_path
) -> None:
    """Item 7: failures that leave valid samples cost those samples only; the summary says
    how many there were."""
    calls = []

    def every_other(response: str, ground_truth: str):
        calls.append(1)
        return None if len(calls) % 2 else 1.0

    with pytest.warns(Warning):
        summary = dapo.train(
            model=str(random_tiny_model),
            output_dir=str(tmp_path / "run"),
            reward_funcs=every_other,
            preset="grpo",
            **{**SMALL, "train.steps": 4},
        )
    assert summary["steps"] == 4
    assert summary["failures"] == {"reward": len(calls) // 2, "env": 0}


class AlwaysRaises:
    """An environment that always raises (a random model seldom ends a turn, so reset)."""

    def reset(self, record):
        raise RuntimeError("the environment is broken")

    def step(self, text):
        raise RuntimeError("the environment is broken")


@pytest.mark.slow
def test_a_run_whose_every_episode_fails_stops_naming_the_environment(tool_model, tmp_path):
    """Item 7: every episode ending in env_failure stops the run the same way, with the
    environment's first error; env/failures is per step with a running total."""
    out = tmp_path / "run"
    with pytest.warns(Warning), pytest.raises(TrainingError) as err:
        dapo.train(
            model=str(tool_model),
            output_dir=str(out),
            environment=AlwaysRaises,
            **{**SMALL, "data.train": "builtin:calculator", "rollout.env_workers": 0},
        )
    text = str(err.value)
    assert "every sample of the last 3 rollout steps failed" in text
    assert "the environment: raised: reset raised RuntimeError: the environment is broken" in text
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "env/failures" in r]
    per_step = [r["env/failures"] for r in steps]
    generated = [r["sampling/generated_groups"] * 2 for r in steps]  # every episode failed
    assert per_step == generated and len(steps) == 2
    assert [r["env/failures_total"] for r in steps] == [per_step[0], per_step[0] + per_step[1]]


@pytest.mark.slow
def test_a_run_writes_transcripts_a_person_can_read(random_tiny_model, tmp_path):
    """Item 10: every rollout step writes logging.transcripts_per_step transcripts to
    rollouts.jsonl: the prompt as the model saw it, the turns, the reward, and the group's
    advantage (checked against the group's rewards: (r - mean) / std)."""
    from dapo.metrics.transcripts import read_transcripts

    out = tmp_path / "run"
    dapo.train(
        model=str(random_tiny_model),
        output_dir=str(out),
        reward_funcs=lambda response, ground_truth: float(len(response) % 2),
        preset="grpo",
        **{**SMALL, "train.steps": 3, "logging.transcripts_per_step": 3},
    )
    records = list(read_transcripts(out))
    assert [r["step"] for r in records] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # as the console counts
    for r in records:
        assert r["prompt"].startswith("Add ") and r["turns"][0]["role"] == "assistant"
        rewards = torch.tensor(r["group_rewards"], dtype=torch.float64)
        expected = (r["reward"] - rewards.mean()) / (rewards.std() + 1e-6)
        assert r["advantage"] == pytest.approx(float(expected), abs=1e-4)
