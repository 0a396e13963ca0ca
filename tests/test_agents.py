"""Agents written for the OpenAI API as the environment (dapo.agents), with the real
``openai`` client: the wire format, token-exact trajectories and segments, batching,
limits and failures, and the trainer's log-probs on agent trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
from vllm_check import needs_vllm

from dapo.agents import AgentHost, run_agent_episodes
from dapo.data.records import PromptRecord
from dapo.data.tasks.calculator import CHAT_TEMPLATE
from dapo.handover import ScoredGroup
from dapo.models.tiny import build_tokenizer
from dapo.rollout.base import Group, SamplingParams
from dapo.training.batch import build_samples, group_sizes
from dapo.training.microbatch import plan_updates

pytestmark = pytest.mark.usefixtures("one_thread")
AGENTS = Path(__file__).with_name("sample_agents.py")
CALL = '<tool_call>{"name": "add", "arguments": {"terms": "1+2"}}</tool_call>'


class ScriptedEngine:
    """An engine whose reply to a prompt is ``reply(prompt_text)``, tokenised, then EOS;
    log-prob -0.5 per token. Records each call's number of prompts."""

    def __init__(self, tok, reply) -> None:
        self.tok, self.reply, self.calls = tok, reply, []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            text = self.reply(self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            ids = ids[: params.max_tokens]
            n = params.n
            out.append(Group(p, [ids] * n, [[-0.5] * len(ids)] * n, [False] * n))
        return out

    def load_weights(self, named_tensors) -> None:
        pass


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CHAT_TEMPLATE)


def record(text: str = "Add 1+2.", **extra) -> PromptRecord:
    return PromptRecord([{"role": "user", "content": text}], "3", extra=extra)


def play(tok, engine, records, agent, n=1, max_tokens=200, max_turns=3, gather_s=0.05, **kw):
    """Episodes of ``agent`` (in threads of this process unless ``num_workers`` says)."""
    host = AgentHost(agent, **{"num_workers": 0, "timeout_s": 30.0, **kw})
    try:
        params = SamplingParams(n=n, max_tokens=max_tokens, seed=3)
        groups = run_agent_episodes(
            engine, tok, records, params, host, max_turns=max_turns, gather_s=gather_s
        )
        return groups, host
    finally:
        host.close()


def calculator_reply(text: str) -> str:
    return "Answer: 3" if "T: 3" in text else CALL


def test_tool_calls_round_trip_in_the_openai_format(tok) -> None:
    seen = []

    def agent(client, rec):
        messages = list(rec["prompt"])
        tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
        while True:
            r = client.chat.completions.create(model="any", messages=messages, tools=tools)
            seen.append(r)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if r.choices[0].finish_reason != "tool_calls":
                return None
            for call in msg.tool_calls:
                total = sum(map(int, json.loads(call.function.arguments)["terms"].split("+")))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(total)})

    engine = ScriptedEngine(tok, calculator_reply)
    (group,), _ = play(tok, engine, [record()], agent)
    first, second = seen
    c = first.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].type == "function"
    assert c.message.tool_calls[0].function.name == "add"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"terms": "1+2"}
    assert first.usage.completion_tokens == len(CALL) + 1  # characters + EOS
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "Answer: 3"
    assert second.choices[0].message.tool_calls is None
    # One sequence: the call as sampled, the tool's reply as rendered ids, the answer.
    eos = tok.eos_token_id
    assert tok.decode(group.prompt_ids) == "tools: add\nU: Add 1+2.\nA: "
    text = tok.decode(group.response_ids[0])
    assert text == CALL + "<eos>\nT: 3\nA: Answer: 3<eos>"
    sampled = [t for t, m in zip(group.response_ids[0], group.model_mask[0], strict=True) if m]
    assert tok.decode(sampled) == CALL + "<eos>Answer: 3<eos>"
    assert sampled.count(eos) == 2
    assert group.final_texts == ["Answer: 3"]
    assert group.env_rewards == [None]
    stats = group.episode_stats[0]
    assert (stats["requests"], stats["segments"], stats["tool_calls"], stats["end"]) == (
        2,
        1,
        1,
        "done",
    )


