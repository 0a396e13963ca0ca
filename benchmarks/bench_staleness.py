"""Streaming rollouts: does training on stale data learn as much per gradient step?

The correctness sweep of ``rollout.max_staleness`` = N: for each task (by default the
default task, ``builtin:addition`` on ``builtin:tiny``, and ``builtin:long_addition`` on
``builtin:tiny-long``) it trains N = 0 (synchronous), and for every N > 0 one run with whole
responses and one with ``rollout.partial_rollouts=true``, plus ``--uncorrected`` N's
without the off-policy correction (``algorithm.is_cap=null``: the ratio is then taken
against the behaviour policy's log-probs, the direction AReaL's ablation shows), each with
``--seeds`` seeds. Every run measures held-out accuracy every ``--eval-every`` rollout steps
(``logging.eval_every``) and counts its gradient steps (``actor/updates``).

Per task it prints a table: the held-out gain (final minus initial accuracy; mean ± std and
min-max over seeds), the gain per 100 gradient steps, the staleness actually trained on
(``stream/staleness_mean`` / ``_max``), the groups dropped as too old and the responses
continued across an update, and whether the gain is within the seed spread of N = 0
(the two min-max ranges overlap) or beyond it, above or below. It writes the figures and
curves to JSON and a plot of held-out accuracy against gradient steps, one panel per task
and one line per variant (colour: N; dashed: partial rollouts; dotted: uncorrected).

    python benchmarks/bench_staleness.py --jobs 2                 # 2 tasks x 8 variants x 2 seeds
    python benchmarks/bench_staleness.py --tasks addition --ns 0,1 --seeds 0 --steps 4

Runs go to ``--runs-dir``; a run whose ``summary.json`` exists is not repeated (as in
``bench_ablation.py``), so an interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)
from bench_ablation import curve, dapo_train  # benchmarks/bench_ablation.py

# task name -> (data.train and data.eval, model, settings of the task)
TASKS: dict[str, tuple[str, str, list[str]]] = {
    "addition": ("builtin:addition", "builtin:tiny", []),
    "long_addition": (
        "builtin:long_addition",
        "builtin:tiny-long",
        # The ablation ladder's length limits for this task (bench_ablation.py).
        ["rollout.max_completion_length=84", "algorithm.overlong_buffer=16"],
    ),
}
# Per rollout step: metrics summed or averaged over a run.
STREAM_SUMS = ("stream/dropped_groups", "stream/partial_responses")
STREAM_MEANS = ("stream/staleness_mean", "stream/versions_per_response")


@dataclass(frozen=True)
class Variant:
    """One setting of the sweep: staleness bound, partial rollouts, the correction."""

    n: int
    partial: bool = False
    corrected: bool = True

    @property
    def name(self) -> str:
        return (
            f"N{self.n}"
            + ("-partial" if self.partial else "")
            + ("" if self.corrected else "-uncorrected")
        )

    @property
    def label(self) -> str:
        if self.n == 0:
            return "N=0 (synchronous)"
        return (
            f"N={self.n}"
            + (", partial rollouts" if self.partial else "")
            + (", no correction (is_cap=null)" if not self.corrected else "")
        )

    def overrides(self) -> list[str]:
        out = [f"rollout.max_staleness={self.n}"]
        if self.partial:
            out.append("rollout.partial_rollouts=true")
        if not self.corrected:
            out.append("algorithm.is_cap=null")
        return out


def variants(ns: list[int], partial: bool, uncorrected: list[int]) -> list[Variant]:
    """N = 0 once; every N > 0 with whole responses (and partial rollouts if ``partial``);
    each N of ``uncorrected`` without the correction."""
    out = [Variant(n) for n in ns]
    out += [Variant(n, partial=True) for n in ns if n > 0 and partial]
    out += [Variant(n, corrected=False) for n in uncorrected]
    return sorted(set(out), key=lambda v: (v.n, v.partial, not v.corrected))


def train_run(
    task: str, variant: Variant, seed: int, args: argparse.Namespace, threads: int
) -> Path:
    """One training run (skipped when it already finished); returns its directory."""
    data, model, settings = TASKS[task]
    out = Path(args.runs_dir) / task / variant.name / f"seed{seed}"
    argv = [
        f"seed={seed}",
        f"output_dir={out}",
        f"model.name_or_path={args.model or model}",
        f"data.train={data}",
        f"data.eval={data}",
        f"train.steps={args.steps}",
        f"train.prompts_per_step={args.prompts}",
        f"train.mini_batch_size={args.prompts // args.updates_per_step}",
        f"train.lr={args.lr}",
        f"rollout.num_generations={args.generations}",
        f"logging.eval_every={args.eval_every}",
        f"data.max_eval_prompts={args.eval_prompts}",
        f"rollout.eval_num_generations={args.eval_k}",
        "rollout.eval_top_p=1.0",  # the protocol of the figures in docs/benchmarks.md
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        *settings,
        *variant.overrides(),
        *args.extra,
    ]
    dapo_train(out, argv, threads, f"{task} {variant.name} seed {seed}")
    return out


def run_figures(run: Path) -> dict[str, Any]:
    """A run's curve (``bench_ablation.curve``) with its gain and the stream metrics."""
    c = curve(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "actor/updates" in r]
    c["gain"] = c["acc"][-1] - c["acc"][0]
    c["gain_per_100_grad_steps"] = (
        100 * c["gain"] / c["gradient_steps"] if c["gradient_steps"] else math.nan
    )
    for key in STREAM_SUMS:
        c[key] = sum(r.get(key, 0.0) for r in steps)
    for key in STREAM_MEANS:
        xs = [r[key] for r in steps if key in r]
        c[key] = statistics.fmean(xs) if xs else math.nan
    c["stream/staleness_max"] = max((r.get("stream/staleness_max", 0.0) for r in steps), default=0)
    del c["per_step"]  # the signals of bench_ablation's plots; not needed here
    return c


