"""Multi-turn episodes in training: the trainer's log-probs of the model's tokens
equal the engine's, environment tokens count in no loss or denominator, a failing
environment costs its episode, and carried-over episode groups survive a resume.

A random model of the built-in tool model's architecture and chat template (no warm-up) and
the test environments of tests/sample_environments.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from learner_utils import backward
from vllm_check import needs_vllm

from dapo.algorithms import LossSettings
from dapo.config import load_config
from dapo.handover import ScoredGroup
from dapo.training.batch import build_samples
from dapo.training.forward import compute_logprobs
from dapo.training.microbatch import loss_denominator
from dapo.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
ENVS = Path(__file__).with_name("sample_environments.py")
ROOT = Path(__file__).resolve().parents[1]


def episode_config(model: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            "data.train=builtin:calculator",
            "data.eval=builtin:calculator",
            "data.max_eval_prompts=8",
            "evaluate=false",
            f"rollout.environment={ENVS}:TwoTurns",
            "rollout.max_turns=2",
            "rollout.max_completion_length=80",
            "algorithm.overlong_buffer=8",
            "train.steps=2",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "reward.num_workers=1",
            *extra,
        ]
    )


def trainer_matches_engine(cfg) -> float:
    """Episodes of 4 prompts; the largest |engine - trainer| log-prob over the model's tokens."""
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        groups = trainer.rollouts.generate([0, 1, 2, 3], step=0, round_no=0)
        assert any(0 in m for g in groups for m in g.model_mask)  # environment tokens present
        scored = trainer.rollouts.scorer.score(groups, trainer.rollouts.train_records[:4], 0)
        samples = trainer.build_samples(scored)
        trained = compute_logprobs(trainer.model, samples, trainer.learner.forward)
    finally:
        trainer.close()
    engine = [torch.tensor(lp) for g in groups for lp in g.logprobs]
    gap = 0.0
    for s, lp, e in zip(samples, trained, engine, strict=True):
        if s.response_ids:
            gap = max(gap, float((lp - e.to(lp)).abs()[s.sampled() > 0].max()))
    return gap


@pytest.mark.slow
def test_the_trainer_sees_the_engines_log_probs_on_the_models_tokens_hf(tool_model, tmp_path):
    assert trainer_matches_engine(episode_config(tool_model, tmp_path / "run")) < 1e-5


@pytest.mark.slow
@needs_vllm
def test_the_trainer_sees_the_engines_log_probs_on_the_models_tokens_vllm(tool_model, tmp_path):
    cfg = episode_config(tool_model, tmp_path / "run", "rollout.engine=vllm")
    assert trainer_matches_engine(cfg) < 1e-5


