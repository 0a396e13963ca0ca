"""The rollout stage: fill a training batch with scored groups (sample, score, filter).

:class:`Rollouts` owns what producing a batch needs: the prompts (the seeded stream with
skipping and curriculum), the rollout engine and, for multi-turn runs, the environments,
the group scorer (reward workers), the dynamic sampler and its carry-over, and the weight
sync of a separate engine. :meth:`Rollouts.fill_batch` is stages 1-3 of a rollout step; with
streaming rollouts (``rollout.max_staleness``) a producer thread calls it for the coming
steps (:mod:`dapo.producer.stream`).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from dapo.agents import AgentHost, run_agent_episodes
from dapo.config import Config
from dapo.data import LoadStats
from dapo.data.images import ImageText
from dapo.data.prompts import dropped_lines, encode_prompts, load_prompt_set, no_template_line
from dapo.environments import (
    ChatRenderer,
    EnvironmentPool,
    EnvironmentSpec,
    load_parser,
    prompt_messages,
)
from dapo.errors import (
    DynamicSamplingError,
    DynamicSamplingWarning,
    TrainingError,
    VLLMEngineError,
    VLLMUnavailableError,
)
from dapo.evaluation.protocol import EvalProtocol, common_repeats, samples_per_problem
from dapo.evaluation.run import engine_accuracy
from dapo.handover import RolloutBatch, ScoredGroup
from dapo.health import diagnose_groups
from dapo.models.vision import pixel_cache
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.producer.dynamic_sampling import DynamicSampler
from dapo.producer.engine_sync import EngineSync
from dapo.producer.metrics import group_metrics
from dapo.producer.prompt_selection import PromptSelector
from dapo.producer.scoring import GroupScorer
from dapo.rollout import Group, SamplingParams, close_engine, make_engine
from dapo.rollout.episodes import run_episodes
from dapo.rollout.versioned import VersionedEngine
from dapo.run_inputs import RunInputs
from dapo.seeding import Stream, mix_seed, stream_seed
from dapo.worker_output import OutputCapture, UserOutput


class Policy(Protocol):
    """What the producer needs of the policy being trained (the learner has it)."""

    model: torch.nn.Module  # the module the hf engine samples from (or copies)
    peft: Any  # the LoRA wrapper, or None

    def engine_weights(self, separate: bool) -> Any:
        """``(name, tensor)`` pairs of the policy as a separate engine loads them."""


class Rollouts:
    """Produces each rollout step's batch of scored groups with a learning signal."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: Any,
        inputs: RunInputs,
        log: Callable[[str], None],
        spec: EnvironmentSpec | None = None,
        processor: Any = None,
    ) -> None:
        """The prompts, the reward scorer, the environments and the dynamic sampler: what a
        bad data file or reward spec breaks, before any model is loaded. :meth:`connect`
        builds the engine from the policy."""
        self.cfg, self.tokenizer, self.dist = cfg, tokenizer, D.current()
        # A vision-language model's processor and the prompts' pixel inputs (None: text).
        self.vision = None if processor is None else (processor, pixel_cache(processor))
        r, a = cfg.rollout, cfg.algorithm
        # Multi-turn episodes: an environment and/or tools (None: one response per prompt).
        # Their prompts are measured as the model sees them: rendered with the tools.
        images = None if self.vision is None else ImageText(*self.vision)
        self.renderer = None if spec is None else ChatRenderer(tokenizer, spec.schemas, images)
        # What user code prints in the workers: output_dir/user_output.log, capped per step.
        output = UserOutput.of_run(
            cfg.output_dir,
            cfg.logging.user_output_kb,
            f"rank {self.dist.rank} " if self.dist.enabled else "",
        )
        self.scorer = GroupScorer(cfg, tokenizer, inputs.reward_funcs, output)
        self.environments: EnvironmentPool | None = None
        self.agents: AgentHost | None = None
        self.engine: Any = None
        try:  # a refusal below stops the workers started so far, and their output's thread
            self._load_prompts(inputs, log)
            if spec is not None:
                self.environments = EnvironmentPool(
                    spec, num_workers=r.env_workers, timeout_s=r.env_timeout_s, output=output
                )
            # Agent episodes: an OpenAI-client program behind this rank's own endpoint.
            agent = inputs.agent if inputs.agent is not None else r.agent
            if agent is not None:
                self.agents = AgentHost(
                    agent,
                    num_workers=r.env_workers,
                    timeout_s=r.agent_timeout_s,
                    parser=load_parser(r.tool_parser),
                    output=output,
                )
            self.sampler = DynamicSampler(
                cfg.train.prompts_per_step,
                # Distillation alone: a uniform group still carries the teacher's signal.
                enabled=a.dynamic_sampling and not a.distill_only,
                metric=a.dynamic_sampling_metric,
                max_rounds=a.max_gen_rounds,
                round_cap=a.round_cap,
                max_empty_steps=a.max_empty_steps,
                keep_surplus=a.keep_surplus,
            )
            self.prompts = PromptSelector(cfg, self.train_records)  # skipping and curriculum
        except BaseException:
            self.close()
            raise
        if self.scorer.rewards.captures_user_output or self._captures():
            log(
                "what the reward functions, environments, tools and agents print in their "
                f"worker processes goes to {output.path}, at most {cfg.logging.user_output_kb} "
                "KiB per worker and rollout step (logging.user_output_kb)"
            )
        self.samples_generated = 0  # every response generated, trained on or not
        self.env_failures = 0  # episodes whose environment failed, over the run
        self.failed_in_a_row = 0  # rollout steps in a row with no sample that did not fail

    def connect(self, learner: Policy) -> None:
        """Build the rollout engine from the policy ``learner`` trains, and its weight sync.

        A separate engine (vLLM, the rollout server) holds its own copy of the weights,
        pushed every ``rollout.vllm_sync_every`` updates; it starts from the base model's
        weights (LoRA's merged ones). With streaming rollouts the transformers engine samples
        from a copy of the policy (the policy itself changes while the producer generates),
        kept like vLLM's."""
        cfg, r = self.cfg, self.cfg.rollout
        own_copy = r.engine == "hf" and r.max_staleness > 0
        separate = r.engine != "hf" or own_copy
        merged = learner.peft is not None and r.engine == "vllm"
        try:
            engine = make_engine(
                r,
                copy.deepcopy(learner.model) if own_copy else learner.model,
                self.tokenizer,
                seed=cfg.seed,
                max_model_len=cfg.data.max_prompt_length + r.max_completion_length,
                state_dict=dict(learner.engine_weights(True)) if merged else None,
                processor=None if self.vision is None else self.vision[0],
            )
        except (VLLMUnavailableError, VLLMEngineError) as exc:
            raise TrainingError(str(exc)) from exc
        chunk = r.partial_chunk_tokens if r.partial_rollouts else None
        self.engine = VersionedEngine(engine, version=0, chunk_tokens=chunk)
        # The copy loads the policy's parameters under their own names (LoRA's too).
        weights = (
            (lambda: sharding.full_named_parameters(learner.model))
            if own_copy
            else (lambda: learner.engine_weights(separate))
        )
        self.sync = EngineSync(
            self.engine,
            weights,
            separate=separate,
            sync_every=r.vllm_sync_every,
            sleep=r.vllm_sleep,
        )

    def _load_prompts(self, inputs: RunInputs, log: Callable[[str], None]) -> None:
        """Training and held-out prompts, rendered and tokenized; over-long ones dropped."""
        d = self.cfg.data
        answers = self.scorer.rewards.answers
        renderer = self.renderer
        opening = (
            None if renderer is None else (lambda r: renderer.opening_text(prompt_messages(r)))
        )
        stats = LoadStats()
        records = load_prompt_set(d, "train", inputs.train_dataset, answers, stats)
        self.scorer.rewards.check_records(records, stats.origins, d.answer_key)
        self.train_records, self.train_ids, _ = encode_prompts(
            records,
            self.tokenizer,
            d.max_prompt_length,
            stats=stats,
            text_of=opening,
            vision=self.vision,
        )
        for line in dropped_lines(stats, "training", d.max_prompt_length):
            log(line)
        if self.train_records:  # TRL-form rewards take columns by name: all there?
            self.scorer.rewards.check_columns(set(self.train_records[0].extra), "data.train")
        if not self.cfg.algorithm.distill_only:
            for line in self.scorer.rewards.describe([r.data_source for r in self.train_records]):
                log(line)
        self.eval_records, self.eval_ids = [], []
        self.eval_protocol: EvalProtocol | None = None
        if self.cfg.evaluate and (d.eval is not None or inputs.eval_dataset is not None):
            stats = LoadStats()
            records = load_prompt_set(d, "eval", inputs.eval_dataset, answers, stats)
            self.scorer.rewards.check_records(records, stats.origins, d.answer_key)
            self.eval_records, self.eval_ids, _ = encode_prompts(
                records,
                self.tokenizer,
                d.max_prompt_length,
                stats=stats,
                text_of=opening,
                vision=self.vision,
            )
            # Repeated problems are avg@k's samples (as in `dapo eval`), not dropped prompts.
            repeats, stats.duplicates = stats.repeats, 0
            for line in dropped_lines(stats, "held-out", d.max_prompt_length):
                log(line)
            r = self.cfg.rollout
            k = samples_per_problem(r.eval_num_generations, common_repeats(repeats))
            self.eval_protocol = EvalProtocol(
                k, r.eval_temperature, r.eval_top_p, len(self.eval_records)
            )
            log(f"held-out evaluation: {self.eval_protocol}{_repeats_note(repeats, k, r)}")
        elif self.cfg.evaluate:
            log(
                "no held-out evaluation: data.eval is null (left unset, it is null when "
                "the training data is not a built-in task: a file or a data set given from "
                "Python has no held-out split of its own); set data.eval=FILE (from Python: "
                "eval_dataset=...) to measure held-out accuracy before and after training"
            )
        joined = no_template_line(self.train_records + self.eval_records, self.tokenizer)
        if renderer is None and joined:  # said once, for the training and held-out prompts
            log(joined)

    def fill_batch(self, step: int) -> RolloutBatch:
        """Generate and score rounds of prompts until the batch is full (dynamic sampling);
        the batch and the metrics of everything generated."""
        generated: list[ScoredGroup] = []
        skipped: list[int] = []
        timing = {"gen": 0.0, "score": 0.0}
        staleness = []  # rollout steps between the policy that sampled a round and this one
        self.prompts.start_step(step)
        # Numbered from 1, as the console counts steps; the workers' output limit starts again.
        dropped_output = self._output_step(f"rollout step {step + 1}")
        n = self.cfg.rollout.max_staleness
        dropped = self.sampler.drop_older_than(step - n) if n else 0  # carry-over too stale
        continued = self.engine.continued

        def produce(k: int) -> list[ScoredGroup]:
            t0 = time.perf_counter()
            taken = self.prompts.next(k, skipped)
            idx = D.shard(taken, self.dist)  # this rank's share of the prompts
            version = self.sync.version
            groups = self.generate(idx, step, len(staleness))
            staleness.append(step - version)
            t1 = time.perf_counter()
            # Generated ahead (streaming), its tokens are as old as their versions say; the
            # groups count as generated at the oldest of them.
            oldest = min([version, *(v for g in groups for x in g.versions or [] for v in x)])
            scored = self.scorer.score(
                groups,
                [self.train_records[i] for i in idx],
                step if not n else oldest,
                rewards=not self.cfg.algorithm.distill_only,
            )
            timing["gen"] += t1 - t0
            timing["score"] += time.perf_counter() - t1
            # Every rank sees every group, in prompt order, so that dynamic-sampling
            # decisions are the same on all ranks.
            scored = D.unshard(D.all_gather_objects(scored))
            generated.extend(scored)
            self.prompts.record(taken, [g.correct for g in scored])
            return scored

        r, h = self.cfg.rollout, self.cfg.health

        def diagnose() -> str:
            return diagnose_groups(
                generated,
                max_completion_length=r.max_completion_length,
                temperature=r.temperature,
                metric=self.cfg.algorithm.dynamic_sampling_metric,
                max_truncated=h.max_truncated,
                greedy_temperature=h.greedy_temperature,
            )

        reward_failures, unscorable = self.scorer.failures, self.scorer.unscorable
        try:
            batch, fill = self.sampler.fill(produce, diagnose)
        except DynamicSamplingError as exc:  # a step of failures says why it found nothing
            self._check_failures(step, generated, reward_failures, exc)
            raise
        failed = self._check_failures(step, generated, reward_failures)
        failed["reward/unscorable"] = float(self.scorer.unscorable - unscorable)
        failed.update({k: float(v - dropped_output[k]) for k, v in self._output_dropped().items()})
        if fill.note and self.dist.is_main:  # the round cap: a short batch or no update
            # Numbered from 1, as the console and the health warnings count steps.
            warnings.warn(
                f"rollout step {step + 1}: {fill.note}", DynamicSamplingWarning, stacklevel=3
            )
        self.samples_generated += sum(g.size for g in generated)
        tokens = sum(len(x) for g in generated for x in g.response_ids)
        skips = (
            {}
            if not self.prompts.skip
            else {
                "sampling/skipped_prompts": float(len(skipped)),
                "sampling/skip_rate": len(skipped) / max(1, len(skipped) + len(generated)),
            }
        )
        # Nothing generated (a step trained on the previous one's surplus): no rewards,
        # lengths or rates to report, rather than zeros that read as real.
        produced = (
            {}
            if not generated
            else {
                **group_metrics(generated, scored=not self.cfg.algorithm.distill_only),
                "perf/rollout_tokens_per_s": tokens / max(timing["gen"], 1e-9),
            }
        )
        used = {id(g) for g in (*batch, *self.sampler.carry)}
        left_out = [(g, _left_out_reason(g)) for g in generated if id(g) not in used]
        return RolloutBatch(
            batch,
            {
                **skips,
                **produced,
                **failed,
                "perf/gen_s": timing["gen"],
                "perf/score_s": timing["score"],
                "sampling/generated_samples_total": float(self.samples_generated),
                "rollout/staleness": float(max(staleness, default=0)),
                **fill.as_metrics(),
                **(
                    {
                        "stream/dropped_groups": float(dropped),
                        "stream/partial_responses": float(self.engine.continued - continued),
                    }
                    if n
                    else {}
                ),
            },
            left_out,
        )

    def _captures(self) -> list[OutputCapture]:
        """The captured output of the environment and agent workers (none in-process)."""
        owners = [self.environments, self.agents.runner if self.agents is not None else None]
        return [o.output for o in owners if o is not None and o.output is not None]

    def _output_step(self, step: str) -> dict[str, int]:
        """What the reward, environment and agent workers print from here on belongs to
        ``step`` (``output_dir/user_output.log``, with a fresh limit per worker); the bytes
        dropped so far (:meth:`_output_dropped`)."""
        self.scorer.rewards.output_step(step)
        for capture in self._captures():
            capture.new_step(step)
        return self._output_dropped()

    def _output_dropped(self) -> dict[str, int]:
        """Bytes the workers printed over the limit, dropped, since the start, by metric."""
        dropped = {"reward/output_dropped_bytes": self.scorer.rewards.output_dropped}
        if self.environments is not None or self.agents is not None:
            dropped["env/output_dropped_bytes"] = sum(c.dropped for c in self._captures())
        return dropped

    def _check_failures(
        self,
        step: int,
        generated: list[ScoredGroup],
        reward_failures_before: int,
        cause: Exception | None = None,
    ) -> dict[str, float]:
        """This step's failed samples (reward calls, environments), counted; stop the run after
        ``train.max_failed_steps`` steps in a row in which every sample failed."""
        episodes = [e for g in generated for e in g.episode_stats or []]
        env = [e for e in episodes if e["end"] == "env_failure"]
        rewards = self.scorer.failures - reward_failures_before
        self.env_failures += len(env)
        samples = sum(g.size for g in generated)
        all_failed = samples > 0 and rewards + len(env) >= samples
        self.failed_in_a_row = self.failed_in_a_row + 1 if all_failed else 0
        limit = self.cfg.train.max_failed_steps
        if all_failed and self.failed_in_a_row >= limit:
            first = (
                f"the environment: {env[0]['failure']}"
                if env
                else (self.scorer.rewards.first_error or "a reward function")
            )
            raise TrainingError(
                f"every sample of the last {self.failed_in_a_row} rollout steps failed "
                f"(train.max_failed_steps={limit}; step {step + 1}: {rewards} reward failures, "
                f"{len(env)} environment failures of {samples} samples); the first error: "
                f"{first}. Fix that component; {self._checkpoints_left()}"
            ) from cause
        return {
            "reward/failures": float(rewards),
            "reward/failures_total": float(self.scorer.failures),
            **({"env/failures_total": float(self.env_failures)} if episodes else {}),
        }

    def _checkpoints_left(self) -> str:
        """What the run's checkpoints offer after a failure: resume, or start again."""
        root = Path(self.cfg.output_dir) / "checkpoints"
        if any(root.glob("step_*")):
            return "the last checkpoint is intact (continue with resume=true)."
        return "no checkpoint was saved yet: rerun to start again."

    def generate(self, indices: list[int], step: int, round_no: int) -> list[Group]:
        """``rollout.num_generations`` responses (or episodes) for the training prompts
        ``indices``, seeded per step, round and rank."""
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.num_generations,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_completion_length,
            seed=mix_seed(self.cfg.seed, step, round_no, self.dist.rank),
        )
        records = [self.train_records[i] for i in indices]
        return self.sample(records, [self.train_ids[i] for i in indices], params)

    def sample(
        self, records: list[Any], ids: list[list[int]], params: SamplingParams
    ) -> list[Group]:
        """Responses from the engine, or episodes of turns with the environment (token-in,
        token-out: :func:`dapo.rollout.episodes.run_episodes`)."""
        if self.agents is not None:
            r = self.cfg.rollout
            return run_agent_episodes(
                self.engine,
                self.tokenizer,
                records,
                params,
                self.agents,
                max_turns=r.max_turns,
                max_length=self.cfg.data.max_prompt_length + r.max_completion_length,
            )
        if self.environments is None:
            return self.engine.generate(ids, params)
        return run_episodes(
            self.engine,
            self.tokenizer,
            records,
            params,
            self.environments,
            max_turns=self.cfg.rollout.max_turns,
            renderer=self.renderer,
            max_prompt_length=self.cfg.data.max_prompt_length,
        )

    def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy (avg@``rollout.eval_num_generations``) over all ranks (every
        rank calls it); ``measured`` is false when every reward call failed (the accuracy
        means nothing then) and ``error`` is the first failure's."""
        r, protocol = self.cfg.rollout, self.eval_protocol
        assert protocol is not None, "evaluate() without held-out prompts"
        params = SamplingParams(
            n=protocol.k,
            temperature=protocol.temperature,
            top_p=protocol.top_p,
            top_k=0,
            max_tokens=r.max_completion_length,
            seed=stream_seed(self.cfg.seed, Stream.EVALUATION),
        )
        records = D.shard(self.eval_records, self.dist)
        ids = D.shard(self.eval_ids, self.dist)
        self._output_step("evaluation")
        rewards = self.scorer.rewards
        scored, failed = rewards.scored, rewards.failed
        ev = self.accuracy(records, ids, params)
        # Gathered here, not only in generate: a rank without eval prompts never generates.
        correct, n, scored, failed = D.all_reduce_sum(
            [
                ev["acc"] * ev["n"] if ev["n"] else 0.0,
                float(ev["n"]),
                float(rewards.scored - scored),
                float(rewards.failed - failed),
            ]
        )
        all_failed = bool(scored and failed >= scored)
        claims = rewards.claims_correct
        return {
            **ev,
            "acc": correct / max(n, 1.0),
            "n": int(n),
            "protocol": str(protocol),
            "measured": not all_failed and claims,
            "error": rewards.first_error,
            **(
                {}
                if all_failed or claims
                else {
                    "unmeasured": "the reward says nothing of correct: it is not -1/0/1-valued "
                    "and returns no acc field"
                }
            ),
        }

    def accuracy(
        self, records: list[Any], ids: list[list[int]], params: SamplingParams
    ) -> dict[str, Any]:
        """This rank's avg@n accuracy on ``records``: responses scored by the reward
        functions, or held-out episode success."""
        if self.environments is None and self.agents is None:
            return engine_accuracy(
                self.engine, self.tokenizer, records, ids, self.scorer.rewards, params
            )
        scored = self.scorer.score(self.sample(records, ids, params), records, 0) if records else []
        correct = [float(c) for g in scored for c in g.correct]
        return {"acc": sum(correct) / max(len(correct), 1), "n": len(correct)}

    def state_dict(self) -> dict[str, Any]:
        """The data position, carry-over and counters, as plain data (the batches a streaming
        producer filled ahead are the stream's: :mod:`dapo.producer.stream`)."""
        return {
            **self.prompts.state_dict(),  # "stream" and "history"
            "sampler": self.sampler.state_dict(),
            "reward_failures": self.scorer.failures,
            "env_failures": self.env_failures,
            "failed_in_a_row": self.failed_in_a_row,
            "samples_generated": self.samples_generated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.scorer.failures = state["reward_failures"]
        self.env_failures = state.get("env_failures", 0)  # absent before they were counted
        self.failed_in_a_row = state.get("failed_in_a_row", 0)
        self.samples_generated = state["samples_generated"]

    def close(self) -> None:
        """Stop the reward and environment workers and release the engine."""
        self.scorer.close()
        if self.environments is not None:
            self.environments.close()
        if self.agents is not None:
            self.agents.close()
        if self.engine is not None:
            close_engine(self.engine)


def _repeats_note(repeats: list[int], k: int, r: Any) -> str:
    """Where k came from, when the data repeats its problems."""
    if not repeats or max(repeats) == 1:
        return ""
    if common_repeats(repeats) is None:
        held = f"the data repeats its problems unevenly ({min(repeats)} to {max(repeats)} times)"
    else:
        held = f"the data holds each problem {repeats[0]} times"
    if r.eval_num_generations is None:
        return f" ({held}; rollout.eval_num_generations sets k)"
    return f" ({held}; k from rollout.eval_num_generations={k})"


def _left_out_reason(group: ScoredGroup) -> str:
    """Why dynamic sampling left a group out, as the transcripts say it."""
    n = group.size
    if all(group.correct):
        return f"filtered out by dynamic sampling: all {n} responses correct (no learning signal)"
    if not any(group.correct) and len(set(group.rewards)) == 1:
        return (
            f"filtered out by dynamic sampling: all {n} responses wrong, reward "
            f"{group.rewards[0]:g} each (no learning signal)"
        )
    if len(set(group.rewards)) == 1:
        return f"filtered out by dynamic sampling: all {n} responses rewarded {group.rewards[0]:g}"
    return f"filtered out by dynamic sampling: all {n} responses scored alike"
