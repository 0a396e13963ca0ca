"""The paper's ablation ladder (Table 1) on the built-in task, with an equal sample budget.

Each step of the ladder adds one technique to the one before (``dapo presets``): naive
GRPO, + overlong filtering, + clip-higher, + soft overlong punishment, + token-level loss,
+ dynamic sampling (= DAPO). Every step trains from the same warmed-up ``builtin:tiny``
with several seeds until it has generated ``--budget`` responses (``train.sample_budget``;
dynamic sampling spends part of its budget on groups it drops), measuring held-out accuracy
every ``--eval-every`` rollout steps. The script prints a table of final held-out accuracy
(mean and spread over seeds), the number of gradient steps DAPO needs to reach naive GRPO's
final accuracy, and writes the figures to JSON and the learning curves to a PNG.

    python benchmarks/bench_ablation.py                      # 6 steps x 3 seeds (long)
    python benchmarks/bench_ablation.py --jobs 2             # two runs at a time, 1 thread each
    python benchmarks/bench_ablation.py --presets grpo,dapo --seeds 0 --budget 2560

Runs go to ``--runs-dir``; a run whose ``summary.json`` exists is not repeated, so an
interrupted ladder continues where it stopped. ``--jobs 2`` trains two runs at once with
one thread each (accuracy does not depend on it; wall time does).

Clip-higher acts only when the policy moves between the sampling of a batch and its update,
i.e. with several optimizer updates per rollout step (``--updates-per-step``; the paper made
16). With one, the importance ratio is exactly 1 and the clip never binds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

from dapo.config import ABLATION_LADDER, PRESETS

LABELS = {
    "grpo": "naive GRPO",
    "grpo+overlong_filter": "+ overlong filtering",
    "grpo+clip_higher": "+ clip-higher",
    "grpo+soft_punish": "+ soft overlong punishment",
    "grpo+token_loss": "+ token-level loss",
    "dapo": "+ dynamic sampling (DAPO)",
}


def train_run(preset: str, seed: int, args: argparse.Namespace, threads: int) -> Path:
    """One training run (skipped when it already finished); returns its directory."""
    out = Path(args.runs_dir) / preset / f"seed{seed}"
    if (out / "summary.json").exists():
        return out
    if out.exists():  # an interrupted run: start it again from scratch
        for p in sorted(out.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    per_step = args.prompts * args.generations
    cmd = [
        sys.executable, "-m", "dapo", "train", f"preset={preset}", f"seed={seed}",
        f"output_dir={out}", f"model.name_or_path={args.model}",
        f"train.sample_budget={args.budget}", f"train.steps={math.ceil(args.budget / per_step)}",
        f"train.prompts_per_step={args.prompts}",
        f"train.lr={args.lr}",
        f"train.mini_batch_size={args.prompts // args.updates_per_step}",
        f"rollout.num_generations={args.generations}",
        f"rollout.max_completion_length={args.max_length}",
        f"algorithm.overlong_buffer={args.overlong_buffer}",
        f"logging.eval_every={args.eval_every}", f"data.max_eval_prompts={args.eval_prompts}",
        "logging.console=false", "logging.tensorboard=false",
        "checkpoint.save_every=0", "checkpoint.save_final_model=false", *args.extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = out.parent / f"seed{seed}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{preset} seed {seed} failed ({proc.returncode}); see {log}")
    return out


def curve(run: Path, updates_per_step: int) -> dict[str, Any]:
    """Held-out accuracy against gradient steps and generated samples, from one run."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run / "summary.json").read_text())
    samples = {0: 0.0}
    points = [(0, summary["accuracy_before"])]
    entropy, length, truncated, clipped_high = [], [], [], []
    for r in rows:
        if "sampling/generated_samples_total" in r:
            samples[r["step"]] = r["sampling/generated_samples_total"]
            entropy.append(r.get("actor/entropy", float("nan")))
            length.append(r.get("response_length/mean", float("nan")))
            if "response_length/clip_ratio" in r:
                truncated.append(r["response_length/clip_ratio"])
            if "actor/clip_frac_high" in r:  # absent when a step made no update
                clipped_high.append(r["actor/clip_frac_high"])
        if "val/acc" in r and r["step"] > 0:
            points = [p for p in points if p[0] != r["step"]] + [(r["step"], r["val/acc"])]
    points.sort()
    return {
        "steps": [s * updates_per_step for s, _ in points],  # gradient steps
        "samples": [samples.get(s, float("nan")) for s, _ in points],
        "acc": [a for _, a in points],
        "final_acc": summary["accuracy_after"],
        "rollout_steps": summary["steps"],
        "gradient_steps": summary["steps"] * updates_per_step,
        "samples_generated": summary["samples_generated"],
        "final_entropy": entropy[-1] if entropy else float("nan"),
        "final_response_length": length[-1] if length else float("nan"),
        "truncated_frac": statistics.fmean(truncated) if truncated else float("nan"),
        "clip_frac_high": statistics.fmean(clipped_high) if clipped_high else float("nan"),
        "wall_s": summary["wall_seconds"],
    }


def steps_to_reach(target: float, steps: list[int], accs: list[float]) -> int | None:
    """The first evaluated step whose accuracy is at least ``target`` (None: never)."""
    return next((s for s, a in zip(steps, accs, strict=True) if a >= target), None)