def test_a_history_rewrite_starts_a_new_segment_trained_with_the_episodes_advantage(tok):
    def agent(client, rec):
        messages = list(rec["prompt"])
        r = client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "more"}]
        client.chat.completions.create(model="m", messages=messages)  # extends: same segment
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "S"}])
        return float(rec["extra"]["reward"])

    engine = ScriptedEngine(tok, lambda text: "ok")
    (group,), _ = play(tok, engine, [record(reward=1)], agent, n=2, max_turns=5)
    for stats, ids, mask in zip(
        group.episode_stats, group.response_ids, group.model_mask, strict=True
    ):
        assert stats["segments"] == 2 and stats["requests"] == 3
        (extra,) = stats["extra_segments"]
        assert tok.decode(extra["prompt_ids"]) == "U: Add 1+2.\nA: "
        assert tok.decode(extra["response_ids"]) == "ok<eos>\nU: more\nA: ok<eos>"
        assert sum(extra["model_mask"]) == 6
        assert tok.decode(group.prompt_ids + ids) == "U: S\nA: ok<eos>"
        assert sum(mask) == 3
    # Training: each extra segment is a sample of its own with its episode's advantage.
    scored = ScoredGroup(
        group.prompt_ids,
        group.response_ids,
        group.logprobs,
        group.truncated,
        rewards=[1.0, 0.0],
        correct=[True, False],
        model_mask=group.model_mask,
        episode_stats=group.episode_stats,
    )
    samples = build_samples([scored], step=0, keep_engine_logprobs=True)
    assert group_sizes([scored]) == [4] and len(samples) == 4
    assert [s.advantage for s in samples[2:]] == [samples[0].advantage, samples[1].advantage]
    assert samples[0].advantage > 0 > samples[1].advantage
    assert samples[2].response_ids == group.episode_stats[0]["extra_segments"][0]["response_ids"]
    assert samples[2].loss_mask == [float(m) for m in samples[2].model_mask]
    engine_lps = [-0.5 if m else 0.0 for m in samples[3].model_mask]
    assert torch.equal(samples[3].sampling_logprobs, torch.tensor(engine_lps))


def test_updates_keep_each_group_with_its_extra_segments_whole() -> None:
    plan = plan_updates(7, [2, 3, 2], 3, 1, 2, seed=0)
    assert len(plan) == 6
    for epoch in (0, 1):
        updates = [idx for e, idx in plan if e == epoch]
        assert sorted(i for idx in updates for i in idx) == list(range(7))
        assert sorted(map(sorted, updates)) == [[0, 1], [2, 3, 4], [5, 6]]


def test_concurrent_agents_are_batched_into_one_engine_call(tok) -> None:
    def agent(client, rec):
        client.chat.completions.create(model="m", messages=list(rec["prompt"]))

    engine = ScriptedEngine(tok, lambda text: "hi")
    groups, host = play(tok, engine, [record("a"), record("b")], agent, n=32, gather_s=10.0)
    assert engine.calls == [64]  # 64 episodes connecting at once, one request each: one call
    assert [s["end"] for g in groups for s in g.episode_stats] == ["done"] * 64


def test_a_request_with_another_temperature_is_refused_naming_the_field(tok) -> None:
    errors = []

    def agent(client, rec):
        try:
            client.chat.completions.create(model="m", messages=rec["prompt"], temperature=0.3)
        except openai.BadRequestError as exc:
            errors.append(exc)
        client.chat.completions.create(model="m", messages=rec["prompt"], temperature=1.0)

    engine = ScriptedEngine(tok, lambda text: "hi")
    (group,), _ = play(tok, engine, [record()], agent)
    (exc,) = errors
    assert exc.status_code == 400 and exc.body["param"] == "temperature"
    assert "`temperature` = 0.3" in exc.message and "rollout.temperature" in exc.message
    assert group.episode_stats[0]["end"] == "done", group.episode_stats[0]["failure"]
    assert group.episode_stats[0]["requests"] == 1


