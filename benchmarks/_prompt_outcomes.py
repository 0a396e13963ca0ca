"""Which groups come out uniform, and could a rule have seen them coming? The analyses of
``bench_ds_waste.py --outcomes`` and its simulation of the skip rule (``--simulate``)."""

from __future__ import annotations

import math
from typing import Any


def record_outcomes(overrides: list[str], class_key: str | None) -> list[dict[str, Any]]:
    """Train in this process and record every generated group: its rollout step, prompt uid,
    class (the record's ``class_key`` field), correct responses and group size."""
    from dapo.config import load_config
    from dapo.training.trainer import Trainer

    cfg = load_config(None, overrides)
    rows: list[dict[str, Any]] = []

    trainer = Trainer(cfg, log=lambda _: None)
    score = trainer.rollouts.scorer.score

    def recording(groups, records, step, **kwargs):  # type: ignore[no-untyped-def]
        scored = score(groups, records, step, **kwargs)
        for g in scored:
            rows.append(
                {
                    "step": step,
                    "uid": g.record.uid,
                    "size": g.size,
                    "correct": sum(g.correct),
                    "class": g.record.extra.get(class_key) if class_key else None,
                }
            )
        return scored

    trainer.rollouts.scorer.score = recording  # every generated group passes here
    try:
        while trainer.step < cfg.train.steps:
            trainer.train_step()
    finally:
        trainer.close()
    return rows


def _uniform(row: dict[str, Any]) -> bool:
    return row["correct"] in (0, row["size"])


def mixture_of_pass_rates(
    counts: list[int], size: int, grid: int = 101, iters: int = 3000
) -> list[float]:
    """Weights on p = 0, 1/(grid-1), ..., 1 of the per-prompt pass rates that best explain
    the histogram of correct responses per group (binomial mixture, nonparametric maximum
    likelihood by EM)."""
    ps = [i / (grid - 1) for i in range(grid)]
    hist = [counts.count(k) / len(counts) for k in range(size + 1)]
    lik = [[math.comb(size, k) * p**k * (1 - p) ** (size - k) for p in ps] for k in range(size + 1)]
    w = [1 / grid] * grid
    for _ in range(iters):
        mix = [sum(lk[j] * w[j] for j in range(grid)) for lk in lik]
        w = [
            w[j] * sum(hist[k] * lik[k][j] / mix[k] for k in range(size + 1) if mix[k] > 0)
            for j in range(grid)
        ]
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


def outcome_analysis(
    rows: list[dict[str, Any]], caps: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)
) -> dict[str, Any]:
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
        "pass_rate_mixture_late": {
            f"{j / (len(weights) - 1):.2f}": w for j, w in enumerate(weights) if w > 1e-4
        },
        "oracle": {str(cap): oracle_skip_bound(weights, size, cap) for cap in caps},
    }


def _bins(mixture: dict[str, float]) -> dict[str, float]:
    edges = [
        ("< 0.1", 0.0, 0.1),
        ("0.1-0.7", 0.1, 0.7),
        ("0.7-0.95", 0.7, 0.95),
        (">= 0.95", 0.95, 1.01),
    ]
    return {
        name: sum(w for p, w in mixture.items() if lo <= float(p) < hi) for name, lo, hi in edges
    }


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
    lines += [
        "",
        "| skip cap | oracle: uniform share | generated / trained | prompts skipped |",
        "|---|---|---|---|",
    ]
    for cap, o in a["oracle"].items():
        lines.append(
            f"| {cap} | {o['uniform_share']:.1%} | {o['generated_per_trained']:.2f} | {o['skipped']:.0%} |"
        )
    return "\n".join(lines)


