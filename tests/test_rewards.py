"""Tests for dapo.rewards: answer scorers, overlong shaping, reward loading, scoring pool."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo.rewards import (
    SCORERS,
    RewardFunctionWarning,
    RewardScorer,
    ScoreRequest,
    dapo_math_lenient_score,
    dapo_math_score,
    extract_answer,
    load_reward_function,
    math_verify_score,
    normalize_final_answer,
    overlong_filter_mask,
    scorer_for_source,
    soft_overlong_punishment,
)

FIXTURES = Path(__file__).with_name("reward_fixtures.py")


def fx(name: str) -> str:
    """Spec of a function in tests/reward_fixtures.py (file form: no sys.path needed)."""
    return f"{FIXTURES}:{name}"


def req(response: str, ground_truth: str = "7", data_source: str = "math_dapo") -> ScoreRequest:
    return ScoreRequest(response, ground_truth, data_source)


# ---------------------------------------------------------------------------
# dapo_math_lenient_score (dapo_math_score, the reference's rules: test_dapo_math_corpus.py)
# ---------------------------------------------------------------------------

LENIENT_CASES = [
    # (response, ground truth, expected)
    ("Let me compute.\nAnswer: 42", "42", 1.0),
    ("The result is 42.", "42", -1.0),  # no Answer line
    ("Answer: 41\nWait, that is wrong.\nAnswer: 42", "42", 1.0),  # last one wins
    ("Answer: 42\nHmm, check again.\nAnswer: 41", "42", -1.0),
    ("Answer: 42\n" + "x" * 300, "42", -1.0),  # outside the last 300 characters
    ("y" * 500 + "\nAnswer: 42", "42", 1.0),
    ("answer : 42", "42", 1.0),  # case-insensitive, space before the colon
    ("ANSWER:42", "42", 1.0),
    ("So the final answer: 42", "42", 1.0),
    ("Answer: \\boxed{42}", "42", 1.0),
    ("Answer: $42$", "42", 1.0),
    ("Answer: $\\boxed{42}$", "42", 1.0),
    ("Answer: 12 cm", "12", 1.0),
    ("Answer: 12 \\text{ cm}^2", "12", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: 1000", "1,000", 1.0),
    ("Answer: 1{,}000", "1000", 1.0),
    ("Answer: 1,2", "12", -1.0),  # a list, not a thousands separator
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", 1.0),
    ("Answer: \\tfrac{1}{2}", "\\frac12", 1.0),
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),
    ("Answer: 2\\sqrt 3", "2\\sqrt{3}", 1.0),
    ("Answer: 42\nI hope this is right!", "42", 1.0),  # text on later lines
    ("Answer: x = 5", "5", 1.0),
    ("Answer: -7", "-7", 1.0),
    ("Answer: 7", "-7", -1.0),
    ("Answer: 43", "42", -1.0),
    ("", "42", -1.0),
    ("Answer:", "42", -1.0),
    ("Answer: \\text{5}", "5", 1.0),
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer: 90 degrees", "90", 1.0),
    ("Answer: 42.", "42", 1.0),
    ("Answer: 0.5", "0.5", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # string comparison: no numeric equivalence
    ("Answer: 3/4", "\\frac{3}{4}", -1.0),
    ("Answer: \\left( 3, 4 \\right)", "(3,4)", 1.0),
    ("Answer: 50\\%", "50", 1.0),
    ("Answer: \\$5", "5", 1.0),
    ("Answer: 5 apples", "5", -1.0),  # only known unit words are dropped
]


@pytest.mark.parametrize(("response", "truth", "expected"), LENIENT_CASES)
def test_dapo_math_lenient_score(response: str, truth: str, expected: float) -> None:
    assert dapo_math_lenient_score(response, truth) == expected


@pytest.mark.parametrize(
    ("response", "truth"),
    [("Answer: 12.", "12"), ("Answer: 50%", "50"), ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}")],
)
def test_the_lenient_scorer_forgives_what_the_reference_does_not(response: str, truth: str) -> None:
    assert (dapo_math_lenient_score(response, truth), dapo_math_score(response, truth)) == (1, -1)
    assert SCORERS["dapo_math_lenient"] is dapo_math_lenient_score
    assert SCORERS["dapo_math"] is dapo_math_score


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("blah\nAnswer: 5\nmore\nanswer :  7 \nend", "7"),
        ("Answer:\n9", "9"),  # \s* after the colon spans the newline, as in the reference
        ("no answer", None),
        ("Answer: 3" + "x" * 300, None),
    ],
)
def test_extract_answer(response: str, expected: str | None) -> None:
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces survive unwrapping
        ("\\frac\\pi2", "\\frac{\\pi}{2}"),
        ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("\\sqrt[3]{2}", "\\sqrt[3]{2}"),
        ("1,234.5", "1234.5"),
        ("3\\,000", "3000"),
        ("\\mbox{12 inches}", "12"),
        ("\\textbf{7}", "7"),
        ("\u22127", "-7"),
        ("\\sec x", "\\secx"),  # unit words are not cut out of commands ("sec")
        ("left", "left"),  # ... nor out of words ("ft")
    ],
)
def test_normalize_final_answer(raw: str, expected: str) -> None:
    assert normalize_final_answer(raw) == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_thousands_separators_match_plain_integers(n: int) -> None:
    assert dapo_math_lenient_score(f"work...\nAnswer: {n:,}", str(n)) == 1.0
    assert dapo_math_lenient_score(f"work...\nAnswer: {n + 1}", f"{n:,}") == -1.0
    # The reference drops commas only when digits alone remain: a minus sign keeps them.
    assert dapo_math_score(f"work...\nAnswer: {n:,}", str(n)) == (1.0 if n > -1000 else -1.0)


@settings(max_examples=60, deadline=None)
@given(
    st.text(max_size=400),
    st.text(alphabet=st.characters(blacklist_characters="\n\r"), min_size=1, max_size=40).filter(
        lambda s: s.strip() != ""
    ),
)
def test_extract_answer_takes_the_final_line(prefix: str, answer: str) -> None:
    r"""The last ``Answer:`` line's text, as the reference scorer finds it: the last match of
    ``Answer\s*:\s*([^\n]+)`` in the last 300 characters (transcribed here)."""
    response = prefix + "\nAnswer: " + answer
    matches = re.findall(r"Answer\s*:\s*([^\n]+)", response[-300:], flags=re.IGNORECASE)
    assert extract_answer(response) == matches[-1].strip()
    # The final line's answer, unless the text before ends in an "Answer:" of its own: the
    # reference's \s* after the colon crosses the newline and takes the next line whole.
    if not re.search(r"answer\s*:\s*$", prefix, flags=re.IGNORECASE):
        assert extract_answer(response) == answer.strip()


def test_an_empty_answer_line_takes_the_next_line_as_the_reference_does() -> None:
    assert extract_answer("ANSWER:\nAnswer: 0") == "Answer: 0"
    assert extract_answer("Answer:\n12") == "12"


# ---------------------------------------------------------------------------
# math_verify_score
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),
        ("Answer: 1/2", "0.5", 1.0),
        ("Answer: \\frac{2}{4}", "\\frac12", 1.0),
        ("Answer: $\\sqrt{27}$", "3\\sqrt{3}", 1.0),
        ("Answer: 0.25", "\\frac{1}{2}", -1.0),
        ("Answer: (1, 2]", "(1,2]", 1.0),
        ("Answer: [1,2]", "(1,2)", -1.0),
        ("Answer: \\{2, 1\\}", "\\{1,2\\}", 1.0),
        ("Answer: (x+1)^2", "x^2+2x+1", 1.0),
        ("so the result is $\\boxed{42}$.", "42", 1.0),  # no Answer line: parse the tail
        ("I could not solve it.", "42", -1.0),
    ],
)
def test_math_verify_score(response: str, truth: str, expected: float) -> None:
    assert math_verify_score(response, truth) == expected


def test_math_verify_score_works_outside_the_main_thread() -> None:
    # math_verify's default signal-based timeouts raise ValueError in other threads.
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(math_verify_score("Answer: 0.5", "1/2")))
    t.start()
    t.join()
    assert out == [1.0]


# ---------------------------------------------------------------------------
# scorer selection
# ---------------------------------------------------------------------------


def test_scorers_registry_and_source_mapping() -> None:
    assert {"dapo_math", "dapo_math_lenient", "math_verify"} <= set(SCORERS)
    mapping = {"aime": "math_verify"}
    assert scorer_for_source("aime", mapping) == "math_verify"
    assert scorer_for_source("math_dapo", mapping) == "dapo_math"
    assert scorer_for_source("x", None, default="math_verify") == "math_verify"
    with pytest.raises(
        ValueError, match=r"'sympy_magic'.*dapo_math, dapo_math_lenient, gsm8k, math_verify"
    ):
        scorer_for_source("aime", {"aime": "sympy_magic"})
    with pytest.raises(ValueError, match=r"'nope'.*reward.default_scorer"):
        scorer_for_source("x", None, default="nope")


# ---------------------------------------------------------------------------
# overlong shaping
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "max_length", "cache_length", "expected"),
    [
        (0, 100, 20, 0.0),
        (80, 100, 20, 0.0),  # boundary: max - cache
        (81, 100, 20, -0.05),
        (90, 100, 20, -0.5),
        (100, 100, 20, -1.0),  # boundary: max
        (101, 100, 20, -1.0),
        (16384, 20480, 4096, 0.0),  # the paper's setting
        (18432, 20480, 4096, -0.5),
        (20480, 20480, 4096, -1.0),
        (25000, 20480, 4096, -1.0),
        (100, 100, 0, 0.0),  # no buffer: only the hard cap
        (101, 100, 0, -1.0),
        (50, 100, 100, -0.5),  # buffer as long as the cap
    ],
)
def test_soft_overlong_punishment(
    length: int, max_length: int, cache_length: int, expected: float
) -> None:
    assert soft_overlong_punishment(length, max_length, cache_length) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 100, -1), r"cache_length.*-1"),
        ((10, 100, 101), r"cache_length.*max_length=100.*101"),
        ((10, 0, 0), r"max_length.*0"),
        ((-1, 100, 20), r"length.*-1"),
    ],
)
def test_soft_overlong_punishment_rejects_bad_arguments(
    args: tuple[int, int, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        soft_overlong_punishment(*args)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5000), st.data())
def test_soft_overlong_punishment_is_bounded_and_non_increasing(
    max_length: int, data: st.DataObject
) -> None:
    cache = data.draw(st.integers(0, max_length))
    length = data.draw(st.integers(0, 2 * max_length))
    here = soft_overlong_punishment(length, max_length, cache)
    assert -1.0 <= here <= 0.0
    assert soft_overlong_punishment(length + 1, max_length, cache) <= here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_overlong_filter_mask_zeroes_truncated_rows(dtype: torch.dtype) -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]).to(dtype)
    before = mask.clone()
    truncated = torch.tensor([False, True, False, True])
    out = overlong_filter_mask(mask, truncated)
    expected = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    assert torch.equal(mask, before)  # input untouched
    with pytest.raises(ValueError, match="truncated must be"):
        overlong_filter_mask(mask, torch.tensor([True]))


# ---------------------------------------------------------------------------
# load_reward_function
# ---------------------------------------------------------------------------


def test_load_reward_function_forms() -> None:
    assert load_reward_function("dapo.rewards:dapo_math_score") is dapo_math_score
    assert load_reward_function("os.path:join") is os.path.join
    fn = load_reward_function(fx("length_score"))
    assert fn("abcdefghij", "") == 1.0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("dapo.rewards", r"malformed.*'package\.module:function'"),
        ("dapo.rewards:", r"malformed"),
        (":dapo_math_score", r"malformed"),
        ("no_such_pkg_xyz.scoring:fn", r"module 'no_such_pkg_xyz.scoring' not found"),
        ("dapo.rewards:no_such_fn", r"no attribute 'no_such_fn'.*dapo_math_score"),
        (f"{FIXTURES}:no_such_fn", r"no attribute 'no_such_fn'.*callables it defines:.*sleepy"),
        (f"{FIXTURES}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
        ("/no/such/dir/reward.py:fn", r"file '/no/such/dir/reward.py' not found"),
    ],
)
def test_load_reward_function_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_reward_function(spec)


# ---------------------------------------------------------------------------
# RewardScorer
# ---------------------------------------------------------------------------


def test_builtin_scorer_in_pool_reuses_workers() -> None:
    batch = [req("Answer: 7"), req("Answer: 8"), req("no answer"), req("Answer: \\boxed{7}")]
    with RewardScorer(num_workers=1) as scorer:
        first = scorer.score(batch)
        pids = scorer.worker_pids
        second = scorer.score(batch)
        assert scorer.worker_pids == pids  # persistent, not re-spawned per batch
        assert scorer.worker_startup_s and scorer.worker_startup_s[0] < 30
        assert scorer.score([]).rewards == []
    for result in (first, second):
        assert result.rewards == [1.0, -1.0, -1.0, 1.0]
        assert result.correct == [True, False, False, True]
        assert result.failures == 0
    assert all(not _alive(pid) for pid in pids)  # close() stopped them
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(batch)


def test_start_up_lines_name_the_reference_or_the_lenient_scorer() -> None:
    """A run says whether its rewards follow the DAPO reference's rules or the lenient ones."""
    reference = "dapo_math scorer (the last 'Answer: ...' line, compared as text by the DAPO "
    lenient = (
        "dapo_math_lenient scorer (the last 'Answer: ...' line, compared as text after a lenient"
    )
    mapping = {"math_dapo": "dapo_math"}
    with RewardScorer(
        source_scorers=mapping, default_scorer="dapo_math_lenient", num_workers=0
    ) as s:
        said = s.describe(["mine", "math_dapo"])
    assert said[0].startswith(f"scoring data_source 'math_dapo' with the built-in {reference}")
    assert said[1].startswith(f"scoring data_source 'mine' with the built-in {lenient}")
    with RewardScorer([("dapo_math", 1.0), ("dapo_math_lenient", 0.5)], num_workers=0) as s:
        (line,) = s.describe(["mine"])
    assert "dapo_math (built-in: the last 'Answer: ...' line, compared as text by the DAPO" in line
    assert (
        "dapo_math_lenient (built-in: the last 'Answer: ...' line, compared as text after" in line
    )
    assert "weight 0.5)" in line


