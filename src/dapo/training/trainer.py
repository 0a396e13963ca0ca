"""The rollout-step loop: sample, score, filter, advantages, update, log, save.

The trainer knows the order of the stages and nothing of their insides. It composes objects
that own their state: the rollout engine (``dapo.rollout``), the group scorer
(:mod:`scoring`), the dynamic sampler (:mod:`dynamic_sampling`), the prompt selector, the
learner (:mod:`learner`: the policy, its optimizer and the update) and the engine sync.
Read :meth:`Trainer.train_step` and :meth:`Trainer.run` top to bottom.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.atomic import write_text_atomic
from dapo.config import Config
from dapo.config.describe import run_plan
from dapo.environments import parse_hermes
from dapo.errors import HealthError, TrainingError
from dapo.handover import ScoredGroup
from dapo.health import HealthMonitor
from dapo.models.precision import precision_of
from dapo.parallel import distributed as D
from dapo.parallel import sharding
from dapo.process_exit import take_interrupt
from dapo.producer.rollouts import Rollouts
from dapo.producer.stream import make_stream, staleness_metrics
from dapo.run_inputs import RunInputs
from dapo.seeding import seed_everything
from dapo.training.batch import Sample, build_samples, group_sizes
from dapo.training.checkpoint import (
    checkpoint_to_resume,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from dapo.training.export import export_final_model
from dapo.training.inputs import Callbacks
from dapo.training.learner import Learner, NonFiniteUpdates
from dapo.training.loading import load_spec_and_tokenizer
from dapo.training.preemption import StopNow, StopSignals, interrupt
from dapo.training.record import RunRecord, check_output_dir, summarise
from dapo.training.resume import check_before_loading, continue_state
from dapo.training.run_lock import lock_run_dir
from dapo.training.teacher import load_teacher


class Trainer:
    """Trains ``cfg.model`` with the configured algorithm; ``run()`` does the whole job,
    ``train_step()`` one rollout step."""

    def __init__(
        self, cfg: Config, log: Callable[[str], None] = print, *, inputs: RunInputs | None = None
    ) -> None:
        self.dist = D.init_distributed()
        self.log = log if self.dist.is_main else (lambda _: None)  # only rank 0 speaks
        self.cfg, self.out, inputs = cfg, Path(cfg.output_dir), inputs or RunInputs()
        check_output_dir(self.out)
        self.lock = lock_run_dir(self.out, self.dist.is_main, self.log)  # one writer per run
        try:
            self._build(cfg, inputs)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise

    def _build(self, cfg: Config, inputs: RunInputs) -> None:
        # resume: the newest checkpoint whose files match its manifest (the same on all ranks),
        # and what it cannot continue refused, before anything heavy loads
        self.resume_from = checkpoint_to_resume(self.out / "checkpoints") if cfg.resume else None
        if self.resume_from is not None:  # resume.py: refused keys, nothing left to train
            check_before_loading(cfg, self.resume_from, self.dist.world_size, self.log)
        seed_everything(cfg.seed)
        self.log(run_plan(cfg))  # the updates per step and the overlong window, said once
        # The episode spec and the tokenizer, checked against each other before any weights.
        self.spec, self.tokenizer, model_path, self.processor = load_spec_and_tokenizer(
            cfg, inputs, self.log
        )
        # The prompts and the reward scorer first: a bad data file or reward spec is refused
        # before any weights load. The teacher is checked against the tokenizer before the policy.
        self.rollouts = Rollouts(cfg, self.tokenizer, inputs, self.log, self.spec, self.processor)
        try:
            teacher = load_teacher(cfg, self.tokenizer, self.log)
            self.learner = Learner.from_config(
                cfg, model_path, self.tokenizer.pad_token_id, self.log, model=inputs.model
            )
            self.learner.use_teacher(teacher)
            # A separate engine's sampling log-probs are compared with (and can correct,
            # `algorithm.is_cap`) the trainer's, as are the transformers engine's below float32
            # (its incremental decoding rounds differently).
            separate = cfg.rollout.engine != "hf"
            self.learner.needs_old_logprobs |= separate
            self.learner.compare_engine = (
                separate or cfg.algorithm.is_cap is not None or precision_of(self.model) != "fp32"
            )
            self.rollouts.connect(self.learner)
        except BaseException:
            self.rollouts.close()  # its reward and environment workers
            raise
        # rollout.max_staleness >= 1: a producer thread fills the coming batches meanwhile.
        self.stream = make_stream(cfg, self.rollouts, self.log)
        self.callbacks = list(inputs.callbacks)
        self.health = HealthMonitor(cfg, warn=self.dist.is_main)  # when it cannot learn
        self.left_out: list[tuple[ScoredGroup, str]] = []  # the last step's, for transcripts
        self.step = 0
        self.saved_step: int | None = None  # the step whose checkpoint holds this state
        self.summary: dict[str, Any] = {}
        self.signals = StopSignals(cfg, self.out / "checkpoints")  # SIGTERM, Ctrl-C
        self.unsaved: dict[str, Any] | None = None  # the state a step began with, if not saved
        self.advantages: list[list[float]] = []  # the last step's, per group (transcripts)

    @property
    def model(self) -> torch.nn.Module:
        """The policy being trained (owned by :attr:`learner`)."""
        return self.learner.model

    # --- one rollout step -----------------------------------------------------------------

    def train_step(self) -> tuple[dict[str, float], list[ScoredGroup]]:
        """One rollout step on ``self.step``: its metrics and the groups it trained on."""
        step = self.step
        t0 = time.perf_counter()
        if self.stream is None:
            with self.signals.generating(self):  # a stop signal abandons it (StopNow)
                batch = self.rollouts.fill_batch(step)  # 1-3. sample, score, filter
        else:  # filled ahead by the producer, which goes on with the next ones meanwhile
            if not self.stream.running:
                self.stream.start(step)
            batch = self.stream.take(step)
            batch.metrics.update(
                staleness_metrics(batch.groups, step, self.cfg.rollout.max_staleness)
            )
        groups, metrics, self.left_out = batch.groups, batch.metrics, list(batch.left_out)
        t1 = time.perf_counter()
        self.advantages = []
        if groups:  # none: no group with a learning signal at the round cap, no update
            samples = self.build_samples(groups)  # 4. advantages and loss masks
            sizes = group_sizes(groups)  # G, more with agent episodes' extra segments
            start = 0
            for g, size in zip(groups, sizes, strict=True):  # per group, for transcripts
                self.advantages.append([s.advantage for s in samples[start : start + g.size]])
                start += size
            n = self.learner.count_updates(len(samples), sizes)
            self.rollouts.sync.before_update(n, generating=self.stream is not None)
            batch = self.learner.prepare(samples, step, sizes)  # 5. old, ref, teacher, IS weights
            metrics.update(self.learner.optimize(batch, step))  # 6. the optimizer updates
        else:
            metrics["actor/updates"] = 0.0
        metrics.update(self.rollouts.sync.after_update(step + 1))  # 7. a separate engine follows
        t2 = time.perf_counter()
        tokens = sum(len(g.prompt_ids) * g.size + sum(map(len, g.response_ids)) for g in groups)
        metrics["train/stale_groups"] = float(sum(g.step < step for g in groups))
        metrics["perf/train_s"] = t2 - t1
        metrics["perf/train_tokens_per_s"] = tokens / max(t2 - t1, 1e-9)
        metrics["perf/step_s"] = t2 - t0
        self.step += 1
        return metrics, groups

    def build_samples(self, groups: list[ScoredGroup]) -> list[Sample]:
        """Advantages (group-normalised) and loss masks (overlong filtering) of a batch."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        # Streaming with a correction (decoupled PPO): the ratio of every sample is taken
        # against the proximal policy (the learner recomputes it), the behaviour policy's
        # log-probs weight it. Otherwise a group generated before this step takes its ratio
        # against the behaviour policy.
        decoupled = r.max_staleness > 0 and a.is_cap is not None
        return build_samples(
            groups,
            step=self.step,
            advantage_scale=a.advantage_scale,
            overlong_filter=a.overlong_filter,
            keep_engine_logprobs=self.learner.compare_engine,
            exact_sampling_logprobs=r.top_p == 1.0 and r.top_k == 0 and not decoupled,
        )

    def stop_nonfinite(self, exc: NonFiniteUpdates) -> TrainingError:
        """Too many non-finite updates in a row: save the last good state; the error to stop with.

        With no update of this step applied, the weights are those of this step's checkpoint,
        if there is one: keep it (it also holds the data position and carry-over of the step
        boundary) rather than overwrite it."""
        existing = step_dir(self.out / "checkpoints", self.step)
        path = existing if not exc.applied_any and existing.is_dir() else self.save()
        return TrainingError(
            f"{exc}; stopped at rollout step {self.step}. The last good state is saved in {path}. "
            "Lower train.lr, check the reward values, or raise train.max_nonfinite_updates."
        )

    # --- evaluation, state, checkpoints -----------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy over all ranks (:meth:`Rollouts.evaluate`)."""
        with self._producer_paused(), sharding.full_params(self.model):
            return self.rollouts.evaluate()

    def _producer_paused(self) -> Any:
        """No batch is filled inside this block (streaming rollouts)."""
        return self.stream.paused() if self.stream is not None else contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """The run's state besides weights and optimizer, as plain data (every rank calls it);
        with streaming rollouts, the batches filled ahead with their versions."""
        with self._producer_paused():
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rollout_queue": self.stream.state_dict() if self.stream is not None else None,
            **self.rollouts.state_dict(),
            "summary": self.summary,
            "nonfinite_in_a_row": self.learner.nonfinite_in_a_row,
            "health": self.health.state_dict(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "config": self.cfg.to_dict(),
            "world_size": self.dist.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.rollouts.load_state_dict(state)
        if self.stream is not None:
            self.stream.load_state_dict(state.get("rollout_queue"))
        self.summary = dict(state["summary"])
        self.learner.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.health.load_state_dict(state.get("health"))  # absent in older checkpoints
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])

    def save(self) -> Path:
        """Every rank saves: with FSDP each writes its shards, else rank 0 writes it all."""
        path = save_checkpoint(
            self.out / "checkpoints",
            self.step,
            self.model,
            self.learner.optimizer,
            self.state_dict(),
            keep_last=self.cfg.checkpoint.keep_last,
        )
        D.barrier()
        self.saved_step = self.step
        return path

    def budget_spent(self) -> bool:
        """``train.sample_budget`` responses have been generated (0: no budget)."""
        budget = self.cfg.train.sample_budget
        return bool(budget) and self.rollouts.samples_generated >= budget

    def close(self) -> None:
        """Stop the producer and the reward workers and release the engine (``run`` does this
        itself)."""
        if self.stream is not None:
            self.stream.close()
        self.rollouts.close()
        if self.learner.teacher is not None:
            self.learner.teacher.close()
        if self.lock is not None:
            self.lock.release()

    # --- the whole run --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Resume or start, evaluate, train ``train.steps`` rollout steps, evaluate, save."""
        cfg, start, error = self.cfg, time.time(), None
        try:
            callbacks = Callbacks(self.callbacks)  # a bad one is refused before anything runs
            resumed_from = self._resume_or_start()
        except BaseException:
            self.close()  # run() owns the reward workers and engine: release them on every exit
            raise
        parser = self.spec.parser if self.spec is not None else parse_hermes
        record = RunRecord(
            cfg,
            self.out,
            resumed_from=resumed_from,
            is_main=self.dist.is_main,
            tokenizer=self.tokenizer,
            parser=parser,
            health=self.health,
        )
        before: dict[str, Any] | None = None  # the weights' accuracy, while no step ran
        take_interrupt(resume=False)  # a Ctrl-C held through start-up stops here: nothing saved
        with (signals := self.signals).watching():
            try:
                if self.rollouts.eval_records and "accuracy_before" not in self.summary:
                    # a stop signal cuts it short (one process); the loop then stops at once
                    with contextlib.suppress(StopNow), signals.abortable(self.dist.world_size == 1):
                        ev = before = self.evaluate()
                        self.summary["accuracy_before"] = ev["acc"] if ev["measured"] else None
                        record.evaluated(self.step, ev, "before training")
                        callbacks.on_evaluate(self.step, ev)
                while self.step < cfg.train.steps and not self.budget_spent():
                    if signals.should_stop():
                        break
                    before = None
                    try:
                        metrics, groups = self.train_step()
                    except NonFiniteUpdates as exc:
                        raise self.stop_nonfinite(exc) from exc
                    except StopNow:  # abandoned while generating: its start state is saved
                        break
                    every = cfg.logging.eval_every
                    last = self.step >= cfg.train.steps or self.budget_spent()  # evaluated below
                    if self.rollouts.eval_records and every and self.step % every == 0 and not last:
                        ev = self.evaluate()
                        metrics["val/acc"] = ev["acc"]
                        callbacks.on_evaluate(self.step, ev)
                    try:  # the health checks, a few transcripts, the metrics
                        record.step(self.step, metrics, groups, self.advantages, self.left_out)
                    except HealthError as exc:
                        raise HealthError(f"{exc}; the state is saved in {self.save()}") from exc
                    if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                        callbacks.on_save(self.step, self.save())
                    if callbacks.on_step(self.step, metrics):  # every rank stops together
                        record.message(f"stopped: {callbacks.requested}")
                        break
                if signals.should_stop():  # before the final evaluation and export
                    raise interrupt(self)
                try:
                    self._finish(record, callbacks, before, signals)
                except StopNow:
                    raise interrupt(self) from None
            except BaseException as exc:
                error = exc
                raise
            finally:
                record.close()
                self.close()
                summarise(self, start, resumed_from, error)
        D.barrier()
        callbacks.raise_error()  # after the clean stop, on every rank
        return self.summary

    def _finish(
        self, record: RunRecord, callbacks: Callbacks, before: dict | None, signals: StopSignals
    ) -> None:
        """The accuracy after training, the last checkpoint and the final model."""
        if self.rollouts.eval_records and before is not None:  # no step since: reuse it
            self.summary["accuracy_after"] = self.summary["accuracy_before"]
        elif self.rollouts.eval_records:
            with signals.abortable(self.dist.world_size == 1):  # a stop signal skips it
                ev = self.evaluate()
            self.summary["accuracy_after"] = ev["acc"] if ev["measured"] else None
            record.evaluated(self.step, ev, "after training")
            callbacks.on_evaluate(self.step, ev)
        final = step_dir(self.out / "checkpoints", self.step)
        existed = self.saved_step == self.step  # not a damaged one resuming skipped
        if self.cfg.train.steps > 0:  # train.steps=0 trains nothing, so saves nothing
            self._save_final()
        if not existed and final.is_dir():
            callbacks.on_save(self.step, final)
        if callbacks.requested:  # not in the checkpoint: a resumed run goes on
            self.summary["stopped_early"] = callbacks.requested

    def _resume_or_start(self) -> int | None:
        """Load the newest checkpoint (``resume=true``) or refuse to overwrite one; write the
        config. The step resumed from, or None."""
        root = self.out / "checkpoints"
        ckpt = self.resume_from if self.cfg.resume else latest_checkpoint(root)
        resumed_from = None
        if self.cfg.resume and ckpt is None:
            self.log(f"resume=true but no checkpoint in {root}; starting fresh")
        elif self.cfg.resume:
            # checked in __init__; held groups a change made unusable are dropped
            state = load_checkpoint(ckpt, self.model, self.learner.optimizer)
            self.load_state_dict(continue_state(state, self.cfg.to_dict()))
            self.rollouts.sync.push(self.step)  # the resumed policy
            resumed_from = self.saved_step = self.step
            self.log(f"resumed from {ckpt} (step {self.step})")
        elif ckpt is not None:
            raise TrainingError(
                f"{self.out} already holds checkpoints of an earlier run; continue it with "
                "resume=true, or choose another output_dir (nothing was overwritten)"
            )
        if resumed_from is None and self.cfg.rollout.engine == "vllm-server":
            self.rollouts.sync.push(self.step)  # the server started from its own copy
        if self.dist.is_main:
            write_text_atomic(self.out / "config.yaml", self.cfg.to_yaml())
        return resumed_from

    def _save_final(self) -> None:
        """A checkpoint of the last step (unless this state is saved) and the final model."""
        if self.saved_step != self.step:
            self.save()
        if self.cfg.checkpoint.save_final_model:
            weights = self.learner.pretrained_weights()  # all ranks gather with FSDP
            if self.dist.is_main:
                export_final_model(
                    self.out / "final_model", self.model, self.processor or self.tokenizer, weights
                )
