"""Several runs side by side: one PNG overlaying the paper's signals of each run, and a
table of their final figures (``dapo compare RUN [RUN ...]``), for the ablation ladder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.atomic import atomic_write
from dapo.metrics.dashboard import (
    compact_ticks,
    fit_share_axis,
    merge_steps,
    metric_series,
)
from dapo.metrics.logger import METRICS_FILE, metrics_file, read_metrics

COMPARE_FILE = "compare.png"


@dataclass(frozen=True)
class Signal:
    """One compared metric: its panel title, its column in the table and how it is shown."""

    key: str
    title: str
    column: str
    fmt: str
    share: bool = False  # a share of 0..1: its axis fitted from 0 (fit_share_axis)
    sparse: bool = False  # logged at a few steps only: drawn with markers


SIGNALS = (
    Signal("reward/acc", "Accuracy (train)", "train acc", "{:.1%}", share=True),
    Signal("val/acc", "Held-out accuracy", "held-out acc", "{:.1%}", share=True, sparse=True),
    Signal("reward/mean", "Reward", "reward", "{:+.3f}"),
    Signal("response_length/mean", "Response length (tokens)", "length", "{:.1f}"),
    Signal("actor/entropy", "Entropy (nats / token)", "entropy", "{:.3f}"),
    Signal("actor/gen_prob", "Generation probability", "gen prob", "{:.3f}"),
    Signal("actor/clip_frac_low", "Clip fraction, low", "clip low", "{:.3%}", share=True),
    Signal("actor/clip_frac_high", "Clip fraction, high", "clip high", "{:.3%}", share=True),
)


@dataclass(frozen=True)
class Run:
    """One run's label and its records, one per step (``merge_steps``)."""

    label: str
    path: Path
    records: list[dict]

    def final(self, key: str) -> float | None:
        """The last finite value of ``key`` (``val/acc``: the last evaluation), else None."""
        _, ys = metric_series(self.records, key)
        return ys[-1] if ys else None

    @property
    def steps(self) -> int:
        """The last rollout step logged (0: none yet)."""
        return max((r["step"] for r in self.records), default=0)


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare_runs` made: the table printed and the figure written."""

    table: str
    figure: Path


class NotARunError(FileNotFoundError):
    """A path given as a run holds no ``metrics.jsonl``."""


def default_labels(paths: Sequence[Path]) -> list[str]:
    """Each run's directory name, with as many parent names as it takes to tell them apart
    (the ablation scripts write ``PRESET/seed0`` for every preset)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # the same run twice: its path as given


def _metrics_of(path: str | Path) -> Path:
    """The metrics.jsonl of the run at ``path`` (a run directory or the file itself)."""
    file = metrics_file(path)
    if not file.is_file():
        raise NotARunError(
            f"{path} is not a run directory: it holds no {METRICS_FILE}. Give the output_dir "
            f"of a dapo train run (or its {METRICS_FILE})"
        )
    return file


def load_runs(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[Run]:
    """The runs at ``paths``, labelled by ``labels`` or their directory names."""
    files = [_metrics_of(p) for p in paths]
    if labels is None:
        labels = default_labels([f.parent for f in files])
    if len(labels) != len(files):
        raise ValueError(f"{len(labels)} labels for {len(files)} runs: give one label per run")
    return [
        Run(label, f.parent, merge_steps(read_metrics(f)))
        for f, label in zip(files, labels, strict=True)
    ]


def build_figure(runs: Sequence[Run]) -> Any:
    """One panel per signal, one line per run that logged it (a run without the metric is
    left out of that panel), a run's colour the same in every panel; x: the rollout step."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cols = 2
    rows = math.ceil(len(SIGNALS) / cols)
    width, height = 14, 3.2 * rows + 1.2
    fig = Figure(figsize=(width, height), dpi=100)
    # Fixed margins in inches, as the dashboard's (constrained layout is slow).
    fig.subplots_adjust(
        left=0.8 / width,
        right=1 - 0.3 / width,
        top=1 - 1.2 / height,
        bottom=0.6 / height,
        hspace=0.45,
        wspace=0.18,
    )
    axes = fig.subplots(rows, cols, sharex=True)
    handles: dict[str, Any] = {}
    for ax, signal in zip(axes.flat, SIGNALS, strict=False):
        ax.set_title(signal.title, fontsize=11, fontweight="bold")
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=8, labelbottom=True)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for i, run in enumerate(runs):
            xs, ys = metric_series(run.records, signal.key)
            if not xs:
                continue
            marker = "o" if signal.sparse or len(xs) == 1 else None
            (line,) = ax.plot(
                xs, ys, color=f"C{i % 10}", marker=marker, markersize=4, lw=1.5, label=run.label
            )
            handles.setdefault(run.label, line)
        compact_ticks(ax)
        if signal.share:
            fit_share_axis(ax)
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    fontsize=12, color="0.5")  # fmt: skip
            ax.set_yticks([])
    for ax in axes.flat[len(SIGNALS) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("rollout step", fontsize=9)
    fig.suptitle(f"{len(runs)} runs compared", fontsize=14, y=1 - 0.15 / height, va="top")
    if handles:
        fig.legend(
            handles=list(handles.values()),
            loc="upper center",
            bbox_to_anchor=(0.5, 1 - 0.5 / height),
            ncol=min(len(handles), 6),
            fontsize=9,
            frameon=False,
        )
    return fig


def final_table(runs: Sequence[Run]) -> str:
    """One row per run: its last rollout step and each signal's last logged value (held-out
    accuracy: its last evaluation); ``-`` where the run did not log it."""
    head = ["run", "steps", *(s.column for s in SIGNALS)]
    rows = [head]
    for run in runs:
        cells = [run.label, str(run.steps)]
        for s in SIGNALS:
            value = run.final(s.key)
            cells.append("-" if value is None else s.fmt.format(value))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(lines)


def compare_runs(
    paths: Sequence[str | Path],
    *,
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
) -> Comparison:
    """Draw the runs at ``paths`` side by side to ``out`` (default ``./compare.png``,
    written atomically) and tabulate their final figures."""
    runs = load_runs(paths, labels)
    out_path = Path(out).absolute() if out is not None else Path.cwd() / COMPARE_FILE
    fig = build_figure(runs)
    atomic_write(out_path, lambda f: fig.savefig(f, format="png"))
    return Comparison(final_table(runs), out_path)
