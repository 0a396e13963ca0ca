"""What a run leaves to read: metrics, transcripts, health warnings, the summary and the
dashboard.

:class:`RunRecord` owns the metrics logger (metrics.jsonl, the console, TensorBoard, W&B),
the transcript writer (rollouts.jsonl) and feeds the run-health monitor
(:mod:`dapo.health`); the trainer hands it each rollout step's metrics and groups.
:func:`write_summary` writes summary.json and the dashboard, also for a run that stopped
with an error, so that there is always something to read.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dapo.atomic import write_text_atomic
from dapo.config import Config
from dapo.errors import Interrupted, TrainingError
from dapo.handover import ScoredGroup
from dapo.health import HealthMonitor
from dapo.metrics import MetricsLogger, plot_dashboard
from dapo.metrics.transcripts import TranscriptWriter, transcript_records


class RunRecord:
    """The logs of one run (rank 0 writes; other ranks' calls do nothing but the health
    checks, which every rank makes alike so that a fatal one stops every rank)."""

    def __init__(
        self,
        cfg: Config,
        out: Path,
        *,
        resumed_from: int | None,
        is_main: bool,
        tokenizer: Any,
        parser: Callable[[str], list[Any]],
        health: HealthMonitor,
    ) -> None:
        self.cfg, self.tokenizer, self.parser, self.health = cfg, tokenizer, parser, health
        self.logger = MetricsLogger(
            out,
            total_steps=cfg.train.steps,
            console=cfg.logging.console,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            wandb_run_name=cfg.logging.run_name,
            verbose=cfg.logging.verbose,
            config=cfg.to_dict(),
            resume_step=resumed_from,  # drop lines a crash left after it; None: a new run
            enabled=is_main,
        )
        per_step = cfg.logging.transcripts_per_step
        self.transcripts = (
            TranscriptWriter(out, resume_step=resumed_from) if per_step and is_main else None
        )

    def step(
        self,
        step: int,
        metrics: dict[str, float],
        groups: Sequence[ScoredGroup],
        advantages: list[list[float]],
        left_out: Sequence[tuple[ScoredGroup, str]] = (),
    ) -> None:
        """Log rollout step ``step`` (1-based): its health checks, a few of its trained
        groups' transcripts and of those left out (``(group, reason)``: filtered or failed),
        and its metrics. A fatal health finding is raised after the step is logged."""
        metrics.update(self.health.observe(step, metrics))
        if self.transcripts is not None:
            k, seed = self.cfg.logging.transcripts_per_step, self.cfg.seed
            records = transcript_records(
                step, groups, advantages, self.tokenizer, k=k, seed=seed, parser=self.parser
            )
            if left_out and len(records) < k:  # too few trained: show what was left out, and why
                records += self._left_out(step, len(groups), left_out, k - len(records), seed)
            self.transcripts.write(records)
            self.logger.log_transcripts(step, records)
        self.logger.log(step, metrics)
        if self.health.fatal is not None:  # logged first, then raised
            raise self.health.fatal

    def _left_out(
        self,
        step: int,
        trained: int,
        left_out: Sequence[tuple[ScoredGroup, str]],
        k: int,
        seed: int,
    ) -> list[dict[str, Any]]:
        """``k`` transcripts of the groups left out (from ``k`` different groups while there
        are enough), each labelled with its group's index (numbered on after the
        ``trained`` groups, in generation order), its sample's and the reason."""
        records = transcript_records(
            step,
            [group for group, _ in left_out],
            None,
            self.tokenizer,
            k=k,
            seed=seed,
            parser=self.parser,
            first_group=trained,
        )
        return [
            {**r, "trained": False, "left_out": left_out[r["group"] - trained][1]} for r in records
        ]

    def evaluated(self, step: int, ev: dict[str, Any], when: str) -> None:
        """An evaluation's line and its ``val/acc`` (``when``: "before training", ...)."""
        if ev.get("measured", True):
            how = f"{ev['protocol']}: " if ev.get("protocol") else ""
            self.logger.message(
                f"held-out accuracy {when}: {ev['acc']:.1%} ({how}{ev['n']} samples)"
            )
            self.logger.log(step, {"val/acc": ev["acc"]})
        else:
            why = ev.get("unmeasured") or (
                f"every reward call failed: {ev.get('error') or 'see the reward warnings'}"
            )
            self.logger.message(f"held-out accuracy {when}: not measured ({why})")

    def message(self, text: str) -> None:
        self.logger.message(text)

    def close(self) -> None:
        self.logger.close()
        if self.transcripts is not None:
            self.transcripts.close()


def write_summary(
    out: Path,
    summary: dict[str, Any],
    log: Callable[[str], None],
    error: BaseException | None,
    dashboard: bool = True,
) -> None:
    """summary.json and (``dashboard``) the dashboard; with ``error``, the error the run
    stopped with."""
    if error is not None:
        summary["error"] = f"{type(error).__name__}: {error}"
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str))
    if not dashboard:
        return
    try:
        plot_dashboard(out)
    except (ValueError, OSError) as exc:  # optional: never what stops a run
        log(f"dashboard not written: {exc}")


def check_output_dir(out: Path) -> None:
    """Create ``out`` and make sure the run can write there, before anything is loaded."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise TrainingError(
            f"`output_dir` = {str(out)!r} is not writable ({exc.strerror}); choose another directory"
        ) from exc


def summarise(
    trainer: Any, start: float, resumed_from: int | None, error: BaseException | None
) -> None:
    """summary.json and the dashboard (rank 0), also after an error or an interruption (its
    ``interrupted`` entry, not an error)."""
    t = trainer
    trainable, total = t.learner.parameter_counts
    t.summary.update(
        {
            "steps": t.step,
            "samples_generated": t.rollouts.samples_generated,
            "wall_seconds": round(time.time() - start, 1),
            "preset": t.cfg.preset,
            "eval_protocol": None
            if t.rollouts.eval_protocol is None
            else str(t.rollouts.eval_protocol),
            "resumed_from_step": resumed_from,
            "trainable_parameters": trainable,
            "parameters": total,
            "failures": {"reward": t.rollouts.scorer.failures, "env": t.rollouts.env_failures},
            "health": t.health.findings,
        }
    )
    if not t.dist.is_main:
        return
    stopped_by = None if isinstance(error, Interrupted) else error
    try:
        write_summary(t.out, t.summary, t.log, stopped_by, t.cfg.logging.dashboard)
    except Exception as exc:  # noqa: BLE001 - never hide the error the run stopped with
        if error is None:
            raise
        t.log(f"summary.json not written: {exc}")