def test_environment_tokens_are_in_no_loss_and_no_denominator(tmp_path) -> None:
    """A hand-made episode group: prompt, 3 model tokens, 2 environment tokens, 2 model
    tokens. token-mean divides by the 5 model tokens of the batch (times the responses),
    and the gradient equals the paper's loss summed over the model's tokens only."""
    from dapo.models.tiny import build_model, build_tokenizer

    mask = [1, 1, 1, 0, 0, 1, 1]
    group = ScoredGroup(
        prompt_ids=[5, 6, 7],
        response_ids=[[8, 9, 10, 11, 12, 13, 1], [8, 9, 1]],
        sample_logprobs=[[-1.0] * 7, [-1.0] * 3],
        truncated=[False, False],
        rewards=[1.0, -1.0],
        correct=[True, False],
        model_mask=[mask, [1, 1, 1]],
        episode_stats=[{"end": "done"}, {"end": "done"}],
    )
    samples = build_samples([group], step=0)
    assert samples[0].loss_mask == [float(m) for m in mask]
    assert loss_denominator(samples, LossSettings()) == 5 + 3
    model = build_model(len(build_tokenizer()), seed=3).double()
    model.train()
    gen = torch.Generator().manual_seed(0)
    for s in samples:
        s.old_logprobs = -2.0 + 0.3 * torch.randn(
            len(s.response_ids), generator=gen, dtype=torch.float64
        )
    model.zero_grad(set_to_none=True)
    backward(model, samples, LossSettings(), token_budget=10**6)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    model.zero_grad(set_to_none=True)
    total = 8.0  # model tokens of the batch
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        objective = 0.0
        for t, m in enumerate(s.model_mask or [1] * len(s.response_ids)):
            if m:
                ratio = torch.exp(logp[t] - s.old_logprobs[t])
                clipped = torch.clamp(ratio, 0.8, 1.28)
                objective = objective + torch.minimum(ratio * s.advantage, clipped * s.advantage)
        (-objective / total).backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert want.abs().max() > 1e-4
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_an_environment_that_fails_costs_its_episodes_not_the_run(tool_model, tmp_path) -> None:
    """An environment that raises on some prompts, hangs on others and answers garbage on
    others: the run finishes, the failures are counted, and the failed episodes' tokens are
    in no loss."""
    out = tmp_path / "run"
    cfg = episode_config(
        tool_model,
        out,
        f"rollout.environment={ENVS}:Flaky",
        "rollout.env_timeout_s=2",
        "algorithm.dynamic_sampling=false",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    seen = []
    build = trainer.build_samples
    trainer.build_samples = lambda groups: seen.append(build(groups)) or seen[-1]
    with pytest.warns(Warning):
        summary = trainer.run()
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    failures = [r["env/failures"] for r in rows if "env/failures" in r]
    assert sum(failures) > 0 and all(r["env/ended_env_failure"] < 1 for r in rows if r["step"])
    failed = [
        s
        for batch in seen
        for s in batch
        if s.model_mask is not None and sum(s.loss_mask) == 0 and any(s.model_mask)
    ]
    assert failed  # sampled tokens of failed episodes, masked out


@pytest.mark.slow
def test_carried_over_episode_groups_survive_a_resume(tool_model, tmp_path) -> None:
    """Three steps in one go and two + one with a resume log the same metrics: the carried-
    over episode groups (model masks, episode statistics) come back from the checkpoint."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from compare_runs import TIMING, differences, load
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    extra = (
        "train.steps=3",
        "checkpoint.save_every=1",
        "algorithm.max_gen_rounds=4",
        f"reward.functions=[{{name: '{ENVS}:half_right'}}]",
    )
    Trainer(episode_config(tool_model, tmp_path / "whole", *extra), log=lambda _: None).run()
    first = episode_config(tool_model, tmp_path / "split", *extra)
    first.train.steps = 2
    Trainer(first, log=lambda _: None).run()
    state = torch.load(
        tmp_path / "split" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True
    )  # plain data
    assert state["sampler"]["carry"] and all(g["model_mask"] for g in state["sampler"]["carry"])
    with pytest.warns(UserWarning, match="train.steps 2 -> 3"):
        Trainer(
            episode_config(tool_model, tmp_path / "split", *extra, "resume=true"),
            log=lambda _: None,
        ).run()
    a, b = load(tmp_path / "whole"), load(tmp_path / "split")
    assert not differences(a, b, TIMING, 0.0)
    assert any(r.get("sampling/carried_in", 0) > 0 for r in a)
    assert not math.isnan(a[-1]["actor/loss"])


def test_more_than_one_turn_needs_an_environment_or_tools() -> None:
    from dapo.errors import ConfigError

    with pytest.raises(ConfigError, match="more than one turn needs something to answer the model"):
        load_config(overrides=["rollout.max_turns=3"])
    assert load_config(overrides=["rollout.max_turns=3", "rollout.environment=calculator"])


@pytest.mark.slow
@needs_vllm
def test_episodes_are_generated_ahead_with_async_rollouts(tool_model, tmp_path) -> None:
    """rollout.max_staleness=1: the next step's episodes are played while the trainer
    trains, at most one policy version behind, every token tagged with its version."""
    out = tmp_path / "run"
    cfg = episode_config(
        tool_model,
        out,
        "rollout.engine=vllm",
        "rollout.max_staleness=1",
        "algorithm.dynamic_sampling=false",
        "train.steps=3",
    )
    Trainer(cfg, log=lambda _: None).run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["stream/staleness_max"] == 0.0  # the first batch: nothing to be behind
    assert all(r["stream/staleness_max"] <= 1.0 for r in rows)
    assert any(r["stream/staleness_max"] == 1.0 for r in rows[1:])
    assert all(r["env/turns_mean"] > 1 for r in rows)
