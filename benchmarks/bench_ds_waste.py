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


# --- which groups are uniform, and could a rule have seen them coming? (--outcomes) -----


def record_outcomes(overrides: list[str], class_key: str | None) -> list[dict[str, Any]]:
    """Train in this process and record every generated group: its rollout step, prompt uid,
    class (the record's ``class_key`` field), correct responses and group size."""
    from dapo.config import load_config
    from dapo.training.trainer import Trainer

    cfg = load_config(None, overrides)
    rows: list[dict[str, Any]] = []

    class Recording(Trainer):
        def score(self, groups, records, step):  # type: ignore[no-untyped-def]
            scored = super().score(groups, records, step)
            for g in scored:
                rows.append({
                    "step": step, "uid": g.record.uid, "size": g.size, "correct": sum(g.correct),
                    "class": g.record.extra.get(class_key) if class_key else None,
                })  # fmt: skip
            return scored

    trainer = Recording(cfg, log=lambda _: None)
    try:
        while trainer.step < cfg.train.steps:
            trainer.train_step()
    finally:
        trainer.close()
    return rows


def _uniform(row: dict[str, Any]) -> bool:
    return row["correct"] in (0, row["size"])


def mixture_of_pass_rates(counts: list[int], size: int, grid: int = 101, iters: int = 3000) -> list[float]:
    """Weights on p = 0, 1/(grid-1), ..., 1 of the per-prompt pass rates that best explain
    the histogram of correct responses per group (binomial mixture, nonparametric maximum
    likelihood by EM)."""
    ps = [i / (grid - 1) for i in range(grid)]
    hist = [counts.count(k) / len(counts) for k in range(size + 1)]
    lik = [[math.comb(size, k) * p**k * (1 - p) ** (size - k) for p in ps] for k in range(size + 1)]
    w = [1 / grid] * grid
    for _ in range(iters):
        mix = [sum(lk[j] * w[j] for j in range(grid)) for lk in lik]
        w = [w[j] * sum(hist[k] * lik[k][j] / mix[k] for k in range(size + 1) if mix[k] > 0) for j in range(grid)]
    return w


def oracle_skip_bound(weights: list[float], size: int, cap: float) -> dict[str, float]:
    """The lowest share of uniform groups among those generated that any rule skipping
    prompts before generation can reach, knowing every prompt's pass rate p exactly, when
    no prompt may be skipped with a probability above ``cap`` (the best such rule skips,
    with probability ``cap``, the prompts whose chance of a uniform group is highest)."""
    grid = len(weights)
    u = [(j / (grid - 1)) ** size + (1 - j / (grid - 1)) ** size for j in range(grid)]
    best = {"uniform_share": sum(w * x for w, x in zip(weights, u, strict=True)), "skipped": 0.0}
    for threshold in sorted(set(u), reverse=True):
        kept = [w * (1 - cap if x >= threshold else 1) for w, x in zip(weights, u, strict=True)]
        if sum(kept) <= 0:
            continue
        share = sum(k * x for k, x in zip(kept, u, strict=True)) / sum(kept)
        if share < best["uniform_share"]:
            best = {"uniform_share": share, "skipped": 1 - sum(kept)}
    best["generated_per_trained"] = 1 / (1 - best["uniform_share"])
    return best