def simulate(
    *,
    solved: float,
    impossible: float,
    skip: bool,
    prompts: int = 1700,
    per_step: int = 50,
    size: int = 16,
    steps: int = 340,
    cap: float = 0.9,
    seed: int = 0,
) -> dict[str, float]:
    """Dynamic sampling, with or without the skip rule, on prompts of fixed pass rates: a
    share ``solved`` always right, ``impossible`` never, the rest with pass rates uniform
    in (0, 1). Uses dapo's own stream, history, skip rule and sampler; only the model is
    replaced by coins (no learning: each prompt's pass rate stays what it was drawn). The
    defaults mimic DAPO-Math-17k at a tenth of the scale: about 34 steps per epoch, 10 epochs,
    16 responses per prompt."""
    import random

    from dapo.data.prompts import PromptStream
    from dapo.producer.dynamic_sampling import DynamicSampler, ScoredGroup
    from dapo.producer.prompt_history import PromptHistory, should_skip

    rng = random.Random(seed)
    rates = []
    for _ in range(prompts):
        u = rng.random()
        rates.append(1.0 if u < solved else 0.0 if u < solved + impossible else rng.random())
    stream, history = PromptStream(prompts, seed), PromptHistory()
    sampler = DynamicSampler(per_step, max_rounds=10_000)
    generated: list[int] = []
    persistent: list[list[int]] = []  # per step: [drawn, generated] of the persistent prompts

    def skip_rule(index: int, position: int) -> bool:
        return should_skip(seed, position, str(index), history.streak(str(index)), cap)

    def produce(k: int) -> list[ScoredGroup]:
        if skip:
            taken, passed = stream.take_skipping(k, skip_rule)
        else:
            taken, passed = stream.take(k), []
        persistent[-1][0] += sum(rates[i] in (0.0, 1.0) for i in taken + passed)
        persistent[-1][1] += sum(rates[i] in (0.0, 1.0) for i in taken)
        groups = []
        for i in taken:
            correct = [rng.random() < rates[i] for _ in range(size)]
            history.record(str(i), correct)
            groups.append(ScoredGroup([], [[]] * size, [], [], [0.0] * size, correct))
        generated[-1] += len(taken)
        return groups

    for _ in range(steps):
        generated.append(0)
        persistent.append([0, 0])
        sampler.fill(produce)
    late = generated[2 * steps // 3 :]
    drawn = sum(d for d, _ in persistent[2 * steps // 3 :])
    return {
        "generated_per_trained": sum(generated) / (steps * per_step),
        "generated_per_trained_late": sum(late) / (len(late) * per_step),
        # Exploration: the share of the persistent prompts' draws still generated, last third.
        "persistent_generated_share_late": sum(g for _, g in persistent[2 * steps // 3 :]) / drawn
        if drawn
        else math.nan,
    }


def simulation_table(
    shares: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6), caps: tuple[float, ...] = (0.9, 0.95)
) -> list[dict[str, Any]]:
    """Responses generated per response trained without and with skipping (at each cap),
    for several shares of prompts whose outcome never changes (half solved, half impossible)."""
    rows = []
    for share in shares:
        row: dict[str, Any] = {"persistent_share": share}
        row["off"] = simulate(solved=share / 2, impossible=share / 2, skip=False)
        for cap in caps:
            row[f"cap {cap}"] = simulate(solved=share / 2, impossible=share / 2, skip=True, cap=cap)
        rows.append(row)
    return rows


def simulation_report(rows: list[dict[str, Any]]) -> str:
    caps = [k for k in rows[0] if k.startswith("cap ")]
    lines = [
        "| prompts always solved or never (half each) | generated / trained, last third: no skipping | "
        + " | ".join(f"skipping, {c}" for c in caps)
        + " | their draws still generated, last third: "
        + " / ".join(caps)
        + " |",
        "|---" * (3 + len(caps)) + "|",
    ]
    for r in rows:
        explored = [r[c]["persistent_generated_share_late"] for c in caps]
        lines.append(
            f"| {r['persistent_share']:.0%} | {r['off']['generated_per_trained_late']:.2f} | "
            + " | ".join(f"{r[c]['generated_per_trained_late']:.2f}" for c in caps)
            + " | "
            + " / ".join("-" if math.isnan(x) else f"{x:.0%}" for x in explored)
            + " |"
        )
    return "\n".join(lines)
