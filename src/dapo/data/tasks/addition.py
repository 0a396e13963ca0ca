"""The built-in addition task (``builtin:addition``): column-by-column sums, DAPO answer format.

Worked solutions may carry warm-up noise (a dropped carry, a final line that ignores the
answer format), so the warmed-up model starts well above zero but well below perfect
accuracy, and RL against the exact scorer has a clear, measurable job to do.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from dapo.data.records import PromptRecord

NAME = "builtin:addition"
DATA_SOURCE = "builtin_addition"
NOISE_CARRY = 0.5  # share of worked solutions (with a carry) that drop one carry
NOISE_FORMAT = 0.3  # share of worked solutions that end "Sum: X", not "Answer: X"


def prompt_text(a: int, b: int) -> str:
    return f"Add {a}+{b} column by column. End with: Answer: <sum>\n"


def worked_solution(a: int, b: int, rng: random.Random | None = None) -> tuple[str, int]:
    """Column-by-column addition, least significant digit first, in the DAPO answer format.

    With ``rng`` the solution may carry the warm-up noise: a dropped carry (the rest of the
    working is consistent with it), or a last line ``Sum: X`` that ignores the requested
    ``Answer: X`` format (scored wrong). Returns the text and the answer it ends with.
    """
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    carries = [i for i in range(n) if _column_sum(da, db, i, 1) >= 10]
    drop = -1
    if rng is not None and carries and rng.random() < NOISE_CARRY:
        drop = rng.choice(carries)
    lines, result, carry = [], "", 0
    for i in range(n):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        terms = f"{x}+{y}" + ("+1" if carry else "")
        result = str(s % 10) + result
        lines.append(f"{terms}={s}, {result}")
        carry = 1 if s >= 10 and i != drop else 0
    if carry:
        result = "1" + result
        lines.append(f"carry 1, {result}")
    answer = int(result)
    label = "Sum" if rng is not None and rng.random() < NOISE_FORMAT else "Answer"
    lines.append(f"{label}: {answer}")
    return "\n".join(lines), answer


def count_carries(a: int, b: int) -> int:
    """How many columns of ``a + b`` carry into the next one (the last one included)."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry = count = 0
    for i in range(max(len(da), len(db))):
        carry = 1 if _column_sum(da, db, i, carry) >= 10 else 0
        count += carry
    return count


def _column_sum(da: str, db: str, i: int, carry: int) -> int:
    x = int(da[i]) if i < len(da) else 0
    y = int(db[i]) if i < len(db) else 0
    return x + y + carry


def split_of(a: int, b: int) -> str:
    h = int(hashlib.sha1(f"{a}+{b}".encode()).hexdigest()[:8], 16)
    return "test" if h % 10 == 0 else "train"


def _sample_operands(rng: random.Random) -> tuple[int, int]:
    def number() -> int:
        digits = rng.choice([1, 2, 2])
        return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)

    return number(), number()


def addition_records(split: str = "train", n: int = 20000, seed: int = 1234) -> list[PromptRecord]:
    """``n`` problems of the given split ("train" or "test"; disjoint by hashing).

    Problems are drawn from the task distribution (repeats allowed), so training and
    held-out accuracy measure the same thing.
    """
    return sum_records(NAME, DATA_SOURCE, "add", _sample_operands, split, n, seed)


def sum_records(
    task: str,
    data_source: str,
    uid_prefix: str,
    sample_operands: Callable[[random.Random], tuple[int, int]],
    split: str,
    n: int,
    seed: int,
) -> list[PromptRecord]:
    """``n`` problems ``a + b`` of ``split``, operands drawn by ``sample_operands`` (shared
    by the built-in addition tasks)."""
    if split not in ("train", "test"):
        raise ValueError(f"{task} has splits 'train' and 'test', not {split!r}")
    rng = random.Random(f"{seed}-{split}")
    out: list[PromptRecord] = []
    while len(out) < n:
        a, b = sample_operands(rng)
        if split_of(a, b) != split:
            continue
        out.append(
            PromptRecord(
                prompt=prompt_text(a, b),
                ground_truth=str(a + b),
                data_source=data_source,
                uid=f"{uid_prefix}-{a}-{b}",
                # carries: what the task is hard for (the warm-up data drops one in half the
                # solutions that have one); a difficulty field for data.difficulty_key.
                extra={"a": a, "b": b, "carries": count_carries(a, b)},
            )
        )
    return out


def sft_example(rng: random.Random) -> tuple[str, str]:
    """A training-split problem and a worked solution with the warm-up noise: (prompt, solution)."""
    a, b = _sample_operands(rng)
    while split_of(a, b) != "train":
        a, b = _sample_operands(rng)
    return prompt_text(a, b), worked_solution(a, b, rng)[0]