def test_per_data_source_scorer_selection() -> None:
    batch = [
        req("Answer: 0.5", "\\frac{1}{2}", "aime"),  # math_verify: equivalent
        req("Answer: 0.5", "\\frac{1}{2}", "math_dapo"),  # dapo_math: different strings
        req("Answer: 12", "12", "other"),
    ]
    with RewardScorer(source_scorers={"aime": "math_verify"}, num_workers=2) as scorer:
        result = scorer.score(batch)
    assert result.rewards == [1.0, -1.0, 1.0]
    assert result.failures == 0


def test_timeout_kills_worker_and_other_samples_still_score() -> None:
    batch = [
        req("Answer: 7"),
        req("SLEEP\nAnswer: 7"),
        *(req(f"Answer: {i}") for i in range(5, 10)),
    ]
    with RewardScorer([(fx("sleepy"), 1.0)], timeout_s=0.5, num_workers=1) as scorer:
        scorer.score(batch[:1])
        pids = scorer.worker_pids
        start = time.monotonic()
        with pytest.warns(RewardFunctionWarning, match=r"sleepy' took longer than 0.5 s"):
            result = scorer.score(batch)
        assert time.monotonic() - start < 5.0
        assert result.rewards == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0]
        assert result.correct == [True, False, False, False, True, False, False]
        assert (result.timeouts, result.failures, result.errors, result.bad_values) == (1, 1, 0, 0)
        assert scorer.worker_pids != pids  # the hung worker was replaced
        again = scorer.score([req("Answer: 7"), req("Answer: 6")])
        assert again.rewards == [1.0, -1.0] and again.failures == 0