def outcome_analysis(rows: list[dict[str, Any]], caps: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)) -> dict[str, Any]:
    """Over the whole run and its last third: how often a prompt comes back, whether its last
    group predicts the next, the uniform shares by class, and the oracle bound."""
    last = max(r["step"] for r in rows) + 1
    late_from = 2 * last // 3
    seen: dict[str, dict[str, Any]] = {}
    repeats = {"all": [0, 0], "late": [0, 0]}
    after: dict[str, list[int]] = {"uniform": [0, 0], "mixed": [0, 0]}  # [groups, uniform]
    for r in rows:
        spans = ["all", "late"] if r["step"] >= late_from else ["all"]
        prev = seen.get(r["uid"])
        for span in spans:
            repeats[span][0] += 1
            repeats[span][1] += prev is not None
        if prev is not None and r["step"] >= late_from:
            kind = after["uniform" if _uniform(prev) else "mixed"]
            kind[0] += 1
            kind[1] += _uniform(r)
        seen[r["uid"]] = r
    late = [r for r in rows if r["step"] >= late_from]
    classes: dict[str, dict[str, float]] = {}
    for c in sorted({str(r["class"]) for r in late}):
        sel = [r for r in late if str(r["class"]) == c]
        classes[c] = {
            "share": len(sel) / len(late),
            "all_correct": sum(r["correct"] == r["size"] for r in sel) / len(sel),
            "all_wrong": sum(r["correct"] == 0 for r in sel) / len(sel),
        }
    size = late[0]["size"]
    counts = [r["correct"] for r in late]
    weights = mixture_of_pass_rates(counts, size)
    return {
        "steps": last,
        "late_from_step": late_from,
        "groups": len(rows),
        "distinct_prompts": len(seen),
        "revisit_share": repeats["all"][1] / repeats["all"][0],
        "revisit_share_late": repeats["late"][1] / repeats["late"][0],
        "uniform_share_late": sum(map(_uniform, late)) / len(late),
        "uniform_after_uniform_late": after["uniform"][1] / max(1, after["uniform"][0]),
        "uniform_after_mixed_late": after["mixed"][1] / max(1, after["mixed"][0]),
        "revisits_late": {k: v[0] for k, v in after.items()},
        "correct_histogram_late": [counts.count(k) / len(counts) for k in range(size + 1)],
        "by_class_late": classes,
        "pass_rate_mixture_late": {f"{j / (len(weights) - 1):.2f}": w for j, w in enumerate(weights) if w > 1e-4},
        "oracle": {str(cap): oracle_skip_bound(weights, size, cap) for cap in caps},
    }


def _bins(mixture: dict[str, float]) -> dict[str, float]:
    edges = [("< 0.1", 0.0, 0.1), ("0.1-0.7", 0.1, 0.7), ("0.7-0.95", 0.7, 0.95), (">= 0.95", 0.95, 1.01)]
    return {name: sum(w for p, w in mixture.items() if lo <= float(p) < hi) for name, lo, hi in edges}


def outcome_report(a: dict[str, Any]) -> str:
    lines = [
        f"{a['groups']} groups over {a['steps']} rollout steps, {a['distinct_prompts']} distinct prompts; "
        f"last third = steps {a['late_from_step']}-{a['steps'] - 1}",
        f"groups whose prompt was generated before: {a['revisit_share']:.1%} (last third {a['revisit_share_late']:.1%})",
        f"uniform groups in the last third: {a['uniform_share_late']:.1%}; among revisits, after a uniform "
        f"group {a['uniform_after_uniform_late']:.1%} (n={a['revisits_late']['uniform']}), after a mixed group "
        f"{a['uniform_after_mixed_late']:.1%} (n={a['revisits_late']['mixed']})",
        "correct responses per group, last third: "
        + " ".join(f"{k}:{v:.1%}" for k, v in enumerate(a["correct_histogram_late"])),
        "pass rates that explain it (share of prompts): "
        + ", ".join(f"p {name}: {w:.1%}" for name, w in _bins(a["pass_rate_mixture_late"]).items()),
        "",
        "| class | share of groups | all correct | all wrong |",
        "|---|---|---|---|",
    ]
    for c, v in a["by_class_late"].items():
        lines.append(f"| {c} | {v['share']:.1%} | {v['all_correct']:.1%} | {v['all_wrong']:.1%} |")
    lines += ["", "| skip cap | oracle: uniform share | generated / trained | prompts skipped |", "|---|---|---|---|"]
    for cap, o in a["oracle"].items():
        lines.append(
            f"| {cap} | {o['uniform_share']:.1%} | {o['generated_per_trained']:.2f} | {o['skipped']:.0%} |"
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
    parser.add_argument(
        "--outcomes", action="store_true",
        help="train in this process, record every group's outcome and report how predictable "
        "uniform groups were (revisits, persistence, classes, the oracle bound of any skip rule)",
    )  # fmt: skip
    parser.add_argument("--class-key", default="carries", help="--outcomes: record field that classes prompts")
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for the run it trains")
    args = parser.parse_args(argv)
    if args.outcomes:
        return outcomes_main(args)
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
        f"model.name_or_path={args.model}", f"train.steps={args.steps}", f"output_dir={args.runs_dir}/outcomes",
        "evaluate=false", "logging.console=false", "logging.tensorboard=false",
        "checkpoint.save_every=0", "checkpoint.save_final_model=false", *args.extra,
    ]  # fmt: skip
    rows = record_outcomes(overrides, args.class_key)
    result = {"outcomes": outcome_analysis(rows), "overrides": overrides, "rows": rows, **provenance()}
    print(outcome_report(result["outcomes"]))
    write_report(args.output, result)
    return result


if __name__ == "__main__":
    main()