def mean_curve(curves: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """Mean accuracy over seeds at the steps every seed evaluated."""
    common = sorted(set.intersection(*(set(c["steps"]) for c in curves)))
    accs = [statistics.fmean(c["acc"][c["steps"].index(s)] for c in curves) for s in common]
    return common, accs


def summarize(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = {}
    for preset, runs in curves.items():
        finals = [c["final_acc"] for c in runs]
        rows[preset] = {
            "label": LABELS.get(preset, preset),
            "final_acc_mean": statistics.fmean(finals),
            "final_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_acc_min": min(finals),
            "final_acc_max": max(finals),
            "final_acc": finals,
            "gradient_steps_mean": statistics.fmean(c["gradient_steps"] for c in runs),
            "samples_generated_mean": statistics.fmean(c["samples_generated"] for c in runs),
            "final_entropy_mean": statistics.fmean(c["final_entropy"] for c in runs),
            "final_response_length_mean": statistics.fmean(c["final_response_length"] for c in runs),
            "truncated_frac_mean": statistics.fmean(c["truncated_frac"] for c in runs),
            "clip_frac_high_mean": statistics.fmean(c["clip_frac_high"] for c in runs),
            "wall_s_mean": statistics.fmean(c["wall_s"] for c in runs),
        }
    out: dict[str, Any] = {"rows": rows}
    if "grpo" in curves and "dapo" in curves:
        target = rows["grpo"]["final_acc_mean"]
        steps, accs = mean_curve(curves["dapo"])
        out["dapo_steps_to_grpo_final"] = steps_to_reach(target, steps, accs)
        out["grpo_gradient_steps"] = rows["grpo"]["gradient_steps_mean"]
    return out


def plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for preset, runs in curves.items():
        steps, accs = mean_curve(runs)
        label = LABELS.get(preset, preset)
        samples = [statistics.fmean(c["samples"][c["steps"].index(s)] for c in runs) for s in steps]
        lo = [min(c["acc"][c["steps"].index(s)] for c in runs) for s in steps]
        hi = [max(c["acc"][c["steps"].index(s)] for c in runs) for s in steps]
        (line,) = axes[0].plot(samples, accs, marker="o", ms=3, label=label)
        axes[0].fill_between(samples, lo, hi, alpha=0.12, color=line.get_color())
        axes[1].plot(steps, accs, marker="o", ms=3, label=label, color=line.get_color())
    axes[0].set_xlabel("generated responses")
    axes[1].set_xlabel("gradient steps")
    for ax in axes:
        ax.set_ylabel("held-out accuracy (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0].set_title("same sample budget (band: min-max over seeds)")
    axes[1].set_title("against gradient steps")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict[str, Any], seeds: int) -> str:
    lines = [
        f"| step | held-out accuracy (mean ± std over {seeds} seeds) | min-max | gradient steps "
        "| final entropy | final length | truncated | clipped high |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"].values():
        lines.append(
            f"| {r['label']} | {r['final_acc_mean']:.1%} ± {r['final_acc_std']:.1%} | "
            f"{r['final_acc_min']:.1%}-{r['final_acc_max']:.1%} | {r['gradient_steps_mean']:.0f} | "
            f"{r['final_entropy_mean']:.3f} | {r['final_response_length_mean']:.1f} | "
            f"{r['truncated_frac_mean']:.1%} | {r['clip_frac_high_mean']:.2%} |"
        )
    if "dapo_steps_to_grpo_final" in result:
        n = result["dapo_steps_to_grpo_final"]
        target = f"naive GRPO's final accuracy ({result['rows']['grpo']['final_acc_mean']:.1%})"
        reach = (
            f"DAPO does not reach {target} at any evaluation within the budget"
            if n is None
            else f"DAPO reaches {target} after {n} gradient steps"
        )
        lines.append("")
        lines.append(f"{reach} (naive GRPO made {result['grpo_gradient_steps']:.0f}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(ABLATION_LADDER))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=10240, help="generated responses per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument(
        "--updates-per-step", type=int, default=4,
        help="optimizer updates per rollout step (the paper: 16); with 1 the ratio is always 1 "
        "and clip-higher has nothing to clip",
    )
    parser.add_argument(
        "--lr", type=float, default=4e-5,
        help="learning rate; 4e-5 x 4 updates moves the policy about as far per rollout step "
        "as the default 1.5e-4 x 1 update (1.5e-4 x 4 was unstable)",
    )
    parser.add_argument(
        "--max-length", type=int, default=44,
        help="response limit L_max in tokens; 44 cuts off the worked solutions that end with a "
        "carry line (13%% of the warmed-up model's responses, ~24%% during training), so "
        "overlong filtering and punishment have something to act on",
    )
    parser.add_argument("--overlong-buffer", type=int, default=8, help="L_cache in tokens")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=500)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    parser.add_argument("--threads", type=int, default=0, help="threads per run (0: cores / jobs)")
    parser.add_argument("--runs-dir", default="runs/ablation")
    parser.add_argument("--output", default="benchmarks/results/ablation.json")
    parser.add_argument("--plot", default="docs/benchmarks/ablation.png")
    parser.add_argument("extra", nargs="*", help="more key.path=value overrides for every run")
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; choose from {list(PRESETS)}")
    if args.updates_per_step < 1 or args.prompts % args.updates_per_step:
        parser.error(f"--updates-per-step {args.updates_per_step} must divide --prompts {args.prompts}")
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)

    t0 = time.time()
    jobs = [(p, s) for p in presets for s in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: train_run(job[0], job[1], args, threads), jobs))
    curves: dict[str, list[dict[str, Any]]] = {p: [] for p in presets}
    for (preset, _), run in zip(jobs, dirs, strict=True):
        curves[preset].append(curve(run, args.updates_per_step))

    result = summarize(curves)
    result.update(
        {
            **provenance(),
            "settings": {k: v for k, v in vars(args).items() if k != "extra"} | {"extra": args.extra},
            "curves": curves,
            "wall_s": time.time() - t0,
        }
    )
    plot(curves, Path(args.plot))
    print(table(result, len(seeds)))
    write_report(args.output, result, args.plot)
    return result


if __name__ == "__main__":
    main()
