"""The built-in task for a real chat model (``builtin:chat_addition``): sums of two 2-digit
numbers, asked in chat messages, answered in the DAPO answer format.

Made for SmolLM2-135M-Instruct (the model of the ``realmodel`` test tier) and models of its
size: a system message states the answer format and three worked examples show it, so the
prompt is rendered through the model's chat template as a conversation::

    system:    Answer with the equation, then a last line: Answer: <number>
    user:      What is 23 + 45?
    assistant: 23 + 45 = 68
               Answer: 68
    user:      What is 47 + 38?
    assistant: 47 + 38 = 85
               Answer: 85
    user:      What is 76 + 49?
    assistant: 76 + 49 = 125
               Answer: 125
    user:      What is 51 + 29?

and a response like ``51 + 29 = 80\\nAnswer: 80`` (about 18 tokens). Scored by the same
``dapo_math`` scorer as real math data (the default reward: nothing to configure), so a
response is *well-formed* when it has an ``Answer: <integer>`` line.

Why this task (``docs/benchmarks.md``, section 14, has the measurements): asked for the
number alone the model is right 10% of the time, without examples never; writing the
equation first, it is right 28% of the time at temperature 1.0 (62% of groups of 8 have a
right answer) with 92% of its answers well-formed, and most groups of 8 are mixed. The
wrong answers are arithmetic slips (``84 + 10 = 194``, ``16 + 19 = 25``), not format, so
what RL can raise is the accuracy among well-formed answers, and a skill, not memorised
facts, carries over to the held-out problems.

Splits: the 8,100 problems ``a + b`` (10 <= a, b <= 99) are split by a hash of the
problem, about 10% held out (``test``); the examples of the prompt are never held out.
Each split is visited in a seeded random order, without repeats until it is exhausted.
Prompts are 152 tokens long with SmolLM2's template (each digit is a token): set
``data.max_prompt_length`` to 192 (the default 128 drops them all, with an error that says so).

``builtin:chat_addition-sanity`` is a fixed set of 32 training problems that
SmolLM2-135M-Instruct partly solves (1 to 7 of 8 responses right at temperature 1.0), for
the sanity check of a trainer: training on them must raise their accuracy to ~100%. Both of
its splits are those 32 problems (its evaluation is the training accuracy).

``VARIANTS`` holds the other candidates measured when choosing the task (other operations
and operand sizes, answers without the equation, no examples); they are not registered as
built-in data sets, ``benchmarks/measure_task.py --variant NAME`` measures them.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from dapo.data.records import PromptRecord

NAME = "builtin:chat_addition"
SANITY_NAME = "builtin:chat_addition-sanity"
DATA_SOURCE = "chat_addition"  # not mapped: scored by reward.default_scorer (dapo_math)
SYSTEM = "Answer with the equation, then a last line: Answer: <number>"
SUGGESTED_MAX_PROMPT_LENGTH = 192  # tokens, with SmolLM2's chat template (prompts: 152)
SUGGESTED_MAX_LENGTH = 24  # response limit: a well-formed answer takes 15-20 tokens
TEST_SHARE = 10  # 1 in TEST_SHARE problems is held out


@dataclass(frozen=True)
class Variant:
    """A candidate task: ``a <op> b`` for ``a`` in ``a_range``, ``b`` in ``b_range``."""

    op: str  # "+", "-" or "x"
    a_range: tuple[int, int]  # inclusive
    b_range: tuple[int, int]
    examples: tuple[tuple[int, int], ...]  # worked examples (a, b) shown before the question
    equation: bool = True  # the examples write "a + b = c" before "Answer: c"
    system: bool = True  # a system message states the answer format

    def answer(self, a: int, b: int) -> int:
        return {"+": a + b, "-": a - b, "x": a * b}[self.op]

    def problems(self) -> list[tuple[int, int]]:
        """Every problem of the variant, in a fixed order."""
        return [
            (a, b)
            for a in range(self.a_range[0], self.a_range[1] + 1)
            for b in range(self.b_range[0], self.b_range[1] + 1)
        ]

    def split_of(self, a: int, b: int) -> str:
        """``train`` or ``test``, by a hash of the problem; examples are always ``train``."""
        if (a, b) in self.examples:
            return "train"
        h = int(hashlib.sha1(f"chat:{a}{self.op}{b}".encode()).hexdigest()[:8], 16)
        return "test" if h % TEST_SHARE == 0 else "train"

    def messages(self, a: int, b: int) -> list[dict[str, str]]:
        """The chat messages asking ``a <op> b``: system message, examples, question."""
        out = [{"role": "system", "content": SYSTEM}] if self.system else []
        for x, y in self.examples:
            out.append({"role": "user", "content": _question(x, self.op, y)})
            out.append({"role": "assistant", "content": self.response(x, y)})
        out.append({"role": "user", "content": _question(a, self.op, b)})
        return out

    def response(self, a: int, b: int) -> str:
        """The right answer in the format the examples show."""
        c = self.answer(a, b)
        return f"{a} {self.op} {b} = {c}\nAnswer: {c}" if self.equation else f"Answer: {c}"


def _question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


CHOSEN = Variant("+", (10, 99), (10, 99), ((23, 45), (47, 38), (76, 49)))
VARIANTS: dict[str, Variant] = {
    "add_2d_2d": CHOSEN,
    "add_2d_1d": Variant("+", (10, 99), (1, 9), ((42, 7), (68, 5), (91, 8))),
    "sub_2d_1d": Variant("-", (10, 99), (1, 9), ((57, 4), (63, 8), (40, 6))),
    "mul_1d_1d": Variant("x", (2, 12), (2, 9), ((3, 7), (8, 6), (9, 4))),
    "add_2d_2d_answer_only": Variant("+", (10, 99), (10, 99), CHOSEN.examples, equation=False),
    "add_2d_2d_no_examples": Variant("+", (10, 99), (10, 99), ()),
}

# The sanity set: the first 32 training problems of CHOSEN (seed 1234 order) with 1 to 7 of
# 8 responses right, sampled from SmolLM2-135M-Instruct (Q4_1 GGUF) at temperature 1.0
# (75 of the first 128 were; docs/benchmarks.md, section 14):
#   python benchmarks/measure_task.py --model smollm2 --task builtin:chat_addition \
#       --split train --problems 128 --select-mixed 32 --max-length 24 --seed 0
SANITY_PROBLEMS: tuple[tuple[int, int], ...] = (
    (32, 52),
    (83, 89),
    (53, 53),
    (73, 61),
    (43, 79),
    (20, 19),
    (13, 62),
    (90, 56),
    (57, 93),
    (68, 98),
    (99, 26),
    (58, 71),
    (11, 37),
    (14, 72),
    (10, 22),
    (29, 93),
    (81, 93),
    (26, 24),
    (76, 45),
    (36, 77),
    (82, 82),
    (32, 69),
    (72, 89),
    (21, 20),
    (94, 81),
    (72, 43),
    (13, 45),
    (29, 42),
    (68, 52),
    (84, 53),
    (62, 30),
    (64, 85),
)


def variant_records(
    variant: Variant, split: str = "train", n: int = 20000, seed: int = 1234, name: str = NAME
) -> list[PromptRecord]:
    """``n`` problems of ``split`` ("train" or "test"): the split's problems in a seeded
    random order, repeated in a new order only when ``n`` exceeds them."""
    if split not in ("train", "test"):
        raise ValueError(f"{name} has splits 'train' and 'test', not {split!r}")
    pool = [p for p in variant.problems() if variant.split_of(*p) == split]
    rng = random.Random(f"{seed}-{split}")
    order: list[tuple[int, int]] = []
    while len(order) < n:
        rng.shuffle(pool)
        order.extend(pool[: n - len(order)])
    return [_record(variant, a, b) for a, b in order]


def _record(variant: Variant, a: int, b: int) -> PromptRecord:
    c = variant.answer(a, b)
    return PromptRecord(
        prompt=variant.messages(a, b),
        ground_truth=str(c),
        data_source=DATA_SOURCE,
        uid=f"chat-{a}{variant.op}{b}",
        # level: a difficulty field for data.difficulty_key and measure_task's breakdown
        # (for sums: 0 no carry, 1 a carry below 100, 2 a sum of 100 or more).
        extra={"a": a, "b": b, "op": variant.op, "level": _level(variant.op, a, b, c)},
    )


def _level(op: str, a: int, b: int, c: int) -> int:
    if op == "+":
        return 2 if c >= 100 else int(a % 10 + b % 10 >= 10)
    if op == "-":
        return int(a % 10 < b % 10)  # a borrow
    return int(c >= 10)


def chat_addition_records(
    split: str = "train", n: int = 20000, seed: int = 1234
) -> list[PromptRecord]:
    """``n`` problems of ``builtin:chat_addition`` from ``split`` ("train" or "test")."""
    return variant_records(CHOSEN, split, n, seed)


def sanity_records(split: str = "train", n: int = 32) -> list[PromptRecord]:
    """The 32 partly-solved training problems of the sanity check (both splits: the same)."""
    if split not in ("train", "test"):
        raise ValueError(f"{SANITY_NAME} has splits 'train' and 'test', not {split!r}")
    return [_record(CHOSEN, a, b) for a, b in SANITY_PROBLEMS[:n]]
