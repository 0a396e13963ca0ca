"""The evaluation protocol: how many samples per problem, drawn how, said the same way
by the trainer's held-out evaluation and by ``dapo eval``.

Evaluation data in the DAPO format repeats each problem k times (the AIME 2024 file: 30
problems x 32 rows) to ask for avg@k. Both entry points read such data as k samples of
each distinct problem, not as one sample of k copies or as one problem de-duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def common_repeats(repeats: Sequence[int]) -> int | None:
    """The number of rows every problem has, or None when they repeat unevenly (or no data)."""
    return repeats[0] if repeats and min(repeats) == max(repeats) else None


def samples_per_problem(configured: int | None, repeats: int | None) -> int:
    """avg@k's k: the configured number, else the data's common repeat count
    (:func:`common_repeats`), else 1."""
    if configured is not None:
        return configured
    return repeats or 1


@dataclass(frozen=True)
class EvalProtocol:
    """What an accuracy figure means: avg@k at a temperature and top-p, over n problems."""

    k: int
    temperature: float
    top_p: float
    problems: int

    def __str__(self) -> str:
        return (
            f"avg@{self.k}, T {float(self.temperature)!r}, top-p {float(self.top_p)!r}, "
            f"{self.problems} problem{'' if self.problems == 1 else 's'}"
        )
