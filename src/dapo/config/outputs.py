"""The ``logging`` and ``checkpoint`` sections: what a run writes and keeps, and how it stops
on a signal with its work saved.

Bounds are on the fields; the rules between them are in :mod:`dapo.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo.choices import OnSignal, StopSignal
from dapo.config.fields import opt


@dataclass
class LoggingConfig:
    """Where metrics go."""

    console: bool = opt(
        True,
        "Show a progress bar and, at the first step, every tenth of the run, each evaluation "
        "and the last step, one line of the paper's signals (accuracy, reward, entropy, "
        "length, clip-high and uniform-group shares, step time) on the terminal "
        "(output_dir/metrics.jsonl always gets every metric).",
    )
    verbose: bool = opt(
        False, "With logging.console: print every metric, grouped, at every rollout step."
    )
    tensorboard: bool = opt(True, "Write TensorBoard event files under output_dir/tensorboard.")
    dashboard: bool = opt(
        True,
        "Draw output_dir/dashboard.png (the run's metrics, one panel per signal) when the run "
        "ends, also after an error; 1-2 s on a CPU. `dapo plot RUN` draws it at any time.",
    )
    wandb: bool = opt(False, "Log to Weights & Biases (needs the wandb package).")
    wandb_project: str = opt("dapo", "Weights & Biases project.")
    run_name: str | None = opt(None, "Weights & Biases run name; null lets wandb pick one.")
    eval_every: int = opt(
        0,
        "Held-out evaluation every N rollout steps; 0: only before and after training.",
        ge=0,
        hint="0: only before and after training",
    )
    transcripts_per_step: int = opt(
        2,
        "Rollouts of each step written as a person reads them to output_dir/rollouts.jsonl "
        "(the prompt as the model saw it, each turn with its role and tool calls, the reward "
        "and its parts, the end reason, the advantage), and to TensorBoard (text) and W&B "
        "(a table); `dapo show RUN` prints them. 0: none.",
        ge=0,
        hint="0: none",
    )
    user_output_kb: int = opt(
        64,
        "What reward functions, environments, tools and agents print in their worker "
        "processes (stdout and stderr) goes to output_dir/user_output.log, not the console: "
        "at most this many KiB per worker and rollout step; the rest is counted "
        "(reward/output_dropped_bytes, env/output_dropped_bytes) and dropped. 0: keep none.",
        ge=0,
        hint="KiB; 0: keep none",
    )


@dataclass
class CheckpointConfig:
    """Periodic and final checkpoints."""

    save_every: int = opt(
        20,
        "Save a resumable checkpoint (policy, optimizer, prompt position, dynamic sampling "
        "carry-over, prompt outcome history, random state) every N rollout steps; 0 saves "
        "only at the end.",
        ge=0,
        hint="0: only at the end",
    )
    keep_last: int = opt(
        2,
        "Step checkpoints to keep; older ones are deleted.",
        ge=1,
        hint="keep at least 1 checkpoint",
    )
    save_final_model: bool = opt(
        True,
        "Save the final policy with save_pretrained to output_dir/final_model (loadable by "
        "transformers, vLLM and `dapo eval`).",
    )
    on_signal: OnSignal = opt(
        "save",
        "On SIGTERM, Ctrl-C or one of checkpoint.stop_signals: save, stop at the next safe "
        "point (a rollout step still generating is abandoned, one updating is finished), "
        "checkpoint, write summary.json marked interrupted, exit 143 (Ctrl-C: 130); exit: no "
        "handler, as in any Python program (SIGTERM ends the process at once, Ctrl-C raises "
        "KeyboardInterrupt; the last periodic checkpoint stays).",
    )
    signal_grace_s: float = opt(
        25.0,
        "Seconds from the signal to the end of the run (the checkpoint, the summary, the "
        "workers stopped); past them the process exits anyway, saying what was saved (without "
        "that checkpoint, the last periodic one stays). Keep it below the scheduler's kill "
        "wait (Slurm KillWait, Kubernetes terminationGracePeriodSeconds: 30 s by default).",
        gt=0,
        hint="seconds",
    )
    stop_signals: list[StopSignal] = opt(
        help="Signals that stop the run as on_signal says, besides SIGINT (Ctrl-C): e.g. "
        "[SIGTERM, SIGUSR1] with Slurm's `#SBATCH --signal=USR1@90` for an early warning.",
        factory=lambda: ["SIGTERM"],
    )
