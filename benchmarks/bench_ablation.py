"""The paper's ablation ladder (Table 1) in miniature, at equal gradient steps and at equal
generation budget.

Each rung adds one technique to the one before (``dapo presets``): naive GRPO, + overlong
filtering, + clip-higher, + soft overlong punishment, + token-level loss, + dynamic sampling
(= DAPO). Every run trains from the same warmed-up model (by default ``builtin:tiny-long`` on
``builtin:long_addition``, the task made for this ladder) with several seeds, measuring
held-out avg@k every ``--eval-every`` rollout steps. Two comparisons:

- **equal gradient steps** (``steps``): every rung makes ``--steps`` rollout steps of
  ``--updates-per-step`` optimizer updates. Dynamic sampling generates more to get there.
- **equal generation budget** (``budget``): every rung stops after generating
  ``--steps x --prompts x --generations`` responses. Dynamic sampling spends part of it on
  groups it drops, so it makes fewer gradient steps.

Without dynamic sampling a rung generates exactly that budget in exactly that many steps, so
its runs serve both comparisons; only the DAPO rung is trained twice. The script prints, per
comparison, a table of final held-out avg@k (mean ± std and min-max over seeds) with the
training signals (entropy, clip fractions, length, truncation, uniform groups), what the
ladder shows against the paper's claims, and writes the figures to JSON and the curves of
every signal per rung to one PNG per comparison.

    python benchmarks/bench_ablation.py --jobs 2                # 6 rungs x 3 seeds, both (~50 min)
    python benchmarks/bench_ablation.py --presets grpo,dapo --seeds 0 --modes steps

Runs go to ``--runs-dir``; a run whose ``summary.json`` exists is not repeated, so an
interrupted ladder continues where it stopped. ``--jobs 2`` trains two runs at once with
one thread each (results do not depend on it; wall time does).

Clip-higher acts only when the policy moves between the sampling of a batch and its update,
i.e. with several optimizer updates per rollout step (``--updates-per-step``; the paper made
16). With one, the importance ratio is exactly 1 and the clip never binds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _in_process import in_process, run_here  # benchmarks/_in_process.py (run as a script)
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
MODES = {"steps": "equal gradient steps", "budget": "equal generation budget"}
# Per rollout step: the metric in metrics.jsonl -> its name in the curves.
SIGNALS = {
    "actor/entropy": "entropy",
    "actor/clip_frac_low": "clip_low",
    "actor/clip_frac_high": "clip_high",
    "response_length/mean": "length",
    "response_length/clip_ratio": "truncated",
    "sampling/all_correct_frac": "all_correct",
    "sampling/all_wrong_frac": "all_wrong",
}


def uses_dynamic_sampling(preset: str) -> bool:
    return bool(PRESETS[preset][1]["algorithm.dynamic_sampling"])


def clips_higher(preset: str) -> bool:
    settings = PRESETS[preset][1]
    return settings["algorithm.clip_high"] > settings["algorithm.clip_low"]


def run_dir(args: argparse.Namespace, preset: str, seed: int, mode: str) -> Path:
    """Where a run lives; rungs without dynamic sampling share one run between the modes."""
    name = f"seed{seed}-{mode}" if uses_dynamic_sampling(preset) else f"seed{seed}"
    return Path(args.runs_dir) / preset / name


def dapo_train(out: Path, argv: list[str], threads: int, what: str) -> bool:
    """``dapo train *argv`` writing to ``out`` (``output_dir=out`` must be in ``argv``), its
    console output in ``out``'s sibling ``<name>.log``; skipped when ``out`` holds a finished
    run (``summary.json``), an interrupted run there is started again from scratch. Returns
    whether it trained; a failed run raises, naming ``what`` and the log (:func:`run_dapo`)."""
    if (out / "summary.json").exists():
        return False
    if out.exists():
        shutil.rmtree(out)
    log = out.parent / f"{out.name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    status = run_dapo(["train", *argv], threads, log)
    if status != 0:
        raise RuntimeError(f"{what} failed ({status}); see {log}")
    return True


def run_dapo(command: list[str], threads: int, log: Path) -> int:
    """``dapo *command`` on ``threads`` threads, its console output in ``log``; its exit
    status. A fresh process, or with ``DAPO_BENCH_IN_PROCESS=1`` (the smoke tests, at tiny
    sizes) this one, one command at a time (``_in_process``)."""
    if not in_process():
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with log.open("w") as fh:
            cmd = [sys.executable, "-m", "dapo", *command]
            return subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    from dapo.cli import main

    return run_here(lambda: main(command), threads, log)


def train_run(preset: str, seed: int, mode: str, args: argparse.Namespace, threads: int) -> Path:
    """One training run (skipped when it already finished); returns its directory."""
    out = run_dir(args, preset, seed, mode)
    # A run without dynamic sampling serves both comparisons: no budget, its steps end it.
    budget = args.steps * args.prompts * args.generations
    budget = budget if mode == "budget" and uses_dynamic_sampling(preset) else 0
    argv = [
        f"preset={preset}",
        f"seed={seed}",
        f"output_dir={out}",
        f"model.name_or_path={args.model}",
        f"data.train={args.task}",
        f"data.eval={args.task}",
        f"train.steps={args.steps}",
        f"train.sample_budget={budget}",
        f"train.prompts_per_step={args.prompts}",
        f"train.lr={args.lr}",
        f"rollout.temperature={args.temperature}",
        f"train.mini_batch_size={args.prompts // args.updates_per_step}",
        f"rollout.num_generations={args.generations}",
        f"rollout.max_completion_length={args.max_length}",
        f"algorithm.overlong_buffer={args.overlong_buffer}",
        f"logging.eval_every={args.eval_every}",
        f"data.max_eval_prompts={args.eval_prompts}",
        f"rollout.eval_num_generations={args.eval_k}",
        "rollout.eval_top_p=1.0",  # the protocol of the figures in docs/benchmarks.md
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        *args.extra,
    ]
    dapo_train(out, argv, threads, f"{preset} seed {seed} ({mode})")
    return out


def curve(run: Path) -> dict[str, Any]:
    """One run's curves: held-out accuracy at each evaluation, and every signal of
    ``SIGNALS`` at each rollout step, against gradient steps and generated responses."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run / "summary.json").read_text())
    per_step: dict[str, list[float]] = {"step": [], "grad_steps": [], "samples": []}
    per_step |= {name: [] for name in SIGNALS.values()}
    # A row's "step" counts the rollout steps done, so held-out accuracy logged at step s
    # was measured after s steps.
    grad_at = {0: 0.0}  # rollout steps done -> gradient steps made
    samples_at = {0: 0.0}
    grad = 0.0
    evals = {0: summary["accuracy_before"]}
    for r in rows:
        if "sampling/generated_samples_total" in r:
            grad += r.get("actor/updates", 0.0)
            grad_at[r["step"]] = grad
            samples_at[r["step"]] = r["sampling/generated_samples_total"]
            per_step["step"].append(r["step"])
            per_step["grad_steps"].append(grad)
            per_step["samples"].append(r["sampling/generated_samples_total"])
            for key, name in SIGNALS.items():  # absent (nan) when a step made no update
                per_step[name].append(r.get(key, math.nan))
        if "val/acc" in r and r["step"] > 0:
            evals[r["step"]] = r["val/acc"]
    steps = sorted(evals)
    return {
        "eval_steps": steps,
        "eval_grad_steps": [grad_at.get(s, grad) for s in steps],
        "eval_samples": [samples_at.get(s, math.nan) for s in steps],
        "acc": [evals[s] for s in steps],
        "final_acc": summary["accuracy_after"],
        "rollout_steps": summary["steps"],
        "gradient_steps": grad,
        "samples_generated": summary["samples_generated"],
        "wall_s": summary["wall_seconds"],
        "per_step": per_step,
    }


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if not math.isnan(x)]


