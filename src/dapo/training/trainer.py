"""The rollout-step loop: sample, score, filter, advantages, update, log, save.

The trainer is the one place that knows the order of the stages; each stage lives in a
module of its own (``dapo.rollout``, ``dapo.rewards``, ``dynamic_sampling``, ``batch``,
``forward`` and ``step``, ``dapo.metrics``, ``checkpoint``) and does not know the trainer.
Read :meth:`Trainer.train_step` and :meth:`Trainer.run` top to bottom.
"""

from __future__ import annotations

import contextlib
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
from dapo.errors import (
    DynamicSamplingWarning,
    TrainingError,
    VLLMEngineError,
    VLLMUnavailableError,
)
from dapo.evaluation.run import engine_accuracy
from dapo.metrics import MetricsLogger, plot_dashboard
from dapo.models import context_length, load_policy, load_tokenizer, lora, resolve_model_path
from dapo.models.precision import (
    bf16_rounding_warning,
    load_dtype,
    reference_copy,
    resolve_precision,
    set_precision,
)
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.models.data_parallel import wrap_data_parallel
from dapo.rewards import RewardScorer, soft_overlong_punishment
from dapo.rollout import Group, RolloutEngine, SamplingParams, close_engine, make_engine
from dapo.seeding import mix_seed, seed_everything
from dapo.training.batch import Sample, build_samples, group_metrics, mean
from dapo.training.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from dapo.training.corrections import attach_is_weights
from dapo.training.dynamic_sampling import DynamicSampler, ScoredGroup
from dapo.training.engine_sync import EngineSync
from dapo.training.forward import compute_logprobs, logprob_mismatch
from dapo.training.prefetch import RolloutPrefetcher
from dapo.training.prompt_selection import PromptSelector
from dapo.training.step import (
    loss_settings,
    lr_at,
    make_optimizer,
    optimizer_step,
    plan_updates,
)


