"""What the scorer takes and gives: :class:`ScoreRequest` (a response with its prompt's row)
and :class:`ScoreResult` (a batch's rewards, correctness, failures and logged fields)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dapo.rewards.user import Sample


@dataclass
class ScoreRequest:
    """One response to score, with its prompt's row (what TRL- and verl-form functions may
    ask for: :class:`~dapo.rewards.user.Sample`)."""

    response: str
    ground_truth: Any
    data_source: str = "math_dapo"
    prompt: Any = None
    columns: dict[str, Any] | None = None
    completion_ids: Sequence[int] = ()
    step: int = 0

    @classmethod
    def of(
        cls, record: Any, response: str, completion_ids: Sequence[int] = (), step: int = 0
    ) -> ScoreRequest:
        """The request for ``response`` to the prompt of ``record`` (a
        :class:`~dapo.data.records.PromptRecord`: its answer, source, prompt and columns)."""
        return cls(
            response,
            record.ground_truth,
            record.data_source,
            prompt=record.prompt,
            columns=record.extra,
            completion_ids=completion_ids,
            step=step,
        )

    def sample(self) -> Sample:
        return Sample(
            self.response,
            self.ground_truth,
            self.data_source,
            self.prompt,
            self.columns,
            tuple(self.completion_ids),
            self.step,
        )


@dataclass
class ScoreResult:
    """Rewards of a batch and how many samples failed (failed samples score -1.0).

    ``correct`` is each response's correctness as the reward says it: a built-in scorer's
    (+1), an ``acc`` field of a dict return, or, for a function that has returned only -1,
    0 and 1 so far, its weighted reward > 0. ``claims_correct`` is False when some function
    says nothing of the kind (partial credit, a length penalty): ``correct`` then holds
    reward > 0 and means nothing. ``info`` holds the numeric fields functions returned
    beside their score (and what TRL-form functions logged), one dict per response.
    ``unscorable`` counts responses every function called "not applicable" (None)."""

    rewards: list[float]
    correct: list[bool]
    failures: int = 0
    timeouts: int = 0
    errors: int = 0
    bad_values: int = 0
    claims_correct: bool = True
    unscorable: int = 0
    infos: list[dict[str, float]] = field(default_factory=list)
