"""``dapo_math`` against the DAPO reference, and ``dapo_math_lenient`` against its own past.

``data/dapo_math_corpus.jsonl`` holds responses with a ground truth, a short category and two
scores: ``expected``, what verl's ``math_dapo.compute_score`` (the scorer of the DAPO paper's
code, default path) returned when run on the case, and ``expected_lenient``, what the lenient
normaliser (``dapo_math`` before it followed the reference) returned.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from dapo.rewards import SCORERS, dapo_math_lenient_score, dapo_math_score

CORPUS = Path(__file__).parent / "data" / "dapo_math_corpus.jsonl"

# What the corpus must cover: the reference's rules, one category each.
CATEGORIES = {
    "probe",
    "units",
    "percent",
    "degrees",
    "fraction",
    "unicode",
    "thousands",
    "article",
    "boxed",
    "text",
    "dollar",
    "window",
    "several_answers",
    "no_answer",
    "equals",
    "empty",
    "multiline",
}

# (response, ground truth, the reference's score): where the lenient rules and the
# reference's part ways.
PROBES = [
    ("Answer: 12.", "12", -1.0),
    ("Answer: 90°", "90", -1.0),
    ("Answer: 50%", "50", -1.0),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", -1.0),
    ("Answer: \u22127", "-7", -1.0),
    ("Answer: 1,2", "12", 1.0),
    ("Answer: a 12", "12", 1.0),
]


def _corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


def _mismatches(score: Callable[[str, str], float], key: str) -> str:
    """The cases where ``score`` differs from the corpus' ``key``, grouped by category."""
    failed: dict[str, list[str]] = defaultdict(list)
    for case in _corpus():
        got = score(case["response"], case["ground_truth"])
        if got != case[key]:
            failed[case["category"]].append(
                f"    response={case['response'][-80:]!r} ground_truth={case['ground_truth']!r}"
                f" want {case[key]} got {got}"
            )
    return "\n".join(
        f"{category}: {len(lines)} case(s)\n" + "\n".join(lines)
        for category, lines in sorted(failed.items())
    )


def test_the_corpus_covers_the_reference_rules() -> None:
    cases = _corpus()
    assert len(cases) >= 200
    assert CATEGORIES.issubset({c["category"] for c in cases})
    assert {c["expected"] for c in cases} == {1.0, -1.0}
    pairs = {(c["response"].rsplit("\n", 1)[-1], c["ground_truth"], c["expected"]) for c in cases}
    assert set(PROBES).issubset(pairs)
    # the two scorers part ways often enough for this to test both
    assert sum(c["expected"] != c["expected_lenient"] for c in cases) >= 50


def test_dapo_math_scores_every_case_as_the_reference_does() -> None:
    assert SCORERS["dapo_math"] is dapo_math_score
    failed = _mismatches(dapo_math_score, "expected")
    assert not failed, "dapo_math differs from verl's math_dapo on:\n" + failed


def test_dapo_math_lenient_scores_every_case_as_before() -> None:
    assert SCORERS["dapo_math_lenient"] is dapo_math_lenient_score
    failed = _mismatches(dapo_math_lenient_score, "expected_lenient")
    assert not failed, "dapo_math_lenient changed on:\n" + failed


@pytest.mark.parametrize(("response", "truth", "expected"), PROBES)
def test_the_probes(response: str, truth: str, expected: float) -> None:
    assert dapo_math_score(response, truth) == expected
    assert dapo_math_lenient_score(response, truth) == -expected


def test_equal_normal_forms_match_whatever_they_are() -> None:
    """The reference compares the normal forms only: a missing answer reads ``[INVALID]``,
    and answers that normalise to nothing match an empty ground truth."""
    assert dapo_math_score("no answer line", "[INVALID]") == 1.0
    assert dapo_math_score("Answer: $$", "") == 1.0
    assert dapo_math_score("Answer: units", " ") == 1.0
    assert dapo_math_score("no answer line", "") == -1.0


def test_ground_truth_is_read_as_text() -> None:
    assert dapo_math_score("Answer: 12", 12) == 1.0  # type: ignore[arg-type]
    assert dapo_math_score("Answer: 1,000", 1000) == 1.0  # type: ignore[arg-type]