@pytest.mark.slow
def test_raising_hanging_and_over_limit_agents_cost_one_episode_each(tok) -> None:
    from dapo.environments import EnvironmentWarning

    modes = ["ok", "raise", "hang", "turns"]
    engine = ScriptedEngine(tok, lambda text: "hi")
    with pytest.warns(EnvironmentWarning) as heard:
        groups, _ = play(
            tok,
            engine,
            [record(mode=m) for m in [*modes, "raise"]],
            f"{AGENTS}:by_mode",
            num_workers=1,
            timeout_s=4.0,
        )
    # Each kind of failure is told once, with its reason (two episodes raised).
    told = sorted(str(w.message).split(": ")[1] for w in heard)
    assert told == ["max_turns", "raised", "timeout"]
    assert any("ValueError: the agent's own bug" in str(w.message) for w in heard)
    stats = {m: g.episode_stats[0] for m, g in zip(modes, groups[:4], strict=True)}
    assert groups[4].episode_stats[0]["failure"].startswith("raised: ValueError")
    assert stats["ok"]["end"] == "done" and groups[0].env_rewards == [1.0]
    assert stats["raise"]["end"] == "env_failure"
    assert stats["raise"]["failure"].startswith("raised: ValueError: the agent's own bug")
    assert stats["hang"]["end"] == "env_failure"
    assert stats["hang"]["failure"].startswith("timeout:")
    assert stats["turns"]["end"] == "env_failure" and stats["turns"]["requests"] == 3
    assert stats["turns"]["failure"].startswith("max_turns: request 4 is over")
    # The episodes before the failures keep their sampled tokens; the run goes on: a
    # second round on the same host (its hung worker replaced) plays normally.
    engine2 = ScriptedEngine(tok, lambda text: "hi")
    with pytest.warns(EnvironmentWarning, match="failed and costs its sample: budget: request 2"):
        groups2, _ = play(
            tok,
            engine2,
            [record(mode="turns")],
            f"{AGENTS}:by_mode",
            num_workers=1,
            max_tokens=7,
            max_turns=10,
        )
    (s,) = groups2[0].episode_stats
    # "hi<eos>" (3 tokens), then "\nU: again\nA: " does not fit in the 7 left with room
    assert s["end"] == "env_failure" and s["failure"].startswith("budget: request 2")
    assert s["requests"] == 1


def test_the_agent_config_key_excludes_environments_and_allows_turns() -> None:
    from dapo.config import load_config
    from dapo.errors import ConfigError

    cfg = load_config(overrides=[f"rollout.agent={AGENTS}:by_mode", "rollout.max_turns=4"])
    assert cfg.rollout.agent.endswith("by_mode") and cfg.rollout.agent_timeout_s == 300.0
    with pytest.raises(ConfigError, match="rollout.agent"):
        load_config(overrides=[f"rollout.agent={AGENTS}:by_mode", "rollout.environment=calculator"])


@pytest.mark.slow
def test_the_trainer_sees_the_engines_log_probs_on_agent_trajectories(tool_model, tmp_path):
    trainer_matches_engine_on_agents(tool_model, tmp_path, "hf")


@pytest.mark.slow
@needs_vllm
def test_the_trainer_sees_the_vllm_engines_log_probs_on_agent_trajectories(tool_model, tmp_path):
    trainer_matches_engine_on_agents(tool_model, tmp_path, "vllm")


def agent_config(model: Path, out: Path, agent: str, *extra: str):
    """A small run of ``tests/sample_agents.py``'s ``agent`` on builtin:calculator: 2 prompts x
    2 episodes of at most 3 requests, no evaluation, dynamic sampling off."""
    from dapo.config import load_config

    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            "data.train=builtin:calculator",
            "evaluate=false",
            f"rollout.agent={AGENTS}:{agent}",
            "rollout.max_turns=3",
            "rollout.max_completion_length=60",
            "train.prompts_per_step=2",
            "train.mini_batch_size=1",
            "rollout.num_generations=2",
            "algorithm.dynamic_sampling=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_final_model=false",
            "reward.num_workers=1",
            *extra,
        ]
    )


