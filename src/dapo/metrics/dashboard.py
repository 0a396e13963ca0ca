"""The dashboard: one PNG of the paper's training signals from ``metrics.jsonl``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.atomic import atomic_write
from dapo.metrics.logger import METRICS_FILE, metrics_file, read_metrics

DASHBOARD_FILE = "dashboard.png"


# --------------------------------------------------------------------------- dashboard


@dataclass(frozen=True)
class _Series:
    key: str
    label: str
    color: str
    style: str = "-"
    marker: str | None = None
    band: str | None = None  # key of a std to shade around the line
    only_nonzero: bool = False  # drawn only where it is ever non-zero (a setting's counter)


@dataclass(frozen=True)
class _Panel:
    title: str
    left: tuple[_Series, ...]
    left_label: str
    right: tuple[_Series, ...] = ()
    right_label: str = ""
    # Shares are drawn from 0 (fit_share_axis): autoscaled, 0.9955 -> 0.998 looks like a trend.
    left_share: bool = False
    right_share: bool = False


_PANELS = (
    _Panel(
        "Reward and accuracy",
        (
            _Series("reward/mean", "reward mean", "C0", band="reward/std"),
            _Series("reward/acc", "train acc", "C1"),
            _Series("val/acc", "val acc", "C3", style="--", marker="o"),
        ),
        "reward / accuracy",
    ),
    _Panel(
        "Response length",
        (
            _Series("response_length/mean", "mean", "C0"),
            _Series("response_length/max", "max", "C1"),
        ),
        "tokens",
        (_Series("response_length/clip_ratio", "truncated share", "C3", style="--"),),
        "truncated share",
        right_share=True,
    ),
    _Panel("Actor entropy", (_Series("actor/entropy", "entropy", "C4"),), "nats / token"),
    _Panel(
        "Mean generation probability",
        (_Series("actor/gen_prob", "p(sampled token)", "C2"),),
        "probability",
    ),
    _Panel(
        "Clip fractions",
        (
            _Series("actor/clip_frac_low", "clipped low", "C0"),
            _Series("actor/clip_frac_high", "clipped high", "C3"),
        ),
        "token share",
        left_share=True,
    ),
    _Panel(
        "Dynamic sampling",
        (
            _Series("sampling/all_correct_frac", "all-correct groups", "C2"),
            _Series("sampling/all_wrong_frac", "all-wrong groups", "C3"),
            _Series("sampling/wasted_frac", "wasted share", "C7"),
        ),
        "share",
        (
            _Series("sampling/gen_rounds", "generation rounds", "C0", style="--", marker="."),
            # The surplus: qualifying groups beyond the batch, trained at the next step.
            _Series("sampling/carried_over", "carried to next step", "C1", style=":", marker="."),
            # algorithm.keep_surplus=false: the surplus thrown away instead, as the paper does.
            _Series(
                "sampling/surplus_discarded",
                "surplus discarded",
                "C4",
                style=":",
                marker="x",
                only_nonzero=True,
            ),
        ),
        "rounds / groups",
        left_share=True,
    ),
    _Panel(
        "Gradient norm and PPO KL",
        (_Series("actor/grad_norm", "grad norm", "C0"),),
        "grad norm",
        (_Series("actor/ppo_kl", "ppo kl", "C1", style="--"),),
        "ppo kl",
    ),
    _Panel(
        "Throughput and step time",
        (
            _Series("perf/rollout_tokens_per_s", "rollout tok/s", "C0"),
            _Series("perf/train_tokens_per_s", "train tok/s", "C1"),
        ),
        "tokens / s",
        (
            _Series("perf/step_s", "step s", "C3", style="--"),
            _Series("perf/gen_s", "gen s", "C4", style=":"),
            _Series("perf/train_s", "train s", "C5", style=":"),
        ),
        "seconds",
    ),
)

# Runs with environments or tools (multi-turn episodes): two more panels.
_EPISODE_PANELS = (
    _Panel(
        "Episodes",
        (
            _Series("env/turns_mean", "turns / episode", "C0"),
            _Series("env/tool_calls", "tool calls / episode", "C1"),
            _Series("env/failures", "environment failures (count)", "C3", marker="."),
        ),
        "per episode / count",
        (_Series("perf/env_s", "environment s", "C7", style="--"),),
        "seconds per step",
    ),
    _Panel(
        "Episode end reasons",
        (
            _Series("env/ended_done", "done", "C2"),
            _Series("env/ended_max_turns", "max turns", "C1"),
            _Series("env/ended_budget", "token budget", "C4"),
            _Series("env/ended_env_failure", "environment failure", "C3"),
            _Series("env/ended_bad_tool_call", "bad tool call", "C5"),
            _Series("env/ended_engine_refused", "engine refused", "C6"),
        ),
        "share of episodes",
        left_share=True,
    ),
)


def panels_for(records: list[dict]) -> tuple[_Panel, ...]:
    """The dashboard's panels: the episode panels too when the run had episodes."""
    episodes = any(k.startswith("env/") for rec in records for k in rec)
    return _PANELS + _EPISODE_PANELS if episodes else _PANELS


