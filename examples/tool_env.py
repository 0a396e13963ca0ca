"""A tool and a multi-turn environment for ``dapo train examples/tool_use.yaml``.

A tool is a plain function with type hints and a Google-style docstring: dapo turns them
into the JSON schema the chat template shows the model (``tools=``), and runs the function
when the model calls it (Hermes form: ``<tool_call>{"name": "add", "arguments": {...}}
</tool_call>``). The function's return value (as JSON unless a string) is the tool's reply;
if it raises, the error text is the reply.

An environment is a class with ``reset(record)`` and ``step(assistant_text)``; one
instance plays one episode, in a worker process. Subclassing ``Environment`` is optional
(its ``reset`` opens with the record's prompt). Tool calls never reach ``step``: it sees the
turns without one, here the final answer.
"""

from __future__ import annotations

from dapo.environments import Environment


def add(terms: str) -> int:
    """Add whole numbers exactly.

    Args:
        terms: The numbers joined by "+", e.g. "12+345".
    """
    numbers = terms.replace(" ", "").split("+")
    if not all(n.isdigit() for n in numbers):
        raise ValueError(f"not whole numbers joined by '+': {terms!r}")  # the model reads this
    return sum(int(n) for n in numbers)


class CheckedAnswer(Environment):
    """Ends the episode at the first answer and rewards it itself: +1 when the number after
    the last ``Answer:`` equals the record's ground truth, else -1 (the configured reward
    functions then do not run). A wrong first answer may be retried once after feedback."""

    def reset(self, record):
        self.truth = record.ground_truth  # a dapo PromptRecord: prompt, ground_truth, extra, ...
        self.tries = 0
        return super().reset(record)  # the record's prompt as the opening user message

    def step(self, assistant_text):
        self.tries += 1
        answer = assistant_text.rpartition("Answer:")[2].strip()
        if answer == self.truth:
            return [], 1.0, True
        if self.tries == 1:
            return [{"role": "user", "content": "Wrong, check the tool's result."}], None, False
        return [], -1.0, True