def spread_verdict(base: list[float], other: list[float]) -> str:
    """``within`` when the min-max ranges of the two seed sets overlap (or either has one
    seed: no spread to compare with, so nothing is beyond it), else ``above`` / ``below``."""
    if min(len(base), len(other)) < 2:
        return "within"
    if min(other) > max(base):
        return "above"
    if max(other) < min(base):
        return "below"
    return "within"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per variant: the gain over seeds, its verdict against N0's seed spread, stream figures."""
    rows: dict[str, dict[str, Any]] = {}
    base = [c["gain"] for c in runs["N0"]] if "N0" in runs else None
    for name, cs in runs.items():
        gains = [c["gain"] for c in cs]
        rows[name] = {
            "gain": gains,
            "gain_mean": statistics.fmean(gains),
            "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0,
            "gain_min": min(gains),
            "gain_max": max(gains),
            "acc_before_mean": statistics.fmean(c["acc"][0] for c in cs),
            "final_acc_mean": statistics.fmean(c["final_acc"] for c in cs),
            "gradient_steps_mean": statistics.fmean(c["gradient_steps"] for c in cs),
            "gain_per_100_grad_steps_mean": statistics.fmean(
                c["gain_per_100_grad_steps"] for c in cs
            ),
            "vs_N0": spread_verdict(base, gains) if base is not None else None,
            "staleness_max": max(c["stream/staleness_max"] for c in cs),
        } | {key: statistics.fmean(c[key] for c in cs) for key in (*STREAM_SUMS, *STREAM_MEANS)}
    return rows


