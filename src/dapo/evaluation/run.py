"""Held-out evaluation: sample k responses per problem, score them, report avg@k, pass@k, maj@k.

Two entry points:

- :func:`engine_accuracy`: the trainer's periodic validation (``logging.eval_every``): avg@n
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
- **maj@k**: majority vote over the answers of the first ``k`` responses, read as the
  data source's scorer reads them (the DAPO ``Answer:`` line; ``#### N`` for ``gsm8k``; a
  ``\\boxed{}`` where ``math_verify`` has no ``Answer:`` line; none for code) and normalised
  with :func:`~dapo.rewards.normalize_final_answer`. Responses with no extractable (or an
  empty normalised) answer do not vote. **Ties are broken by first occurrence**: among
  the answers with the highest count, the one that appears first in sample order wins.
  The problem counts as correct when the scorer judged the first response that gave the
  winning answer correct (no votes at all: wrong), so maj@k and avg@k agree on what a
  correct answer is.

Each metric is averaged over problems, per ``data_source`` and overall. Correctness of a
response (avg@k, pass@k) comes from :class:`~dapo.rewards.RewardScorer` with the
per-source scorer as training picks it (the built-in ``dapo_math``, the DAPO reference's
rules, unless the source is a GSM8K, MATH or Numina one), or the one ``--scorer`` names for
every source: reward > 0 is correct. Each source's scorer is said and kept (``scorers``).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dapo.config import RolloutConfig
from dapo.data import PromptRecord, group_repeats, load_records
from dapo.data.tasks import TASKS, is_builtin, load_task
from dapo.errors import EvalError, VLLMEngineError, VLLMUnavailableError
from dapo.evaluation.inputs import load_model, tokenize_prompts
from dapo.evaluation.protocol import EvalProtocol, common_repeats, samples_per_problem
from dapo.evaluation.stats import mean_or_nan, summarize
from dapo.rewards import (
    RewardScorer,
    ScoreRequest,
    normalize_final_answer,
    scorer_for_source,
)
from dapo.rewards.math import SCORER_FORMS, SCORERS
from dapo.rollout import (
    ENGINES,
    Group,
    RolloutEngine,
    SamplingParams,
    close_engine,
    make_engine,
)

BUILTIN_DEFAULT_PROBLEMS = 500  # held-out builtin:addition problems when --max-problems is unset
DEFAULT_MAX_TOKENS = 1024
_NO_LIMIT = 10**9  # the prompt budget when the model does not say how long its context is


# --------------------------------------------------------------------------- scoring


def score_groups(
    groups: Sequence[Group],
    records: Sequence[PromptRecord],
    tokenizer: Any,
    scorer: RewardScorer,
) -> tuple[list[list[bool]], list[list[str | None]]]:
    """Decode and score each group's responses: per-problem correctness and extracted answers."""
    texts = [g.decode(tokenizer) for g in groups]
    requests = [
        ScoreRequest.of(r, t, ids)
        for g, r, group_texts in zip(groups, records, texts, strict=True)
        for t, ids in zip(group_texts, g.response_ids, strict=True)
    ]
    _, correct, _ = scorer.score_grouped(requests, [len(t) for t in texts])
    answers = [
        [read(t) for t in group_texts]
        for r, group_texts in zip(records, texts, strict=True)
        for read in [scorer.answer_reader(r.data_source)]
    ]
    return correct, answers


