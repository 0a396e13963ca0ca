"""Held-out evaluation: sample k responses per problem, score them, report avg@k, pass@k, maj@k.

Two entry points:

- :func:`evaluate`: the trainer's periodic validation (``logging.eval_every``): avg@n
  accuracy of an engine that is already loaded.
- :func:`run_evaluation`: ``dapo eval MODEL --data PATH``: loads a model and an evaluation
  set, samples ``k`` responses per problem and writes a JSON report.

The metric math is in pure functions (:func:`pass_at_k`, :func:`majority_correct`,
:func:`summarize`). Definitions, per problem with ``n >= k`` sampled responses of which
``c`` are correct:

- **avg@k**: the share of correct responses, ``c / n`` (with ``n == k``: the mean accuracy
  over the k samples).
- **pass@k**: the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` of "at least one of k
  samples is correct" (with ``n == k``: 1 if any sample is correct, else 0).
- **maj@k**: majority vote over the answers of the first ``k`` responses, extracted with
  :func:`~dapo.rewards.extract_answer` (the DAPO ``Answer:`` line) and normalised with
  :func:`~dapo.rewards.normalize_final_answer`. Responses with no extractable (or an
  empty normalised) answer do not vote. **Ties are broken by first occurrence**: among
  the answers with the highest count, the one that appears first in sample order wins.
  The problem counts as correct when the winning answer equals the normalised ground
  truth (no votes at all: wrong).

Each metric is averaged over problems, per ``data_source`` and overall. Correctness of a
response (avg@k, pass@k) comes from :class:`~dapo.rewards.RewardScorer` with the
per-source scorer (the built-in ``dapo_math`` by default): reward > 0 is correct.
"""

from __future__ import annotations

import json
import math
import re
import time
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo.data import PromptRecord, group_repeats, load_records
from dapo.rewards import RewardScorer, ScoreRequest, extract_answer, normalize_final_answer
from dapo.rollout import Group, RolloutEngine, SamplingParams

__all__ = [
    "EvalError",
    "EvalProblems",
    "default_output_path",
    "evaluate",
    "format_table",
    "load_eval_problems",
    "majority_answer",
    "majority_correct",
    "pass_at_k",
    "run_evaluation",
    "score_groups",
    "summarize",
]

BUILTIN_DEFAULT_PROBLEMS = 500  # held-out builtin:addition problems when --max-problems is unset
DEFAULT_MAX_TOKENS = 1024


class EvalError(ValueError):
    """A bad evaluation option or set-up; the message says what to change."""


