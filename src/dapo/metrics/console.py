"""What a person sees while a run goes: one compact line of the paper's signals per
printed step, and (``logging.verbose``) every metric grouped by its prefix.

The compact line, for example::

    step  40/300  val-acc 45.4%  acc 56.9%  reward +0.138  entropy 0.0917  len 32
    clip-high 0.018%  uniform 12%  0.60s/step  03:12 eta 45:00

(one line on the console) stays under :data:`MAX_LINE` characters for any values; a metric
missing from a step (no update, an evaluation-only record) is left out of it. Runs with
environments or tools add ``turns`` (assistant turns per episode), runs with a teacher
``kl-teacher`` (``distill/reverse_kl``), and any run with
failures ``failed reward N env M`` (that step's counts) when they are not zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import IO

from tqdm import tqdm

# The compact line's length bound (checked by the tests): every field at its widest, an
# episode run's turns, the teacher's KL and both failure counts included; a usual line is
# about 110.
MAX_LINE = 225

# Group order of the verbose dump; other groups follow alphabetically.
_GROUP_ORDER = ("val", "reward", "response_length", "actor", "sampling", "perf")


def _finite(fmt: Callable[[float], str]) -> Callable[[float], str]:
    return lambda v: fmt(v) if math.isfinite(v) else str(v)


def _seconds(v: float) -> str:
    return f"{v:.2f}s/step" if v < 10 else f"{v:.1f}s/step" if v < 100 else f"{v:.0f}s/step"


def _share(v: float) -> str:
    """A small share as a percentage with 2 significant digits: 0.000183 -> 0.018%."""
    return "0%" if v == 0 else f"{100 * v:.2g}%"


# (metric key, label, format): the paper's signals, in the order printed.
LINE_FIELDS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("val/acc", "val-acc", _finite(lambda v: f"{v:.1%}")),
    ("reward/acc", "acc", _finite(lambda v: f"{v:.1%}")),
    ("reward/mean", "reward", _finite(lambda v: f"{v:+.3g}")),
    ("actor/entropy", "entropy", _finite(lambda v: f"{v:.3g}")),
    # Runs with a teacher (algorithm.teacher): the reverse KL to it, what distillation lowers.
    ("distill/reverse_kl", "kl-teacher", _finite(lambda v: f"{v:.3g}")),
    ("response_length/mean", "len", _finite(lambda v: f"{v:.0f}")),
    ("actor/clip_frac_high", "clip-high", _finite(_share)),
    ("sampling/uniform_groups", "uniform", _finite(lambda v: f"{v:.0%}")),
    # Runs with environments or tools: assistant turns per episode.
    ("env/turns_mean", "turns", _finite(lambda v: f"{v:.3g}")),
    ("perf/step_s", "", _finite(_seconds)),
)
# Per-step failure counts, shown after the signals when non-zero: ``failed reward 3 env 1``.
FAILURE_FIELDS = (("reward/failures", "reward"), ("env/failures", "env"))


def _with_uniform(values: dict[str, float]) -> dict[str, float]:
    """``sampling/uniform_groups`` from its two parts when only those were logged."""
    if "sampling/uniform_groups" in values:
        return values
    correct = values.get("sampling/all_correct_frac")
    wrong = values.get("sampling/all_wrong_frac")
    if correct is None or wrong is None:
        return values
    return {**values, "sampling/uniform_groups": correct + wrong}


# The live figures on the in-place bar (the printed lines carry the rest).
BAR_KEYS = ("reward/acc", "reward/mean", "actor/entropy")


def signals(values: dict[str, float], keys: tuple[str, ...] | None = None) -> str:
    """The paper's signals of one step (of ``keys``, default all), those present, e.g.
    ``acc 56.9%  reward +0.138``."""
    shown = _with_uniform(values)
    parts = []
    for key, label, fmt in LINE_FIELDS:
        if key in shown and (keys is None or key in keys):
            parts.append(f"{label} {fmt(shown[key])}" if label else fmt(shown[key]))
    return "  ".join(parts)


def timing(elapsed: float, done: int, remaining: int) -> str:
    """``MM:SS`` elapsed and, once a step is done and some remain, the time left."""
    text = tqdm.format_interval(elapsed)
    if done > 0 and remaining > 0:
        text += f" eta {tqdm.format_interval(elapsed / done * remaining)}"
    return text


def failures(values: dict[str, float]) -> str:
    """``failed reward 3 env 1``: the step's non-zero failure counts (reward functions that
    raised, timed out or returned a non-number; episodes ended by their environment)."""
    parts = [
        f"{label} {_count(values[key])}"
        for key, label in FAILURE_FIELDS
        if key in values and values[key] != 0
    ]
    return "failed " + " ".join(parts) if parts else ""


def _count(v: float) -> str:
    return f"{v:.0f}" if math.isfinite(v) and abs(v) < 1e6 else f"{v:.3g}"


def compact_line(step: int, total: int, values: dict[str, float], clock: str) -> str:
    """``step  N/TOTAL  <signals>  <failures>  <clock>``: the line printed for a step."""
    head = f"step {step:>{len(str(total))}}/{total}"
    parts = (head, signals(values), failures(values), clock)
    return "  ".join(part for part in parts if part)


def fmt_number(value: float) -> str:
    """Compact number formatting for the verbose dump."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000 or (value == int(value) and abs(value) < 1e15):
        return f"{value:.0f}"
    return f"{value:.4g}"


def full_lines(values: dict[str, float]) -> list[str]:
    """Every metric, one indented line per group: ``  actor: entropy=0.09 grad_norm=0.3``."""
    groups: dict[str, list[str]] = {}
    for key, value in values.items():
        group, _, name = key.rpartition("/")
        groups.setdefault(group, []).append(f"{name}={fmt_number(value)}")
    order = [g for g in _GROUP_ORDER if g in groups]
    order += sorted(g for g in groups if g not in _GROUP_ORDER)
    return [f"  {g or '-'}: {' '.join(groups[g])}" for g in order]


class LineStream:
    """Stream wrapper for non-TTY output: each tqdm redraw becomes one plain line.

    tqdm redraws in place with carriage returns and padding, which turns CI logs into
    one endless line; here every non-empty redraw is written as its own line instead.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._last = ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line and line != self._last:
            self._stream.write(line + "\n")
            self._last = line
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    @property
    def encoding(self) -> str | None:
        return getattr(self._stream, "encoding", None)
