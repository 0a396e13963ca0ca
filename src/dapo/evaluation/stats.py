"""Evaluation metrics as pure functions: avg@k, pass@k, maj@k per problem and per source."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from dapo.rewards import normalize_final_answer

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


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer (see :func:`majority_answer`) is correct, as the scorer
    judged the first response that gave it (``correct[j]`` of response ``j``).

    Votes are grouped by :func:`normalize_final_answer` (two spellings of one answer count
    together); ``None`` (no extractable answer) does not vote; ties are broken by first
    occurrence. The verdict is the data source's scorer's, as for avg@k and pass@k, not a
    comparison of normalised strings: so maj@k never counts an answer the scorer rejects.
    """
    if len(answers) != len(correct):
        raise ValueError(f"{len(answers)} answers but {len(correct)} correctness values")
    winner = majority_answer(answers)
    if winner is None:
        return False
    first = next(j for j, a in enumerate(answers) if _vote(a) == winner)
    return bool(correct[first])


def mean_or_nan(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(
    correct: Sequence[Sequence[bool]],
    answers: Sequence[Sequence[str | None]],
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
                float(majority_correct(list(answers[i])[:k], row[:k])),
                trunc,
            )
        )

    def entry(rows: list[tuple[str, float, float, float, float | None]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "problems": len(rows),
            f"avg@{k}": mean_or_nan([r[1] for r in rows]),
            f"pass@{k}": mean_or_nan([r[2] for r in rows]),
            f"maj@{k}": mean_or_nan([r[3] for r in rows]),
        }
        if truncated is not None:
            out["truncated"] = mean_or_nan([r[4] for r in rows if r[4] is not None])
        return out

    by_source = {
        src: entry([r for r in per_problem if r[0] == src])
        for src in sorted({r[0] for r in per_problem})
    }
    return {"overall": entry(per_problem), "by_source": by_source}
