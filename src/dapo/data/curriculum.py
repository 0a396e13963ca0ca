"""Curriculum: draw the training prompts easiest first (``data.curriculum=easy_first``).

Competence-based (Platanios et al. 2019, "Competence-based Curriculum Learning for Neural
Machine Translation"): at rollout step ``s`` prompts are drawn uniformly from the easiest
share

    c(s) = min(1, sqrt(c0^2 + (1 - c0^2) * s / S))      c0 = data.curriculum_start,
                                                        S = data.curriculum_steps

of the training set, so the pool grows from the easiest ``c0`` to every prompt at step
``S``, fast at first and slower later, and the model meets harder problems as it gets
able to solve some of them. Fewer groups come out all wrong early, which dynamic sampling
would drop. Difficulty is a field of the data (``data.difficulty_key``, higher = harder)
or one minus the pass rate measured so far (prompts not generated yet count as average).
Ties are broken by a seeded coin per prompt, and each draw is a pure function of (seed,
stream position, pool), so every rank draws the same prompts and a resumed run draws what
the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dapo.data.records import PromptRecord, record_field
from dapo.errors import DataError
from dapo.seeding import unit_hash


def competence(step: int, start: float, steps: int) -> float:
    """c(step): the share of the prompts in the pool, from ``start`` at step 0 to 1 at ``steps``."""
    if steps <= 0 or step >= steps:
        return 1.0
    return min(1.0, math.sqrt(start**2 + (1 - start**2) * step / steps))


def field_difficulties(records: Sequence[PromptRecord], field: str) -> list[float]:
    """Each record's ``field`` (``data.difficulty_key``) as a number."""
    out = []
    for record in records:
        value = record_field(record, field, "data.difficulty_key")
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise DataError(
                f"training prompt uid={record.uid}: data.difficulty_key={field!r} holds "
                f"{value!r}, not a finite number. Fix: point data.difficulty_key at a numeric "
                "field (higher = harder), or set it to null to use the measured pass rate"
            )
        out.append(number)
    return out


def measured_difficulties(pass_rates: Sequence[float | None]) -> list[float]:
    """1 - pass rate; prompts not generated yet (None) get the mean of the others."""
    known = [1 - p for p in pass_rates if p is not None]
    default = sum(known) / len(known) if known else 0.5
    return [default if p is None else 1 - p for p in pass_rates]


def easiest_first(difficulty: Sequence[float], ties: Sequence[float]) -> list[int]:
    """Prompt indices from easiest to hardest; equal difficulties in the order of ``ties``."""
    return sorted(range(len(difficulty)), key=lambda i: (difficulty[i], ties[i]))


def draw(order: Sequence[int], size: int, seed: int, position: int) -> int:
    """The prompt drawn at stream ``position`` from the pool ``order[:size]``."""
    return order[int(unit_hash("curriculum", seed, position) * size)]


class Curriculum:
    """The pool of each rollout step: its prompts easiest first, and how many of them."""

    def __init__(
        self, n: int, seed: int, start: float, steps: int, difficulty: Sequence[float] | None
    ) -> None:
        self.n, self.start, self.steps = n, start, steps
        self.ties = [unit_hash("tie", seed, i) for i in range(n)]  # a seeded order for ties
        # A difficulty field ranks once; the measured pass rate, at every step.
        self.fixed = None if difficulty is None else easiest_first(difficulty, self.ties)

    @property
    def measured(self) -> bool:
        return self.fixed is None

    def pool(self, step: int, pass_rates: Sequence[float | None] = ()) -> tuple[list[int], int]:
        """(prompts easiest first, pool size) at ``step``; ``pass_rates`` (per prompt, None if
        never generated) rank the prompts when the data gives no difficulty."""
        order = self.fixed
        if order is None:
            order = easiest_first(measured_difficulties(pass_rates), self.ties)
        share = competence(step, self.start, self.steps)
        return order, max(1, min(self.n, math.ceil(share * self.n)))
