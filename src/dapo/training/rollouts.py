"""The rollout stage: fill a training batch with scored groups (sample, score, filter).

:class:`Rollouts` owns what producing a batch needs: the prompts (the seeded stream with
skipping and curriculum), the rollout engine and, for multi-turn runs, the environments,
the group scorer (reward workers), the dynamic sampler and its carry-over, the round
generated ahead (``rollout.async_steps=1``) and the weight sync of a separate engine.
:meth:`Rollouts.fill_batch` is stages 1-3 of a rollout step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from dapo.agents import AgentHost, run_agent_episodes
from dapo.config import Config
from dapo.data.prompts import encode_prompts, load_prompt_set
from dapo.environments import PARSERS, EnvironmentPool, load_environment
from dapo.environments.loading import import_spec
from dapo.errors import DynamicSamplingWarning, TrainingError, VLLMEngineError, VLLMUnavailableError
from dapo.evaluation.run import engine_accuracy
from dapo.parallel import distributed as D
from dapo.rollout import Group, RolloutEngine, SamplingParams, close_engine, make_engine
from dapo.rollout.episodes import run_episodes
from dapo.seeding import mix_seed
from dapo.training.batch import group_metrics
from dapo.training.dynamic_sampling import DynamicSampler, ScoredGroup
from dapo.training.engine_sync import EngineSync
from dapo.training.inputs import RunInputs
from dapo.training.learner import Learner
from dapo.training.prefetch import RolloutPrefetcher
from dapo.training.prompt_selection import PromptSelector
from dapo.training.scoring import GroupScorer


class Rollouts:
    """Produces each rollout step's batch of scored groups with a learning signal."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: Any,
        learner: Learner,
        inputs: RunInputs,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.tokenizer, self.dist = cfg, tokenizer, D.current()
        self._load_prompts(inputs, log)
        r, a = cfg.rollout, cfg.algorithm
        # A separate engine (vLLM, the rollout server) holds its own copy of the weights,
        # pushed every `rollout.vllm_sync_every` updates; it starts from the base model's
        # weights (LoRA's merged ones).
        separate = r.engine != "hf"
        merged = learner.peft is not None and r.engine == "vllm"
        try:
            self.engine: RolloutEngine = make_engine(
                r,
                learner.model,
                tokenizer,
                seed=cfg.seed,
                max_model_len=cfg.data.max_prompt_length + r.max_completion_length,
                state_dict=dict(learner.engine_weights(True)) if merged else None,
            )
        except (VLLMUnavailableError, VLLMEngineError) as exc:
            raise TrainingError(str(exc)) from exc
        self.sync = EngineSync(
            self.engine,
            lambda: learner.engine_weights(separate),
            separate=separate,
            sync_every=r.vllm_sync_every,
            sleep=r.vllm_sleep,
        )
        self.scorer = GroupScorer(cfg, tokenizer, inputs.reward_funcs)
        # Multi-turn episodes: an environment and/or tools (None: one response per prompt).
        spec = load_environment(
            inputs.environment or r.environment, [*r.tools, *inputs.tools], r.tool_parser
        )
        self.environments = (
            None
            if spec is None
            else EnvironmentPool(spec, num_workers=r.env_workers, timeout_s=r.env_timeout_s)
        )
        # Agent episodes: an OpenAI-client program behind this rank's own endpoint.
        agent = inputs.agent if inputs.agent is not None else r.agent
        self.agents = (
            None
            if agent is None
            else AgentHost(
                agent,
                num_workers=r.env_workers,
                timeout_s=r.agent_timeout_s,
                parser=PARSERS.get(r.tool_parser)
                or import_spec(r.tool_parser, "rollout.tool_parser"),
            )
        )
        self.sampler = DynamicSampler(
            cfg.train.prompts_per_step,
            enabled=a.dynamic_sampling,
            metric=a.dynamic_sampling_metric,
            max_rounds=a.max_gen_rounds,
            round_cap=a.round_cap,
            max_empty_steps=a.max_empty_steps,
        )
        self.prompts = PromptSelector(cfg, self.train_records)  # skipping and curriculum
        self.prefetcher = RolloutPrefetcher()  # rollout.async_steps=1: the next round, ahead
        self.samples_generated = 0  # every response generated, trained on or not

    def _load_prompts(self, inputs: RunInputs, log: Callable[[str], None]) -> None:
        """Training and held-out prompts, rendered and tokenized; over-long ones dropped."""
        d = self.cfg.data
        self.train_records, self.train_ids, dropped = encode_prompts(
            load_prompt_set(d, "train", inputs.train_dataset), self.tokenizer, d.max_prompt_length
        )
        if dropped:
            log(f"dropped {dropped} training prompts longer than data.max_prompt_length")
        self.eval_records, self.eval_ids = [], []
        if self.cfg.evaluate and (d.eval is not None or inputs.eval_dataset is not None):
            self.eval_records, self.eval_ids, _ = encode_prompts(
                load_prompt_set(d, "eval", inputs.eval_dataset), self.tokenizer, d.max_prompt_length
            )
        elif self.cfg.evaluate:
            log(
                "no held-out evaluation: data.eval is null (left unset, it is null when "
                "data.train is not a built-in task: a file has no held-out split); set "
                "data.eval=FILE to measure held-out accuracy before and after training"
            )

    def fill_batch(self, step: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Generate and score rounds of prompts until the batch is full (dynamic sampling);
        the batch and the metrics of everything generated."""
        generated: list[ScoredGroup] = []
        skipped: list[int] = []
        timing = {"gen": 0.0, "score": 0.0}
        staleness = []  # rollout steps between the policy that sampled a round and this one
        self.prompts.start_step(step)

        def produce(k: int) -> list[ScoredGroup]:
            ahead = self.prefetcher.take(step, k) if not staleness else None
            t0 = time.perf_counter()
            if ahead is None:
                taken = self.prompts.next(k, skipped)
                idx = D.shard(taken, self.dist)  # this rank's share of the prompts
                groups, version = self.generate(idx, step, len(staleness)), self.sync.version
            else:  # generated during the last step's update, by the policy before it
                taken, groups, version = ahead.indices, ahead.groups or [], ahead.version
                idx = D.shard(taken, self.dist)
                skipped.extend(ahead.skipped)
            staleness.append(step - version)
            t1 = time.perf_counter()
            # Its log-probs are the behaviour policy's: the groups count as generated at
            # `version` when made ahead, else at this step.
            scored = self.scorer.score(
                groups, [self.train_records[i] for i in idx], step if ahead is None else version
            )
            timing["gen"] += t1 - t0
            timing["score"] += time.perf_counter() - t1
            # Every rank sees every group, in prompt order, so that dynamic-sampling
            # decisions are the same on all ranks.
            scored = D.unshard(D.all_gather_objects(scored))
            generated.extend(scored)
            self.prompts.record(taken, [g.correct for g in scored])
            return scored

        batch, fill = self.sampler.fill(produce)
        if fill.note and self.dist.is_main:  # the round cap: a short batch or no update
            warnings.warn(f"rollout step {step}: {fill.note}", DynamicSamplingWarning, stacklevel=3)
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
        return batch, {
            **skips,
            **group_metrics(generated),
            "reward/failures": float(self.scorer.failures),
            "perf/gen_s": timing["gen"],
            "perf/score_s": timing["score"],
            "perf/rollout_tokens_per_s": tokens / max(timing["gen"], 1e-9),
            "sampling/generated_samples_total": float(self.samples_generated),
            "rollout/staleness": float(max(staleness, default=0)),
            **fill.as_metrics(),
        }

    def generate_ahead(self, step: int) -> None:
        """``rollout.async_steps=1``: start generating the first round of ``step`` (the
        prompts and seeds a synchronous run would use for it) in the background."""
        if not self.cfg.rollout.async_steps or step >= self.cfg.train.steps:
            return
        k = self.sampler.first_round_size()
        if k == 0:  # the carried-over groups fill the batch
            return
        self.prompts.start_step(step)  # the pool fill_batch(step) sets again: same history
        skipped: list[int] = []
        indices = self.prompts.next(k, skipped)
        mine = D.shard(indices, self.dist)
        self.prefetcher.submit(
            step, indices, self.sync.version, lambda: self.generate(mine, step, 0), skipped
        )

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
        )

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
        """The data position, carry-over and counters, as plain data; every rank must call it
        (the round generated ahead is gathered)."""
        return {
            **self.prompts.state_dict(),  # "stream" and "history"
            "sampler": self.sampler.state_dict(),
            "reward_failures": self.scorer.failures,
            "samples_generated": self.samples_generated,
            "prefetch": self.prefetcher.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.prompts.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.prefetcher.load_state_dict(state["prefetch"], step)
        self.scorer.failures = state["reward_failures"]
        self.samples_generated = state["samples_generated"]

    def close(self) -> None:
        """Stop the reward and environment workers and release the engine."""
        self.scorer.close()
        self.prefetcher.close()  # a round still generating uses the engine
        if self.environments is not None:
            self.environments.close()
        if self.agents is not None:
            self.agents.close()
        close_engine(self.engine)
