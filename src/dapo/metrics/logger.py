"""Metric sinks: console progress bar, JSONL, TensorBoard, W&B."""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from dapo.atomic import append_whole, atomic_write
from dapo.metrics import registry
from dapo.metrics.console import (
    BAR_KEYS,
    LineStream,
    compact_line,
    full_lines,
    signals,
    timing,
)
from dapo.metrics.transcripts import format_transcript

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

PG_LOSS_NOTE = (
    "note: pg loss near 0 is expected with zero-mean advantages and ratio 1; "
    "the gradient is not zero (docs/getting-started.md: why actor/pg_loss is about 0)"
)
PG_LOSS_NEAR_ZERO = 1e-3  # |actor/pg_loss| below this triggers the one-time note

_RESERVED_KEYS = ("step", "time")
# The W&B table of transcripts: its columns, from transcript_records' fields.
TABLE_COLUMNS = (
    "step",
    "group",
    "sample",
    "prompt",
    "transcript",
    "reward",
    "score",
    "penalty",
    "advantage",
    "end",
)
_NONFINITE_TO_STR = {math.inf: "inf", -math.inf: "-inf"}
_STR_TO_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

# --------------------------------------------------------------------------- helpers


def _to_float(key: str, value: Any) -> float:
    """Convert a metric value (number, tensor, numpy scalar) to a Python float."""
    if isinstance(value, bool | int | float):
        return float(value)
    item = getattr(value, "item", None)  # torch.Tensor, numpy scalar / 1-element array
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError) as err:
            raise TypeError(f"metric {key!r} must be a scalar, got {value!r}") from err
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from err


def _json_value(value: float) -> float | str:
    """Encode a float for strict JSON: non-finite values become "nan"/"inf"/"-inf"."""
    if math.isnan(value):
        return "nan"
    return _NONFINITE_TO_STR.get(value, value)


def _decode_record(obj: dict[str, Any]) -> dict[str, Any]:
    """Turn the "nan"/"inf"/"-inf" strings of a record back into floats."""
    return {
        k: _STR_TO_NONFINITE[v] if isinstance(v, str) and v in _STR_TO_NONFINITE else v
        for k, v in obj.items()
    }


def _parse_jsonl(path: Path) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """Yield (raw line, record) for each valid line; drop a torn last line silently."""
    lines = path.read_bytes().split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict):
            if i != last:  # a torn last line is the expected crash case; anything else is odd
                warnings.warn(
                    f"{path}: skipping malformed line {i + 1}", RuntimeWarning, stacklevel=3
                )
            continue
        yield raw, obj


def metrics_file(path: str | Path) -> Path:
    """The metrics.jsonl of a run directory, or ``path`` itself when it is a file."""
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _cell(record: Mapping[str, Any], column: str) -> Any:
    """One cell of the transcripts table: the turns as ``[role] text`` blocks."""
    if column == "transcript":
        return "\n\n".join(
            f"[{t.get('role')}] {t.get('text', '')}" for t in record.get("turns", [])
        )
    return record.get(column)


# --------------------------------------------------------------------------- logger


