"""Every error dapo raises on purpose, in one place that any module may import.

Each message names the field or input, the value, and the fix. ``DapoError`` is the common
base where a caller wants to catch "a problem the user can fix" in one ``except``.
"""

from __future__ import annotations

from typing import Any


class DapoError(Exception):
    """A problem the user can fix; the message says what to change."""


class ConfigError(DapoError, ValueError):
    """A configuration problem, with the key, the value and the fix in the message; ``key``:
    the key whose value a rule refused, where one is."""

    def __init__(self, message: str = "", *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(DapoError, ValueError):
    """A problem with the data; the message names the file, row, field and the fix."""


class ModelError(DapoError, ValueError):
    """A model or tokenizer that cannot be loaded; the message says why and what to do."""


class TrainingError(DapoError, RuntimeError):
    """Training cannot go on; the message says why and what to change."""


class DynamicSamplingError(TrainingError):
    """The round cap was reached before the batch was full (``algorithm.round_cap=stop``),
    or too many rollout steps in a row found no group with a learning signal."""


class HealthError(TrainingError):
    """A run-health symptom of a kind listed in ``health.fatal``: the run stops (its
    checkpoints are kept)."""


class NothingToTrain(DapoError):
    """``resume=true`` found the run's checkpoint already at ``train.steps`` (or its
    ``train.sample_budget`` spent): nothing was loaded and there is nothing to train.
    ``step``: the step reached; ``summary``: the run's saved summary (``summary.json``).
    ``dapo train`` exits 0 and ``dapo.train`` returns the summary."""

    def __init__(self, message: str, *, step: int, summary: dict[str, Any]) -> None:
        super().__init__(message)
        self.step, self.summary = step, summary


class Interrupted(DapoError):
    """A stop signal (SIGTERM, Ctrl-C, one of ``checkpoint.stop_signals``) ended the run at a
    safe point, its state saved in ``checkpoint`` (None when none could be); ``exit_code``:
    130 for Ctrl-C, else 143, as for a process the signal ended."""

    def __init__(
        self, message: str, *, signal: str, step: int, checkpoint: str | None, exit_code: int
    ) -> None:
        super().__init__(message)
        self.signal, self.step, self.checkpoint = signal, step, checkpoint
        self.exit_code = exit_code


class OutputWriteError(TrainingError):
    """A run's file could not be written (a full disk, an I/O error): the message names the
    file, the space left and the fix; nothing half-written is left in it."""


class CheckpointError(DapoError, RuntimeError):
    """A checkpoint could not be written or read; earlier checkpoints are intact."""


class EvalError(DapoError, ValueError):
    """A bad evaluation option or set-up; the message says what to change."""


class VLLMUnavailableError(DapoError, ImportError):
    """vLLM is not installed (or does not import); the message names the extra to install."""


class VLLMEngineError(DapoError, RuntimeError):
    """The vLLM engine could not start or failed; the message says what to change."""


class RolloutServerError(TrainingError):
    """The rollout server (``dapo vllm-serve``) cannot be reached, failed or is unsuitable;
    the message names its URL and what to do."""


class RewardFunctionWarning(UserWarning):
    """A reward function timed out, raised, or returned a non-number (the sample scored -1)."""


class DynamicSamplingWarning(UserWarning):
    """The round cap cut a batch short (it trains on fewer groups), or a rollout step found
    no group with a learning signal (its update is skipped)."""


class HealthWarning(UserWarning):
    """A run-health symptom: the metrics say the run cannot learn as configured (once per
    kind; docs/guides/run-health.md)."""


class CheckpointWarning(UserWarning):
    """A checkpoint is damaged (resuming falls back to an older intact one) or cannot be
    verified (it has no manifest)."""