def trainer_matches_engine_on_agents(tool_model, tmp_path, engine: str) -> None:
    """Agent episodes with tool messages and a history rewrite: the trainer's log-probs of
    every sampled token (extra segments too) are the engine's; then a training step."""
    from dapo.training.forward import compute_logprobs
    from dapo.training.trainer import Trainer

    cfg = agent_config(
        tool_model,
        tmp_path / "run",
        "three_requests",
        "train.steps=1",
        "checkpoint.save_every=0",
        f"rollout.engine={engine}",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        groups = trainer.rollouts.generate([0, 1], step=0, round_no=0)
        scored = trainer.rollouts.scorer.score(groups, trainer.rollouts.train_records[:2], 0)
        samples = build_samples(scored, step=0, keep_engine_logprobs=True)
        assert len(samples) > 4  # the rewrites' segments
        assert any(0 in s.model_mask for s in samples)  # tool replies: not sampled
        trained = compute_logprobs(trainer.model, samples, trainer.learner.forward)
        gap = 0.0
        for s, lp in zip(samples, trained, strict=True):
            keep = s.sampled() > 0
            if keep.any():
                gap = max(gap, float((lp - s.sampling_logprobs.to(lp)).abs()[keep].max()))
        assert gap < 1e-5
        metrics, _ = trainer.train_step()  # a training step on agent episodes
    finally:
        trainer.close()
    assert metrics["agent/requests_mean"] == 3.0
    assert metrics["agent/segments_mean"] == 2.0
    assert metrics["perf/agent_s"] > 0


def test_async_agents_get_an_async_client_and_run_concurrently(tok) -> None:
    clients = []

    async def agent(client, rec):
        clients.append(type(client).__name__)
        messages = list(rec["prompt"])
        r = await client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=messages)
        return 0.5

    engine = ScriptedEngine(tok, lambda text: "hi")
    (group,), _ = play(tok, engine, [record()], agent, n=3, gather_s=10.0)
    assert clients == ["AsyncOpenAI"] * 3
    assert engine.calls == [3, 3]  # both rounds of requests batched
    assert group.env_rewards == [0.5] * 3
    assert [s["requests"] for s in group.episode_stats] == [2] * 3
    assert tok.decode(group.response_ids[0]) == "hi<eos>\nU: again\nA: hi<eos>"


def test_an_agent_function_is_given_through_the_python_api(tool_model, tmp_path) -> None:
    import dapo

    def my_agent(client, rec):
        return 1.0

    trainer = dapo.make_trainer(
        model=str(tool_model),
        output_dir=str(tmp_path / "run"),
        agent=my_agent,
        **{"rollout.max_turns": 2, "data.train": "builtin:calculator", "evaluate": False},
    )
    try:
        assert trainer.rollouts.agents.runner.fn is my_agent
        assert (
            trainer.cfg.rollout.agent
            == "<agent: test_an_agent_function_is_given_through_the_python_api.<locals>.my_agent>"
        )
    finally:
        trainer.close()


def test_an_unknown_tool_parser_for_agents_is_named_before_any_model_loads(tmp_path) -> None:
    import dapo
    from dapo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`rollout.tool_parser` = 'hermse' .*\(hermes\)"):
        dapo.make_trainer(
            model=str(tmp_path / "no-model-here"),  # never reached
            output_dir=str(tmp_path / "run"),
            agent=f"{AGENTS}:by_mode",
            **{"rollout.max_turns": 2, "rollout.tool_parser": "hermse"},
        )