class MetricsLogger:
    """Per-step metrics sink: JSONL (always), TensorBoard, W&B (optional) and console.

    With ``enabled=False`` (non-zero ranks) every method is a no-op and nothing is written.
    ``console`` shows a progress bar and, on the first step, every ~10% of the run, at each
    evaluation and at the end, one compact line of the paper's signals
    (:mod:`dapo.metrics.console`); ``verbose`` prints that line and every metric at every
    step. :meth:`message` prints whenever the logger is enabled.

    ``resume_step``: the step a resumed run continues from; the records a crashed run wrote
    after it are dropped (those of steps ``0..resume_step`` are kept: step 0 holds the
    held-out accuracy before training). ``None``: a new run, whose ``metrics.jsonl`` starts
    empty (a file left by an earlier run in ``output_dir`` is replaced).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        total_steps: int,
        console: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "dapo",
        wandb_run_name: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
        enabled: bool = True,
        verbose: bool = False,
    ) -> None:
        total_steps = operator.index(total_steps)
        if total_steps < 0:  # 0: a run that only evaluates (train.steps=0)
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        if resume_step is not None:
            resume_step = operator.index(resume_step)
            if resume_step < 0:
                raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.enabled = enabled
        self.verbose = verbose
        self.metrics_path = self.output_dir / METRICS_FILE
        self._closed = False
        self._fd: int | None = None  # metrics.jsonl, append-only
        self._tb: Any = None
        self._wandb_run: Any = None
        self._wandb_mod: Any = None
        self._bar: tqdm | None = None
        self._stream: IO[str] = sys.stderr
        self._line_mode = True  # non-TTY: plain lines instead of an in-place bar
        self._pg_note_done = False
        self._warned_reserved = False
        self.unregistered: set[str] = set()  # logged keys missing from dapo.metrics.registry
        self._last_step: int | None = None
        self._last_values: dict[str, float] = {}
        self._last_printed_step: int | None = None
        self._trained_step_seen = False
        self._start_step = resume_step or 0
        self._print_every = max(1, math.ceil(total_steps / 10))
        self._showwarning: Any = None  # the hook replaced while an in-place bar is drawn
        self._t0 = time.time()
        if not enabled:
            return

        wandb_mod = _import_wandb() if wandb else None  # fail before touching anything
        self.output_dir.mkdir(parents=True, exist_ok=True)
        keep_through = -1 if resume_step is None else resume_step
        self._truncate(keep_through)
        self._fd = self._open_append()

        if wandb_mod is not None:
            self._wandb_mod = wandb_mod
            try:
                self._wandb_run = wandb_mod.init(
                    project=wandb_project,
                    name=wandb_run_name,
                    config=dict(config) if config is not None else None,
                    dir=str(self.output_dir),
                )
            except BaseException:
                os.close(self._fd)
                raise

        if tensorboard:
            self._tb = self._open_tensorboard(keep_through, config)

        if console:
            self._stream = sys.stderr
            tty = _isatty(self._stream)
            self._line_mode = not tty
            self._bar = tqdm(
                total=total_steps,
                initial=min(self._start_step, total_steps),
                desc="dapo",
                unit="step",
                file=self._stream if tty else LineStream(self._stream),
                dynamic_ncols=True,
                mininterval=0.5 if tty else 30.0,
                ascii=None if tty else True,
                smoothing=0.1,
                leave=True,
            )
            if tty:
                self._route_warnings()
        self._t0 = time.time()

    # ------------------------------------------------------------------ setup helpers

    def _truncate(self, keep_through: int) -> None:
        """Atomically keep only records with step <= keep_through (drops torn lines)."""
        if not self.metrics_path.exists():
            return
        kept = [
            raw.rstrip(b"\r") + b"\n"
            for raw, rec in (_parse_jsonl(self.metrics_path) if keep_through >= 0 else ())
            if isinstance(rec.get("step"), int) and rec["step"] <= keep_through
        ]
        atomic_write(self.metrics_path, lambda f: f.writelines(kept))

    def _open_append(self) -> int:
        """Open metrics.jsonl for appending, first cutting off a torn last line (crash)."""
        path = self.metrics_path
        if path.exists() and path.stat().st_size > 0:
            with path.open("r+b") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # rare: read it all to find the last full line
                    f.seek(0)
                    f.truncate(f.read().rfind(b"\n") + 1)
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def _open_tensorboard(self, keep_through: int, config: dict | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            warnings.warn(
                f"TensorBoard logging disabled (cannot import it: {err})",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        try:
            # purge_step hides the events a crashed run wrote after the resume checkpoint
            # (all of them for a new run).
            writer = SummaryWriter(
                log_dir=str(self.output_dir / TENSORBOARD_DIR), purge_step=keep_through + 1
            )
            if config:
                text = json.dumps(config, indent=2, sort_keys=True, default=str)
                writer.add_text(
                    "config", "```\n" + text + "\n```", global_step=max(keep_through, 0)
                )
        except Exception as err:  # noqa: BLE001 - logging must not stop training
            warnings.warn(f"TensorBoard logging disabled: {err}", RuntimeWarning, stacklevel=3)
            return None
        return writer

    # ------------------------------------------------------------------ public API

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one rollout step's metrics to every enabled sink."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        step = operator.index(step)
        values: dict[str, float] = {}
        for key, value in metrics.items():
            if key in _RESERVED_KEYS:
                if not self._warned_reserved:
                    warnings.warn(
                        f"metric names {_RESERVED_KEYS} are reserved; ignoring them",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    self._warned_reserved = True
                continue
            values[str(key)] = _to_float(key, value)
            if str(key) not in self.unregistered and not registry.is_registered(str(key)):
                self.unregistered.add(str(key))
                warnings.warn(
                    f"metric {key!r} is not in dapo.metrics.registry: register it with its "
                    "meaning (the docs' metrics reference is generated from there)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        now = time.time()

        record: dict[str, Any] = {"step": step, "time": now}
        record.update((k, _json_value(v)) for k, v in values.items())
        assert self._fd is not None
        line = json.dumps(record, allow_nan=False) + "\n"
        append_whole(self._fd, line.encode("utf-8"), self.metrics_path)  # whole, or stops

        if self._tb is not None:
            try:
                for key, value in values.items():
                    self._tb.add_scalar(key, value, global_step=step, walltime=now)
                self._tb.flush()
            except Exception as err:  # noqa: BLE001 - logging must not stop training
                warnings.warn(f"TensorBoard logging disabled: {err}", RuntimeWarning, stacklevel=2)
                self._tb = None

        if self._wandb_run is not None:
            self._wandb_run.log(dict(values), step=step)

        self._last_step = step
        self._last_values = values
        self._update_console(step, values)

        pg_loss = values.get("actor/pg_loss")
        grad_norm = values.get("actor/grad_norm", 1.0)  # the note claims it is not zero
        if (
            not self._pg_note_done
            and pg_loss is not None
            and math.isfinite(pg_loss)
            and abs(pg_loss) < PG_LOSS_NEAR_ZERO
            and grad_norm > 0
        ):
            self._pg_note_done = True
            self.message(PG_LOSS_NOTE)

    def log_transcripts(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Show one step's transcripts (:func:`~dapo.metrics.transcripts.transcript_records`)
        where a sink has a place for text: TensorBoard's text tab (``rollouts``) and a W&B
        table (``rollouts``). ``rollouts.jsonl`` is :class:`TranscriptWriter`'s."""
        if not self.enabled or not records:
            return
        step = operator.index(step)
        if self._tb is not None:
            text = "\n\n".join("```\n" + format_transcript(dict(r)) + "\n```" for r in records)
            try:
                self._tb.add_text("rollouts", text, global_step=step)
                self._tb.flush()
            except Exception as err:  # noqa: BLE001 - logging must not stop training
                warnings.warn(f"TensorBoard logging disabled: {err}", RuntimeWarning, stacklevel=2)
                self._tb = None
        if self._wandb_run is not None and self._wandb_mod is not None:
            columns = list(TABLE_COLUMNS)
            rows = [[_cell(r, c) for c in columns] for r in records]
            self._wandb_run.log(
                {"rollouts": self._wandb_mod.Table(columns=columns, data=rows)}, step=step
            )

    def message(self, text: str) -> None:
        """Print a line to stderr without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None and not self._line_mode:
            tqdm.write(text, file=self._bar.fp)  # clears and redraws the in-place bar
            return
        stream = self._stream if self._bar is not None else sys.stderr
        stream.write(text + "\n")
        stream.flush()

    def close(self) -> None:
        """Flush and close all sinks (idempotent)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        try:
            if (
                self._bar is not None
                and self._last_step is not None
                and self._last_printed_step != self._last_step
            ):
                self._print_step(self._last_step, self._last_values)
        finally:
            self._restore_warnings()
            if self._bar is not None:
                self._bar.close()
            if self._tb is not None:
                with contextlib.suppress(Exception):
                    self._tb.close()
            if self._wandb_run is not None:
                self._wandb_run.finish()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ console

    def _route_warnings(self) -> None:
        """Print warnings above the in-place bar (tqdm.write) instead of into it."""
        original = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: IO[str] | None = None,
            line: str | None = None,
        ) -> None:
            if file is not None and file is not sys.stderr:
                original(message, category, filename, lineno, file, line)
                return
            text = warnings.formatwarning(message, category, filename, lineno, line)
            self.message(text.rstrip("\n"))

        self._showwarning = (original, show)
        warnings.showwarning = show

    def _restore_warnings(self) -> None:
        if self._showwarning is not None:
            original, show = self._showwarning
            if warnings.showwarning is show:  # not replaced again meanwhile
                warnings.showwarning = original
            self._showwarning = None

    def _update_console(self, step: int, values: dict[str, float]) -> None:
        bar = self._bar
        if bar is None:
            return
        if not self._line_mode:  # the live figures; a plain log gets the lines below
            bar.set_postfix_str(signals(values, BAR_KEYS), refresh=False)
        if step >= bar.n:
            bar.update(step - bar.n)
        else:  # step went backwards (a record of an earlier step); just move the bar
            bar.n = step
            bar.refresh()
        first = step > self._start_step and not self._trained_step_seen
        self._trained_step_seen |= step > self._start_step
        if (
            self.verbose
            or first
            or "val/acc" in values
            or step % self._print_every == 0
            or step >= self.total_steps
        ):
            self._print_step(step, values)

    def _print_step(self, step: int, values: dict[str, float]) -> None:
        self._last_printed_step = step
        elapsed = time.time() - self._t0
        clock = timing(elapsed, step - self._start_step, self.total_steps - step)
        lines = [compact_line(step, self.total_steps, values, clock)]
        if self.verbose:
            lines += full_lines(values)
        self.message("\n".join(lines))


def _import_wandb() -> Any:
    try:
        import wandb  # type: ignore[import-not-found]
    except ImportError as err:
        raise RuntimeError(
            "W&B logging is enabled but the 'wandb' package is not installed: "
            "run `pip install wandb` (or `pip install dapo[wandb]`), "
            "or set logging.wandb=false in the config"
        ) from err
    return wandb


# --------------------------------------------------------------------------- reading


def read_metrics(path: str | Path) -> list[dict]:
    """Read the records of a run dir or metrics.jsonl; a torn last line is dropped.

    The strings "nan", "inf" and "-inf" are returned as floats.
    """
    file = metrics_file(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no metrics file at {file}: give a run directory (a dapo train output_dir, "
            f"which holds {METRICS_FILE}) or the {METRICS_FILE} file itself"
        )
    return [_decode_record(rec) for _, rec in _parse_jsonl(file)]
