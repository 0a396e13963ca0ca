"""Dynamic-sampling waste: the share of generated responses that never train.

Dynamic sampling drops groups whose responses are all correct or all wrong (zero
advantage, no gradient) and generates more until the batch is full. Our sampler keeps the
surplus of the last round for the next step instead of discarding it (verl's recipe
discards it), so only the uniform groups, plus the surplus left when training ends, are
waste. The script reads the per-step sampling metrics of DAPO runs (``--runs``, e.g. the
ablation ladder's ``runs/ablation/dapo/seed*``) or trains one itself, prints the waste by
quarter of training, and plots it against training progress.

Three more modes measure what choosing prompts before generation can save
(``algorithm.skip_uniform_prompts``, ``data.curriculum``; docs/benchmarks.md section 7):
``--outcomes`` records every group of a run and measures whether uniform groups were
predictable (revisits, persistence, classes, the oracle bound of any skip rule);
``--compare`` trains whole default runs with and without them for several seeds and
compares responses generated per response trained, held-out accuracy and time;
``--simulate`` runs the skip rule on prompts of fixed pass rates (no model).

    python benchmarks/bench_ds_waste.py --runs runs/ablation/dapo/seed0 runs/ablation/dapo/seed1
    python benchmarks/bench_ds_waste.py --steps 60          # trains a DAPO run first
    python benchmarks/bench_ds_waste.py --outcomes --steps 150 seed=0
    python benchmarks/bench_ds_waste.py --compare off,skip,easy_first --seeds 0,1,2 --steps 150
    python benchmarks/bench_ds_waste.py --simulate
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from _prompt_outcomes import (  # benchmarks/_prompt_outcomes.py
    outcome_analysis,
    outcome_report,
    record_outcomes,
    simulation_report,
    simulation_table,
)
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)


def train(args: argparse.Namespace) -> Path:
    out = Path(args.runs_dir) / "dapo"
    if not (out / "summary.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "dapo",
            "train",
            "preset=dapo",
            f"output_dir={out}",
            f"model.name_or_path={args.model}",
            f"train.steps={args.steps}",
            "evaluate=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            *args.extra,
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def per_step(run: Path) -> list[dict[str, float]]:
    """Responses generated, dropped as uniform, and carried over at each rollout step."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    g = int(yaml.safe_load((run / "config.yaml").read_text())["rollout"]["num_generations"])
    out = []
    for r in rows:
        if "sampling/generated_groups" not in r:
            continue
        groups = r["sampling/generated_groups"]
        out.append(
            {
                "step": r["step"],
                "generated": g * groups,
                "all_correct": g * round(groups * r.get("sampling/all_correct_frac", 0.0)),
                "all_wrong": g * round(groups * r.get("sampling/all_wrong_frac", 0.0)),
                "uniform": g * round(groups * r.get("sampling/uniform_groups", 0.0)),
                "carried_over": g * r["sampling/carried_over"],
                "train_acc": r.get("reward/acc", float("nan")),
            }
        )
    if not out:
        raise ValueError(f"{run}/metrics.jsonl has no sampling metrics")
    return out


def waste(steps: list[dict[str, float]]) -> dict[str, float]:
    """Totals over a span of steps; ``final_surplus`` counts only if the span ends the run."""
    gen = sum(s["generated"] for s in steps)
    uniform = sum(s["uniform"] for s in steps)
    surplus = sum(s["carried_over"] for s in steps)
    return {
        "generated": gen,
        "uniform": uniform,
        "all_correct": sum(s["all_correct"] for s in steps),
        "all_wrong": sum(s["all_wrong"] for s in steps),
        "carried_over": surplus,
        "uniform_share": uniform / gen if gen else 0.0,
        # What discarding the surplus (instead of carrying it) would have wasted.
        "discard_surplus_share": (uniform + surplus) / gen if gen else 0.0,
    }


