"""Built-in tasks: verifiable problems the project generates itself (no download).

``load_task(name, split, n)`` gives ``n`` problems of a task named ``builtin:<task>``.
"""

from __future__ import annotations

from dapo.data.records import PromptRecord
from dapo.data.tasks import (
    addition,
    calculator,
    chat_addition,
    code,
    colour_count,
    long_addition,
)

TASKS = {
    addition.NAME: addition.addition_records,
    long_addition.NAME: long_addition.long_addition_records,
    calculator.NAME: calculator.calculator_records,
    chat_addition.NAME: chat_addition.chat_addition_records,
    chat_addition.SANITY_NAME: chat_addition.sanity_records,
    colour_count.NAME: colour_count.colour_count_records,
    code.NAME: code.code_records,
}


def is_builtin(source: str | None) -> bool:
    return bool(source) and str(source).startswith("builtin:")


def load_task(name: str, split: str, n: int) -> list[PromptRecord]:
    """``n`` problems of the built-in task ``name`` (``split`` is ``train`` or ``test``)."""
    try:
        make = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown built-in data set {name!r}; the built-in ones are: {', '.join(TASKS)}"
        ) from None
    return make(split, n=n)