_TITLE_FONT = {"size": 11, "weight": "bold"}


def metric_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """The steps and finite values of ``key`` in ``records`` (those lacking it are left out)."""
    xs, ys = [], []
    for rec in records:
        value = rec.get(key)
        # Non-finite values are left out: NaN would break lines into invisible single
        # points and inf would wreck the axis scaling.
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(rec["step"])
            ys.append(float(value))
    return xs, ys


def fit_share_axis(ax: Any) -> None:
    """Fit the y axis of shares (values in 0..1) to the lines drawn, from 0 up.

    A fixed 0-1 axis flattens clip fractions of 0.1% into the zero line; an axis that leaves
    0 out makes 0.9955 -> 0.998 look like a trend. An axis with nothing above 0 stays 0-1.
    """
    peak = max((max(line.get_ydata(), default=0.0) for line in ax.lines), default=0.0)
    top = min(1.0, 1.1 * float(peak)) if peak > 0 else 1.0
    ax.set_ylim(-0.03 * top, 1.03 * top)


def compact_ticks(ax: Any) -> None:
    """Short y tick labels: values below 1e-3 or from 1e5 as mantissas under a ``1e-4``
    above the axis. A label like ``0.000225`` was wide enough to push the axis label of a
    panel's right axis into the next panel's tick labels."""
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5))
    ax.yaxis.get_offset_text().set_fontsize(8)


def _draw_panel(ax: Any, panel: _Panel, records: list[dict]) -> bool:
    """Draw one panel; return False (and show "no data") when none of its keys exist.

    A panel with data carries its title as the title of a legend placed above the plot.
    """
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=8)
    handles: list[Any] = []

    def draw(target: Any, series: tuple[_Series, ...]) -> None:
        for s in series:
            xs, ys = metric_series(records, s.key)
            if not xs or (s.only_nonzero and not any(ys)):
                continue
            marker = s.marker or ("o" if len(xs) == 1 else None)
            (line,) = target.plot(
                xs, ys, s.style, color=s.color, marker=marker, markersize=4, lw=1.5, label=s.label
            )
            handles.append(line)
            if s.band:
                bx, by = metric_series(records, s.band)
                std = dict(zip(bx, by, strict=True))
                pts = [(x, y, std[x]) for x, y in zip(xs, ys, strict=True) if x in std]
                if pts:
                    line.set_label(f"{s.label} (±std)")
                    target.fill_between(
                        [p[0] for p in pts],
                        [p[1] - p[2] for p in pts],
                        [p[1] + p[2] for p in pts],
                        color=s.color,
                        alpha=0.15,
                        lw=0,
                    )

    draw(ax, panel.left)
    n_left = len(handles)
    compact_ticks(ax)
    if panel.left_share:
        fit_share_axis(ax)
    top = ax
    if panel.right and any(metric_series(records, s.key)[0] for s in panel.right):
        top = ax.twinx()
        draw(top, panel.right)
        compact_ticks(top)
        if panel.right_share:
            fit_share_axis(top)
        top.set_ylabel(panel.right_label, color=panel.right[0].color, fontsize=9)
        top.tick_params(axis="y", labelsize=8, colors=panel.right[0].color)
    if not handles:
        ax.set_title(panel.title, **_TITLE_FONT)
        ax.text(
            0.5,
            0.5,
            "no data",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=12,
            color="0.5",
        )
        ax.set_yticks([])
        return False
    if n_left:
        ax.set_ylabel(panel.left_label, fontsize=9)
    else:  # only twin-axis series: the left axis has nothing to show
        ax.set_yticks([])
    # Legend above the plot area, under the panel title, so it never hides data.
    ax.legend(
        handles=handles,
        title=panel.title,
        title_fontproperties=_TITLE_FONT,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=min(len(handles), 3),
        fontsize=8,
        frameon=False,
        borderaxespad=0.2,
        handlelength=2.5,
    )
    return True


