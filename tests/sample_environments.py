"""Environments and tools for tests/test_environments.py, importable by worker processes."""

from __future__ import annotations

import os
import time

from dapo.environments import Environment


def add(numbers: list[int]) -> int:
    """Add numbers.

    Args:
        numbers: The numbers to add.
    """
    return sum(numbers)


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def no_docstring(x: int) -> int:
    return x


class Counter(Environment):
    """Replies ``seen N: <text>`` and ends (reward 1.0) when the model says ``stop``. Turns
    named ``hang``, ``die``, ``raise``, ``garbage``, ``bad-message``, ``bad-reward`` misbehave."""

    def reset(self, record):
        self.n = 0
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, text):
        self.n += 1
        if text == "hang":
            time.sleep(60)
        if text == "die":
            os._exit(3)
        if text == "raise":
            raise ZeroDivisionError("boom")
        if text == "garbage":
            return "not a triple"
        if text == "bad-message":
            return [{"role": "user", "content": 42}], None, False
        if text == "bad-reward":
            return [], "high", True
        if text == "stop":
            return [], 1.0, True
        return [{"role": "user", "content": f"seen {self.n}: {text}"}], None, False


class RandomOpening(Environment):
    """Replays differently each time: its replies depend on the process it runs in."""

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, text):
        if text == "die":
            os._exit(3)
        return [{"role": "user", "content": f"pid {os.getpid()}"}], None, False


class NoStep:
    def reset(self, record):
        return []


class Forever(Environment):
    """Never ends; replies with ``reply_chars`` characters (a class attribute)."""

    reply_chars = 3

    def step(self, text):
        return [{"role": "tool", "content": "x" * self.reply_chars}], None, False


class LongReply(Forever):
    reply_chars = 200


class Echo(Environment):
    """Replies ``ok`` to the first turn and ends after the second."""

    def reset(self, record):
        self.turns = 0
        return super().reset(record)

    def step(self, text):
        self.turns += 1
        if self.turns >= 2:
            return [], 0.5, True
        return [{"role": "tool", "content": "ok"}], None, False


class TwoTurns(Environment):
    """Replies ``ok`` to the first turn and ends after the second, without a reward (the
    reward functions score the final answer)."""

    def reset(self, record):
        self.turns = 0
        return super().reset(record)

    def step(self, text):
        self.turns += 1
        if self.turns >= 2:
            return [], None, True
        return [{"role": "tool", "content": "ok"}], None, False


class Flaky(TwoTurns):
    """Misbehaves by prompt: the sum's last digit 0-1 raises in reset, 2-3 hangs in step, 4-5
    answers garbage; the others play TwoTurns."""

    def reset(self, record):
        self.kind = int(record.ground_truth[-1]) // 2
        if self.kind == 0:
            raise RuntimeError("no such table")
        return super().reset(record)

    def step(self, text):
        if self.kind == 1:
            time.sleep(60)
        if self.kind == 2:
            return {"messages": "not a triple"}
        return super().step(text)


def half_right(response: str, ground_truth: str) -> float:
    """+1 for an odd number of characters in the final answer, else -1: mixed groups."""
    return 1.0 if len(response) % 2 else -1.0


class Noisy(Environment):
    """Prints: 10 MB to stdout and to stderr on a turn saying ``noisy``, else one line to
    each (``heard <text>``); ends on ``stop``. A tool the model calls runs in it too."""

    def step(self, text):
        import sys

        if text == "noisy":
            print("o" * 10_000_000)
            print("e" * 10_000_000, file=sys.stderr)
        else:
            print(f"heard {text}")
            print(f"grumbled {text}", file=sys.stderr)
        return [], None, text == "stop"


def shout(word: str) -> str:
    """Print a word 1,000,000 times (a noisy tool).

    Args:
        word: The word to print.
    """
    print(f"{word} " * 1_000_000)
    return "done"


class LookAgain(Environment):
    """A second image for a vision-language policy: answers the first turn with a grid of one
    colour (which one depends on the turn's text) and "Look again.", and ends after the
    second turn (the reward functions score the final answer)."""

    def reset(self, record):
        self.turns = 0
        return super().reset(record)  # the record's prompt; its image fills the placeholder

    def step(self, text):
        from dapo.data.tasks.colour_count import COLOURS, GRID, draw

        self.turns += 1
        if self.turns >= 2:
            return [], None, True
        colour = list(COLOURS)[sum(map(ord, text)) % len(COLOURS)]
        image = draw([colour] * GRID**2)
        parts = [{"type": "image", "image": image}, {"type": "text", "text": "Look again."}]
        return [{"role": "user", "content": parts}], None, False