def test_raising_function_is_a_failure_warned_once() -> None:
    with RewardScorer([(fx("raises"), 1.0)], num_workers=1) as scorer:
        with pytest.warns(RewardFunctionWarning) as record:
            result = scorer.score([req("RAISE Answer: 7"), req("Answer: 7"), req("RAISE")])
        assert result.rewards == [-1.0, 1.0, -1.0]
        assert (result.errors, result.failures, result.timeouts) == (2, 2, 0)
        messages = [str(w.message) for w in record if w.category is RewardFunctionWarning]
        assert len(messages) == 1
        assert "raises' raised ValueError: cannot score 'RAISE Answer'" in messages[0]
        assert "reward_fixtures.py" in messages[0]  # where it raised
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            assert scorer.score([req("RAISE again")]).errors == 1
        assert not [w for w in later if w.category is RewardFunctionWarning]


@pytest.mark.parametrize("num_workers", [1, 0])
def test_bad_return_values(num_workers: int) -> None:
    batch = [req("NAN Answer: 7"), req("INF Answer: 7"), req("Answer: 7"), req("STRING Answer: 7")]
    functions = [(fx("returns_nan"), 1.0), (fx("returns_string"), 1.0)]
    with (
        RewardScorer(functions, num_workers=num_workers) as scorer,
        pytest.warns(RewardFunctionWarning) as record,
    ):
        result = scorer.score(batch)
    assert result.rewards == [-1.0, -1.0, 2.0, -1.0]
    assert result.correct == [False, False, True, False]
    assert (result.bad_values, result.failures, result.errors) == (3, 3, 0)
    messages = sorted(str(w.message) for w in record if w.category is RewardFunctionWarning)
    assert len(messages) == 2  # once per function, not once per sample
    assert "returns_nan' returned nan, not a finite number" in messages[0]
    assert "returns_string' returned '1.0', not a finite number" in messages[1]