def _build_figure(records: list[dict], title: str) -> Any:
    """Build the dashboard figure (no pyplot, so no global backend state is touched)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = panels_for(records)
    rows = math.ceil(len(panels) / 2)
    width, height = 15, 4 * rows
    fig = Figure(figsize=(width, height), dpi=100)
    # Fixed margins (inches) for the fixed grid: matplotlib's constrained layout took a third
    # of the drawing time, 0.6 s of every run's end on a 2-core CPU.
    fig.subplots_adjust(
        left=0.7 / width,
        right=1 - 0.7 / width,
        top=1 - 1.0 / height,
        bottom=0.55 / height,
        hspace=0.45,
        wspace=0.22,
    )
    axes = fig.subplots(rows, 2, sharex=True)
    warned = health_marks(records)
    for ax, panel in zip(axes.flat, panels, strict=True):
        _draw_panel(ax, panel, records)
        ax.tick_params(labelbottom=True)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for step in sorted(set(warned.values())):  # a health warning's first step
            ax.axvline(step, color="red", ls=":", lw=1.2, alpha=0.7)
    for ax in axes[-1]:
        ax.set_xlabel("rollout step", fontsize=9)
    fig.suptitle(title, fontsize=14, y=1 - 0.2 / height, va="top")
    if warned:
        text = ", ".join(f"{kind} (step {step})" for kind, step in warned.items())
        fig.text(
            0.5,
            1 - 0.55 / height,
            f"health warnings (red dotted lines; docs/guides/run-health.md): {text}",
            ha="center",
            va="top",
            fontsize=10,
            color="red",
        )
    return fig


def health_marks(records: list[dict]) -> dict[str, int]:
    """Each health warning's kind and the first step its ``health/<kind>`` metric was set."""
    first: dict[str, int] = {}
    for rec in records:
        for key, value in rec.items():
            if key.startswith("health/") and key != "health/warnings" and value:
                first.setdefault(key.removeprefix("health/"), rec["step"])
    return first


def merge_steps(records: list[dict]) -> list[dict]:
    """One record per step, in step order: the records of a step merged, later values
    winning (the trainer logs the final held-out accuracy as a second record of the last
    step; step 0 holds the accuracy before training)."""
    by_step: dict[int, dict] = {}
    for rec in records:
        step = rec.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step.setdefault(step, {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def _title(name: str, records: list[dict]) -> str:
    """``NAME — N rollout steps``, with the range when it is not 1..N (step 0, the
    evaluation before training, is no rollout step)."""
    steps = [rec["step"] for rec in records if rec["step"] > 0]
    title = f"{name} — {len(steps)} rollout steps"
    if steps and (steps[0], steps[-1]) != (1, len(steps)):
        title += f" (steps {steps[0]}–{steps[-1]})"
    return title


def plot_dashboard(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Render the run's metrics.jsonl to a PNG grid of panels; return the PNG path.

    ``run_dir`` may also be the metrics.jsonl file itself. Default output:
    ``run_dir/dashboard.png`` (written atomically).
    """
    file = metrics_file(run_dir)
    if not file.is_file():
        raise FileNotFoundError(
            f"no metrics file at {file}: give a run directory (a dapo train output_dir, "
            f"which holds {METRICS_FILE}) or the {METRICS_FILE} file itself"
        )
    run_dir = file.parent
    records = merge_steps(read_metrics(file))
    if not records:
        raise ValueError(f"{file} has no metric records")
    fig = _build_figure(records, _title(run_dir.resolve().name, records))

    out = Path(out_path) if out_path is not None else run_dir / DASHBOARD_FILE
    atomic_write(out, lambda f: fig.savefig(f, format="png"))
    return out
