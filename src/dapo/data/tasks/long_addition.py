"""The built-in long-addition task (``builtin:long_addition``): sums of numbers of 1 to 4
digits, column by column, with warm-up noise made for the DAPO mechanisms.

A second built-in task, made so that the mechanisms of the DAPO paper have something to act
on (``builtin:addition``, 1- and 2-digit sums, is too short and too regular for that). The
worked solution is the one of ``builtin:addition`` (one line per column, with the digits
of the result so far), so a ~1M-parameter model learns it in a few minutes::

    Add 4738+975 column by column. End with: Answer: <sum>
    8+5=13, 3
    3+7+1=11, 13
    7+9+1=17, 713
    4+0+1=5, 5713
    Answer: 5713

(Chains that need a lookup of "the next term" in the prompt, or sums written in one go, a
model of this size did not learn in that time.) Each property is there for one mechanism:

- **Lengths that vary several-fold.** Each line holds the result so far, so a clean
  solution grows faster than the number of columns: 19 tokens (``3+4``) to 81 (two 4-digit
  numbers whose sum gains a digit). The token-level loss weighs responses by their length;
  a sample-level loss does not.
- **A range of difficulty.** The warm-up data drops each carry with probability
  ``DROP_CARRY`` (the rest of the working follows from it, so the answer is wrong): a sum
  without carries is easy, one with three or four carries is right only by luck. So many
  groups are all right or all wrong: dynamic sampling has groups to drop.
- **Decision points with real entropy.** Besides the carry (keep it or drop it), at each
  line the warmed-up model may stop working and jump to ``Answer: <sum>`` (``SHORTCUT``;
  mostly a wrong guess), or write the line again, and again (``REPEAT``, ``REPEAT_AGAIN``:
  rambling that changes nothing but the length). RL must learn to keep carries, to work the
  sum out rather than guess, and to stop repeating itself.
- **Truncation.** Every clean solution fits the suggested response limit
  (``SUGGESTED_MAX_LENGTH``); rambling pushes a real share of responses past it early in
  training, so the overlong filter and the soft punishment have something to act on.

Scored by the same ``dapo_math`` scorer as real math data: the response must end with
``Answer: <sum>``. ``docs/benchmarks.md`` (section 8) says how each property was measured
(``benchmarks/measure_task.py``).
"""

from __future__ import annotations

import random

from dapo.data.records import PromptRecord
from dapo.data.tasks.addition import prompt_text, split_of, sum_records

NAME = "builtin:long_addition"
DATA_SOURCE = "builtin_long_addition"
MAX_DIGITS = 4  # each operand has 1..MAX_DIGITS digits, independently
SUGGESTED_MAX_LENGTH = 84  # response limit: every clean solution fits, long rambling ones do not

# Warm-up noise (only in the supervised warm-up data, never in the problems' answers).
DROP_CARRY = 0.5  # each carry is dropped with these odds: 8+5=13, then 3+7=10 (not 3+7+1)
SHORTCUT = 0.05  # before each line after the first: stop, write "Answer: <sum>" at once
REPEAT = 0.1  # a line is written a second time ...
REPEAT_AGAIN = 0.6  # ... and once more with these odds each time,
MAX_REPEATS = 4  # at most this many extra copies (keeps warm-up batches short)


def worked_solution(a: int, b: int, rng: random.Random | None = None) -> tuple[str, int]:
    """Column-by-column addition, least significant digit first, in the DAPO answer format.

    With ``rng`` the solution carries the warm-up noise described in the module docstring.
    Every line follows from the lines before it (a shortcut adds the remaining columns
    correctly), so a dropped carry makes the answer wrong. Returns the text and its answer.
    """
    da, db = str(a)[::-1], str(b)[::-1]
    lines: list[str] = []
    result, carry = "", 0
    for i in range(max(len(da), len(db))):
        if rng is not None and i > 0 and rng.random() < SHORTCUT:  # the rest "mentally"
            result = str(a // 10**i + b // 10**i + carry) + result
            carry = 0
            break
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        result = str(s % 10) + result
        line = f"{x}+{y}" + ("+1" if carry else "") + f"={s}, {result}"
        lines.append(line)
        if rng is not None and rng.random() < REPEAT:
            lines.append(line)
            for _ in range(MAX_REPEATS - 1):
                if rng.random() >= REPEAT_AGAIN:
                    break
                lines.append(line)
        carry = int(s >= 10 and not (rng is not None and rng.random() < DROP_CARRY))
    if carry:
        result = "1" + result
        lines.append(f"carry 1, {result}")
    answer = int(result)
    lines.append(f"Answer: {answer}")
    return "\n".join(lines), answer


def _sample_operands(rng: random.Random) -> tuple[int, int]:
    def number() -> int:
        digits = rng.randint(1, MAX_DIGITS)
        return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)

    return number(), number()


def _sample_split(rng: random.Random, split: str) -> tuple[int, int]:
    a, b = _sample_operands(rng)
    while split_of(a, b) != split:
        a, b = _sample_operands(rng)
    return a, b


def long_addition_records(
    split: str = "train", n: int = 20000, seed: int = 1234
) -> list[PromptRecord]:
    """``n`` problems of the given split ("train" or "test"; disjoint by hashing).

    Problems are drawn from the task distribution (repeats allowed), so training and
    held-out accuracy measure the same thing.
    """
    return sum_records(NAME, DATA_SOURCE, "long", _sample_operands, split, n, seed)


def sft_example(rng: random.Random) -> tuple[str, str]:
    """A training-split problem and a worked solution with the warm-up noise: (prompt, solution)."""
    a, b = _sample_split(rng, "train")
    return prompt_text(a, b), worked_solution(a, b, rng)[0]
