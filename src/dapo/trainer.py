"""The rollout-step loop: sample, score, filter, compute advantages, update, log, save.

The trainer is the one place that knows the order of the stages; each stage is a module of
its own (rollout, rewards, sampling, algorithms, update, metrics, checkpoint).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo import algorithms as alg
from dapo import distributed as D
from dapo import sharding
from dapo.builtin import BUILTIN_DATA, addition_records
from dapo.checkpoint import full_state, latest_checkpoint, load_checkpoint, save_checkpoint
from dapo.config import Config
from dapo.data import PromptRecord, encode_prompts, load_records
from dapo.evaluation import evaluate
from dapo.metrics import MetricsLogger, plot_dashboard
from dapo.models import context_length, load_policy, load_tokenizer, resolve_model_path
from dapo.rewards import RewardScorer, ScoreRequest, soft_overlong_punishment
from dapo.rollout import HFEngine, RolloutEngine, SamplingParams
from dapo.sampling import DynamicSampler, ScoredGroup
from dapo.update import LossSettings, Sample, compute_logprobs, optimizer_step


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what to change."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def load_prompt_set(cfg: Config, which: str) -> list[PromptRecord]:
    """The training (``which="train"``) or held-out (``"eval"``) prompts of the config."""
    d = cfg.data
    source = d.train if which == "train" else d.eval
    split = d.train_split if which == "train" else d.eval_split
    if source is None:
        return []
    if source == BUILTIN_DATA:
        n = 20000 if which == "train" else d.max_eval_prompts
        return addition_records("train" if which == "train" else "test", n=n)
    records, _ = load_records(
        source,
        split=split,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        data_source_key=d.data_source_key,
        dedupe=True,
    )
    return records[: d.max_eval_prompts] if which == "eval" else records


class PromptStream:
    """Endless, seeded, reshuffled-per-epoch stream over the training prompts."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._make_order()


@dataclass
class StepOutput:
    metrics: dict[str, float]
    groups: list[ScoredGroup]