def _mean(xs: list[float]) -> float:
    xs = _finite(xs)
    return statistics.fmean(xs) if xs else math.nan


def run_stats(c: dict[str, Any]) -> dict[str, float]:
    """Per-run figures: the signals early (first quarter of the rollout steps) and late
    (last quarter), and the largest per-step clip-high share."""
    s = c["per_step"]
    n = len(s["step"])
    q = max(1, n // 4)
    out = {f"{name}_early": _mean(s[name][:q]) for name in SIGNALS.values()}
    out |= {f"{name}_late": _mean(s[name][-q:]) for name in SIGNALS.values()}
    out["clip_high_max"] = max(_finite(s["clip_high"]), default=math.nan)
    return out


def summarize_mode(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per rung: final held-out avg@k over seeds and the per-run figures, averaged."""
    rows = {}
    for preset, runs in curves.items():
        finals = [c["final_acc"] for c in runs]
        stats = [run_stats(c) for c in runs]
        rows[preset] = {
            "label": LABELS.get(preset, preset),
            "final_acc": finals,
            "final_acc_mean": statistics.fmean(finals),
            "final_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_acc_min": min(finals),
            "final_acc_max": max(finals),
            "gradient_steps_mean": statistics.fmean(c["gradient_steps"] for c in runs),
            "samples_generated_mean": statistics.fmean(c["samples_generated"] for c in runs),
            "wall_s_mean": statistics.fmean(c["wall_s"] for c in runs),
        } | {key: _mean([s[key] for s in stats]) for key in stats[0]}
    return rows


def separated(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when, over two or more seeds, the seeds of ``b`` all beat, or all lose to, every
    seed of ``a`` (the min-max ranges do not overlap): a difference beyond the seed spread."""
    if min(len(a["final_acc"]), len(b["final_acc"])) < 2:
        return False  # one seed has no spread to compare with
    return b["final_acc_min"] > a["final_acc_max"] or b["final_acc_max"] < a["final_acc_min"]


def findings(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the ladder shows against the paper's claims, from one comparison's rows."""
    out: dict[str, Any] = {}
    order = [p for p in ABLATION_LADDER if p in rows]
    out["steps"] = [
        {
            "from": a,
            "to": b,
            "diff": rows[b]["final_acc_mean"] - rows[a]["final_acc_mean"],
            "separated": separated(rows[a], rows[b]),
        }
        for a, b in zip(order, order[1:], strict=False)
    ]
    if "grpo" in rows and "dapo" in rows:
        out["dapo_vs_grpo"] = {
            "diff": rows["dapo"]["final_acc_mean"] - rows["grpo"]["final_acc_mean"],
            "separated": separated(rows["grpo"], rows["dapo"]),
        }
    sym = [p for p in order if not clips_higher(p)]
    high = [p for p in order if clips_higher(p)]
    if sym and high:
        out["entropy_late_symmetric"] = _mean([rows[p]["entropy_late"] for p in sym])
        out["entropy_late_clip_higher"] = _mean([rows[p]["entropy_late"] for p in high])
    if "grpo+overlong_filter" in rows and "grpo+clip_higher" in rows:  # only the clip differs
        out["entropy_late_pair"] = [
            rows["grpo+overlong_filter"]["entropy_late"],
            rows["grpo+clip_higher"]["entropy_late"],
        ]
    best = max(order, key=lambda p: rows[p]["clip_high_max"])
    out["clip_high_max"] = {"preset": best, "value": rows[best]["clip_high_max"]}
    return out


def _mean_curve(runs: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """Mean over seeds of ``per_step[y]`` against the mean of ``per_step[x]``, up to the
    shortest run."""
    n = min(len(c["per_step"]["step"]) for c in runs)
    xs = [statistics.fmean(c["per_step"][x][i] for c in runs) for i in range(n)]
    ys = [_mean([c["per_step"][y][i] for c in runs]) for i in range(n)]
    return xs, ys


def _smooth(ys: list[float], k: int) -> list[float]:
    """Trailing moving average over ``k`` points (NaN-aware)."""
    return [_mean(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]


def plot(curves: dict[str, list[dict[str, Any]]], mode: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("acc", "held-out avg@k (band: min-max over seeds)"),
        ("entropy", "token entropy (nats)"),
        ("clip_low", "share of tokens clipped low"),
        ("clip_high", "share of tokens clipped high"),
        ("length", "response length (tokens)"),
        ("truncated", "truncated share"),
        ("all_correct", "all-correct groups"),
        ("all_wrong", "all-wrong groups"),
    ]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    xkey = "samples" if mode == "budget" else "grad_steps"
    xlabel = "generated responses" if mode == "budget" else "gradient steps"
    for preset, runs in curves.items():
        label = LABELS.get(preset, preset)
        color = None
        for ax, (name, title) in zip(axes.flat, panels, strict=True):
            if name == "acc":
                k = min(len(c["acc"]) for c in runs)
                xs = [statistics.fmean(c[f"eval_{xkey}"][i] for c in runs) for i in range(k)]
                accs = [statistics.fmean(c["acc"][i] for c in runs) for i in range(k)]
                lo = [min(c["acc"][i] for c in runs) for i in range(k)]
                hi = [max(c["acc"][i] for c in runs) for i in range(k)]
                (line,) = ax.plot(xs, accs, marker="o", ms=3, label=label)
                color = line.get_color()
                ax.fill_between(xs, lo, hi, alpha=0.12, color=color)
            else:
                xs, ys = _mean_curve(runs, xkey, name)
                ax.plot(xs, _smooth(ys, 5), label=label, color=color, lw=1.3)
            ax.set_title(title, fontsize=10)
    for ax in axes.flat:
        ax.set_xlabel(xlabel, fontsize=9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"Ablation ladder, {MODES[mode]}: mean over seeds (signals: 5-step moving average)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(rows: dict[str, Any], found: dict[str, Any], seeds: int, k: int) -> str:
    lines = [
        f"| rung | held-out avg@{k} (mean ± std, {seeds} seeds) | min-max | gradient steps "
        "| responses generated | entropy early → late | clipped low / high (late) | "
        "length early → late | truncated early → late | all-correct / all-wrong groups (late) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['label']} | {r['final_acc_mean']:.1%} ± {r['final_acc_std']:.1%} | "
            f"{r['final_acc_min']:.1%}-{r['final_acc_max']:.1%} | "
            f"{r['gradient_steps_mean']:.0f} | {r['samples_generated_mean']:.0f} | "
            f"{r['entropy_early']:.3f} → {r['entropy_late']:.3f} | "
            f"{r['clip_low_late']:.2%} / {r['clip_high_late']:.2%} | "
            f"{r['length_early']:.1f} → {r['length_late']:.1f} | "
            f"{r['truncated_early']:.1%} → {r['truncated_late']:.1%} | "
            f"{r['all_correct_late']:.0%} / {r['all_wrong_late']:.0%} |"
        )
    lines.append("")
    if "dapo_vs_grpo" in found:
        d = found["dapo_vs_grpo"]
        beyond = "beyond" if d["separated"] else "within"
        lines.append(f"DAPO - naive GRPO: {d['diff']:+.1%} ({beyond} the seed spread).")
    for s in found["steps"]:
        beyond = "beyond" if s["separated"] else "within"
        lines.append(
            f"{LABELS.get(s['to'], s['to'])} vs the rung before: {s['diff']:+.1%} "
            f"({beyond} the seed spread)"
        )
    if "entropy_late_symmetric" in found:
        lines.append(
            f"Entropy, last quarter: symmetric clip {found['entropy_late_symmetric']:.3f}, "
            f"clip-higher {found['entropy_late_clip_higher']:.3f} nats"
            + (
                " (+ overlong filtering vs + clip-higher, which differ only in the clip: "
                f"{found['entropy_late_pair'][0]:.3f} vs {found['entropy_late_pair'][1]:.3f})"
                if "entropy_late_pair" in found
                else ""
            )
        )
    c = found["clip_high_max"]
    lines.append(
        f"Largest share of tokens clipped high in a rollout step: {c['value']:.2%} "
        f"({LABELS.get(c['preset'], c['preset'])}, mean over seeds of each run's maximum)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(ABLATION_LADDER))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--modes",
        default="steps,budget",
        help="steps (equal gradient steps), budget (equal generation budget), or both",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="rollout steps per run; the budget is steps x prompts x generations responses",
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument(
        "--updates-per-step",
        type=int,
        default=4,
        help="optimizer updates per rollout step (the paper: 16); with 1 the ratio is always 1 "
        "and clip-higher has nothing to clip",
    )
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="rollout.temperature of the training rollouts (the loss uses it too); held-out "
        "avg@k samples at rollout.eval_temperature",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=84,
        help="response limit L_max in tokens; every clean long_addition solution fits, "
        "rambling ones do not",
    )
    parser.add_argument("--overlong-buffer", type=int, default=16, help="L_cache in tokens")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-k", type=int, default=4, help="held-out avg@k: samples per problem")
    parser.add_argument("--task", default="builtin:long_addition", help="data.train and data.eval")
    parser.add_argument("--model", default="builtin:tiny-long")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    parser.add_argument("--threads", type=int, default=0, help="threads per run (0: cores / jobs)")
    parser.add_argument("--runs-dir", default="runs/ablation_long")
    parser.add_argument("--output", default="benchmarks/results/ablation_long.json")
    parser.add_argument(
        "--plot",
        default="docs/benchmarks/ablation_long",
        help="plot path prefix: PREFIX_steps.png and PREFIX_budget.png",
    )
    parser.add_argument("extra", nargs="*", help="more key.path=value overrides for every run")
    args = parser.parse_args(argv)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; choose from {list(PRESETS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)} (comma-separated)")
    if args.updates_per_step < 1 or args.prompts % args.updates_per_step:
        parser.error(
            f"--updates-per-step {args.updates_per_step} must divide --prompts {args.prompts}"
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)

    t0 = time.time()
    jobs = {(p, s, m): run_dir(args, p, s, m) for m in modes for p in presets for s in seeds}
    unique = list({d: job for job, d in jobs.items()}.values())  # a shared run trains once
    done = sum((run_dir(args, *job) / "summary.json").exists() for job in unique)
    print(
        f"{len(unique)} runs ({done} already done), {args.jobs} at a time, {threads} thread(s) each"
    )
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda job: train_run(*job, args, threads), unique))

    result: dict[str, Any] = {**provenance(), "modes": {}}
    for mode in modes:
        curves = {p: [curve(jobs[(p, s, mode)]) for s in seeds] for p in presets}
        rows = summarize_mode(curves)
        found = findings(rows)
        result["modes"][mode] = {"rows": rows, "findings": found, "curves": curves}
        png = Path(f"{args.plot}_{mode}.png")
        plot(curves, mode, png)
        print(f"\n## {MODES[mode]}\n")
        print(table(rows, found, len(seeds), args.eval_k))
    result["settings"] = {k: v for k, v in vars(args).items() if k != "extra"} | {
        "extra": args.extra
    }
    result["wall_s"] = time.time() - t0
    result["runs"] = len(unique)
    write_report(args.output, result, *(f"{args.plot}_{m}.png" for m in modes))
    return result


if __name__ == "__main__":
    main()