def test_bool_return_counts_as_number() -> None:
    with RewardScorer([(fx("returns_bool"), 1.0)], num_workers=1) as scorer:
        result = scorer.score([req("it is 7", "7"), req("it is 8", "7")])
    assert result.rewards == [1.0, 0.0]
    assert result.correct == [True, False]
    assert result.failures == 0


def test_weighted_combination_and_failure_override() -> None:
    functions = [("dapo_math", 0.5), (fx("length_score"), 2.0)]
    with RewardScorer(functions, num_workers=1) as scorer:
        result = scorer.score([req("Answer: 7"), req("Answer: 8"), req("x")])
    # "Answer: 7" is 9 characters: length_score 0.9
    assert result.rewards == pytest.approx([0.5 * 1 + 2.0 * 0.9, 0.5 * -1 + 2.0 * 0.9, -0.5 + 0.2])
    assert result.correct == [True, True, False]
    with (
        RewardScorer([("dapo_math", 3.0), (fx("raises"), 2.0)], num_workers=0) as scorer,
        pytest.warns(RewardFunctionWarning),
    ):
        result = scorer.score([req("Answer: 7 RAISE"), req("Answer: 7")])
    assert result.rewards == [-1.0, 5.0]  # a failure is -1 whatever the weights


def test_data_source_is_passed_when_accepted() -> None:
    functions = [(fx("by_source"), 1.0), (fx("with_kwargs"), 10.0), (fx("length_score"), 0.0)]
    with RewardScorer(functions, num_workers=1) as scorer:
        result = scorer.score([req("a", data_source="good"), req("a", data_source="bad")])
    assert result.rewards == [11.0, -11.0]