@pytest.mark.slow
def test_an_agent_run_resumed_from_its_checkpoint_logs_what_one_run_logs(tool_model, tmp_path):
    """Three steps of agent episodes (tool replies, a history rewrite: extra segments) in one
    go, and two + one resumed from the step-2 checkpoint file, log the same metrics: the
    agents' sampling seeds depend on the step and round, not on what the process did before."""
    import sys

    from dapo.training.trainer import Trainer

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    try:
        from compare_runs import TIMING, differences, load
    finally:
        sys.path.pop(0)

    def config(out: Path, steps: int, *extra: str):
        return agent_config(  # three_requests_scored: mixed groups, a learning signal
            tool_model,
            out,
            "three_requests_scored",
            f"train.steps={steps}",
            "checkpoint.save_every=1",
            *extra,
        )

    Trainer(config(tmp_path / "whole", 3), log=lambda _: None).run()
    Trainer(config(tmp_path / "split", 2), log=lambda _: None).run()
    assert (tmp_path / "split" / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    with pytest.warns(UserWarning, match="train.steps 2 -> 3"):
        Trainer(config(tmp_path / "split", 3, "resume=true"), log=lambda _: None).run()
    a, b = load(tmp_path / "whole"), load(tmp_path / "split")
    assert not differences(a, b, TIMING, 0.0)
    steps = [r for r in a if "agent/segments_mean" in r]
    assert len(steps) == 3 and all(r["agent/segments_mean"] == 2.0 for r in steps)
    assert steps[-1]["reward/std"] > 0 and steps[-1]["actor/grad_norm"] > 0  # step 3 learned


@pytest.mark.slow
def test_two_ranks_each_serve_their_episodes_and_train_every_segment_once(tool_model, tmp_path):
    """Under 2 ranks each rank plays its share of the episodes on its own endpoint, every
    rank sees the same batch, and together they train every sample (segments too) once."""
    from ranks import torchrun

    out = tmp_path / "run"
    here = Path(__file__).parent
    torchrun(
        str(here / "dist_worker.py"),
        "dynamic",
        str(tool_model),
        str(out),
        f"{here / 'sample_environments.py'}:half_right",
        "data.train=builtin:calculator",
        f"rollout.agent={AGENTS}:three_requests",
        "rollout.max_turns=3",
        "rollout.max_completion_length=80",
        "algorithm.overlong_buffer=8",
        cwd=tmp_path,
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(ranks[0]) == len(ranks[1]) == 3
    played = [m for m in metrics if "agent/requests_mean" in m]  # a step of carried-over
    assert played  # groups alone (dynamic sampling's surplus) plays no episode
    assert all(m["agent/requests_mean"] == 3 and m["agent/segments_mean"] == 2 for m in played)
    for a, b in zip(*ranks, strict=True):
        assert a["uids"] == b["uids"] and len(a["uids"]) == 4
        # 4 prompts x 4 episodes x 2 segments
        assert sorted(a["trained_rows"] + b["trained_rows"]) == list(range(32))


def test_episodes_that_open_differently_still_train_every_segment(tok) -> None:
    import itertools

    count = itertools.count()

    def agent(client, rec):  # the second episode opens with a system message
        first = next(count) == 0
        opening = [] if first else [{"role": "system", "content": "be brief"}]
        client.chat.completions.create(model="m", messages=[*opening, *rec["prompt"]])

    engine = ScriptedEngine(tok, lambda text: "hi")
    (group,), _ = play(tok, engine, [record()], agent, n=2)
    opened = [bool(ids) for ids in group.response_ids]
    extras = [len(s["extra_segments"]) for s in group.episode_stats]
    assert sorted(zip(opened, extras, strict=True)) == [(False, 1), (True, 0)]
    assert tok.decode(group.prompt_ids) in ("U: Add 1+2.\nA: ", "S: be brief\nU: Add 1+2.\nA: ")


@pytest.mark.slow
def test_an_agent_that_kills_its_worker_costs_that_workers_episodes_only(tok) -> None:
    engine = ScriptedEngine(tok, lambda text: "hi")
    host = AgentHost(f"{AGENTS}:by_mode", num_workers=2, timeout_s=30.0)
    try:
        params = SamplingParams(n=1, max_tokens=50, seed=0)
        records = [record(mode="exit"), record(mode="ok")]  # one per worker (round-robin)
        groups = run_agent_episodes(engine, tok, records, params, host, max_turns=3)
        ends = [g.episode_stats[0] for g in groups]
        assert ends[0]["end"] == "env_failure"
        assert ends[0]["failure"] == "the agent's worker process exited with code 3"
        assert ends[1]["end"] == "done"
        # The dead worker is replaced for the next round.
        again = run_agent_episodes(engine, tok, [record(mode="ok")] * 2, params, host, max_turns=3)
        assert [g.episode_stats[0]["end"] for g in again] == ["done", "done"]
    finally:
        host.close()


def test_groups_with_extra_segments_survive_a_checkpoint(tok) -> None:
    def agent(client, rec):
        client.chat.completions.create(model="m", messages=rec["prompt"])
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "S"}])

    (group,), _ = play(tok, ScriptedEngine(tok, lambda text: "ok"), [record()], agent, n=2)
    scored = ScoredGroup(
        group.prompt_ids,
        group.response_ids,
        group.logprobs,
        group.truncated,
        rewards=[1.0, 0.0],
        correct=[True, False],
        model_mask=group.model_mask,
        episode_stats=group.episode_stats,
        step=0,
    )
    back = ScoredGroup.from_state(json.loads(json.dumps(scored.to_state())))
    before = build_samples([scored], step=1, keep_engine_logprobs=True)
    after = build_samples([back], step=1, keep_engine_logprobs=True)
    assert len(before) == len(after) == 4
    for a, b in zip(before, after, strict=True):
        assert (a.prompt_ids, a.response_ids, a.advantage, a.loss_mask) == (
            b.prompt_ids,
            b.response_ids,
            b.advantage,
            b.loss_mask,
        )
        assert torch.equal(a.old_logprobs, b.old_logprobs)  # carried over: the engine's