class Trainer:
    """Trains ``cfg.model`` with the configured algorithm; ``run()`` does the whole job,
    ``train_step()`` one rollout step."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.dist = D.init_distributed()
        self.log = log if self.dist.is_main else (lambda _: None)  # only rank 0 speaks
        self.out = Path(cfg.output_dir)
        _check_output_dir(self.out)
        seed_everything(cfg.seed)

        # A separate engine (vLLM, the rollout server) holds its own copy of the weights:
        # they are pushed to it every `rollout.vllm_sync_every` optimizer updates, and its
        # sampling log-probs are compared with (and can correct, `algorithm.is_cap`) the
        # trainer's.
        self.separate_engine = cfg.rollout.engine != "hf"
        self.engine_logprobs = self.separate_engine or cfg.algorithm.is_cap is not None
        self._load_model()
        self._load_prompts()
        self.engine: RolloutEngine = self._make_engine()
        self.scorer = RewardScorer(
            [(f.name, f.weight) for f in cfg.reward.functions] or None,
            source_scorers=cfg.reward.source_scorers,
            default_scorer=cfg.reward.default_scorer,
            timeout_s=cfg.reward.timeout_s,
            num_workers=cfg.reward.num_workers,
        )
        self.optimizer = make_optimizer(self.model, cfg.train)
        self.sampler = DynamicSampler(
            cfg.train.prompts_per_step,
            enabled=cfg.algorithm.dynamic_sampling,
            metric=cfg.algorithm.dynamic_sampling_metric,
            max_rounds=cfg.algorithm.max_gen_rounds,
            round_cap=cfg.algorithm.round_cap,
            max_empty_steps=cfg.algorithm.max_empty_steps,
        )
        # The prompt stream, with algorithm.skip_uniform_prompts and data.curriculum.
        self.prompts = PromptSelector(cfg, self.train_records)
        self.loss_settings = loss_settings(cfg)
        self.step = 0
        self.summary: dict[str, Any] = {}
        self.reward_failures = 0
        self.nonfinite_in_a_row = 0
        self.samples_generated = 0  # every response generated, trained on or not
        self.engine_sync = EngineSync(
            self.engine, self._engine_weights, separate=self.separate_engine,
            sync_every=cfg.rollout.vllm_sync_every, sleep=cfg.rollout.vllm_sleep,
        )  # fmt: skip
        self.prefetcher = RolloutPrefetcher()  # rollout.async_steps=1: the next round, ahead
        # Below float32 the transformers engine's incremental decoding and the training
        # forward round differently: its log-probs are kept and compared too (no extra pass).
        self.keep_engine_logprobs = self.engine_logprobs or self.precision != "fp32"

    # --- set-up ---------------------------------------------------------------------------

    def _load_model(self) -> None:
        """The policy, its tokenizer, the reference model (beta > 0) and data parallelism."""
        cfg = self.cfg
        model_path = resolve_model_path(cfg.model.name_or_path, log=self.log)
        self.tokenizer = load_tokenizer(
            cfg.model.tokenizer or model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        self.precision = resolve_precision(cfg.train.precision, torch.cuda.is_available())
        auto = " (auto: CUDA)" if torch.cuda.is_available() else " (auto: no CUDA)"
        self.log(f"precision: {self.precision}{auto if cfg.train.precision == 'auto' else ''}")
        if self.precision == "bf16":
            self.log(bf16_rounding_warning(cfg.train.lr))
        self.model = load_policy(
            model_path,
            dtype=load_dtype(self.precision),
            trust_remote_code=cfg.model.trust_remote_code,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
        )
        set_precision(self.model, self.precision)
        self.peft = None  # the peft handle of a LoRA policy (model.lora.rank > 0)
        if cfg.model.lora.rank > 0:
            self.peft = lora.apply_lora(self.model, cfg.model.lora)
        self.parameter_counts = lora.parameter_counts(self.model)
        if self.peft is not None:
            trainable, total = self.parameter_counts
            self.log(f"LoRA: rank {cfg.model.lora.rank}, alpha {cfg.model.lora.alpha:g}, "
                     f"layers {', '.join(cfg.model.lora.target_modules)}: {trainable:,} of "
                     f"{total:,} parameters trained ({trainable / total:.2%})")
        self.model.train()
        if torch.cuda.is_available():  # one GPU per rank; the CPU path is the tested one
            self.model.to(f"cuda:{self.dist.local_rank}")
        self.ref_model = None
        if cfg.algorithm.beta > 0 and self.peft is None:  # beta = 0 (DAPO): no reference
            # A plain copy on every rank, taken before the policy is sharded. (With LoRA the
            # reference is the base model: the policy with its adapters disabled.)
            self.ref_model = reference_copy(self.model)
        self.ddp = None
        self.data_parallel = None
        if self.dist.enabled:
            self.data_parallel, self.ddp = wrap_data_parallel(
                self.model, self.dist, cfg.train.data_parallel, self.log
            )
        ctx = context_length(self.model)
        need = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
        if ctx is not None and need > ctx:
            raise TrainingError(
                f"data.max_prompt_length ({cfg.data.max_prompt_length}) + "
                f"rollout.max_completion_length ({cfg.rollout.max_completion_length}) = {need} "
                f"exceeds the model's context of {ctx} positions; lower one of them"
            )

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
        try:
            return make_engine(
                r.engine,
                self.model,
                self.tokenizer,
                batch_size=r.generation_batch_size,
                max_model_len=self.cfg.data.max_prompt_length + r.max_completion_length,
                seed=self.cfg.seed,
                gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                sleep=r.vllm_sleep,
                server_url=r.server_url,
                server_timeout_s=r.server_timeout_s,
                # A separate engine starts from base-model weights: LoRA's merged ones.
                state_dict=dict(self._engine_weights()) if self.peft is not None and r.engine == "vllm" else None,
            )
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
        rounds = 0
        staleness = []  # rollout steps between the policy that sampled a round and this one
        self.prompts.start_step(step)

        def produce(k: int) -> list[ScoredGroup]:
            nonlocal rounds
            ahead = self.prefetcher.take(step, k) if rounds == 0 else None
            t0 = time.perf_counter()
            if ahead is None:
                taken = self.prompts.next(k, skipped)
                idx = D.shard(taken, self.dist)  # this rank's share of the prompts
                groups = self.generate([self.train_ids[i] for i in idx], step, rounds)
                staleness.append(step - self.engine_sync.version)
                gen_step = step
            else:  # generated during the last step's update, by the policy before it
                taken, groups = ahead.indices, ahead.groups or []
                idx = D.shard(taken, self.dist)
                skipped.extend(ahead.skipped)
                staleness.append(step - ahead.version)
                gen_step = ahead.version  # its log-probs are the behaviour policy's
            t1 = time.perf_counter()
            scored = self.score(groups, [self.train_records[i] for i in idx], gen_step)
            timing["gen"] += t1 - t0
            timing["score"] += time.perf_counter() - t1
            rounds += 1
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
            "reward/failures": float(self.reward_failures),
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
            n=r.num_generations,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_completion_length,
            seed=mix_seed(self.cfg.seed, step, round_no, self.dist.rank),
        )
        return self.engine.generate(prompt_ids, params)

    def score(self, groups: list[Group], records: list[Any], step: int) -> list[ScoredGroup]:
        """Correctness, plus the soft overlong punishment, for every response of every group."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        texts = [g.decode(self.tokenizer) for g in groups]
        rewards, correct, result = self.scorer.score_groups(
            texts, [(rec.ground_truth, rec.data_source) for rec in records]
        )
        self.reward_failures += result.failures
        factor = a.overlong_penalty_factor if a.overlong_penalty else 0.0
        out = []
        for g, rec, rew, cor in zip(groups, records, rewards, correct, strict=True):
            penalty = [
                factor * soft_overlong_punishment(len(x), r.max_completion_length, a.overlong_buffer)
                for x in g.response_ids
            ]
            out.append(
                ScoredGroup(
                    prompt_ids=g.prompt_ids,
                    response_ids=g.response_ids,
                    sample_logprobs=g.logprobs,
                    truncated=g.truncated,
                    rewards=[x + p for x, p in zip(rew, penalty, strict=True)],
                    correct=cor,
                    penalty=penalty,
                    record=rec,
                    step=step,
                )
            )
        return out

    def build_samples(self, groups: list[ScoredGroup]) -> list[Sample]:
        """Advantages (group-normalised) and loss masks (overlong filtering) of a batch."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        return build_samples(
            groups,
            step=self.step,
            advantage_scale=a.advantage_scale,
            overlong_filter=a.overlong_filter,
            keep_engine_logprobs=self.keep_engine_logprobs,
            exact_sampling_logprobs=r.top_p == 1.0 and r.top_k == 0,
        )

    def update(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Mini-batches x epochs of exact-normalised optimizer updates on the batch."""
        lr = lr_at(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t = self.cfg.train
        plan = plan_updates(
            len(samples), self.cfg.rollout.num_generations, t.prompts_per_step,
            t.mini_batch_size, t.epochs, seed=mix_seed(self.cfg.seed, step, 99991),
        )  # fmt: skip
        self.engine_sync.before_update(len(plan), generating=self.prefetcher.generating)
        mine = sorted({i for _, idx in plan for i in self._my_share(samples, idx)})
        fresh = [samples[i] for i in mine if samples[i].old_logprobs is None]
        metrics = self._fill_logprobs(samples, mine, plan)
        metrics.update(attach_is_weights([samples[i] for i in mine], self.loss_settings))
        metrics.update(self._apply_updates(samples, plan, step))
        if self.keep_engine_logprobs and "rollout/logprob_mismatch" not in metrics:
            # One update per step: the training forward itself gave the old log-probs.
            metrics.update(logprob_mismatch(fresh))
        metrics["actor/lr"] = lr
        metrics["train/loss_tokens"] = float(sum(sum(s.loss_mask) for s in samples))
        return metrics

    def _engine_weights(self) -> Any:
        """``(name, tensor)`` of the whole policy for a separate rollout engine (every rank
        iterates them: with FSDP they are gathered; see ``full_named_parameters``), or for a
        LoRA policy the merged ``W + (alpha/r) B A`` under the base names (an engine loads
        base-model checkpoints; the policy is not changed)."""
        if self.peft is not None and self.separate_engine:
            return lora.merged_parameters(self.model, sharding.full_named_parameters(self.model))
        return sharding.full_named_parameters(self.model)

    def _fill_logprobs(
        self, samples: list[Sample], mine: list[int], plan: list[tuple[int, list[int]]]
    ) -> dict[str, float]:
        """Old (ratio) and reference (KL) log-probs of the samples this rank trains."""
        cfg, t = self.cfg, self.cfg.train
        forward = dict(
            pad_id=self.tokenizer.pad_token_id, temperature=cfg.rollout.temperature,
            token_budget=t.micro_batch_tokens, shared_prompt=t.shared_prompt_forward,
            logits_chunk_size=t.logits_chunk_size,
        )  # fmt: skip
        metrics: dict[str, float] = {}
        if len(plan) > 1 or self.engine_logprobs or cfg.algorithm.entropy_control != "none":
            # The ratio is taken against the policy that produced the batch: this one, now.
            # (With one update per rollout step it is the policy being trained: ratio 1;
            # Clip-Cov / KL-Cov select their tokens from these log-probs before the update.)
            todo = [i for i in mine if samples[i].old_logprobs is None]
            old = compute_logprobs(self.model, [samples[i] for i in todo], **forward)
            for i, lp in zip(todo, old, strict=True):
                samples[i].old_logprobs = lp
            if self.keep_engine_logprobs:  # compared with the engine's
                metrics.update(logprob_mismatch([samples[i] for i in todo]))
        if cfg.algorithm.beta > 0:
            # The reference policy: the initial model, or LoRA's base (adapters disabled).
            off = self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()
            with off:
                model = self.model if self.ref_model is None else self.ref_model
                ref = compute_logprobs(model, [samples[i] for i in mine], **forward)
            for i, lp in zip(mine, ref, strict=True):
                samples[i].ref_logprobs = lp
        return metrics

    def _apply_updates(
        self, samples: list[Sample], plan: list[tuple[int, list[int]]], step: int
    ) -> dict[str, float]:
        """Run the planned optimizer updates; skip non-finite ones, stop after too many."""
        t = self.cfg.train
        sums: dict[str, float] = {}
        weight = 0.0
        grad_norms, losses, pg_losses, bonuses = [], [], [], []
        selected: list[float] = []
        skipped = 0
        for n, (epoch, idx) in enumerate(plan):
            result = optimizer_step(
                self.model, self.optimizer, [samples[i] for i in idx], self.loss_settings,
                pad_id=self.tokenizer.pad_token_id, token_budget=t.micro_batch_tokens,
                max_grad_norm=t.max_grad_norm, logits_chunk_size=t.logits_chunk_size,
                with_entropy=epoch == 0, ddp=self.ddp, shared_prompt=t.shared_prompt_forward,
                seed=mix_seed(self.cfg.seed, step, n, 7919),
            )  # fmt: skip
            if not result.applied:  # skipped: the weights stay at the last good state
                skipped += 1
                self.nonfinite_in_a_row += 1
                if self.nonfinite_in_a_row >= t.max_nonfinite_updates:
                    self._stop_nonfinite(result, step, applied_any=bool(grad_norms))
                continue
            self.nonfinite_in_a_row = 0
            grad_norms.append(result.grad_norm)
            losses.append(result.stats.loss)
            pg_losses.append(result.stats.pg_loss)
            bonuses.append(result.stats.entropy_bonus)
            if "actor/cov_selected_frac" in result.selection:
                selected.append(result.selection["actor/cov_selected_frac"])
            for k, v in result.stats.sums.items():
                sums[k] = sums.get(k, 0.0) + v
            weight += result.stats.tokens
        metrics = {k: v / max(weight, 1.0) for k, v in sums.items()}
        if self.loss_settings.entropy_coef > 0:
            metrics["actor/entropy_bonus"] = mean(bonuses)
        if self.loss_settings.entropy_control != "none":
            metrics["actor/cov_selected_frac"] = mean(selected)
        metrics.update(
            {
                "actor/pg_loss": mean(pg_losses),
                "actor/loss": mean(losses),
                "actor/grad_norm": mean(grad_norms),
                "actor/updates": float(len(grad_norms)),
                "actor/skipped_updates": float(skipped),
            }
        )
        return metrics

    def _stop_nonfinite(self, result: Any, step: int, applied_any: bool) -> None:
        """Save the last good state and stop: too many non-finite updates in a row."""
        # With no update of this step applied, the weights are those of this step's
        # checkpoint, if there is one: keep it (it also holds the data position and
        # carry-over of the step boundary) rather than overwrite it.
        existing = step_dir(self.out / "checkpoints", self.step)
        path = existing if not applied_any and existing.is_dir() else self.save()
        raise TrainingError(
            f"{self.nonfinite_in_a_row} updates in a row had a non-finite loss "
            f"or gradient (loss {result.stats.loss}, gradient norm {result.grad_norm}); "
            f"stopped at rollout step {step}. The last good state is saved in "
            f"{path}. Lower train.lr, check the reward values, or raise "
            "train.max_nonfinite_updates."
        )

    def _my_share(self, samples: list[Sample], idx: list[int]) -> list[int]:
        """The indices of a mini-batch that this rank trains (all of them on one process)."""
        return [idx[j] for j in D.token_share([samples[i].length for i in idx], self.dist)]

    # --- evaluation, state, checkpoints -----------------------------------------------------

    def validate(self) -> dict[str, float]:
        """Held-out accuracy (avg@``rollout.eval_num_generations``) over all ranks."""
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.eval_num_generations,
            temperature=r.eval_temperature,
            top_p=r.eval_top_p,
            top_k=0,
            max_tokens=r.max_completion_length,
            seed=mix_seed(self.cfg.seed, 7, 7),
        )
        records = D.shard(self.eval_records, self.dist)
        ids = D.shard(self.eval_ids, self.dist)
        # Gathered here, not only in generate: a rank without eval prompts never generates.
        with sharding.full_params(self.model):
            ev = engine_accuracy(self.engine, self.tokenizer, records, ids, self.scorer, params)
        correct, n = D.all_reduce_sum([ev["acc"] * ev["n"] if ev["n"] else 0.0, float(ev["n"])])
        return {**ev, "acc": correct / max(n, 1.0), "n": int(n)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            **self.prompts.state_dict(),  # "stream" and "history"
            "sampler": self.sampler.state_dict(),
            "summary": self.summary,
            "reward_failures": self.reward_failures,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "samples_generated": self.samples_generated,
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.prompts.load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self.summary = dict(state["summary"])
        self.prefetcher.load_state_dict(state.get("prefetch"), self.step)
        self.reward_failures = state["reward_failures"]
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self.samples_generated = state.get("samples_generated", 0)
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])

    def save(self) -> Path:
        """Every rank saves: with FSDP each writes its shards, else rank 0 writes it all."""
        ahead = self.prefetcher.state_dict()  # every rank: the round generated ahead, gathered
        path = save_checkpoint(
            self.out / "checkpoints", self.step, self.model, self.optimizer,
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
            self.out,
            total_steps=cfg.train.steps,
            console=cfg.logging.console,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            wandb_run_name=cfg.logging.run_name,
            config=cfg.to_dict(),
            resume_step=resumed_from or 0,  # drop lines a crashed run wrote after it
            enabled=self.dist.is_main,  # only rank 0 writes logs
        )
        try:
            if self.eval_records and "accuracy_before" not in self.summary:
                ev = self.validate()
                self.summary["accuracy_before"] = ev["acc"]
                logger.message(f"held-out accuracy before training: {ev['acc']:.1%} ({ev['n']} samples)")
            while self.step < cfg.train.steps and not self.budget_spent():
                metrics, _ = self.train_step()
                every = cfg.logging.eval_every
                last = self.step >= cfg.train.steps or self.budget_spent()  # evaluated below
                if self.eval_records and every and self.step % every == 0 and not last:
                    metrics["val/acc"] = self.validate()["acc"]
                logger.log(self.step, metrics)
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
            if self.eval_records:
                ev = self.validate()
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
        if self.cfg.resume:
            if ckpt is None:
                self.log(f"resume=true but no checkpoint in {self.out / 'checkpoints'}; starting fresh")
            else:
                self.load_state_dict(load_checkpoint(ckpt, self.model, self.optimizer))
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
            weights = sharding.pretrained_state(self.model)  # all ranks gather with FSDP
            if self.peft is not None:  # a plain transformers model: the merged weights
                state = self.model.state_dict() if weights is None else weights
                weights = lora.merge_state(state, lora.scalings(self.model))
            if self.dist.is_main:
                final = self.out / "final_model"
                self.model.save_pretrained(final, state_dict=weights)
                self.tokenizer.save_pretrained(final)

    def _write_summary(self, start: float, resumed_from: int | None) -> None:
        self.summary.update(
            {
                "steps": self.step,
                "samples_generated": self.samples_generated,
                "wall_seconds": round(time.time() - start, 1),
                "preset": self.cfg.preset,
                "resumed_from_step": resumed_from,
                "trainable_parameters": self.parameter_counts[0],
                "parameters": self.parameter_counts[1],
            }
        )
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