def test_crashing_worker_costs_one_sample() -> None:
    batch = [req("Answer: 7"), req("CRASH"), req("Answer: 7")]
    with RewardScorer([(fx("crashes"), 1.0)], num_workers=1) as scorer:
        with pytest.warns(RewardFunctionWarning, match=r"crashes' raised WorkerDied.*code 3"):
            result = scorer.score(batch)
        assert result.rewards == [1.0, -1.0, 1.0]
        assert (result.errors, result.failures) == (1, 1)
        assert scorer.score(batch[:1]).rewards == [1.0]


def test_workers_do_not_import_torch_and_see_parent_sys_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "torch" in sys.modules  # the parent has it, like the trainer
    monkeypatch.syspath_prepend(str(FIXTURES.parent))
    functions = [("reward_fixtures:torch_loaded", 1.0), ("reward_fixtures:worker_pid", 1.0)]
    with RewardScorer(functions, num_workers=1) as scorer:
        result = scorer.score([req("a")])
        assert result.rewards == [float(scorer.worker_pids[0])]  # torch_loaded gave 0.0
    with RewardScorer(functions, num_workers=0) as scorer:
        assert scorer.score([req("a")]).rewards == [1.0 + os.getpid()]  # in-process


def test_works_from_python_dash_c() -> None:
    spec = fx("returns_bool")
    code = (
        "from dapo.rewards import RewardScorer, ScoreRequest\n"
        f"with RewardScorer([('dapo_math', 1.0), ({spec!r}, 1.0)], num_workers=1) as s:\n"
        "    r = s.score([ScoreRequest('Answer: 3', '3'), ScoreRequest('Answer: 3', '4')])\n"
        "print(r.rewards)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[2.0, -1.0]"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"functions": [("nonsense", 1.0)]},
            r"'nonsense' is neither a built-in scorer \(code, dapo_math, dapo_math_lenient, gsm8k, "
            r"math_verify\)",
        ),
        ({"functions": [("dapo_math", float("nan"))]}, r"weight must be a finite number"),
        ({"functions": [("no_such_pkg_xyz:f", 1.0)]}, r"module 'no_such_pkg_xyz' not found"),
        (
            {"source_scorers": {"aime": "mathverify"}},
            r"'mathverify'.*reward.source_scorers\['aime'\]",
        ),
        ({"default_scorer": "exact"}, r"'exact'.*valid names"),
        ({"timeout_s": 0}, r"timeout_s.*positive"),
        ({"num_workers": -1}, r"num_workers.*>= 0"),
    ],
)
def test_reward_scorer_rejects_bad_configuration(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardScorer(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Python callables as reward functions
# ---------------------------------------------------------------------------


def test_lambda_and_closure_rewards_run_in_worker_processes() -> None:
    answers = {"q1": "7", "q2": "12"}  # local state the closure captures

    class Bonus:  # a class local to this test: cloudpickle sends it by value
        def __init__(self, amount: float) -> None:
            self.amount = amount

    bonus = Bonus(0.5)

    def by_key(response: str, ground_truth: str, data_source: str = "") -> float:
        hit = 1.0 if f"Answer: {answers[ground_truth]}" in response else 0.0
        return hit + (bonus.amount if data_source == "bonus" else 0.0)

    functions = [(lambda r, g: len(r) / 10, 1.0), (by_key, 2.0)]
    batch = [req("Answer: 7", "q1"), req("Answer: 7", "q2", "bonus"), req("Answer: 12", "q2")]
    with RewardScorer(functions, num_workers=1) as scorer:
        result = scorer.score(batch)
        assert len(scorer.worker_pids) == 1
    # by hand: len/10 + 2 * (hit + bonus): 0.9 + 2*1, 0.9 + 2*(0 + 0.5), 1.0 + 2*1
    assert result.rewards == pytest.approx([2.9, 1.9, 3.0])
    assert result.failures == 0
    with RewardScorer([(lambda r, g: os.getpid(), 1.0)], num_workers=1) as scorer:
        (pid,) = scorer.score([req("a")]).rewards
        assert pid == scorer.worker_pids[0] != os.getpid()  # run in the worker, not here
    with RewardScorer([(lambda r, g: os.getpid(), 1.0)], num_workers=0) as scorer:
        assert scorer.score([req("a")]).rewards == [os.getpid()]  # debugging: in this thread


def test_callables_defined_in_main_run_in_worker_processes() -> None:
    code = (
        "import os\n"
        "from dapo.rewards import RewardScorer, ScoreRequest\n"
        "answers = {'a': '3', 'b': '4'}\n"
        "def make(weight):\n"
        "    return lambda response, truth: weight * (answers[truth] in response)\n"
        "def pid(response, truth):\n"
        "    return os.getpid()\n"
        "if __name__ == '__main__':\n"
        "    functions = [(make(3.0), 1.0), (lambda r, t: len(r), 1.0), (pid, 0.0)]\n"
        "    with RewardScorer(functions, num_workers=1) as s:\n"
        "        r = s.score([ScoreRequest('x 3', 'a'), ScoreRequest('x 3', 'b')])\n"
        "    with RewardScorer([(pid, 1.0)], num_workers=1) as s:\n"
        "        elsewhere = s.score([ScoreRequest('', '')]).rewards[0] != os.getpid()\n"
        "    print(r.rewards, r.failures, elsewhere)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[6.0, 3.0] 0 True"  # 3*1 + len('x 3'), 3*0 + 3


def test_raising_callable_costs_its_sample_not_the_run() -> None:
    def picky(response: str, ground_truth: str) -> float:
        if "RAISE" in response:
            raise KeyError(response)
        return 1.0

    with RewardScorer([(picky, 1.0)], num_workers=1) as scorer:
        with pytest.warns(RewardFunctionWarning) as record:
            result = scorer.score([req("RAISE"), req("fine"), req("RAISE too")])
        assert result.rewards == [-1.0, 1.0, -1.0]
        assert (result.errors, result.failures, result.timeouts) == (2, 2, 0)
        messages = [str(w.message) for w in record if w.category is RewardFunctionWarning]
        assert len(messages) == 1
        assert ".<locals>.picky' raised " in messages[0]  # named by its qualified name
        assert "KeyError: 'RAISE'" in messages[0]


def test_hanging_callable_is_timed_out_in_its_worker() -> None:
    slow = {"SLEEP": 60.0}  # captured: how long to hang on which marker

    def hangs(response: str, ground_truth: str) -> float:
        time.sleep(slow.get(response.split()[0], 0.0))
        return 1.0

    with RewardScorer([(hangs, 1.0)], timeout_s=0.5, num_workers=1) as scorer:
        scorer.score([req("warm")])
        pids = scorer.worker_pids
        start = time.monotonic()
        with pytest.warns(RewardFunctionWarning, match=r"took longer than 0.5 s.*worker was"):
            result = scorer.score([req("ok"), req("SLEEP now"), req("ok again")])
        assert time.monotonic() - start < 5.0
        assert result.rewards == [1.0, -1.0, 1.0]
        assert (result.timeouts, result.failures) == (1, 1)
        assert scorer.worker_pids != pids  # the stuck worker was replaced


def test_unpicklable_callable_runs_in_this_process_with_failure_isolation() -> None:
    lock = threading.Lock()  # cannot be pickled: the closure stays in this process
    release = threading.Event()
    threads: list[str] = []

    def locked(response: str, ground_truth: str) -> float:
        with lock:
            threads.append(threading.current_thread().name)
        if "RAISE" in response:
            raise RuntimeError("no")
        if "HANG" in response:
            release.wait(30)
        return 0.25

    with pytest.warns(RewardFunctionWarning) as record:
        scorer = RewardScorer([("dapo_math", 1.0), (locked, 2.0)], timeout_s=0.5, num_workers=1)
    messages = [str(w.message) for w in record if w.category is RewardFunctionWarning]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "locked' cannot be pickled for the worker processes (TypeError: " in messages[0]
    assert "_thread.lock" in messages[0] and "runs in this process" in messages[0]
    try:
        batch = [req("Answer: 7"), req("RAISE"), req("Answer: 8"), req("HANG"), req("Answer: 7")]
        start = time.monotonic()
        with pytest.warns(RewardFunctionWarning) as record:
            result = scorer.score(batch)
        assert time.monotonic() - start < 5.0
        # dapo_math (in a worker) + 2 * 0.25 (here): 1 + 0.5, -1 + 0.5; failures score -1
        assert result.rewards == [1.5, -1.0, -0.5, -1.0, 1.5]
        assert (result.errors, result.timeouts, result.failures) == (1, 1, 2)
        texts = " ".join(str(w.message) for w in record)
        assert "raised RuntimeError: no" in texts and "runs on in a background thread" in texts
        assert len(scorer.worker_pids) == 1  # dapo_math still ran in the worker
        assert len(threads) == 5 and all(t == "dapo-reward" for t in threads)  # visible here
        assert scorer.score([req("Answer: 7")]).rewards == [1.5]  # a fresh helper thread
    finally:
        release.set()
        scorer.close()


def test_reward_functions_must_be_specs_or_callables() -> None:
    with pytest.raises(ValueError, match=r"functions\[0\] name '3' is neither a built-in"):
        RewardScorer([(3, 1.0)], num_workers=0)  # type: ignore[list-item]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A reaped child is gone; a zombie would still answer, so check its state too.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