class Trainer:
    """Trains ``cfg.model`` with the configured algorithm; ``run()`` does the whole job."""

    def __init__(self, cfg: Config, log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.dist = D.init_distributed()
        if cfg.rollout.engine != "hf" and self.dist.world_size > 1:
            raise TrainingError(
                f"`rollout.engine` = {cfg.rollout.engine!r} runs in one process only; "
                f"this run has {self.dist.world_size} ranks: use rollout.engine=hf with torchrun"
            )
        self.log = log if self.dist.is_main else (lambda _: None)
        self.out = Path(cfg.output_dir)
        _check_output_dir(self.out)
        seed_everything(cfg.seed)

        model_path = resolve_model_path(cfg.model.name_or_path, log=log)
        self.tokenizer = load_tokenizer(
            cfg.model.tokenizer or model_path, trust_remote_code=cfg.model.trust_remote_code
        )
        self.model = load_policy(
            model_path,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
        )
        self.model.train()
        if torch.cuda.is_available():  # one GPU per rank; the CPU path is the tested one
            self.model.to(f"cuda:{self.dist.local_rank}")
        self.ref_model = None
        if cfg.algorithm.beta > 0:  # beta = 0 (DAPO) needs no reference model at all
            # A plain copy on every rank, taken before the policy is sharded.
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.ddp = None
        self.data_parallel = None
        if self.dist.enabled:
            self.data_parallel = self._wrap_data_parallel(cfg.train.data_parallel)

        ctx = context_length(self.model)
        need = cfg.data.max_prompt_length + cfg.rollout.max_completion_length
        if ctx is not None and need > ctx:
            raise TrainingError(
                f"data.max_prompt_length ({cfg.data.max_prompt_length}) + "
                f"rollout.max_completion_length ({cfg.rollout.max_completion_length}) = {need} "
                f"exceeds the model's context of {ctx} positions; lower one of them"
            )

        train = load_prompt_set(cfg, "train")
        self.train_records, self.train_ids, dropped = encode_prompts(
            train, self.tokenizer, cfg.data.max_prompt_length
        )
        if dropped:
            log(f"dropped {dropped} training prompts longer than data.max_prompt_length")
        self.eval_records, self.eval_ids = [], []
        if cfg.evaluate and cfg.data.eval is not None:
            self.eval_records, self.eval_ids, _ = encode_prompts(
                load_prompt_set(cfg, "eval"), self.tokenizer, cfg.data.max_prompt_length
            )

        self.engine: RolloutEngine = make_engine(cfg, self.model, self.tokenizer)
        self.scorer = RewardScorer(
            [(f.name, f.weight) for f in cfg.reward.functions] or None,
            source_scorers=cfg.reward.source_scorers,
            default_scorer=cfg.reward.default_scorer,
            timeout_s=cfg.reward.timeout_s,
            num_workers=cfg.reward.num_workers,
        )
        t = cfg.train
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
        )
        self.sampler = DynamicSampler(
            t.prompts_per_step,
            enabled=cfg.algorithm.dynamic_sampling,
            metric=cfg.algorithm.dynamic_sampling_metric,
            max_rounds=cfg.algorithm.max_gen_rounds,
        )
        self.stream = PromptStream(len(self.train_records), cfg.seed, cfg.data.shuffle)
        self.loss_settings = LossSettings(
            clip_low=cfg.algorithm.clip_low,
            clip_high=cfg.algorithm.clip_high,
            clip_c=cfg.algorithm.clip_c,
            loss_agg=cfg.algorithm.loss_agg,
            beta=cfg.algorithm.beta,
            kl_estimator=cfg.algorithm.kl_estimator,
            temperature=cfg.rollout.temperature,
            max_len=cfg.rollout.max_completion_length,
            tis_cap=cfg.algorithm.tis_cap,
        )
        self.step = 0
        self.summary: dict[str, Any] = {}
        self.reward_failures = 0
        self.nonfinite_in_a_row = 0
        self.samples_generated = 0  # every response generated, trained on or not
        # A separate engine (vLLM) holds its own copy of the weights: they are pushed to it
        # every `rollout.vllm_sync_every` optimizer updates, and its sampling log-probs are
        # compared with (and can correct, `algorithm.tis_cap`) the trainer's.
        self.separate_engine = cfg.rollout.engine != "hf"
        self.engine_logprobs = self.separate_engine or cfg.algorithm.tis_cap is not None
        self.updates_since_sync = 0

    def _wrap_data_parallel(self, requested: str) -> str:
        """Shard the policy with FSDP2 or replicate it with DDP; the one chosen.

        Runs before the optimizer is created: with FSDP it must hold the sharded parameters.
        """
        where = f"{self.dist.world_size} ranks, {self.dist.backend}"
        if requested == "auto" and not torch.cuda.is_available():
            # FSDP2 works on CPU (train.data_parallel=fsdp), but its per-layer collectives
            # made a step ~1.4x slower than DDP here: sharding pays off on accelerators.
            requested = "ddp"
        why_not = None if requested == "ddp" else sharding.fsdp_support(self.dist)
        if requested != "ddp" and why_not is None:
            sharding.shard_model(self.model, self.dist)
            self.log(f"data parallel: fsdp (FSDP2 fully_shard, parameters sharded; {where})")
            return "fsdp"
        if requested == "fsdp":
            raise TrainingError(
                f"`train.data_parallel` = 'fsdp', but FSDP2 sharding does not work on this "
                f"platform: {why_not}. Use train.data_parallel=ddp (or auto)"
            )
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(self.model)
        because = f"; fsdp does not work here: {why_not}" if why_not else ""
        if self.cfg.train.data_parallel == "auto" and not torch.cuda.is_available():
            because = "; auto uses fsdp on GPUs only, set train.data_parallel=fsdp to shard"
        self.log(f"data parallel: ddp (parameters replicated; {where}{because})")
        return "ddp"

    # --- one rollout step -------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Linear warm-up over rollout steps, then constant or cosine."""
        t = self.cfg.train
        warm = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
        if t.lr_schedule == "cosine" and t.steps > t.warmup_steps:
            progress = min(1.0, max(0.0, (step - t.warmup_steps) / (t.steps - t.warmup_steps)))
            floor = t.min_lr_ratio
            return t.lr * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        return t.lr * warm

    def score_groups(self, groups: list[Any], records: list[PromptRecord], step: int) -> list[ScoredGroup]:
        """Correctness (+ soft overlong punishment) for every response of every group."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        requests = [
            ScoreRequest(
                response=self.tokenizer.decode(resp, skip_special_tokens=True),
                ground_truth=rec.ground_truth,
                data_source=rec.data_source,
            )
            for g, rec in zip(groups, records, strict=True)
            for resp in g.response_ids
        ]
        result = self.scorer.score(requests)
        self.reward_failures += result.failures
        out, k = [], 0
        for g, rec in zip(groups, records, strict=True):
            n = len(g.response_ids)
            rewards = list(result.rewards[k : k + n])
            correct = list(result.correct[k : k + n])
            k += n
            if a.overlong_penalty:
                for i, resp in enumerate(g.response_ids):
                    rewards[i] += a.overlong_penalty_factor * soft_overlong_punishment(
                        len(resp), r.max_completion_length, a.overlong_buffer
                    )
            out.append(
                ScoredGroup(
                    prompt_ids=g.prompt_ids,
                    response_ids=g.response_ids,
                    sample_logprobs=g.logprobs,
                    truncated=g.truncated,
                    rewards=rewards,
                    correct=correct,
                    record=rec,
                    step=step,
                )
            )
        return out

    def rollout(self, step: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Fill the training batch (dynamic sampling); metrics of everything generated."""
        r = self.cfg.rollout
        generated: list[ScoredGroup] = []
        timing = {"gen": 0.0, "score": 0.0, "tokens": 0}
        round_no = [0]

        def produce(k: int) -> list[ScoredGroup]:
            idx = self.stream.take(k)
            params = SamplingParams(
                n=r.num_generations,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_tokens=r.max_completion_length,
                seed=_mix(self.cfg.seed, step, round_no[0], self.dist.rank),
            )
            round_no[0] += 1
            mine = D.shard(idx, self.dist)  # each rank generates its share of the prompts
            t0 = time.perf_counter()
            groups = self.engine.generate([self.train_ids[i] for i in mine], params)
            t1 = time.perf_counter()
            scored = self.score_groups(groups, [self.train_records[i] for i in mine], step)
            timing["gen"] += t1 - t0
            timing["score"] += time.perf_counter() - t1
            # Every rank sees every group, in prompt order, so that dynamic-sampling
            # decisions are the same on all ranks.
            scored = _unshard(D.all_gather_objects(scored))
            timing["tokens"] += sum(len(x) for g in scored for x in g.response_ids)
            generated.extend(scored)
            return scored

        batch, fill = self.sampler.fill(produce)
        self.samples_generated += sum(g.size for g in generated)
        rewards = [x for g in generated for x in g.rewards]
        correct = [x for g in generated for x in g.correct]
        lengths = [len(x) for g in generated for x in g.response_ids]
        truncated = [x for g in generated for x in g.truncated]
        penalty = [
            soft_overlong_punishment(n, r.max_completion_length, self.cfg.algorithm.overlong_buffer)
            for n in lengths
        ]
        m = {
            "reward/mean": _mean(rewards),
            "reward/std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "reward/acc": _mean([float(c) for c in correct]),
            "reward/overlong_penalty_mean": _mean(penalty),
            "reward/failures": float(self.reward_failures),
            "response_length/mean": _mean([float(n) for n in lengths]),
            "response_length/max": float(max(lengths)) if lengths else 0.0,
            "response_length/clip_ratio": _mean([float(t) for t in truncated]),
            "perf/gen_s": timing["gen"],
            "perf/score_s": timing["score"],
            "perf/rollout_tokens_per_s": timing["tokens"] / max(timing["gen"], 1e-9),
            "sampling/generated_samples_total": float(self.samples_generated),
            **fill.as_metrics(),
        }
        return batch, m

    def build_samples(self, groups: list[ScoredGroup]) -> list[Sample]:
        """Advantages (group-normalised) and loss masks (overlong filtering)."""
        a = self.cfg.algorithm
        g_size = groups[0].size
        if any(g.size != g_size for g in groups):
            raise TrainingError("all groups of a batch must have the same number of responses")
        rewards = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float64)
        adv = alg.group_advantages(rewards, g_size, a.advantage_scale).tolist()
        r = self.cfg.rollout
        exact_sampling_logprobs = r.top_p == 1.0 and r.top_k == 0
        samples, k = [], 0
        for g in groups:
            for resp, trunc, lp in zip(g.response_ids, g.truncated, g.sample_logprobs, strict=True):
                keep = 0.0 if (a.overlong_filter and trunc) else 1.0
                s = Sample(g.prompt_ids, resp, adv[k], [keep] * len(resp))
                if self.engine_logprobs:
                    s.sampling_logprobs = torch.tensor(lp)
                if g.step < self.step and exact_sampling_logprobs:
                    # Carried over from an earlier step: the ratio is taken against the
                    # policy that generated it, whose log-probs the engine recorded.
                    s.old_logprobs = torch.tensor(lp)
                samples.append(s)
                k += 1
        return samples

    def update(self, groups: list[ScoredGroup], step: int) -> dict[str, float]:
        """Mini-batches x epochs of exact-normalised gradient updates on the batch."""
        cfg, t = self.cfg, self.cfg.train
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        samples = self.build_samples(groups)
        g_size = groups[0].size
        n_mini = cfg.train.prompts_per_step // t.mini_batch_size
        pad = self.tokenizer.pad_token_id
        gen = torch.Generator().manual_seed(_mix(cfg.seed, step, 99991))
        plan = []  # (epoch, sample indices of the mini-batch) for every optimizer step
        for epoch in range(t.epochs):
            order = torch.randperm(len(groups), generator=gen).tolist()
            for m in range(n_mini):
                gids = order[m * t.mini_batch_size : (m + 1) * t.mini_batch_size]
                plan.append((epoch, [g * g_size + j for g in gids for j in range(g_size)]))
        # A separate engine sleeps while the trainer trains (level 2, its weights dropped,
        # when they are replaced right after; no-op where sleeping is not supported).
        sync = False
        if self.separate_engine:
            self.updates_since_sync += len(plan)
            sync = self.updates_since_sync >= cfg.rollout.vllm_sync_every
            engine_sleep = getattr(self.engine, "sleep", None)
            if engine_sleep is not None and cfg.rollout.vllm_sleep:
                engine_sleep(level=2 if sync else 1)
        # Log-probs are needed only for the samples this rank will train.
        mine = sorted({i for _, idx in plan for i in self._my_share(samples, idx)})
        mismatch: dict[str, float] = {}
        if not (n_mini == 1 and t.epochs == 1) or self.engine_logprobs:
            # The ratio is taken against the policy that produced the batch: this one, now.
            # (With one update per rollout step it is the policy being trained: ratio 1.)
            # With a separate engine they are also compared with the engine's log-probs.
            todo = [i for i in mine if samples[i].old_logprobs is None]
            old = compute_logprobs(
                self.model, [samples[i] for i in todo], pad_id=pad,
                temperature=cfg.rollout.temperature, token_budget=t.micro_batch_tokens,
                shared_prompt=t.shared_prompt_forward,
            )
            for i, lp in zip(todo, old, strict=True):
                samples[i].old_logprobs = lp
            if self.engine_logprobs:
                mismatch = _logprob_mismatch([samples[i] for i in todo])
        if self.ref_model is not None:
            ref = compute_logprobs(
                self.ref_model, [samples[i] for i in mine], pad_id=pad,
                temperature=cfg.rollout.temperature, token_budget=t.micro_batch_tokens,
                shared_prompt=t.shared_prompt_forward,
            )
            for i, lp in zip(mine, ref, strict=True):
                samples[i].ref_logprobs = lp

        agg: dict[str, float] = {}
        weight = 0.0
        grad_norms, losses, pg_losses = [], [], []
        skipped = 0
        for epoch, idx in plan:
            result = optimizer_step(
                self.model, self.optimizer, [samples[i] for i in idx], self.loss_settings,
                pad_id=pad, token_budget=t.micro_batch_tokens, max_grad_norm=t.max_grad_norm,
                entropy_chunk_size=t.entropy_chunk_size, with_entropy=epoch == 0, ddp=self.ddp,
                shared_prompt=t.shared_prompt_forward,
            )
            stats = result.stats
            if not result.applied:
                # Skipped: the weights stay at the last good state.
                skipped += 1
                self.nonfinite_in_a_row += 1
                if self.nonfinite_in_a_row >= t.max_nonfinite_updates:
                    # With no update of this step applied, the weights are those of this
                    # step's checkpoint, if there is one: keep it (it also holds the data
                    # position and carry-over of the step boundary) rather than overwrite it.
                    existing = self.out / "checkpoints" / f"step_{self.step:06d}"
                    path = existing if not grad_norms and existing.is_dir() else self.save()
                    raise TrainingError(
                        f"{self.nonfinite_in_a_row} updates in a row had a non-finite loss "
                        f"or gradient (loss {stats.loss}, gradient norm {result.grad_norm}); "
                        f"stopped at rollout step {step}. The last good state is saved in "
                        f"{path}. Lower train.lr, check the reward values, or raise "
                        "train.max_nonfinite_updates."
                    )
                continue
            self.nonfinite_in_a_row = 0
            grad_norms.append(result.grad_norm)
            losses.append(stats.loss)
            pg_losses.append(stats.pg_loss)
            for k, v in stats.sums.items():
                agg[k] = agg.get(k, 0.0) + v
            weight += stats.tokens
        out = {k: v / max(weight, 1.0) for k, v in agg.items()}
        out.update(
            {
                "actor/pg_loss": _mean(pg_losses),
                "actor/loss": _mean(losses),
                "actor/grad_norm": _mean(grad_norms),
                "actor/lr": lr,
                "actor/updates": float(len(grad_norms)),
                "actor/skipped_updates": float(skipped),
                "train/loss_tokens": float(sum(sum(s.loss_mask) for s in samples)),
                "train/stale_groups": float(sum(g.step < step for g in groups)),
                **mismatch,
            }
        )
        if sync:  # the engine samples the next batch with the weights just trained
            t0 = time.perf_counter()
            self.engine.load_weights(self.model.named_parameters())
            self.updates_since_sync = 0
            out["perf/weight_sync_s"] = time.perf_counter() - t0
        return out

    def _my_share(self, samples: list[Sample], idx: list[int]) -> list[int]:
        """The indices of a mini-batch that this rank trains (all of them on one process)."""
        if not self.dist.enabled:
            return idx
        parts = D.balance_by_tokens([samples[i].length for i in idx], self.dist.world_size)
        return [idx[j] for j in parts[self.dist.rank]]

    # --- the whole run --------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        r = self.cfg.rollout
        params = SamplingParams(
            n=r.eval_num_generations,
            temperature=r.eval_temperature,
            top_p=r.eval_top_p,
            top_k=0,
            max_tokens=r.max_completion_length,
            seed=_mix(self.cfg.seed, 7, 7),
        )
        records = D.shard(self.eval_records, self.dist)
        ids = D.shard(self.eval_ids, self.dist)
        # Gathered here, not only in generate: a rank without eval prompts never generates.
        with sharding.full_params(self.model):
            ev = evaluate(self.engine, self.tokenizer, records, ids, self.scorer, params)
        correct, n = D.all_reduce_sum([ev["acc"] * ev["n"] if ev["n"] else 0.0, float(ev["n"])])
        return {**ev, "acc": correct / max(n, 1.0), "n": int(n)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stream": self.stream.state_dict(),
            "sampler": self.sampler.state_dict(),
            "summary": self.summary,
            "reward_failures": self.reward_failures,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "samples_generated": self.samples_generated,
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
            },
            "config": self.cfg.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.stream.load_state_dict(state["stream"])
        self.sampler.load_state_dict(state["sampler"])
        self.summary = dict(state["summary"])
        self.reward_failures = state["reward_failures"]
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self.samples_generated = state.get("samples_generated", 0)
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])

    def budget_spent(self) -> bool:
        """``train.sample_budget`` responses have been generated (0: no budget)."""
        budget = self.cfg.train.sample_budget
        return bool(budget) and self.samples_generated >= budget

    def close(self) -> None:
        """Stop the reward workers and release the engine (``run`` does this itself)."""
        self.scorer.close()
        _close_engine(self.engine)

    def save(self) -> Path:
        """Rank 0 writes the checkpoint; the others wait for it (with FSDP, after gathering
        the full weights and optimizer state for it)."""
        root = self.out / "checkpoints"
        path = root / f"step_{self.step:06d}"
        full = full_state(self.model, self.optimizer)
        if self.dist.is_main:
            path = save_checkpoint(
                root, self.step, self.model, self.optimizer, self.state_dict(),
                keep_last=self.cfg.checkpoint.keep_last, full=full,
            )
        D.barrier()
        return path

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        start = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        resumed_from = None
        if cfg.resume:
            ckpt = latest_checkpoint(self.out / "checkpoints")
            if ckpt is None:
                self.log(f"resume=true but no checkpoint in {self.out / 'checkpoints'}; starting fresh")
            else:
                self.load_state_dict(load_checkpoint(ckpt, self.model, self.optimizer))
                self.engine.load_weights(self.model.named_parameters())  # the resumed policy
                resumed_from = self.step
                self.log(f"resumed from {ckpt} (step {self.step})")
        elif latest_checkpoint(self.out / "checkpoints") is not None:
            self.scorer.close()  # run() owns the reward workers: stop them on every exit
            _close_engine(self.engine)
            raise TrainingError(
                f"{self.out} already holds checkpoints of an earlier run; continue it with "
                "resume=true, or choose another output_dir (nothing was overwritten)"
            )
        main = self.dist.is_main
        if main:
            _write_text_atomic(self.out / "config.yaml", cfg.to_yaml())

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
            enabled=main,  # only rank 0 writes logs
        )
        try:
            if self.eval_records and "accuracy_before" not in self.summary:
                ev = self.evaluate()
                self.summary["accuracy_before"] = ev["acc"]
                logger.message(f"held-out accuracy before training: {ev['acc']:.1%} ({ev['n']} samples)")
            while self.step < cfg.train.steps and not self.budget_spent():
                t0 = time.perf_counter()
                batch, metrics = self.rollout(self.step)
                t1 = time.perf_counter()
                metrics.update(self.update(batch, self.step))
                t2 = time.perf_counter()
                tokens = sum(len(g.prompt_ids) * g.size + sum(map(len, g.response_ids)) for g in batch)
                metrics["perf/train_s"] = t2 - t1
                metrics["perf/train_tokens_per_s"] = tokens / max(t2 - t1, 1e-9)
                metrics["perf/step_s"] = t2 - t0
                self.step += 1
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
            last = latest_checkpoint(self.out / "checkpoints")
            if last is None or last.name != f"step_{self.step:06d}":
                self.save()
            if cfg.checkpoint.save_final_model:
                weights = sharding.pretrained_state(self.model)  # all ranks gather with FSDP
                if main:
                    final = self.out / "final_model"
                    self.model.save_pretrained(final, state_dict=weights)
                    self.tokenizer.save_pretrained(final)
        finally:
            logger.close()
            self.scorer.close()
            _close_engine(self.engine)
        self.summary.update(
            {
                "steps": self.step,
                "samples_generated": self.samples_generated,
                "wall_seconds": round(time.time() - start, 1),
                "preset": cfg.preset,
                "resumed_from_step": resumed_from,
            }
        )
        if main:
            _write_text_atomic(self.out / "summary.json", json.dumps(self.summary, indent=2, default=str))
            try:
                plot_dashboard(self.out)
            except (ValueError, FileNotFoundError) as exc:
                self.log(f"dashboard not written: {exc}")
        D.barrier()
        return self.summary


