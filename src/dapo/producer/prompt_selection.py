"""Which training prompts a rollout step generates: the seeded prompt stream, the skip rule
of ``algorithm.skip_uniform_prompts`` and the pool of ``data.curriculum``.

The trainer asks :meth:`PromptSelector.next` for prompts and reports every scored group
back (:meth:`PromptSelector.record`, on every rank the gathered groups in the same order),
so that each rank holds the same history and draws and skips the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo.config import Config
from dapo.data.curriculum import Curriculum, field_difficulties
from dapo.data.prompts import PromptStream, history_keys
from dapo.data.records import PromptRecord
from dapo.producer.prompt_history import PromptHistory, should_skip


class PromptSelector:
    """The training prompts' stream, with the configured skipping and curriculum."""

    def __init__(self, cfg: Config, records: Sequence[PromptRecord]) -> None:
        a, d = cfg.algorithm, cfg.data
        self.seed, self.skip, self.cap = cfg.seed, a.skip_uniform_prompts, a.skip_max_prob
        self.stream = PromptStream(len(records), cfg.seed, d.shuffle)
        self.curriculum = None
        if d.curriculum != "none":
            difficulty = (
                None if d.difficulty_key is None else field_difficulties(records, d.difficulty_key)
            )
            steps = d.curriculum_steps or cfg.train.steps // 2
            self.curriculum = Curriculum(
                len(records), cfg.seed, d.curriculum_start, steps, difficulty
            )
        # Each prompt's group outcomes: for the skip rule and a curriculum by measured difficulty.
        self.history: PromptHistory | None = None
        self.keys: list[str] = []
        if self.skip or (self.curriculum is not None and self.curriculum.measured):
            self.history = PromptHistory()
            self.keys = history_keys(list(records), a.skip_key)

    def start_step(self, step: int) -> None:
        """Set the curriculum's pool for ``step`` (before the step draws any prompt)."""
        if self.curriculum is None:
            return
        rates = []
        if self.curriculum.measured:
            assert self.history is not None
            rates = [self.history.pass_rate(k) for k in self.keys]
        self.stream.use_pool(*self.curriculum.pool(step, rates))

    def next(self, k: int, skipped: list[int]) -> list[int]:
        """The next ``k`` prompts (indices into the records); with skipping, past those the
        rule passes over, which are appended to ``skipped``."""
        if not self.skip:
            return self.stream.take(k)
        history = self.history
        assert history is not None

        def skip(index: int, position: int) -> bool:
            key = self.keys[index]
            return should_skip(self.seed, position, key, history.streak(key), self.cap)

        taken, passed = self.stream.take_skipping(k, skip)
        skipped.extend(passed)
        return taken

    def record(self, indices: Sequence[int], correct: Sequence[Sequence[bool]]) -> None:
        """The outcomes of the groups generated for ``indices`` (each response's correctness)."""
        if self.history is not None:
            for i, c in zip(indices, correct, strict=True):
                self.history.record(self.keys[i], c)

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.stream.state_dict(),
            "history": None if self.history is None else self.history.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        if self.history is not None and state.get("history") is not None:
            self.history.load_state_dict(state["history"])