def table(task: str, rows: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    lines = [
        f"## {task}",
        "",
        "| variant | held-out gain (mean ± std) | min-max | gain / 100 gradient steps | "
        "gradient steps | staleness mean / max | dropped groups | continued responses | "
        "vs N=0's seed spread |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        stale = (
            "-"
            if math.isnan(r["stream/staleness_mean"])
            else f"{r['stream/staleness_mean']:.2f} / {r['staleness_max']:.0f}"
        )
        lines.append(
            f"| {labels[name]} | {r['gain_mean']:+.1%} ± {r['gain_std']:.1%} | "
            f"{r['gain_min']:+.1%} to {r['gain_max']:+.1%} | "
            f"{r['gain_per_100_grad_steps_mean']:+.2%} | {r['gradient_steps_mean']:.0f} | "
            f"{stale} | {r['stream/dropped_groups']:.1f} | "
            f"{r['stream/partial_responses']:.1f} | "
            f"{'-' if name == 'N0' or r['vs_N0'] is None else r['vs_N0']} |"
        )
    return "\n".join(lines)


def plot(curves: dict[str, dict[str, list[dict[str, Any]]]], vs: list[Variant], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 5), squeeze=False)
    colours = {n: f"C{i}" for i, n in enumerate(sorted({v.n for v in vs}))}
    for ax, (task, runs) in zip(axes.flat, curves.items(), strict=True):
        for v in vs:
            cs = runs[v.name]
            k = min(len(c["acc"]) for c in cs)
            xs = [statistics.fmean(c["eval_grad_steps"][i] for c in cs) for i in range(k)]
            ys = [statistics.fmean(c["acc"][i] for c in cs) for i in range(k)]
            style = ":" if not v.corrected else "--" if v.partial else "-"
            ax.plot(xs, ys, style, marker="o", ms=3, color=colours[v.n], label=v.label)
            ax.fill_between(
                xs,
                [min(c["acc"][i] for c in cs) for i in range(k)],
                [max(c["acc"][i] for c in cs) for i in range(k)],
                alpha=0.08,
                color=colours[v.n],
            )
        ax.set_title(f"{task}: held-out avg@k (band: min-max over seeds)", fontsize=10)
        ax.set_xlabel("gradient steps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Streaming rollouts: held-out accuracy against gradient steps, by max_staleness")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"some of {','.join(TASKS)}")
    parser.add_argument("--ns", default="0,1,2,4", help="rollout.max_staleness values")
    parser.add_argument(
        "--partial",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run every N > 0 with rollout.partial_rollouts=true",
    )
    parser.add_argument(
        "--uncorrected", default="4", help="N's also run with algorithm.is_cap=null ('' for none)"
    )
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=40, help="rollout steps per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument(
        "--updates-per-step", type=int, default=4, help="optimizer updates per rollout step"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        help="learning rate (the ablation ladder's, for 4 updates)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=8, help="rollout steps between evaluations"
    )
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-k", type=int, default=4, help="held-out avg@k: samples per problem")
    parser.add_argument("--model", default="", help="one model for every task (default: its own)")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    parser.add_argument("--threads", type=int, default=0, help="threads per run (0: cores / jobs)")
    parser.add_argument("--runs-dir", default="runs/staleness")
    parser.add_argument("--output", default="benchmarks/results/staleness.json")
    parser.add_argument("--plot", default="docs/benchmarks/staleness.png")
    parser.add_argument("extra", nargs="*", help="more key.path=value overrides for every run")
    args = parser.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        parser.error(f"--tasks {args.tasks!r}: choose from {', '.join(TASKS)}")
    ns, uncorrected, seeds = _ints(args.ns), _ints(args.uncorrected), _ints(args.seeds)
    if 0 not in ns or any(n < 0 for n in ns + uncorrected) or 0 in uncorrected:
        parser.error(
            f"--ns {args.ns!r} must include 0 (the synchronous baseline) and be >= 0; "
            f"--uncorrected {args.uncorrected!r} must be >= 1"
        )
    if not seeds:
        parser.error("--seeds: give at least one seed, e.g. 0,1")
    if args.updates_per_step < 1 or args.prompts % args.updates_per_step:
        parser.error(
            f"--updates-per-step {args.updates_per_step} must divide --prompts {args.prompts}"
        )
    vs = variants(ns, args.partial, uncorrected)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)

    t0 = time.time()
    jobs = [(t, v, s) for t in tasks for v in vs for s in seeds]
    done = sum(
        (Path(args.runs_dir) / t / v.name / f"seed{s}" / "summary.json").exists()
        for t, v, s in jobs
    )
    print(
        f"{len(jobs)} runs ({done} already done), {args.jobs} at a time, {threads} thread(s) each"
    )
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: train_run(*job, args, threads), jobs))
    by_job = dict(zip(jobs, dirs, strict=True))

    labels = {v.name: v.label for v in vs}
    result: dict[str, Any] = {**provenance(), "variants": labels, "tasks": {}}
    curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task in tasks:
        curves[task] = {v.name: [run_figures(by_job[(task, v, s)]) for s in seeds] for v in vs}
        rows = summarize(curves[task])
        result["tasks"][task] = {"rows": rows, "curves": curves[task]}
        print()
        print(table(task, rows, labels))
    print(
        "\nvs N=0: within when the variant's min-max gain over seeds overlaps N=0's, "
        "above / below when it lies entirely beyond it."
    )
    plot(curves, vs, Path(args.plot))
    result["settings"] = {k: v for k, v in vars(args).items() if k != "extra"} | {
        "extra": args.extra
    }
    result["wall_s"] = time.time() - t0
    result["runs"] = len(jobs)
    write_report(args.output, result, args.plot)
    return result


if __name__ == "__main__":
    main()
