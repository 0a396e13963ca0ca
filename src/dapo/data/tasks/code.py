"""The built-in code task (``builtin:code``): a short specification in words, answered by a
two-line Python program judged on stdin/stdout tests in the sandbox (the ``code`` scorer).

"Read two integers a and b. Print the sum of a and b times 4." is answered by::

    a,b=map(int,input().split())
    print((a+b)*4)

The warm-up's programs carry noise: for half of the specifications a habit (one wrong
program, written 65% of the time: a dropped pair of parentheses, the other operator, the
operands swapped), for all of them a constant off by one or a label printed before the
number now and then. The warmed-up ``builtin:tiny-code`` writes the right program for most
specifications and its habit for the others, so RL against the tests has a clear job: find
the right program where the habit is wrong (it samples it about one time in three). Ground truths are verl/PRIME's ``{"inputs", "outputs"}`` as JSON text.
"""

from __future__ import annotations

import json
import random

from dapo.data.records import PromptRecord

NAME = "builtin:code"
DATA_SOURCE = "builtin_code"  # a code source: the code scorer picks it
READ = "a,b=map(int,input().split())"
# (words, the expression of the right program, a wrong program's expression) with K the constant
TEMPLATES = [
    ("the sum of a and b times K", "(a+b)*K", "a+b*K"),
    ("a times K plus b", "a*K+b", "a*K-b"),
    ("a minus b, times K", "(a-b)*K", "(b-a)*K"),
    ("the larger of a and b plus K", "max(a,b)+K", "min(a,b)+K"),
    ("the smaller of a and b times K", "min(a,b)*K", "max(a,b)*K"),
    ("a plus b plus K", "a+b+K", "a+b-K"),
    ("the product of a and b minus K", "a*b-K", "a*b+K"),
    ("a modulo K plus b", "a%K+b", "b%K+a"),
]
HABIT = 0.65  # share of warm-up programs that are the habit's wrong one, where there is one
HABITS = (0, 2, 4, 6)  # the templates with a habit
NOISE = 0.15  # share of the other warm-up programs that are wrong (constant, label)
TESTS = 3  # stdin/stdout tests per problem


def prompt_text(words: str, k: int) -> str:
    return f"Read two integers a and b. Print {words.replace('K', str(k))}.\n"


def program(expression: str, k: int) -> str:
    return f"{READ}\nprint({expression.replace('K', str(k))})"


def _value(expression: str, k: int, a: int, b: int) -> int:
    return eval(expression.replace("K", str(k)), {"max": max, "min": min}, {"a": a, "b": b})  # noqa: S307 - our own expressions


def sample(rng: random.Random) -> tuple[int, int]:
    """A template (index) and its constant."""
    return rng.randrange(len(TEMPLATES)), rng.randint(2, 9)


def sft_example(rng: random.Random) -> tuple[str, str]:
    """A warm-up example ``(prompt, program)`` with the warm-up noise."""
    t, k = sample(rng)
    words, right, wrong = TEMPLATES[t]
    text = program(right, k)
    if t in HABITS and rng.random() < HABIT:
        text = program(wrong, k)
    elif rng.random() < NOISE:
        if rng.random() < 0.5:
            text = program(right, k + rng.choice([-1, 1]))
        else:
            text = f"{READ}\nprint('value',{right.replace('K', str(k))})"
    return prompt_text(words, k), text


def code_records(split: str = "train", n: int = 4000, seed: int = 1234) -> list[PromptRecord]:
    """``n`` problems of ``split`` ("train" or "test": the same specifications, other tests
    drawn with another seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"{NAME} has splits 'train' and 'test', not {split!r}")
    rng = random.Random(f"{seed}-{split}-{NAME}")
    out = []
    for i in range(n):
        t, k = sample(rng)
        words, right, _ = TEMPLATES[t]
        pairs = [(rng.randint(1, 99), rng.randint(1, 99)) for _ in range(TESTS)]
        truth = {
            "inputs": [f"{a} {b}\n" for a, b in pairs],
            "outputs": [f"{_value(right, k, a, b)}\n" for a, b in pairs],
        }
        out.append(
            PromptRecord(
                prompt=prompt_text(words, k),
                ground_truth=json.dumps(truth),
                data_source=DATA_SOURCE,
                uid=f"code-{split}-{i}",
                extra={"template": t, "k": k},
            )
        )
    return out