@dataclass
class _Samples:
    """Scored responses: one row per problem, plus every response's length in tokens."""

    correct: list[list[bool]] = field(default_factory=list)
    answers: list[list[str | None]] = field(default_factory=list)
    truncated: list[list[bool]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # flat, over all problems

    def extend(self, more: _Samples) -> None:
        """Append the problems of ``more``."""
        self.correct += more.correct
        self.answers += more.answers
        self.truncated += more.truncated
        self.lengths += more.lengths

    def accuracy(self) -> float:
        """avg@n so far: mean over problems of the share of correct responses (NaN if none)."""
        return mean_or_nan([sum(row) / len(row) for row in self.correct])


def _sample_and_score(
    engine: RolloutEngine,
    tokenizer: Any,
    records: Sequence[PromptRecord],
    prompt_ids: list[list[int]],
    scorer: RewardScorer,
    params: SamplingParams,
) -> _Samples:
    """Generate ``params.n`` responses per prompt and score them against ``records``."""
    groups = engine.generate(prompt_ids, params)
    correct, answers = score_groups(groups, records, tokenizer, scorer)
    truncated = [list(g.truncated) for g in groups]
    return _Samples(correct, answers, truncated, [len(r) for g in groups for r in g.response_ids])


def _summarize(samples: _Samples, records: Sequence[PromptRecord], k: int) -> dict[str, Any]:
    """:func:`~dapo.evaluation.stats.summarize` of ``samples`` (one row per record)."""
    return summarize(
        samples.correct,
        samples.answers,
        [r.data_source for r in records],
        k,
        truncated=samples.truncated,
    )


def engine_accuracy(
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
    samples = _sample_and_score(engine, tokenizer, records, prompt_ids, scorer, params)
    n = len(samples.lengths)
    return {
        "acc": _summarize(samples, records, params.n)["overall"][f"avg@{params.n}"],
        "n": n,
        "response_length": sum(samples.lengths) / n,
        "truncated": sum(t for row in samples.truncated for t in row) / n,
    }


def make_scorer(name: str | None) -> RewardScorer:
    """The scorer of ``dapo eval``: each data source's own built-in scorer (``name`` None),
    else ``name`` for all, a built-in scorer or ``module:function`` resolved as training
    resolves ``reward.functions`` (:class:`~dapo.rewards.RewardScorer`)."""
    if name is None:
        return RewardScorer()
    try:
        return RewardScorer([(name, 1.0)], origins=["--scorer"])
    except ValueError as exc:
        said = str(exc)
        if not said.startswith("--scorer"):
            said = f"--scorer: {said}"  # the spec names the value
        raise EvalError(said) from exc


def scorer_names(sources: Sequence[str], name: str | None) -> dict[str, str]:
    """The scorer each data source gets: ``name`` (``--scorer``), else the source's own."""
    return {s: name or scorer_for_source(s) for s in sorted(set(sources))}


def describe_scoring(rewards: RewardScorer, sources: Sequence[str], name: str | None) -> list[str]:
    """Start-up lines, one per data source: the scorer it gets (training's lines) or, with
    ``--scorer``, the one named there."""
    if name is None:
        return rewards.describe(sources)
    what = f"the built-in {name} scorer ({SCORER_FORMS[name]})" if name in SCORERS else name
    return [
        f"scoring data_source {source!r} with {what}, as --scorer says: reward > 0 is correct"
        for source in sorted(set(sources))
    ]


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
    if is_builtin(data):
        if data not in TASKS:
            raise EvalError(f"--data {data!r}: the built-in data sets are: {', '.join(TASKS)}")
        n = max_problems or BUILTIN_DEFAULT_PROBLEMS
        records = load_task(data, "test", n=n)
        return EvalProblems(records, rows=n, repeats=None, distinct=n)
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
        repeats=common_repeats(counts),
        min_repeats=lo,
        max_repeats=hi,
        distinct=len(records),
    )
    if max_problems is not None and max_problems < len(records):
        problems.records = records[:max_problems]
        problems.truncated_to = max_problems
    return problems


# --------------------------------------------------------------------------- the command


def _make_engine(
    name: str,
    model: Any,
    tokenizer: Any,
    batch_size: int,
    max_prompt: int,
    max_tokens: int,
    processor: Any = None,
) -> RolloutEngine:
    """The rollout engine (the trainer's factory: same engines, same errors)."""
    rollout = RolloutConfig(engine=name, generation_batch_size=batch_size)
    length = max_prompt + max_tokens
    try:
        return make_engine(rollout, model, tokenizer, max_model_len=length, processor=processor)
    except (VLLMUnavailableError, VLLMEngineError) as exc:
        raise EvalError(f"--engine {name}: {exc}") from exc


def default_output_path(model: str) -> Path:
    """``<model-name>-eval.json`` in the working directory."""
    name = model.rstrip("/\\")
    name = re.split(r"[/\\]", name)[-1] or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"
    return Path.cwd() / f"{name}-eval.json"


def _check_options(
    k: int | None,
    temperature: float,
    top_p: float,
    max_tokens: int | None,
    batch_size: int,
    max_prompt_length: int | None,
    engine: str,
) -> None:
    """Reject out-of-range options before any data or model is loaded."""
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
    if engine not in ENGINES or engine == "vllm-server":
        local = [e for e in ENGINES if e != "vllm-server"]  # a server serves a trainer's weights
        raise EvalError(f"unknown engine {engine!r}; choose one of: {', '.join(local)}")


def _load_problems(
    data: str,
    k: int | None,
    max_problems: int | None,
    split: str,
    prompt_key: str,
    answer_key: str,
    log: Callable[[str], None],
) -> tuple[EvalProblems, int]:
    """Load the problems, settle k (default: the repeat count) and log what was found."""
    problems = load_eval_problems(
        data,
        max_problems=max_problems,
        split=split,
        prompt_key=prompt_key,
        answer_key=answer_key,
        log=log,
    )
    k = samples_per_problem(k, problems.repeats)  # the trainer's rule
    _log_problems(problems, k, log)
    return problems, k


def _log_problems(problems: EvalProblems, k: int, log: Callable[[str], None]) -> None:
    """Say how many problems the data holds, how they repeat and how many are evaluated."""
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


def _resolve_lengths(
    ctx: int | None,
    max_tokens: int | None,
    max_prompt_length: int | None,
    log: Callable[[str], None],
) -> tuple[int, int]:
    """``max_tokens`` and ``max_prompt_length``, defaulted to fit a context of ``ctx`` positions."""
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if ctx is None else min(DEFAULT_MAX_TOKENS, ctx // 2)
        max_tokens = max(1, max_tokens)
    if max_prompt_length is None:
        if ctx is None:
            return max_tokens, _NO_LIMIT
        if ctx - max_tokens < 1:
            raise EvalError(
                f"--max-tokens {max_tokens} leaves no room for the prompt in the model's "
                f"context of {ctx} positions; lower --max-tokens"
            )
        return max_tokens, ctx - max_tokens
    if ctx is not None and max_prompt_length + max_tokens > ctx:
        log(
            f"warning: --max-prompt-length {max_prompt_length} + --max-tokens {max_tokens} "
            f"exceeds the model's context of {ctx} positions; long sequences may fail or "
            "degrade"
        )
    return max_tokens, max_prompt_length


def _generate_and_score(
    engine: str,
    policy: Any,
    tokenizer: Any,
    records: list[PromptRecord],
    prompt_ids: list[list[int]],
    params: SamplingParams,
    batch_size: int,
    scorer: RewardScorer,
    start: float,
    log: Callable[[str], None],
    processor: Any = None,
) -> _Samples:
    """Sample ``params.n`` responses per problem with ``engine``, a chunk at a time; score them."""
    longest = max(map(len, prompt_ids))
    rollout = _make_engine(
        engine, policy, tokenizer, batch_size, longest, params.max_tokens, processor
    )
    k = params.n
    chunk = max(1, batch_size // k)  # problems per engine call: about batch_size sequences
    samples = _Samples()
    log(
        f"sampling {len(records)} problems x {k} (temperature {params.temperature}, "
        f"top_p {params.top_p}, max {params.max_tokens} tokens, engine {engine})"
    )
    try:
        for index, lo in enumerate(range(0, len(records), chunk)):
            # a distinct, reproducible seed per chunk, derived from --seed
            chunk_params = replace(params, seed=params.seed * 1_000_003 + index)
            part = slice(lo, lo + chunk)
            samples.extend(
                _sample_and_score(
                    rollout, tokenizer, records[part], prompt_ids[part], scorer, chunk_params
                )
            )
            took = time.time() - start
            log(
                f"  {len(samples.correct)}/{len(records)} problems, "
                f"avg@{k} so far {samples.accuracy():.1%} ({took:.0f} s)"
            )
    finally:
        close_engine(rollout)  # vLLM holds memory and a process group until closed
    return samples


def _build_report(
    model: str,
    data: str,
    params: SamplingParams,
    max_prompt_length: int,
    engine: str,
    problems: EvalProblems,
    records: list[PromptRecord],
    dropped: int,
    samples: _Samples,
    scorers: dict[str, str],
    start: float,
) -> dict[str, Any]:
    """The JSON report: the settings, the data's shape and the metrics."""
    k = params.n
    summary = _summarize(samples, records, k)
    return {
        "model": model,
        "data": data,
        "k": k,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "max_prompt_length": max_prompt_length,
        "engine": engine,
        "seed": params.seed,
        "problems": len(records),
        "protocol": str(EvalProtocol(k, params.temperature, params.top_p, len(records))),
        "samples": len(records) * k,
        "problems_in_data": problems.distinct,
        "rows_in_data": problems.rows,
        "repeats_in_data": problems.repeats,
        "dropped_too_long": dropped,
        "mean_response_length": mean_or_nan(samples.lengths),
        "overall": {key: v for key, v in summary["overall"].items() if key != "problems"},
        "by_source": summary["by_source"],
        "scorers": scorers,
        "seconds": round(time.time() - start, 1),
    }


def _write_report(report: dict[str, Any], output: str | Path | None, model: str) -> dict[str, Any]:
    """Write ``report`` as JSON (default: :func:`default_output_path`); add its ``output`` path."""
    out = Path(output) if output is not None else default_output_path(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    report["output"] = str(out)
    return report


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
    scorer: str | None = None,
    output: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate ``model`` on ``data`` with k samples per problem; write and return the report.

    ``k`` defaults to the number of times every problem repeats in the data (1 when the
    repeats are uneven or absent). ``max_tokens`` defaults to 1024, at most half the
    model's context; ``max_prompt_length`` to the context minus ``max_tokens``. Longer
    prompts are dropped (never truncated) and counted in ``dropped_too_long``. ``scorer``
    (a built-in scorer or ``module:function``) scores every data source in place of each
    source's own (:func:`make_scorer`).
    """
    start = time.time()
    _check_options(k, temperature, top_p, max_tokens, batch_size, max_prompt_length, engine)
    rewards = make_scorer(scorer)  # a bad --scorer fails before anything is loaded
    try:
        problems, k = _load_problems(data, k, max_problems, split, prompt_key, answer_key, log)
        for line in describe_scoring(rewards, [r.data_source for r in problems.records], scorer):
            log(line)
        policy, tokenizer, ctx, vision = load_model(model, log)
        max_tokens, max_prompt_length = _resolve_lengths(ctx, max_tokens, max_prompt_length, log)
        records, ids, dropped = tokenize_prompts(
            problems.records, tokenizer, max_prompt_length, log, vision
        )
        params = SamplingParams(
            n=k, temperature=temperature, top_p=top_p, top_k=0, max_tokens=max_tokens, seed=seed
        )
        processor = None if vision is None else vision[0]
        samples = _generate_and_score(
            engine, policy, tokenizer, records, ids, params, batch_size, rewards, start, log,
            processor,
        )  # fmt: skip
    finally:
        rewards.close()
    report = _build_report(
        model,
        data,
        params,
        max_prompt_length,
        engine,
        problems,
        records,
        dropped,
        samples,
        scorer_names([r.data_source for r in records], scorer),
        start,
    )
    return _write_report(report, output, model)


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