# --------------------------------------------------------------------------- metric math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: ``1 - C(n-c,k)/C(n,k)``."""
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if n < k:
        raise ValueError(f"pass@k needs at least k={k} samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples must be in [0, n={n}], got c={c}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _vote(answer: str | None) -> str | None:
    if answer is None:
        return None
    normalized = normalize_final_answer(answer)
    return normalized or None


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent normalised answer; ties go to the answer seen first; None: no votes."""
    votes = [v for v in map(_vote, answers) if v is not None]
    if not votes:
        return None
    counts = Counter(votes)
    best = max(counts.values())
    return next(v for v in votes if counts[v] == best)  # first occurrence among the tied


def majority_correct(answers: Sequence[str | None], ground_truth: str) -> bool:
    """Whether the majority answer (see :func:`majority_answer`) equals the ground truth.

    Answers and ground truth are compared after :func:`normalize_final_answer`; ``None``
    (no extractable answer) does not vote; ties are broken by first occurrence.
    """
    winner = majority_answer(answers)
    return winner is not None and winner == normalize_final_answer(str(ground_truth))


def _mean_or_nan(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(
    correct: Sequence[Sequence[bool]],
    answers: Sequence[Sequence[str | None]],
    ground_truths: Sequence[str],
    sources: Sequence[str],
    k: int,
    truncated: Sequence[Sequence[bool]] | None = None,
) -> dict[str, Any]:
    """avg@k, pass@k and maj@k per ``data_source`` and overall (means over problems).

    Row ``i`` holds the ``n_i >= k`` samples of problem ``i``: their correctness and their
    extracted answers (None when there is none). With ``truncated`` (same shape), each
    entry also has ``truncated``: the share of samples that hit the token limit. Returns
    ``{"overall": {...}, "by_source": {source: {...}}}``; each entry has ``problems`` and
    the metrics keyed with the literal k, e.g. ``"avg@4"``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    m = len(correct)
    lengths = {
        "answers": len(answers),
        "ground_truths": len(ground_truths),
        "sources": len(sources),
    }
    if truncated is not None:
        lengths["truncated"] = len(truncated)
    for name, size in lengths.items():
        if size != m:
            raise ValueError(f"summarize: {name} has {size} rows, correct has {m}")
    per_problem: list[tuple[str, float, float, float, float | None]] = []
    for i in range(m):
        row = list(correct[i])
        if len(answers[i]) != len(row):
            raise ValueError(
                f"summarize: problem {i} has {len(row)} correctness values but "
                f"{len(answers[i])} answers"
            )
        if len(row) < k:
            raise ValueError(f"summarize: problem {i} has {len(row)} samples, fewer than k={k}")
        trunc = None
        if truncated is not None:
            if len(truncated[i]) != len(row):
                raise ValueError(
                    f"summarize: problem {i} has {len(row)} samples but "
                    f"{len(truncated[i])} truncation flags"
                )
            trunc = sum(map(bool, truncated[i])) / len(row)
        c = sum(map(bool, row))
        per_problem.append(
            (
                str(sources[i]),
                c / len(row),
                pass_at_k(len(row), c, k),
                float(majority_correct(list(answers[i])[:k], ground_truths[i])),
                trunc,
            )
        )

    def entry(rows: list[tuple[str, float, float, float, float | None]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "problems": len(rows),
            f"avg@{k}": _mean_or_nan([r[1] for r in rows]),
            f"pass@{k}": _mean_or_nan([r[2] for r in rows]),
            f"maj@{k}": _mean_or_nan([r[3] for r in rows]),
        }
        if truncated is not None:
            out["truncated"] = _mean_or_nan([r[4] for r in rows if r[4] is not None])
        return out

    by_source = {
        src: entry([r for r in per_problem if r[0] == src])
        for src in sorted({r[0] for r in per_problem})
    }
    return {"overall": entry(per_problem), "by_source": by_source}


# --------------------------------------------------------------------------- scoring


def score_groups(
    groups: Sequence[Group],
    records: Sequence[PromptRecord],
    tokenizer: Any,
    scorer: RewardScorer,
) -> tuple[list[list[bool]], list[list[str | None]]]:
    """Decode and score each group's responses: per-problem correctness and extracted answers."""
    texts = [
        [tokenizer.decode(resp, skip_special_tokens=True) for resp in g.response_ids]
        for g in groups
    ]
    requests = [
        ScoreRequest(response=text, ground_truth=rec.ground_truth, data_source=rec.data_source)
        for group_texts, rec in zip(texts, records, strict=True)
        for text in group_texts
    ]
    flat = scorer.score(requests).correct
    correct: list[list[bool]] = []
    start = 0
    for group_texts in texts:
        correct.append(list(flat[start : start + len(group_texts)]))
        start += len(group_texts)
    answers = [[extract_answer(t) for t in group_texts] for group_texts in texts]
    return correct, answers


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    scorer: RewardScorer,
    params: SamplingParams,
) -> dict[str, float]:
    """avg@n accuracy (mean correctness over ``params.n`` samples per prompt).

    Returns ``acc`` (avg@n), ``n`` (samples scored), ``response_length`` (mean tokens)
    and ``truncated`` (share of responses that hit ``params.max_tokens``).
    """
    if not records:
        return {"acc": float("nan"), "n": 0}
    groups = engine.generate(prompt_ids, params)
    correct, answers = score_groups(groups, records, tokenizer, scorer)
    summary = summarize(
        correct,
        answers,
        [r.ground_truth for r in records],
        [r.data_source for r in records],
        k=params.n,
    )
    lengths = [len(r) for g in groups for r in g.response_ids]
    return {
        "acc": summary["overall"][f"avg@{params.n}"],
        "n": len(lengths),
        "response_length": sum(lengths) / len(lengths),
        "truncated": sum(t for g in groups for t in g.truncated) / len(lengths),
    }


# --------------------------------------------------------------------------- data


@dataclass
class EvalProblems:
    """The distinct problems of an evaluation set and how the rows repeated them."""

    records: list[PromptRecord]  # one per problem, in first-appearance order
    rows: int  # rows read
    repeats: int | None  # the common repeat count; None when problems repeat unevenly
    min_repeats: int = 1
    max_repeats: int = 1
    truncated_to: int | None = None  # problems kept by max_problems (None: all)
    distinct: int = 0  # distinct problems in the data, before max_problems


def load_eval_problems(
    data: str,
    *,
    max_problems: int | None = None,
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    log: Callable[[str], None] = print,
) -> EvalProblems:
    """Load an evaluation set and recognise repeated prompts as samples of one problem.

    ``builtin:addition`` gives held-out builtin problems (``max_problems``, default 500;
    drawn from the task distribution like the trainer's held-out set, so a problem may
    occur more than once and every row counts as a problem). Files keep all rows
    (``dedupe=False``); rows with the same prompt are one problem (the first row's ground
    truth and data source are used). ``max_problems`` keeps the first N problems.
    """
    if max_problems is not None and max_problems < 1:
        raise EvalError(f"--max-problems must be >= 1, got {max_problems}")
    from dapo.builtin import BUILTIN_DATA, addition_records

    if data == BUILTIN_DATA:
        n = max_problems or BUILTIN_DEFAULT_PROBLEMS
        records = addition_records("test", n=n)
        return EvalProblems(records, rows=n, repeats=None, distinct=n)
    if data.startswith("builtin:"):
        raise EvalError(f"--data {data!r}: the only built-in data set is {BUILTIN_DATA!r}")
    rows, _ = load_records(
        data, split=split, prompt_key=prompt_key, answer_key=answer_key, dedupe=False
    )
    groups = group_repeats(rows)
    records: list[PromptRecord] = []
    conflicts = 0
    for indices in groups.values():
        first = rows[indices[0]]
        truths = {normalize_final_answer(rows[i].ground_truth) for i in indices}
        conflicts += len(truths) > 1
        records.append(first)
    if conflicts:
        log(
            f"warning: {conflicts} problems repeat with different ground truths; "
            "the first row's answer is used"
        )
    counts = [len(v) for v in groups.values()]
    lo, hi = min(counts), max(counts)
    problems = EvalProblems(
        records,
        rows=len(rows),
        repeats=lo if lo == hi else None,
        min_repeats=lo,
        max_repeats=hi,
        distinct=len(records),
    )
    if max_problems is not None and max_problems < len(records):
        problems.records = records[:max_problems]
        problems.truncated_to = max_problems
    return problems


# --------------------------------------------------------------------------- the command


def _engine_names() -> tuple[str, ...]:
    from dapo.config import RolloutConfig

    hint = typing.get_type_hints(RolloutConfig).get("engine")
    return tuple(a for a in typing.get_args(hint) if isinstance(a, str))


def _make_engine(
    name: str, model: Any, tokenizer: Any, batch_size: int, max_prompt: int, max_tokens: int
) -> RolloutEngine:
    """The rollout engine, through the trainer's factory (same engines, same errors)."""
    from dapo.config import Config
    from dapo.trainer import TrainingError, make_engine

    cfg = Config()
    cfg.rollout.engine = name  # type: ignore[assignment]
    cfg.rollout.generation_batch_size = batch_size
    cfg.data.max_prompt_length = max_prompt  # vLLM sizes its context from these
    cfg.rollout.max_completion_length = max_tokens
    try:
        return make_engine(cfg, model, tokenizer)
    except TrainingError as exc:
        raise EvalError(f"--engine {name}: {exc}") from exc


def default_output_path(model: str) -> Path:
    """``<model-name>-eval.json`` in the working directory."""
    name = model.rstrip("/\\")
    name = re.split(r"[/\\]", name)[-1] or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
    return Path.cwd() / f"{name}-eval.json"


def _check_options(
    k: int | None, temperature: float, top_p: float, max_tokens: int | None, batch_size: int,
    max_prompt_length: int | None, engine: str,
) -> None:  # fmt: skip
    if k is not None and k < 1:
        raise EvalError(f"--k must be >= 1 (samples per problem), got {k}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EvalError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise EvalError(f"--top-p must be in (0, 1], got {top_p}")
    if max_tokens is not None and max_tokens < 1:
        raise EvalError(f"--max-tokens must be >= 1, got {max_tokens}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise EvalError(f"--max-prompt-length must be >= 1, got {max_prompt_length}")
    if batch_size < 1:
        raise EvalError(f"--batch-size must be >= 1, got {batch_size}")
    names = _engine_names()
    if names and engine not in names:
        raise EvalError(f"unknown engine {engine!r}; choose one of: {', '.join(names)}")


def run_evaluation(
    model: str,
    data: str,
    *,
    k: int | None = None,
    temperature: float = 1.0,
    top_p: float = 0.7,
    max_tokens: int | None = None,
    max_prompt_length: int | None = None,
    max_problems: int | None = None,
    seed: int = 0,
    batch_size: int = 256,
    engine: str = "hf",
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    output: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate ``model`` on ``data`` with k samples per problem; write and return the report.

    ``k`` defaults to the number of times every problem repeats in the data (1 when the
    repeats are uneven or absent). ``max_tokens`` defaults to 1024, at most half the
    model's context; ``max_prompt_length`` to the context minus ``max_tokens``. Longer
    prompts are dropped (never truncated) and counted in ``dropped_too_long``.
    """
    start = time.time()
    _check_options(k, temperature, top_p, max_tokens, batch_size, max_prompt_length, engine)
    problems = load_eval_problems(
        data,
        max_problems=max_problems,
        split=split,
        prompt_key=prompt_key,
        answer_key=answer_key,
        log=log,
    )
    if k is None:
        k = problems.repeats or 1
    n_distinct = problems.distinct
    if problems.repeats is not None and problems.repeats > 1:
        log(
            f"{n_distinct} problems, each repeated {problems.repeats} times: "
            f"scoring k={k} samples per problem"
        )
    elif problems.max_repeats > 1:
        log(
            f"{problems.rows} rows hold {n_distinct} distinct problems repeated unevenly "
            f"({problems.min_repeats} to {problems.max_repeats} times): "
            f"scoring k={k} samples per problem"
        )
    else:
        log(f"{n_distinct} problems: scoring k={k} samples per problem")
    if problems.truncated_to is not None:
        log(
            f"evaluating the first {problems.truncated_to} of {n_distinct} problems "
            "(--max-problems)"
        )

    from dapo.data import encode_prompts
    from dapo.models import context_length, load_policy, load_tokenizer, resolve_model_path

    path = resolve_model_path(model, log=log)
    tokenizer = load_tokenizer(path)
    policy = load_policy(path)
    policy.eval()
    ctx = context_length(policy)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if ctx is None else min(DEFAULT_MAX_TOKENS, ctx // 2)
        max_tokens = max(1, max_tokens)
    if max_prompt_length is None:
        if ctx is None:
            max_prompt_length = 10**9
        elif ctx - max_tokens < 1:
            raise EvalError(
                f"--max-tokens {max_tokens} leaves no room for the prompt in the model's "
                f"context of {ctx} positions; lower --max-tokens"
            )
        else:
            max_prompt_length = ctx - max_tokens
    elif ctx is not None and max_prompt_length + max_tokens > ctx:
        log(
            f"warning: --max-prompt-length {max_prompt_length} + --max-tokens {max_tokens} "
            f"exceeds the model's context of {ctx} positions; long sequences may fail or "
            "degrade"
        )

    # Render and tokenize everything, then drop (never truncate) the prompts that are too long.
    records, all_ids, _ = encode_prompts(problems.records, tokenizer, 10**12)
    kept = [i for i, ids in enumerate(all_ids) if len(ids) <= max_prompt_length]
    dropped = len(records) - len(kept)
    if not kept:
        shortest = min(map(len, all_ids))
        raise EvalError(
            f"all {len(records)} prompts are longer than --max-prompt-length "
            f"{max_prompt_length} tokens (shortest {shortest}); raise --max-prompt-length "
            "or lower --max-tokens"
        )
    if dropped:
        log(
            f"dropped {dropped} of {len(records)} problems whose prompts are longer than "
            f"{max_prompt_length} tokens (--max-prompt-length)"
        )
    records = [records[i] for i in kept]
    prompt_ids = [all_ids[i] for i in kept]

    longest = max(map(len, prompt_ids))
    rollout = _make_engine(engine, policy, tokenizer, batch_size, longest, max_tokens)
    scorer = RewardScorer()
    correct: list[list[bool]] = []
    answers: list[list[str | None]] = []
    truncated: list[list[bool]] = []
    lengths: list[int] = []
    chunk = max(1, batch_size // k)
    log(
        f"sampling {len(records)} problems x {k} (temperature {temperature}, top_p {top_p}, "
        f"max {max_tokens} tokens, engine {engine})"
    )
    try:
        for index, lo in enumerate(range(0, len(records), chunk)):
            params = SamplingParams(
                n=k,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_tokens=max_tokens,
                seed=seed * 1_000_003 + index,
            )
            groups = rollout.generate(prompt_ids[lo : lo + chunk], params)
            c, a = score_groups(groups, records[lo : lo + chunk], tokenizer, scorer)
            correct += c
            answers += a
            truncated += [list(g.truncated) for g in groups]
            lengths += [len(r) for g in groups for r in g.response_ids]
            acc = _mean_or_nan([sum(r) / len(r) for r in correct])
            took = time.time() - start
            log(
                f"  {len(correct)}/{len(records)} problems, avg@{k} so far {acc:.1%} ({took:.0f} s)"
            )
    finally:
        scorer.close()

    summary = summarize(
        correct,
        answers,
        [r.ground_truth for r in records],
        [r.data_source for r in records],
        k,
        truncated=truncated,
    )
    report: dict[str, Any] = {
        "model": model,
        "data": data,
        "k": k,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": max_tokens,
        "max_prompt_length": max_prompt_length,
        "engine": engine,
        "seed": seed,
        "problems": len(records),
        "samples": len(records) * k,
        "problems_in_data": n_distinct,
        "rows_in_data": problems.rows,
        "repeats_in_data": problems.repeats,
        "dropped_too_long": dropped,
        "mean_response_length": _mean_or_nan(lengths),
        "overall": {key: v for key, v in summary["overall"].items() if key != "problems"},
        "by_source": summary["by_source"],
        "seconds": round(time.time() - start, 1),
    }
    out = Path(output) if output is not None else default_output_path(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    report["output"] = str(out)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report's metrics as a text table, one line per data source plus the overall line."""
    k = report["k"]
    cols = [f"avg@{k}", f"pass@{k}", f"maj@{k}", "truncated"]
    rows = [(src, e["problems"], e) for src, e in report["by_source"].items()]
    rows.append(("overall", report["problems"], report["overall"]))
    width = max(12, *(len(r[0]) for r in rows))
    lines = [f"{'data_source':<{width}} {'problems':>8} " + " ".join(f"{c:>9}" for c in cols)]
    for name, n, entry in rows:
        cells = " ".join(f"{entry[c]:>9.1%}" for c in cols)
        lines.append(f"{name:<{width}} {n:>8} {cells}")
    return "\n".join(lines)