def analyse(runs: dict[str, list[dict[str, float]]], parts: int = 4) -> dict[str, Any]:
    result: dict[str, Any] = {"runs": {}}
    for name, steps in runs.items():
        total = waste(steps)
        final_surplus = steps[-1]["carried_over"]
        total["final_surplus"] = final_surplus
        total["wasted_share"] = (total["uniform"] + final_surplus) / total["generated"]
        n = len(steps)
        quarters = [waste(steps[i * n // parts : (i + 1) * n // parts]) for i in range(parts)]
        result["runs"][name] = {"total": total, "parts": quarters, "steps": steps}
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in result["runs"].items():
        steps = run["steps"]
        x = [s["step"] for s in steps]
        # A step served entirely from the carried-over surplus generated nothing.
        share = [s["uniform"] / s["generated"] if s["generated"] else math.nan for s in steps]
        (line,) = axes[0].plot(x, share, lw=1.2, label=f"{name}: dropped (uniform groups)")
        acc = [s["train_acc"] for s in steps]
        axes[0].plot(
            x, acc, lw=0.8, ls=":", color=line.get_color(), label=f"{name}: sampled accuracy"
        )
        cum_gen, cum_waste, cum_discard, ys, yd = 0.0, 0.0, 0.0, [], []
        for s in steps:
            cum_gen += s["generated"]
            cum_waste += s["uniform"]
            cum_discard += s["uniform"] + s["carried_over"]
            ys.append(cum_waste / cum_gen if cum_gen else math.nan)
            yd.append(cum_discard / cum_gen if cum_gen else math.nan)
        axes[1].plot(x, ys, color=line.get_color(), label=f"{name}: ours (surplus carried over)")
        axes[1].plot(x, yd, color=line.get_color(), ls="--", label=f"{name}: if surplus discarded")
    axes[0].set_title("per rollout step: share of generated responses dropped")
    axes[1].set_title("cumulative share of generated responses wasted")
    for ax in axes:
        ax.set_xlabel("rollout step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any]) -> str:
    lines = [
        "| run | generated | dropped: all correct | dropped: all wrong | surplus left at end "
        "| wasted | wasted if surplus were discarded | dropped by quarter of training |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in result["runs"].items():
        t = run["total"]
        quarters = " / ".join(f"{q['uniform_share']:.0%}" for q in run["parts"])
        lines.append(
            f"| {name} | {t['generated']:.0f} | {t['all_correct'] / t['generated']:.1%} | "
            f"{t['all_wrong'] / t['generated']:.1%} | {t['final_surplus']:.0f} | "
            f"{t['wasted_share']:.1%} | {t['discard_surplus_share']:.1%} | {quarters} |"
        )
    return "\n".join(lines)


# --- skipping and curriculum against plain dynamic sampling (--compare) ------------------

VARIANTS = {  # what --compare can run: name -> overrides on top of the default run
    "off": [],
    "skip": ["algorithm.skip_uniform_prompts=true"],
    "easy_first": ["data.curriculum=easy_first", "data.difficulty_key=carries"],
}


def train_variant(args: argparse.Namespace, variant: str, seed: int) -> Path:
    """A whole `dapo train` run (evaluation before and after included) of one variant."""
    out = Path(args.runs_dir) / variant / f"seed{seed}"
    if not (out / "summary.json").exists():
        cmd = [
            sys.executable,
            "-m",
            "dapo",
            "train",
            f"output_dir={out}",
            f"seed={seed}",
            f"model.name_or_path={args.model}",
            f"train.steps={args.steps}",
            "logging.console=false",
            "rollout.eval_top_p=1.0",  # the protocol of the figures in docs/benchmarks.md
            "logging.tensorboard=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            *VARIANTS[variant],
            *args.extra,
        ]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (out / "process_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return out


def run_figures(run: Path) -> dict[str, float]:
    """Responses generated per response trained (whole run, last third), waste, skip rate,
    held-out accuracy and times of a finished run."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    trained = cfg["train"]["prompts_per_step"] * cfg["rollout"]["num_generations"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "sampling/generated_groups" in r]
    steps = per_step(run)
    late = steps[2 * len(steps) // 3 :]
    late_rows = rows[2 * len(rows) // 3 :]
    summary = json.loads((run / "summary.json").read_text())
    seconds = run / "process_seconds.txt"
    return {
        "generated_per_trained": sum(s["generated"] for s in steps) / (trained * len(steps)),
        "generated_per_trained_late": sum(s["generated"] for s in late) / (trained * len(late)),
        "wasted_share": analyse({"run": steps})["runs"]["run"]["total"]["wasted_share"],
        "skip_rate_late": sum(r.get("sampling/skip_rate", 0.0) for r in late_rows) / len(late_rows),
        "accuracy_before": summary.get("accuracy_before", math.nan),
        "accuracy_after": summary.get("accuracy_after", math.nan),
        "train_seconds": sum(r["perf/step_s"] for r in rows),
        "run_seconds": summary["wall_seconds"],
        "process_seconds": float(seconds.read_text()) if seconds.exists() else math.nan,
    }


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def compare_table(result: dict[str, Any]) -> str:
    cols = [
        ("generated_per_trained_late", "generated / trained, last third", "{:.3f}"),
        ("generated_per_trained", "generated / trained, whole run", "{:.3f}"),
        ("wasted_share", "wasted", "{:.1%}"),
        ("skip_rate_late", "draws skipped, last third", "{:.1%}"),
        ("accuracy_after", "held-out accuracy after", "{:.1%}"),
        ("train_seconds", "training s", "{:.0f}"),
        ("process_seconds", "whole `dapo train` s", "{:.0f}"),
    ]
    lines = [
        "| variant | seeds | " + " | ".join(c[1] for c in cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for variant, runs in result["variants"].items():
        cells = []
        for key, _, fmt in cols:
            mean, std = _mean_std([r[key] for r in runs.values()])
            cells.append(f"{fmt.format(mean)} ± {fmt.format(std)}")
        lines.append(f"| {variant} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_main(args: argparse.Namespace) -> dict[str, Any]:
    variants = args.compare.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--compare: unknown variants {unknown}; choose from {list(VARIANTS)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    result: dict[str, Any] = {"steps": args.steps, "extra": args.extra, "variants": {}}
    for seed in seeds:  # seed-major: a variant's runs spread over the whole measurement
        for variant in variants:
            run = train_variant(args, variant, seed)
            result["variants"].setdefault(variant, {})[f"seed{seed}"] = run_figures(run)
    result["overrides"] = {v: VARIANTS[v] for v in variants}
    result.update(provenance())
    print(compare_table(result))
    write_report(args.output, result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=[], help="finished run directories")
    parser.add_argument("--steps", type=int, default=60, help="without --runs: steps to train")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--runs-dir", default="runs/ds_waste")
    parser.add_argument("--output", default="benchmarks/results/ds_waste.json")
    parser.add_argument("--plot", default="docs/benchmarks/ds_waste.png")
    parser.add_argument(
        "--outcomes",
        action="store_true",
        help="train in this process, record every group's outcome and report how predictable "
        "uniform groups were (revisits, persistence, classes, the oracle bound of any skip rule)",
    )
    parser.add_argument(
        "--class-key", default="carries", help="--outcomes: record field that classes prompts"
    )
    parser.add_argument(
        "--compare",
        default=None,
        help=f"train whole runs of these variants (comma-separated: {', '.join(VARIANTS)}) for "
        "each of --seeds and compare generation per trained response, accuracy and time",
    )
    parser.add_argument("--seeds", default="0,1,2", help="--compare: seeds, comma-separated")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="simulate the skip rule on prompts whose pass rates never change (seconds, no model)",
    )
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for the run it trains")
    args = parser.parse_args(argv)
    if args.outcomes:
        return outcomes_main(args)
    if args.compare:
        return compare_main(args)
    if args.simulate:
        result = {"simulation": simulation_table(), **provenance()}
        print(simulation_report(result["simulation"]))
        write_report(args.output, result)
        return result
    dirs = [Path(r) for r in args.runs] or [train(args)]
    runs = {}
    for d in dirs:
        if not (d / "metrics.jsonl").exists():
            parser.error(f"--runs: {d} has no metrics.jsonl; give finished run directories")
        runs[f"{d.parent.name}/{d.name}"] = per_step(d)
    result = analyse(runs)
    result.update(provenance())
    plot(result, Path(args.plot))
    print(table(result))
    write_report(args.output, result, args.plot)
    return result


def outcomes_main(args: argparse.Namespace) -> dict[str, Any]:
    overrides = [
        f"model.name_or_path={args.model}",
        f"train.steps={args.steps}",
        f"output_dir={args.runs_dir}/outcomes",
        "evaluate=false",
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        *args.extra,
    ]
    rows = record_outcomes(overrides, args.class_key)
    result = {"outcomes": outcome_analysis(rows), "overrides": overrides, **provenance()}
    print(outcome_report(result["outcomes"]))
    write_report(args.output, result)
    return {**result, "rows": rows}  # every group's outcome, for a caller to analyse further


if __name__ == "__main__":
    main()
