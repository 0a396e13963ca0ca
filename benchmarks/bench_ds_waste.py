"""Dynamic-sampling waste: the share of generated responses that never train.

Dynamic sampling drops groups whose responses are all correct or all wrong (zero
advantage, no gradient) and generates more until the batch is full. Our sampler keeps the
surplus of the last round for the next step instead of discarding it (verl's recipe
discards it), so only the uniform groups, plus the surplus left when training ends, are
waste. The script reads the per-step sampling metrics of DAPO runs (``--runs``, e.g. the
ablation ladder's ``runs/ablation/dapo/seed*``) or trains one itself, prints the waste by
quarter of training, and plots it against training progress.

    python benchmarks/bench_ds_waste.py --runs runs/ablation/dapo/seed0 runs/ablation/dapo/seed1
    python benchmarks/bench_ds_waste.py --steps 60          # trains a DAPO run first
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)


def train(args: argparse.Namespace) -> Path:
    out = Path(args.runs_dir) / "dapo"
    if not (out / "summary.json").exists():
        cmd = [
            sys.executable, "-m", "dapo", "train", "preset=dapo", f"output_dir={out}",
            f"model.name_or_path={args.model}", f"train.steps={args.steps}",
            "evaluate=false", "logging.console=false", "logging.tensorboard=false",
            "checkpoint.save_every=0", "checkpoint.save_final_model=false", *args.extra,
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
                "all_correct": g * round(groups * r["sampling/all_correct_frac"]),
                "all_wrong": g * round(groups * r["sampling/all_wrong_frac"]),
                "uniform": g * round(groups * r["sampling/uniform_groups"]),
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
        axes[0].plot(x, acc, lw=0.8, ls=":", color=line.get_color(), label=f"{name}: sampled accuracy")
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=[], help="finished run directories")
    parser.add_argument("--steps", type=int, default=60, help="without --runs: steps to train")
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--runs-dir", default="runs/ds_waste")
    parser.add_argument("--output", default="benchmarks/results/ds_waste.json")
    parser.add_argument("--plot", default="docs/benchmarks/ds_waste.png")
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for the run it trains")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
