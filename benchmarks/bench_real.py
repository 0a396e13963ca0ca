"""The real model on this CPU: SmolLM2-135M-Instruct (``builtin:smollm2``) on
``builtin:chat_addition``, with the settings of ``examples/chat_addition.yaml`` (``make
train-real``).

Two reports:

- ``compare``: DAPO against naive GRPO and against DAPO without clip-higher, at equal
  gradient steps: every variant makes ``--steps`` rollout steps of ``prompts_per_step /
  mini_batch_size`` optimizer updates (dynamic sampling generates more to fill its batch,
  GRPO trains on what it generated), seeds ``--seeds``. Prints held-out accuracy before and
  after per variant (mean, spread over seeds) with the signals the paper's claims are
  about (entropy, share of tokens clipped high and low, response length, uniform groups),
  and draws them side by side in one PNG. Clip-higher acts only with several updates per
  rollout step (the ratio is 1 at the first); the example's 4 updates give it room.
- ``time``: where a rollout step's time goes in given run directories: generation (prompt
  prefill and sampling), scoring and the update (``perf/gen_s``, ``perf/score_s``,
  ``perf/train_s``), medians over the steps after the first, with the tokens per second of
  each and the run's wall time.

    python benchmarks/bench_real.py compare --seeds 0,1 --steps 16
    python benchmarks/bench_real.py time runs/real runs/real_lora

Runs go to ``--runs-dir``; a run whose ``summary.json`` exists is not repeated. The accuracy
before training is measured once per seed by every variant (the same model, sampled).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from _report import ROOT, provenance, write_report  # benchmarks/_report.py (run as a script)
from bench_ablation import _mean, _mean_curve, _smooth, curve, dapo_train, separated

CONFIG = ROOT / "examples" / "chat_addition.yaml"
# name -> (label, preset, overrides)
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    "grpo": ("naive GRPO", "grpo", []),
    "dapo_no_clip_higher": ("DAPO without clip-higher", "dapo", ["algorithm.clip_high=0.2"]),
    "dapo": ("DAPO", "dapo", []),
}
SIGNALS = {  # per rollout step: metric -> name in the curves (bench_ablation.curve's)
    "actor/entropy": "entropy",
    "actor/clip_frac_low": "clip_low",
    "actor/clip_frac_high": "clip_high",
    "response_length/mean": "length",
    "reward/acc": "train_acc",
    "sampling/uniform_groups": "uniform",
}


def train_run(name: str, seed: int, args: argparse.Namespace) -> Path:
    """One run of ``name`` (skipped when it already finished); returns its directory."""
    out = Path(args.runs_dir) / name / f"seed{seed}"
    _, preset, overrides = VARIANTS[name]
    argv = [
        str(args.config),
        f"preset={preset}",
        f"seed={seed}",
        f"output_dir={out}",
        f"train.steps={args.steps}",
        f"data.max_eval_prompts={args.eval_prompts}",
        "rollout.eval_top_p=1.0",  # the protocol of the figures in docs/benchmarks.md
        "logging.console=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        *overrides,
        *args.extra,
    ]
    t0 = time.time()
    if dapo_train(out, argv, args.threads, f"{name} seed {seed}"):
        print(f"{name} seed {seed}: {time.time() - t0:.0f} s")
    return out


def signals(run: Path) -> dict[str, Any]:
    """bench_ablation's curve of a run, with this report's signals per rollout step."""
    c = curve(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_step = [r for r in rows if "sampling/generated_samples_total" in r]
    for key, name in SIGNALS.items():
        c["per_step"][name] = [r.get(key, math.nan) for r in per_step]
    c["acc_before"] = c["acc"][0]
    return c


def summarize(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per variant: held-out accuracy before and after over seeds, and each signal in the
    first and last quarter of the rollout steps (mean over seeds)."""
    rows = {}
    for name, runs in curves.items():
        finals = [c["final_acc"] for c in runs]
        gains = [c["final_acc"] - c["acc_before"] for c in runs]
        row = {
            "label": VARIANTS[name][0],
            "final_acc": finals,
            "final_acc_mean": statistics.fmean(finals),
            "final_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_acc_min": min(finals),
            "final_acc_max": max(finals),
            "acc_before": [c["acc_before"] for c in runs],
            "gain_mean": statistics.fmean(gains),
            "gradient_steps_mean": statistics.fmean(c["gradient_steps"] for c in runs),
            "samples_generated_mean": statistics.fmean(c["samples_generated"] for c in runs),
            "wall_s_mean": statistics.fmean(c["wall_s"] for c in runs),
        }
        for sig in SIGNALS.values():
            early, late, peak = [], [], []
            for c in runs:
                ys = c["per_step"][sig]
                q = max(1, len(ys) // 4)
                early.append(_mean(ys[:q]))
                late.append(_mean(ys[-q:]))
                peak.append(max((y for y in ys if not math.isnan(y)), default=math.nan))
            row[f"{sig}_early"], row[f"{sig}_late"] = _mean(early), _mean(late)
            row[f"{sig}_max"] = _mean(peak)
        rows[name] = row
    return rows


def compare_table(rows: dict[str, Any], seeds: int) -> str:
    lines = [
        f"| variant | held-out before | after (mean ± std, {seeds} seeds) | min-max | gradient "
        "steps | responses generated | entropy early → late | clipped high: late (largest "
        "step) | clipped low, late | length early → late | train accuracy early → late |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['label']} | {_mean(r['acc_before']):.1%} | {r['final_acc_mean']:.1%} ± "
            f"{r['final_acc_std']:.1%} | {r['final_acc_min']:.1%}-{r['final_acc_max']:.1%} | "
            f"{r['gradient_steps_mean']:.0f} | {r['samples_generated_mean']:.0f} | "
            f"{r['entropy_early']:.3f} → {r['entropy_late']:.3f} | {r['clip_high_late']:.2%} "
            f"({r['clip_high_max']:.2%}) | {r['clip_low_late']:.2%} | {r['length_early']:.1f} → "
            f"{r['length_late']:.1f} | {r['train_acc_early']:.1%} → {r['train_acc_late']:.1%} |"
        )
    if "grpo" in rows and "dapo" in rows:
        d = rows["dapo"]["final_acc_mean"] - rows["grpo"]["final_acc_mean"]
        beyond = "beyond" if separated(rows["grpo"], rows["dapo"]) else "within"
        lines.append(f"\nDAPO - naive GRPO: {d:+.1%} ({beyond} the seed spread).")
    if "dapo_no_clip_higher" in rows and "dapo" in rows:
        a, b = rows["dapo_no_clip_higher"], rows["dapo"]
        lines.append(
            f"Clip-higher (DAPO against DAPO without it): held-out {b['final_acc_mean'] - a['final_acc_mean']:+.1%} "
            f"({'beyond' if separated(a, b) else 'within'} the seed spread); entropy in the last "
            f"quarter {b['entropy_late']:.3f} against {a['entropy_late']:.3f} nats."
        )
    return "\n".join(lines)


def plot(curves: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("entropy", "token entropy (nats)"),
        ("clip_high", "share of tokens clipped high"),
        ("length", "response length (tokens)"),
        ("acc", "held-out accuracy (band: min-max over seeds)"),
        ("train_acc", "training accuracy (generated groups)"),
        ("clip_low", "share of tokens clipped low"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for name, runs in curves.items():
        color = None
        for ax, (sig, panel) in zip(axes.flat, panels, strict=True):
            if sig == "acc":
                k = min(len(c["acc"]) for c in runs)
                xs = [statistics.fmean(c["eval_grad_steps"][i] for c in runs) for i in range(k)]
                ys = [statistics.fmean(c["acc"][i] for c in runs) for i in range(k)]
                lo = [min(c["acc"][i] for c in runs) for i in range(k)]
                hi = [max(c["acc"][i] for c in runs) for i in range(k)]
                ax.plot(xs, ys, marker="o", ms=4, color=color, label=VARIANTS[name][0])
                ax.fill_between(xs, lo, hi, alpha=0.12, color=color)
            else:
                xs, ys = _mean_curve(runs, "grad_steps", sig)
                (line,) = ax.plot(xs, _smooth(ys, 3), lw=1.4, color=color, label=VARIANTS[name][0])
                color = line.get_color()
            ax.set_title(panel, fontsize=10)
    for ax in axes.flat:
        ax.set_xlabel("gradient steps", fontsize=9)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.time()
    # Seed-major: an interrupted comparison has whole seeds of every variant.
    dirs = {(v, s): train_run(v, s, args) for s in seeds for v in names}
    curves = {v: [signals(dirs[(v, s)]) for s in seeds] for v in names}
    rows = summarize(curves)
    print(compare_table(rows, len(seeds)))
    png = Path(args.plot)
    plot(
        curves,
        png,
        f"SmolLM2-135M-Instruct on builtin:chat_addition, {args.steps} rollout steps, mean "
        f"over {len(seeds)} seeds (signals: 3-step moving average)",
    )
    result = {
        **provenance(),
        "rows": rows,
        "curves": curves,
        "settings": {k: str(v) for k, v in vars(args).items() if k != "func"},
        "wall_s": time.time() - t0,
    }
    write_report(args.output, result, png)
    return result


def breakdown(run: Path) -> dict[str, Any]:
    """Where a run's rollout steps spent their time: medians over the steps after the first
    (which also warms up the kernels), with the tokens per second of each part."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "perf/step_s" in r]
    summary = json.loads((run / "summary.json").read_text())
    config = yaml.safe_load((run / "config.yaml").read_text())
    later = steps[1:] or steps

    def med(f: Any) -> float:
        return statistics.median(f(r) for r in later)

    def gen_tokens(r: dict[str, Any]) -> float:
        return r["perf/rollout_tokens_per_s"] * r["perf/gen_s"]

    prev = {r["step"]: r["sampling/generated_samples_total"] for r in steps}
    responses = [
        r["sampling/generated_samples_total"] - prev.get(r["step"] - 1, 0.0) for r in later
    ]
    return {
        "run": str(run),
        "steps": len(steps),
        "wall_seconds": summary["wall_seconds"],
        "trainable_parameters": summary["trainable_parameters"],
        "precision": config["train"]["precision"],
        "lora_rank": config["model"]["lora"]["rank"],
        "step_s": med(lambda r: r["perf/step_s"]),
        "gen_s": med(lambda r: r["perf/gen_s"]),
        "score_s": med(lambda r: r["perf/score_s"]),
        "train_s": med(lambda r: r["perf/train_s"]),
        "gen_share": med(lambda r: r["perf/gen_s"] / r["perf/step_s"]),
        "train_share": med(lambda r: r["perf/train_s"] / r["perf/step_s"]),
        "responses_per_step": statistics.median(responses),
        "gen_tokens_per_s": med(lambda r: r["perf/rollout_tokens_per_s"]),
        "score_tokens_per_s": med(lambda r: gen_tokens(r) / max(r["perf/score_s"], 1e-9)),
        "train_tokens_per_s": med(lambda r: r["perf/train_tokens_per_s"]),
        "updates_per_step": med(lambda r: r.get("actor/updates", 0.0)),
    }


def time_report(args: argparse.Namespace) -> dict[str, Any]:
    runs = [breakdown(Path(r)) for r in args.runs]
    lines = [
        "| run | precision, LoRA rank | trained parameters | median step | generation | scoring | update | "
        "generated tokens/s | scored tokens/s | trained tokens/s | responses per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b in runs:
        lines.append(
            f"| {b['run']} | {b['precision']}, {b['lora_rank'] or 'full'} | "
            f"{b['trainable_parameters'] / 1e6:.1f}M | "
            f"{b['step_s']:.1f} s | {b['gen_s']:.1f} s ({b['gen_share']:.0%}) | "
            f"{b['score_s'] * 1000:.0f} ms | {b['train_s']:.1f} s ({b['train_share']:.0%}) | "
            f"{b['gen_tokens_per_s']:.0f} | {b['score_tokens_per_s']:.0f} | "
            f"{b['train_tokens_per_s']:.0f} | {b['responses_per_step']:.0f} |"
        )
    print("\n".join(lines))
    result = {**provenance(), "runs": runs}
    if args.output:
        write_report(args.output, result)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="DAPO vs naive GRPO vs DAPO without clip-higher")
    c.add_argument("--variants", default=",".join(VARIANTS))
    c.add_argument("--seeds", default="0,1")
    c.add_argument("--steps", type=int, default=16, help="rollout steps per run")
    c.add_argument("--eval-prompts", type=int, default=200, help="held-out problems")
    c.add_argument("--config", default=str(CONFIG), help="the YAML every run starts from")
    c.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    c.add_argument("--runs-dir", default="runs/real_compare")
    c.add_argument("--output", default="benchmarks/results/real_compare.json")
    c.add_argument("--plot", default="docs/benchmarks/real_dapo_vs_grpo.png")
    c.add_argument("extra", nargs="*", help="more key.path=value overrides for every run")
    c.set_defaults(func=compare)
    t = sub.add_parser("time", help="a rollout step's time split, from run directories")
    t.add_argument("runs", nargs="+", help="run directories (metrics.jsonl, summary.json)")
    t.add_argument("--output", default=None, help="JSON report (default: none)")
    t.set_defaults(func=time_report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    main()
