"""The built-in chain task (``builtin:chain``): add up a list of numbers, one line per term.

A second built-in task, made so that the mechanisms of the DAPO paper have something to act
on (``builtin:addition`` is too short and too regular for that). Each property is there
for one of them:

- **Lengths that vary several-fold.** A problem has 2 to 7 terms and the worked solution
  writes one line per addition (``12+9=21``), so clean solutions run from 16 to 77 tokens
  (42 on average). The token-level loss weighs these by their length; a sample-level loss does not.
- **A range of difficulty.** Most problems add one-digit terms (``7+5+9``), which the warmed-up
  model does well; ``WIDE_SHARE`` of them add two-digit terms (``37+48+25``), whose three-digit
  running totals a ~1M-parameter model gets right only sometimes, less the longer the chain.
  So many groups are all right (short, narrow) or all wrong (long, wide): dynamic sampling has
  groups to drop.
- **Decision points with real entropy.** The warm-up data is noisy in three ways, each a
  choice the warmed-up model keeps making with a real probability:
  a line whose units overflow drops the carry (``17+5=12``, ``DROP_CARRY``; the rest of the
  working is consistent with it, so the answer is wrong); at each line boundary the solution
  may stop working and jump to ``Answer: <total>`` (``SHORTCUT``; right when little is left to
  add, mostly wrong for the model on a long chain); a line may be written again, and again
  (``REPEAT``, ``REPEAT_AGAIN``: rambling that changes nothing but the length). RL must learn
  to keep carries, to work the chain out rather than guess, and to stop repeating itself.
- **Truncation.** Rambling pushes the longer solutions past a response limit that the clean
  ones fit under (``SUGGESTED_MAX_LENGTH``), so truncation hits a real share of responses
  early in training: the overlong filter and the soft punishment have something to act on.

Scored by the same ``dapo_math`` scorer as real math data: the response must end with
``Answer: <sum>``. ``docs/benchmarks.md`` (section 3) says how each property was measured
(``benchmarks/measure_task.py``).
"""

from __future__ import annotations

import hashlib
import random

from dapo.data.records import PromptRecord

NAME = "builtin:chain"
DATA_SOURCE = "builtin_chain"
MIN_TERMS, MAX_TERMS = 2, 7
WIDE_SHARE = 0.3  # share of problems whose terms have two digits (10-99) instead of one (1-9)
SUGGESTED_MAX_LENGTH = 80  # response limit: every clean solution fits, long rambling ones do not

# Warm-up noise (only in the supervised warm-up data, never in the problems' answers).
DROP_CARRY = 0.25  # a line whose units overflow drops the carry into the tens: 17+5=12
SHORTCUT = 0.06  # at each line boundary: stop working, write "Answer: <total>" at once
REPEAT = 0.08  # a line is written a second time ...
REPEAT_AGAIN = 0.6  # ... and once more, with these odds each time (a loop)


def _prompt(terms: list[int]) -> str:
    return f"Add {'+'.join(map(str, terms))} line by line. End with: Answer: <sum>\n"


def worked_solution(terms: list[int], rng: random.Random | None = None) -> tuple[str, int]:
    """One line per addition (``running+term=new``) and a last line ``Answer: <sum>``.

    With ``rng`` the solution carries the warm-up noise described in the module docstring.
    Every line is consistent with the lines before it, so a dropped carry makes the answer
    wrong. Returns the text and the answer it ends with.
    """
    lines: list[str] = []
    total = terms[0]
    for i, term in enumerate(terms[1:]):
        if rng is not None and rng.random() < SHORTCUT:  # stop working, add the rest "mentally"
            total += sum(terms[1 + i :])
            break
        new = total + term
        if rng is not None and (total % 10) + (term % 10) >= 10 and rng.random() < DROP_CARRY:
            new -= 10
        line = f"{total}+{term}={new}"
        lines.append(line)
        if rng is not None and rng.random() < REPEAT:
            lines.append(line)
            while rng.random() < REPEAT_AGAIN:
                lines.append(line)
        total = new
    lines.append(f"Answer: {total}")
    return "\n".join(lines), total


def _split_of(terms: list[int]) -> str:
    h = int(hashlib.sha1("+".join(map(str, terms)).encode()).hexdigest()[:8], 16)
    return "test" if h % 10 == 0 else "train"


def _sample_terms(rng: random.Random) -> list[int]:
    k = rng.randint(MIN_TERMS, MAX_TERMS)
    lo, hi = (10, 99) if rng.random() < WIDE_SHARE else (1, 9)
    return [rng.randint(lo, hi) for _ in range(k)]


def _sample_split(rng: random.Random, split: str) -> list[int]:
    terms = _sample_terms(rng)
    while _split_of(terms) != split:
        terms = _sample_terms(rng)
    return terms


def chain_records(split: str = "train", n: int = 20000, seed: int = 1234) -> list[PromptRecord]:
    """``n`` problems of the given split ("train" or "test"; disjoint by hashing).

    Problems are drawn from the task distribution (short ones repeat), so training and
    held-out accuracy measure the same thing.
    """
    if split not in ("train", "test"):
        raise ValueError(f"{NAME} has splits 'train' and 'test', not {split!r}")
    rng = random.Random(f"{seed}-{split}")
    out: list[PromptRecord] = []
    for _ in range(n):
        terms = _sample_split(rng, split)
        out.append(
            PromptRecord(
                prompt=_prompt(terms),
                ground_truth=str(sum(terms)),
                data_source=DATA_SOURCE,
                uid="chain-" + "+".join(map(str, terms)),
                extra={"terms": terms},
            )
        )
    return out


def sft_example(rng: random.Random) -> tuple[str, str]:
    """A training-split problem and a worked solution with the warm-up noise: (prompt, solution)."""
    terms = _sample_split(rng, "train")
    return _prompt(terms), worked_solution(terms, rng)[0]
