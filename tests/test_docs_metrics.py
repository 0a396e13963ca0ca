"""Every metric a run logs is in ``dapo.metrics.registry`` (the docs' metrics reference is
generated from it): short trainings over the main paths, and a check of the lookup itself."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from vllm_check import needs_vllm  # tests/vllm_check.py

from dapo.metrics import MetricsLogger
from dapo.metrics.registry import METRICS, is_registered, lookup

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "train.steps": 2,
    "train.prompts_per_step": 4,
    "train.mini_batch_size": 2,
    "rollout.num_generations": 4,
    "data.max_eval_prompts": 8,
    "algorithm.max_gen_rounds": 2,
    "checkpoint.save_every": 0,
    "logging.eval_every": 1,
    "logging.console": False,
    "logging.tensorboard": False,
}

PATHS = {
    "dapo_is_cap_bf16": {"algorithm.is_cap": 2.0, "train.precision": "bf16-mixed"},
    "grpo_beta_dual_clip_entropy": {
        "preset": "grpo",
        "algorithm.beta": 0.01,
        "algorithm.clip_c": 3.0,
        "algorithm.entropy_coef": 0.001,
    },
    "clip_cov_skip_curriculum": {
        "preset": "clip_cov",
        "algorithm.skip_uniform_prompts": True,
        "data.curriculum": "easy_first",
        "data.difficulty_key": "carries",
    },
    # Streaming on the hf engine (it samples from a copy of the policy, pushed every step);
    # short chunks so that partial rollouts continue responses across an update.
    "streaming_partial": {
        "rollout.max_staleness": 1,
        "rollout.partial_rollouts": True,
        "rollout.partial_chunk_tokens": 8,
    },
    # A teacher equal to the student: the distill/* keys, with a zero signal.
    "distill_teacher": {"algorithm.teacher": "builtin:tiny"},
}

EXPECTED = {
    "streaming_partial": {
        "stream/staleness_mean",
        "stream/staleness_max",
        "stream/staleness_0",
        "stream/staleness_1",
        "stream/versions_per_response",
        "stream/dropped_groups",
        "stream/partial_responses",
        "stream/queued_batches",
        "perf/data_wait_s",
        "perf/capacity_wait_s",
    },
    "distill_teacher": {
        "distill/reverse_kl",
        "distill/teacher_share",
        "distill/teacher_logprob",
        "perf/teacher_s",
    },
}


def test_the_lookup_matches_keys_and_patterns_only() -> None:
    assert lookup("reward/acc") is not None and lookup("reward/acc").key == "reward/acc"
    assert lookup("env/ended_max_turns").key == "env/ended_{reason}"
    assert lookup("stream/staleness_12").key == "stream/staleness_{age}"  # a number too
    assert not is_registered("env/ended_")  # the placeholder stands for a name
    assert not is_registered("reward/accuracy") and not is_registered("Reward/acc")
    keys = [m.key for m in METRICS]
    assert len(keys) == len(set(keys))
    assert all(re.fullmatch(r"[a-z_]+/[a-z0-9_{}]+", k) for k in keys)
    assert all(m.meaning.endswith(".") for m in METRICS)


def test_the_logger_warns_once_about_an_unregistered_key(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, total_steps=2, console=False, tensorboard=False) as lg:
        with pytest.warns(RuntimeWarning, match="'made/up' is not in dapo.metrics.registry"):
            lg.log(1, {"made/up": 1.0, "reward/acc": 0.5})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lg.log(2, {"made/up": 2.0, "reward/acc": 0.5})  # once only
    assert lg.unregistered == {"made/up"}


def _logged_keys(run: Path) -> set[str]:
    keys: set[str] = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        keys |= set(json.loads(line)) - {"step", "time"}
    return keys


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATHS))
def test_every_key_a_training_logs_is_registered(name: str, tmp_path: Path) -> None:
    import dapo

    dapo.train(**{**TINY, **PATHS[name]}, output_dir=str(tmp_path / "run"))
    keys = _logged_keys(tmp_path / "run")
    assert {"reward/acc", "actor/pg_loss", "val/acc"} <= keys
    assert {"reward/failures", "reward/failures_total"} <= keys
    assert EXPECTED.get(name, set()) <= keys
    assert not [k for k in keys if not is_registered(k)]


@pytest.mark.slow
def test_every_key_a_multiturn_training_logs_is_registered(
    tool_model: Path, tmp_path: Path
) -> None:
    import dapo

    dapo.train(
        **TINY,
        model=str(tool_model),
        output_dir=str(tmp_path / "run"),
        data={"train": "builtin:calculator", "eval": "builtin:calculator"},
        rollout={"environment": "calculator", "max_turns": 3, "max_completion_length": 96},
        algorithm={"dynamic_sampling": False},  # an untrained model: update all the same
    )
    keys = _logged_keys(tmp_path / "run")
    assert "env/turns_mean" in keys and any(k.startswith("env/ended_") for k in keys)
    assert {"actor/pg_loss", "env/failures_total"} <= keys
    assert not [k for k in keys if not is_registered(k)]


@pytest.mark.slow
def test_every_key_an_agent_training_logs_is_registered(tool_model: Path, tmp_path: Path) -> None:
    """An OpenAI-client agent (examples/agent_calculator.py) as the environment."""
    import dapo

    dapo.train(
        **TINY,
        model=str(tool_model),
        output_dir=str(tmp_path / "run"),
        data={"train": "builtin:calculator", "eval": "builtin:calculator"},
        rollout={
            "agent": str(ROOT / "examples" / "agent_calculator.py") + ":agent",
            "max_turns": 3,
            "max_completion_length": 96,
        },
        algorithm={"dynamic_sampling": False},
    )
    keys = _logged_keys(tmp_path / "run")
    agent = {"agent/requests_mean", "agent/segments_mean", "agent/tool_calls", "perf/agent_s"}
    assert agent | {"env/failures_total", "actor/pg_loss"} <= keys
    assert not [k for k in keys if not is_registered(k)]


@pytest.mark.slow
@needs_vllm
def test_every_key_a_vllm_streaming_training_logs_is_registered(tmp_path: Path) -> None:
    """The engine's keys: log-prob mismatch, weight sync, staleness, the batch filled ahead."""
    import dapo

    dapo.train(
        **TINY,
        **{"rollout.engine": "vllm", "rollout.max_staleness": 1},
        output_dir=str(tmp_path / "run"),
    )
    keys = _logged_keys(tmp_path / "run")
    engine = {"rollout/logprob_mismatch", "perf/weight_sync_s", "perf/data_wait_s"}
    assert engine | {"stream/staleness_mean", "stream/queued_batches"} <= keys
    assert not [k for k in keys if not is_registered(k)]
