"""The built-in multi-turn task (``builtin:calculator``): long sums with a calculator tool.

Each problem adds 3 numbers of 4 to 6 digits (15 digits in all), far beyond what the
~1M-parameter built-in model can add itself. The model has one tool, ``add(terms)``; an
episode that solves the problem copies the sum into a Hermes tool call, reads the tool's
reply and copies it into the DAPO answer format (scored by ``dapo_math``, as the other
built-in tasks)::

    tools: add
    U: Add 48213+905771+1234.
    A: <tool_call>{"name": "add", "arguments": {"terms": "48213+905771+1234"}}</tool_call><eos>
    T: 955218
    A: Answer: 955218<eos>

(as the chat template of ``builtin:tiny-tool``, :data:`CHAT_TEMPLATE`, renders it). The
operands always take 15 digits, so the copy into the call is at a fixed distance: with 3
or 4 numbers of 4-6 digits each, the same warm-up left the model copying no digit (0%
success). The answer cannot be reached without the tool's reply: with the replies
withheld the warmed-up model is right 0% of the time (``benchmarks/measure_tool_task.py``).

The warm-up transcripts (:func:`sft_example`) carry noise for RL to remove: some skip the
tool and guess (``SKIP_TOOL``), some mis-copy one digit of the sum into the call
(``MISCOPY_OPERAND``; the tool then adds the wrong numbers and the answer follows it),
some mis-copy the tool's result into the answer (``MISCOPY_RESULT``). The environment is
:class:`CalculatorEnvironment` (``rollout.environment=calculator``).
"""

from __future__ import annotations

import hashlib
import json
import random

from dapo.data.records import PromptRecord
from dapo.environments.base import Environment, Message

NAME = "builtin:calculator"
DATA_SOURCE = "builtin_calculator"
# The digits of the 3 numbers a problem adds: 4 to 6 each, 15 in all, so that the sum
# written out always has the same length (the copy into the tool call is at a fixed offset).
LENGTHS = [(4, 5, 6), (4, 6, 5), (5, 4, 6), (5, 6, 4), (6, 4, 5), (6, 5, 4), (5, 5, 5)]
SUGGESTED_MAX_TURNS = 3
SUGGESTED_MAX_LENGTH = 160  # tokens after the prompt: a clean episode takes about 115

# Warm-up noise (only in the supervised warm-up transcripts).
SKIP_TOOL = 0.25  # answer at once with a guess (the sum with some digits wrong)
MISCOPY_OPERAND = 0.3  # one digit of one operand is wrong in the tool call
MISCOPY_RESULT = 0.2  # one digit of the answer differs from the tool's reply


def add(terms: str) -> int:
    """Add whole numbers exactly.

    Args:
        terms: The numbers joined by "+", e.g. "12+345".
    """
    numbers = terms.replace(" ", "").split("+")
    if not all(n.isdigit() for n in numbers):
        raise ValueError(f"not whole numbers joined by '+': {terms!r}")
    return sum(int(n) for n in numbers)


class CalculatorEnvironment(Environment):
    """The task's environment: the record's prompt, the ``add`` tool, and the episode ends
    at the first turn without a tool call (the reward functions score that answer)."""

    tools = (add,)


def _prompt(numbers: list[int]) -> str:
    return "Add " + "+".join(map(str, numbers)) + "."


def _split_of(numbers: list[int]) -> str:
    h = int(hashlib.sha1("+".join(map(str, numbers)).encode()).hexdigest()[:8], 16)
    return "test" if h % 10 == 0 else "train"


def _sample(rng: random.Random, split: str) -> list[int]:
    while True:
        numbers = [rng.randrange(10 ** (d - 1), 10**d) for d in rng.choice(LENGTHS)]
        if _split_of(numbers) == split:
            return numbers


def calculator_records(
    split: str = "train", n: int = 20000, seed: int = 1234
) -> list[PromptRecord]:
    """``n`` problems of the given split ("train" or "test"; disjoint by hashing)."""
    if split not in ("train", "test"):
        raise ValueError(f"{NAME} has splits 'train' and 'test', not {split!r}")
    rng = random.Random(f"{seed}-{split}")
    out = []
    for _ in range(n):
        numbers = _sample(rng, split)
        out.append(
            PromptRecord(
                prompt=[{"role": "user", "content": _prompt(numbers)}],
                ground_truth=str(sum(numbers)),
                data_source=DATA_SOURCE,
                uid="calc-" + "-".join(map(str, numbers)),
                extra={"numbers": numbers, "operands": len(numbers)},
            )
        )
    return out


def _change_digit(rng: random.Random, number: int) -> int:
    """``number`` with one digit replaced by another (the leading digit stays non-zero)."""
    digits = list(str(number))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and (i > 0 or d != "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def tool_call_text(numbers: list[int]) -> str:
    """The model's Hermes tool call adding ``numbers``."""
    call = {"name": "add", "arguments": {"terms": "+".join(map(str, numbers))}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def sft_example(rng: random.Random) -> list[Message]:
    """A training-split problem and a noisy transcript of an episode (chat messages)."""
    numbers = _sample(rng, "train")
    opening: list[Message] = [{"role": "user", "content": _prompt(numbers)}]
    if rng.random() < SKIP_TOOL:
        guess = sum(numbers)
        for _ in range(rng.randint(1, 3)):
            guess = _change_digit(rng, guess)
        guess = guess if guess != sum(numbers) else _change_digit(rng, guess)
        return [*opening, {"role": "assistant", "content": f"Answer: {guess}"}]
    called = list(numbers)
    if rng.random() < MISCOPY_OPERAND:
        i = rng.randrange(len(called))
        called[i] = _change_digit(rng, called[i])
    result = sum(called)
    answer = _change_digit(rng, result) if rng.random() < MISCOPY_RESULT else result
    return [
        *opening,
        {"role": "assistant", "content": tool_call_text(called)},
        {"role": "tool", "name": "add", "content": str(result)},
        {"role": "assistant", "content": f"Answer: {answer}"},
    ]


# The chat template of builtin:tiny-tool (character tokens: every character counts). The
# tools line names the tools; the assistant's turn ends with the EOS token, and the "\n"
# after it is the environment's (as ChatML's "\n" after <|im_end|>).
CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}{{ 'A: ' + m['content'] + eos_token + '\\n' }}"
    "{%- elif m['role'] == 'tool' %}{{ 'T: ' + m['content'] + '\\n' }}"
    "{%- elif m['role'] == 'system' %}{{ 'S: ' + m['content'] + '\\n' }}"
    "{%- else %}{{ 'U: ' + m['content'] + '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'A: ' }}{% endif %}"
)
