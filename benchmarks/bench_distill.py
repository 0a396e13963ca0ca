"""On-policy distillation against RL, at equal gradient steps: distillation alone, RL alone
(DAPO) and both, several seeds each.

The teacher must be better than the student on the task. By default it is made by a DAPO
run: ``--teacher-base`` (``builtin:tiny-long``) trained for ``--teacher-steps`` rollout
steps on the task (its final model, in ``<runs-dir>/teacher``), teaching a fresh
``--student`` (``builtin:tiny-long`` too, so both share the character tokenizer);
``--teacher PATH`` gives a ready teacher instead (e.g. ``builtin:tiny-long`` teaching
``--student builtin:tiny``: 22.3% against 13.0% held-out avg@1 on 300 problems). Teacher and
student are measured first (``dapo eval`` of each: held-out avg@k before any training, with
the task's own reward). Then every arm trains the student for ``--steps`` rollout steps of
``--updates-per-step`` optimizer updates, measuring held-out avg@k every ``--eval-every``
steps:

- ``rl``: DAPO on the task's reward (``preset=dapo``);
- ``distill``: ``algorithm.teacher=TEACHER algorithm.distill_only=true`` (no reward);
- ``both``: the reward's advantage plus ``--coef`` x the teacher's per-token signal.

The report has, per arm, the final accuracy (mean ± std over seeds), the mean held-out
accuracy against gradient steps and against wall time (the summed ``perf/step_s`` of the
rollout steps: generation, teacher scoring and updates, evaluations excluded), and the
gradient steps each arm needs to reach RL's final mean accuracy, with the claim to test:
distillation reaches it in at most a third of RL's steps. Figures go to JSON and one PNG.

    python benchmarks/bench_distill.py --jobs 2                     # 3 arms x 2 seeds
    python benchmarks/bench_distill.py --arms rl,distill --seeds 0 --steps 20

Runs go to ``--runs-dir``; a finished run (its ``summary.json`` exists) is not repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)
from bench_ablation import curve, dapo_train, run_dapo

ARMS = {"rl": "RL alone (DAPO)", "distill": "distillation alone", "both": "RL + distillation"}


def common_argv(args: argparse.Namespace, out: Path, seed: int) -> list[str]:
    """The settings every run shares: the task, batch shape, evaluation, logging."""
    return [
        f"seed={seed}",
        f"output_dir={out}",
        f"data.train={args.task}",
        f"data.eval={args.task}",
        f"train.prompts_per_step={args.prompts}",
        f"train.mini_batch_size={args.prompts // args.updates_per_step}",
        f"train.lr={args.lr}",
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
    ]


def arm_argv(arm: str, args: argparse.Namespace) -> list[str]:
    """What an arm changes: the teacher and whether the reward counts."""
    if arm == "rl":
        return ["preset=dapo"]
    teacher = [f"algorithm.teacher={args.teacher}", f"algorithm.distill_coef={args.coef}"]
    if arm == "distill":
        return ["preset=dapo", *teacher, "algorithm.distill_only=true"]
    return ["preset=dapo", *teacher]


def train_arm(arm: str, seed: int, args: argparse.Namespace, threads: int) -> Path:
    out = Path(args.runs_dir) / arm / f"seed{seed}"
    argv = [
        *common_argv(args, out, seed),
        f"model.name_or_path={args.student}",
        f"train.steps={args.steps}",
        *arm_argv(arm, args),
        *args.extra,
    ]
    dapo_train(out, argv, threads, f"{arm} seed {seed}")
    return out


def train_teacher(args: argparse.Namespace, threads: int) -> str:
    """The teacher: ``--teacher`` as given, or ``--teacher-base`` after ``--teacher-steps``
    rollout steps of DAPO on the task (seed 1000, apart from the arms' seeds)."""
    if args.teacher:
        return args.teacher
    out = Path(args.runs_dir) / "teacher"
    argv = [
        *common_argv(args, out, 1000),
        f"model.name_or_path={args.teacher_base}",
        f"train.steps={args.teacher_steps}",
        "preset=dapo",
        "evaluate=false",
        "checkpoint.save_final_model=true",
        *args.extra,
    ]
    dapo_train(out, argv, threads, f"training the teacher from {args.teacher_base}")
    return str(out / "final_model")


def measure_model(name: str, model: str, args: argparse.Namespace, threads: int) -> float:
    """Held-out avg@k of ``model`` before training, as the runs evaluate (``dapo eval`` at
    temperature 1 and top-p 1, the task's reward), written to ``<runs-dir>/measure``."""
    out = Path(args.runs_dir) / "measure" / f"{name}.json"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["eval", model, "--data", args.task]
        cmd += ["--k", str(args.eval_k), "--max-problems", str(args.eval_prompts)]
        cmd += ["--max-tokens", str(args.max_length), "--temperature", "1.0", "--top-p", "1.0"]
        if run_dapo([*cmd, "--output", str(out)], threads, out.with_suffix(".log")) != 0:
            raise RuntimeError(
                f"measuring the {name} {model} failed; see {out.with_suffix('.log')}"
            )
    return float(json.loads(out.read_text())["overall"][f"avg@{args.eval_k}"])


def wall_curve(run: Path, eval_steps: list[int]) -> list[float]:
    """Seconds of rollout steps (``perf/step_s`` summed) done at each evaluation step."""
    done, total = {0: 0.0}, 0.0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "perf/step_s" in row:
            total += row["perf/step_s"]
            done[row["step"]] = total
    return [done.get(s, total) for s in eval_steps]


def arm_curve(run: Path) -> dict[str, Any]:
    c = curve(run)
    c["eval_wall_s"] = wall_curve(run, c["eval_steps"])
    return {k: v for k, v in c.items() if k != "per_step"}


def mean_curve(runs: list[dict[str, Any]], x: str) -> tuple[list[float], list[float]]:
    """The seeds' mean accuracy at each evaluation (runs of an arm evaluate at the same steps)."""
    n = min(len(r["acc"]) for r in runs)
    xs = [statistics.fmean(r[x][i] for r in runs) for i in range(n)]
    return xs, [statistics.fmean(r["acc"][i] for r in runs) for i in range(n)]


def steps_to_reach(runs: list[dict[str, Any]], target: float) -> float | None:
    """The first gradient step at which the seeds' mean held-out accuracy reaches ``target``."""
    xs, ys = mean_curve(runs, "eval_grad_steps")
    return next((x for x, y in zip(xs, ys, strict=True) if y >= target), None)


def summarize(curves: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    finals = {a: [r["final_acc"] for r in runs] for a, runs in curves.items()}
    target = statistics.fmean(finals["rl"]) if "rl" in finals else None
    for arm, runs in curves.items():
        acc = finals[arm]
        rows[arm] = {
            "final_acc_mean": statistics.fmean(acc),
            "final_acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "final_acc_min": min(acc),
            "final_acc_max": max(acc),
            "gradient_steps": statistics.fmean(r["gradient_steps"] for r in runs),
            "train_s": statistics.fmean(r["eval_wall_s"][-1] for r in runs),
            "steps_to_rl_final": None if target is None else steps_to_reach(runs, target),
        }
    return {"rows": rows, "rl_final_acc": target}


def findings(summary: dict[str, Any]) -> dict[str, Any]:
    """The claim: distillation reaches RL's final accuracy in at most a third of RL's steps."""
    rows = summary["rows"]
    if "rl" not in rows or "distill" not in rows:
        return {}
    rl, dist = rows["rl"]["steps_to_rl_final"], rows["distill"]["steps_to_rl_final"]
    ratio = None if rl in (None, 0) or dist is None else dist / rl
    return {
        "rl_steps": rl,
        "distill_steps": dist,
        "distill_over_rl": ratio,
        "claim_third_holds": ratio is not None and ratio <= 1 / 3,
    }


def plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, runs in curves.items():
        for ax, x in zip(axes, ("eval_grad_steps", "eval_wall_s"), strict=True):
            xs, ys = mean_curve(runs, x)
            ax.plot(xs, ys, marker="o", label=ARMS[arm])
    axes[0].set_xlabel("gradient steps")
    axes[1].set_xlabel("wall time of the rollout steps (s)")
    for ax in axes:
        ax.set_ylabel("held-out avg@k (mean over seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summary: dict[str, Any], found: dict[str, Any], before: dict[str, float]) -> str:
    lines = [
        f"teacher {before['teacher']:.1%}, student {before['student']:.1%} held-out before training",
        "",
        "| arm | final acc (mean ± std) | min-max | gradient steps | train s | steps to RL's final |",
        "|---|---|---|---|---|---|",
    ]
    for arm, r in summary["rows"].items():
        reach = "never" if r["steps_to_rl_final"] is None else f"{r['steps_to_rl_final']:g}"
        lines.append(
            f"| {ARMS[arm]} | {r['final_acc_mean']:.1%} ± {r['final_acc_std']:.1%} | "
            f"{r['final_acc_min']:.1%}-{r['final_acc_max']:.1%} | {r['gradient_steps']:g} | "
            f"{r['train_s']:.0f} | {reach} |"
        )
    if found:
        ratio = found["distill_over_rl"]
        lines += [
            "",
            f"distillation / RL gradient steps to RL's final accuracy: "
            f"{'n/a' if ratio is None else f'{ratio:.2f}'}; at most 1/3: "
            f"{'yes' if found['claim_third_holds'] else 'no'}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help="rl, distill, both")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=40, help="rollout steps per run")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt")
    parser.add_argument("--updates-per-step", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill_coef")
    parser.add_argument("--max-length", type=int, default=84)
    parser.add_argument("--overlong-buffer", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--task", default="builtin:long_addition")
    parser.add_argument("--student", default="builtin:tiny-long")
    parser.add_argument(
        "--teacher", default=None, help="a ready teacher (default: train one, see --teacher-base)"
    )
    parser.add_argument("--teacher-base", default="builtin:tiny-long")
    parser.add_argument(
        "--teacher-steps", type=int, default=120, help="DAPO rollout steps that make the teacher"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once")
    parser.add_argument("--threads", type=int, default=0, help="threads per run (0: cores / jobs)")
    parser.add_argument("--runs-dir", default="runs/distill")
    parser.add_argument("--output", default="benchmarks/results/distill.json")
    parser.add_argument("--plot", default="docs/benchmarks/distill.png")
    parser.add_argument("extra", nargs="*", help="more key.path=value overrides for every run")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms {args.arms!r}: choose from {', '.join(ARMS)} (comma-separated)")
    if args.updates_per_step < 1 or args.prompts % args.updates_per_step:
        parser.error(
            f"--updates-per-step {args.updates_per_step} must divide --prompts {args.prompts}"
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)

    t0 = time.time()
    args.teacher = train_teacher(args, threads)
    with ThreadPoolExecutor(args.jobs) as pool:
        measured = pool.map(
            lambda nm: measure_model(*nm, args, threads),
            [("teacher", args.teacher), ("student", args.student)],
        )
        before = dict(zip(("teacher", "student"), measured, strict=True))
    print(
        f"held-out before training: teacher {before['teacher']:.1%}, student {before['student']:.1%}"
    )
    if before["teacher"] <= before["student"]:
        print("warning: the teacher is not better than the student on this task")
    jobs = [(a, s) for a in arms for s in seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(zip(jobs, pool.map(lambda j: train_arm(*j, args, threads), jobs), strict=True))
    curves = {a: [arm_curve(runs[(a, s)]) for s in seeds] for a in arms}
    summary = summarize(curves)
    found = findings(summary)
    plot(curves, Path(args.plot))
    print(table(summary, found, before))
    result: dict[str, Any] = {
        **provenance(),
        "before": before,
        **summary,
        "findings": found,
        "curves": curves,
        "settings": {k: v for k, v in vars(args).items() if k != "extra"} | {"extra": args.extra},
        "wall_s": time.time() - t0,
    }
    write_report(args.output, result, args.plot)
    return result


if __name__ == "__main__":
    main()
