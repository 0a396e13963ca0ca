"""Prompt history: each prompt's group outcomes, and the rule that skips prompts likely to
give a uniform group again.

Dynamic sampling drops every group whose G responses are all correct or all wrong (no
learning signal), so the generation spent on it is wasted. Where a prompt's difficulty
persists (a problem the model always solves, or never does; common in real data sets,
visited once per epoch), its last groups predict the next one. The rule
(``algorithm.skip_uniform_prompts``): a prompt whose last ``n`` groups were all uniform
(its *streak*) is skipped before generation with probability

    P(skip) = cap * (1 - 2^-n)        cap = algorithm.skip_max_prob < 1

half the cap after one uniform group, three quarters after two, never above the cap, so
every prompt is still generated now and then (exploration: an impossible prompt may
become solvable, a solved one forgotten). A mixed group ends the streak. The coin is a
pure function of (run seed, stream position, prompt key): every rank, holding the same
history (all ranks record every gathered group), decides the same, and a resumed run
decides as the uninterrupted one would. Skipping changes which prompts are generated,
never the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo.seeding import unit_hash


def skip_probability(streak: int, cap: float) -> float:
    """``cap * (1 - 2**-streak)``: 0 without a streak, rising with it, below ``cap``."""
    return cap * (1.0 - 0.5**streak) if streak > 0 else 0.0


def should_skip(seed: int, position: int, key: str, streak: int, cap: float) -> bool:
    """Skip the prompt ``key`` drawn at stream ``position``? Pure and seeded: the same
    arguments give the same answer on every rank and in every run."""
    p = skip_probability(streak, cap)
    return p > 0 and unit_hash("skip", seed, position, key) < p


class PromptHistory:
    """Per prompt key: the current streak of uniform groups, and counts of groups, correct
    responses and responses (for the measured pass rate)."""

    def __init__(self) -> None:
        self._stats: dict[str, list[int]] = {}  # key -> [streak, groups, correct, responses]

    def __len__(self) -> int:
        return len(self._stats)

    def record(self, key: str, correct: Sequence[bool]) -> None:
        """Add one group's outcome (the correctness of each of its responses)."""
        s = self._stats.setdefault(key, [0, 0, 0, 0])
        hits = sum(map(bool, correct))
        s[0] = s[0] + 1 if hits in (0, len(correct)) else 0
        s[1] += 1
        s[2] += hits
        s[3] += len(correct)

    def streak(self, key: str) -> int:
        """How many of the prompt's latest groups in a row were uniform (0 if never seen)."""
        s = self._stats.get(key)
        return s[0] if s else 0

    def groups(self, key: str) -> int:
        s = self._stats.get(key)
        return s[1] if s else 0

    def pass_rate(self, key: str) -> float | None:
        """Share of the prompt's responses so far that were correct; None if never generated."""
        s = self._stats.get(key)
        return s[2] / s[3] if s and s[3] else None

    def state_dict(self) -> dict[str, Any]:
        # Plain lists in a dict: checkpoints stay readable whatever this class becomes.
        return {"prompts": {k: list(v) for k, v in self._stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stats = {str(k): [int(x) for x in v] for k, v in state["prompts"].items()}