def make_engine(cfg: Config, model: torch.nn.Module, tokenizer: Any) -> RolloutEngine:
    r = cfg.rollout
    if r.engine == "hf":
        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.generation_batch_size)
    if r.engine == "vllm":
        from dapo.vllm_engine import VLLMEngine, VLLMEngineError, VLLMUnavailableError

        try:
            return VLLMEngine(
                model,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                max_model_len=cfg.data.max_prompt_length + r.max_completion_length,
                max_num_seqs=r.generation_batch_size,
                gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                enable_sleep_mode=None if r.vllm_sleep else False,  # None: on a GPU only
                seed=cfg.seed,
            )
        except (VLLMUnavailableError, VLLMEngineError) as exc:
            raise TrainingError(str(exc)) from exc
    raise TrainingError(
        f"`rollout.engine` = {r.engine!r} is not available in this version; use `hf` or `vllm`"
    )


def _close_engine(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _logprob_mismatch(samples: list[Sample]) -> dict[str, float]:
    """Mean |engine log-prob - trainer log-prob| over the response tokens (all ranks)."""
    total, count = 0.0, 0
    for s in samples:
        if s.sampling_logprobs is None or s.old_logprobs is None:
            continue
        total += float((s.sampling_logprobs.to(s.old_logprobs) - s.old_logprobs).abs().sum())
        count += len(s.response_ids)
    total, n = D.all_reduce_sum([total, float(count)])
    return {"rollout/logprob_mismatch": total / n} if n else {}


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


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _mix(*parts: int) -> int:
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFF)) * 1099511628211) % 2**61
    return h


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _unshard(parts: list[list[Any]]) -> list[Any]:
    """Undo :func:`dapo.distributed.shard`: rank r held items r, r + W, r + 2W, ..."""
    out: list[Any] = []
    for i in range(max((len(p) for p in parts), default=0)):
        out.extend(p[i] for p in parts if i < len(p))
    return out
