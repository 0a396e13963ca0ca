"""The rollout-step loop: sample, score, filter, advantages, update, log, save.

The trainer knows the order of the stages and nothing of their insides. It composes objects
that own their state: the rollout engine (``dapo.rollout``), the group scorer
(:mod:`scoring`), the dynamic sampler (:mod:`dynamic_sampling`), the prompt selector, the
learner (:mod:`learner`: the policy, its optimizer and the update) and the engine sync.
Read :meth:`Trainer.train_step` and :meth:`Trainer.run` top to bottom.
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.atomic import write_text_atomic
from dapo.config import Config
from dapo.data.prompts import encode_prompts, load_prompt_set
from dapo.errors import DynamicSamplingWarning, TrainingError, VLLMEngineError, VLLMUnavailableError
from dapo.evaluation.run import engine_accuracy
from dapo.metrics import MetricsLogger, plot_dashboard
from dapo.models import load_tokenizer, resolve_model_path
from dapo.models.precision import precision_of
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.rollout import Group, RolloutEngine, SamplingParams, close_engine, make_engine
from dapo.seeding import Stream, mix_seed, seed_everything, stream_seed
from dapo.training.batch import Sample, build_samples, group_metrics
from dapo.training.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    step_dir,
)
from dapo.training.dynamic_sampling import DynamicSampler, ScoredGroup
from dapo.training.engine_sync import EngineSync
from dapo.training.learner import Learner, NonFiniteUpdates
from dapo.training.prefetch import RolloutPrefetcher
from dapo.training.prompt_selection import PromptSelector
from dapo.training.resume import check_resume
from dapo.training.scoring import GroupScorer


class Trainer:
    """Trains ``cfg.model`` with the configured algorithm; ``run()`` does the whole job,
    ``train_step()`` one rollout step."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print) -> None:
        self.dist = D.init_distributed()
        self.log = log if self.dist.is_main else (lambda _: None)  # only rank 0 speaks
        self.cfg, self.out = cfg, Path(cfg.output_dir)
        _check_output_dir(self.out)
        seed_everything(cfg.seed)
        model_path = resolve_model_path(cfg.model.name_or_path, log=self.log)
        self.tokenizer = load_tokenizer(
            cfg.model.tokenizer or model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        self.learner = Learner.from_config(cfg, model_path, self.tokenizer.pad_token_id, self.log)
        # A separate engine (vLLM, the rollout server) holds its own copy of the weights:
        # pushed every `rollout.vllm_sync_every` updates; its sampling log-probs are compared
        # with (and can correct, `algorithm.is_cap`) the trainer's, as are the transformers
        # engine's below float32 (its incremental decoding rounds differently).
        self.separate_engine = cfg.rollout.engine != "hf"
        self.learner.needs_old_logprobs |= self.separate_engine
        self.learner.compare_engine = (self.separate_engine or cfg.algorithm.is_cap is not None
                                       or precision_of(self.model) != "fp32")  # fmt: skip
        self._load_prompts()
        self.engine: RolloutEngine = self._make_engine()
        self.scorer = GroupScorer(cfg, self.tokenizer)
        a = cfg.algorithm
        self.sampler = DynamicSampler(
            cfg.train.prompts_per_step, enabled=a.dynamic_sampling, metric=a.dynamic_sampling_metric,
            max_rounds=a.max_gen_rounds, round_cap=a.round_cap, max_empty_steps=a.max_empty_steps,
        )  # fmt: skip
        self.prompts = PromptSelector(cfg, self.train_records)  # skipping and curriculum
        self.engine_sync = EngineSync(
            self.engine, lambda: self.learner.engine_weights(self.separate_engine),
            separate=self.separate_engine, sync_every=cfg.rollout.vllm_sync_every,
            sleep=cfg.rollout.vllm_sleep,
        )  # fmt: skip
        self.prefetcher = RolloutPrefetcher()  # rollout.async_steps=1: the next round, ahead
        self.step = 0
        self.summary: dict[str, Any] = {}
        self.samples_generated = 0  # every response generated, trained on or not

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained (owned by :attr:`learner`)."""
        return self.learner.model

    def _load_prompts(self) -> None:
        """Training and held-out prompts, rendered and tokenized; over-long ones dropped."""
        cfg = self.cfg
        self.train_records, self.train_ids, dropped = encode_prompts(
            load_prompt_set(cfg.data, "train"), self.tokenizer, cfg.data.max_prompt_length
        )
        if dropped:
            self.log(f"dropped {dropped} training prompts longer than data.max_prompt_length")
        self.eval_records, self.eval_ids = [], []
        if cfg.evaluate and cfg.data.eval is not None:
            self.eval_records, self.eval_ids, _ = encode_prompts(
                load_prompt_set(cfg.data, "eval"), self.tokenizer, cfg.data.max_prompt_length
            )

    def _make_engine(self) -> RolloutEngine:
        r = self.cfg.rollout
        # A separate engine starts from base-model weights: LoRA's merged ones.
        merged = self.learner.peft is not None and r.engine == "vllm"
        try:
            return make_engine(
                r, self.model, self.tokenizer, seed=self.cfg.seed,
                max_model_len=self.cfg.data.max_prompt_length + r.max_completion_length,
                state_dict=dict(self.learner.engine_weights(True)) if merged else None,
            )  # fmt: skip
        except (VLLMUnavailableError, VLLMEngineError) as exc:
            raise TrainingError(str(exc)) from exc

    # --- one rollout step -----------------------------------------------------------------

    def train_step(self) -> tuple[dict[str, float], list[ScoredGroup]]:
        """One rollout step on ``self.step``: its metrics and the groups it trained on."""
        step = self.step
        t0 = time.perf_counter()
        groups, metrics = self.fill_batch(step)  # 1-3. sample, score, filter
        self.generate_ahead(step + 1)  # async: the next step's first round, while we train
        t1 = time.perf_counter()
        if groups:  # none: no group with a learning signal at the round cap, no update
            samples = self.build_samples(groups)  # 4. advantages and loss masks
            metrics.update(self.update(samples, step))  # 5. update the policy
        else:
            metrics["actor/updates"] = 0.0
        metrics.update(self.prefetcher.collect())  # async: the next round is in
        metrics.update(self.engine_sync.after_update(step + 1))  # 6. a separate engine follows
        t2 = time.perf_counter()
        tokens = sum(len(g.prompt_ids) * g.size + sum(map(len, g.response_ids)) for g in groups)
        metrics["train/stale_groups"] = float(sum(g.step < step for g in groups))
        metrics["perf/train_s"] = t2 - t1
        metrics["perf/train_tokens_per_s"] = tokens / max(t2 - t1, 1e-9)
        metrics["perf/step_s"] = t2 - t0
        self.step += 1
        return metrics, groups

    def fill_batch(self, step: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Generate and score rounds of prompts until the batch is full (dynamic sampling);
        the batch and the metrics of everything generated."""
        generated: list[ScoredGroup] = []
        skipped: list[int] = []
        timing = {"gen": 0.0, "score": 0.0}
        staleness = []  # rollout steps between the policy that sampled a round and this one
        self.prompts.start_step(step)

        def produce(k: int) -> list[ScoredGroup]:
            first = not staleness
            ahead = self.prefetcher.take(step, k) if first else None
            t0 = time.perf_counter()
            if ahead is None:
                taken = self.prompts.next(k, skipped)
                idx = D.shard(taken, self.dist)  # this rank's share of the prompts
                groups = self.generate([self.train_ids[i] for i in idx], step, len(staleness))
                version = self.engine_sync.version
            else:  # generated during the last step's update, by the policy before it
                taken, groups, version = ahead.indices, ahead.groups or [], ahead.version
                idx = D.shard(taken, self.dist)
                skipped.extend(ahead.skipped)
            staleness.append(step - version)
            t1 = time.perf_counter()
            # Its log-probs are the behaviour policy's: the groups count as generated at
            # `version` when made ahead, else at this step.
            scored = self.scorer.score(groups, [self.train_records[i] for i in idx],
                                       step if ahead is None else version)  # fmt: skip
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
            warnings.warn(f"rollout step {step}: {fill.note}", DynamicSamplingWarning, stacklevel=2)
        self.samples_generated += sum(g.size for g in generated)
        tokens = sum(len(x) for g in generated for x in g.response_ids)
        skips = {} if not self.prompts.skip else {
            "sampling/skipped_prompts": float(len(skipped)),
            "sampling/skip_rate": len(skipped) / max(1, len(skipped) + len(generated)),
        }  # fmt: skip
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
        prompts = [self.train_ids[i] for i in D.shard(indices, self.dist)]
        self.prefetcher.submit(
            step, indices, self.engine_sync.version, lambda: self.generate(prompts, step, 0), skipped
        )

    def generate(self, prompt_ids: list[list[int]], step: int, round_no: int) -> list[Group]:
        """Sample ``rollout.num_generations`` responses per prompt (seeded per step, round
        and rank)."""
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.num_generations, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_tokens=r.max_completion_length, seed=mix_seed(self.cfg.seed, step, round_no, self.dist.rank),
        )  # fmt: skip
        return self.engine.generate(prompt_ids, params)

    def build_samples(self, groups: list[ScoredGroup]) -> list[Sample]:
        """Advantages (group-normalised) and loss masks (overlong filtering) of a batch."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        return build_samples(
            groups, step=self.step, advantage_scale=a.advantage_scale,
            overlong_filter=a.overlong_filter, keep_engine_logprobs=self.learner.compare_engine,
            exact_sampling_logprobs=r.top_p == 1.0 and r.top_k == 0,
        )  # fmt: skip

    def update(self, samples: list[Sample], step: int) -> dict[str, float]:
        """The learner's update on the batch; too many non-finite updates in a row save the
        last good state and stop the run."""
        n = self.learner.count_updates(len(samples), self.cfg.rollout.num_generations)
        self.engine_sync.before_update(n, generating=self.prefetcher.generating)
        try:
            return self.learner.update(samples, step, self.cfg.rollout.num_generations)
        except NonFiniteUpdates as exc:
            # With no update of this step applied, the weights are those of this step's
            # checkpoint, if there is one: keep it (it also holds the data position and
            # carry-over of the step boundary) rather than overwrite it.
            existing = step_dir(self.out / "checkpoints", self.step)
            path = existing if not exc.applied_any and existing.is_dir() else self.save()
            raise TrainingError(
                f"{exc}; stopped at rollout step {step}. The last good state is saved in {path}. "
                "Lower train.lr, check the reward values, or raise train.max_nonfinite_updates."
            ) from exc

    # --- evaluation, state, checkpoints -----------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy (avg@``rollout.eval_num_generations``) over all ranks."""
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.eval_num_generations, temperature=r.eval_temperature, top_p=r.eval_top_p, top_k=0,
            max_tokens=r.max_completion_length, seed=stream_seed(self.cfg.seed, Stream.EVALUATION),
        )  # fmt: skip
        records = D.shard(self.eval_records, self.dist)
        ids = D.shard(self.eval_ids, self.dist)
        # Gathered here, not only in generate: a rank without eval prompts never generates.
        with sharding.full_params(self.model):
            ev = engine_accuracy(self.engine, self.tokenizer, records, ids, self.scorer.rewards, params)
        correct, n = D.all_reduce_sum([ev["acc"] * ev["n"] if ev["n"] else 0.0, float(ev["n"])])
        return {**ev, "acc": correct / max(n, 1.0), "n": int(n)}

    def state_dict(self) -> dict[str, Any]:
        """The run's state besides weights and optimizer, as plain data."""
        return {
            "step": self.step,
            **self.prompts.state_dict(),  # "stream" and "history"
            "sampler": self.sampler.state_dict(),
            "summary": self.summary,
            "reward_failures": self.scorer.failures,
            "nonfinite_in_a_row": self.learner.nonfinite_in_a_row,
            "samples_generated": self.samples_generated,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.prompts.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.summary = dict(state["summary"])
        self.prefetcher.load_state_dict(state["prefetch"], self.step)
        self.scorer.failures = state["reward_failures"]
        self.learner.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.samples_generated = state["samples_generated"]
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])

    def save(self) -> Path:
        """Every rank saves: with FSDP each writes its shards, else rank 0 writes it all."""
        ahead = self.prefetcher.state_dict()  # every rank: the round generated ahead, gathered
        path = save_checkpoint(
            self.out / "checkpoints", self.step, self.model, self.learner.optimizer,
            {**self.state_dict(), "prefetch": ahead}, keep_last=self.cfg.checkpoint.keep_last,
        )  # fmt: skip
        D.barrier()
        return path

    def budget_spent(self) -> bool:
        """``train.sample_budget`` responses have been generated (0: no budget)."""
        budget = self.cfg.train.sample_budget
        return bool(budget) and self.samples_generated >= budget

    def close(self) -> None:
        """Stop the reward workers and release the engine (``run`` does this itself)."""
        self.scorer.close()
        self.prefetcher.close()  # a round still generating uses the engine
        close_engine(self.engine)

    # --- the whole run --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Resume or start, evaluate, train ``train.steps`` rollout steps, evaluate, save."""
        cfg = self.cfg
        start = time.time()
        try:
            resumed_from = self._resume_or_start()
        except BaseException:
            self.close()  # run() owns the reward workers and engine: release them on every exit
            raise
        logger = MetricsLogger(
            self.out, total_steps=cfg.train.steps, console=cfg.logging.console,
            tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project, wandb_run_name=cfg.logging.run_name,
            verbose=cfg.logging.verbose, config=cfg.to_dict(),
            resume_step=resumed_from,  # drop lines a crash left after it; None: a new run
            enabled=self.dist.is_main,  # only rank 0 writes logs
        )  # fmt: skip
        try:
            if self.eval_records and "accuracy_before" not in self.summary:
                ev = self.evaluate()
                self.summary["accuracy_before"] = ev["acc"]
                logger.message(f"held-out accuracy before training: {ev['acc']:.1%} ({ev['n']} samples)")
                logger.log(self.step, {"val/acc": ev["acc"]})
            while self.step < cfg.train.steps and not self.budget_spent():
                metrics, _ = self.train_step()
                every = cfg.logging.eval_every
                last = self.step >= cfg.train.steps or self.budget_spent()  # evaluated below
                if self.eval_records and every and self.step % every == 0 and not last:
                    metrics["val/acc"] = self.evaluate()["acc"]
                logger.log(self.step, metrics)
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
            if self.eval_records:
                ev = self.evaluate()
                self.summary["accuracy_after"] = ev["acc"]
                logger.log(self.step, {"val/acc": ev["acc"]})
            self._save_final()
        finally:
            logger.close()
            self.close()
        self._write_summary(start, resumed_from)
        D.barrier()
        return self.summary

    def _resume_or_start(self) -> int | None:
        """Load the newest checkpoint (``resume=true``) or refuse to overwrite one; write the
        config. The step resumed from, or None."""
        ckpt = latest_checkpoint(self.out / "checkpoints")
        resumed_from = None
        if self.cfg.resume and ckpt is None:
            self.log(f"resume=true but no checkpoint in {self.out / 'checkpoints'}; starting fresh")
        elif self.cfg.resume:
            changed = check_resume(read_trainer_state(ckpt).get("config"), self.cfg.to_dict(), ckpt)
            if changed:
                warnings.warn(changed, UserWarning, stacklevel=2)
            self.load_state_dict(load_checkpoint(ckpt, self.model, self.learner.optimizer))
            self.engine_sync.push(self.step)  # the resumed policy
            resumed_from = self.step
            self.log(f"resumed from {ckpt} (step {self.step})")
        elif ckpt is not None:
            raise TrainingError(
                f"{self.out} already holds checkpoints of an earlier run; continue it with "
                "resume=true, or choose another output_dir (nothing was overwritten)"
            )
        if resumed_from is None and self.cfg.rollout.engine == "vllm-server":
            self.engine_sync.push(self.step)  # the server started from its own copy
        if self.dist.is_main:
            write_text_atomic(self.out / "config.yaml", self.cfg.to_yaml())
        return resumed_from

    def _save_final(self) -> None:
        """A checkpoint of the last step (unless it exists) and the final model."""
        last = latest_checkpoint(self.out / "checkpoints")
        if last is None or last.name != step_dir(self.out / "checkpoints", self.step).name:
            self.save()
        if self.cfg.checkpoint.save_final_model:
            weights = self.learner.pretrained_weights()  # all ranks gather with FSDP
            if self.dist.is_main:
                final = self.out / "final_model"
                self.model.save_pretrained(final, state_dict=weights)
                self.tokenizer.save_pretrained(final)

    def _write_summary(self, start: float, resumed_from: int | None) -> None:
        trainable, total = self.learner.parameter_counts
        self.summary.update({
            "steps": self.step, "samples_generated": self.samples_generated,
            "wall_seconds": round(time.time() - start, 1), "preset": self.cfg.preset,
            "resumed_from_step": resumed_from, "trainable_parameters": trainable,
            "parameters": total,
        })  # fmt: skip
        if not self.dist.is_main:
            return
        write_text_atomic(self.out / "summary.json", json.dumps(self.summary, indent=2, default=str))
        try:
            plot_dashboard(self.out)
        except (ValueError, FileNotFoundError) as exc:
            self.log(f"dashboard not written: {exc}")


def _check_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise TrainingError(
            f"`output_dir` = {str(out)!r} is not writable ({exc.strerror}); choose another directory"
        ) from exc