def test_the_example_agent_plays_the_calculator_environments_episodes_token_for_token(tok):
    """examples/agent_calculator.py over the endpoint gives the very sequences (and masks)
    of the built-in calculator environment over run_episodes, for the same model turns."""
    import re

    from dapo.data.tasks.calculator import calculator_records, tool_call_text
    from dapo.environments import EnvironmentPool, load_environment
    from dapo.rollout.episodes import run_episodes

    def reply(text: str) -> str:
        if "T: " in text:
            return "Answer: " + text.rsplit("T: ", 1)[1].split("\n")[0]
        numbers = re.search(r"Add ([\d+]+)\.", text).group(1).split("+")
        return tool_call_text([int(x) for x in numbers])

    records = calculator_records("train", 3)
    params = SamplingParams(n=2, max_tokens=160, seed=0)
    example = Path(__file__).parents[1] / "examples" / "agent_calculator.py"
    agent_groups, _ = play(
        tok, ScriptedEngine(tok, reply), records, f"{example}:agent", n=2, max_tokens=160
    )
    with EnvironmentPool(load_environment("calculator"), num_workers=0) as pool:
        env_groups = run_episodes(
            ScriptedEngine(tok, reply), tok, records, params, pool, max_turns=3
        )
    for a, e in zip(agent_groups, env_groups, strict=True):
        assert a.prompt_ids == e.prompt_ids
        assert a.response_ids == e.response_ids and a.model_mask == e.model_mask
        assert a.final_texts == e.final_texts and a.final_texts[0].startswith("Answer: ")
        assert [s["tool_calls"] for s in a.episode_stats] == [1, 1]


def test_what_an_agent_prints_in_its_worker_is_captured_not_shown(tok, tmp_path, capfd) -> None:
    from dapo.worker_output import UserOutput

    engine = ScriptedEngine(tok, lambda text: "hi")
    path = tmp_path / "user_output.log"
    host = AgentHost(
        f"{AGENTS}:by_mode", num_workers=1, timeout_s=30.0, output=UserOutput(path, 4096)
    )
    try:
        params = SamplingParams(n=1, max_tokens=50, seed=0)
        (group,) = run_agent_episodes(
            engine, tok, [record(mode="print")], params, host, max_turns=3
        )
        assert group.episode_stats[0]["end"] == "done"
        capture = host.runner.output
        assert capture is not None
        capture.sync()  # the worker flushed before its result: all of it is readable now
        assert capture.dropped == 10_000_001 + 11 - 4096
    finally:
        host.close()
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 1000
    text = path.read_text()
    assert text.startswith("==> agent worker ") and "o" * 4096 in text and "o" * 4097 not in text
    assert f"[{10_000_001 + 11 - 4096} more bytes dropped" in text
    assert capture._thread is not None and not capture._thread.is_alive()


def test_an_agent_worker_process_does_not_import_torch() -> None:
    """A worker (re)starts in a fraction of a second: its module and the package's
    ``__init__`` import neither torch nor transformers (6.9 s on a 2-core CPU)."""
    import subprocess
    import sys

    code = (
        "import sys, dapo.agents.worker; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
