"""The one hand-over between the rollout producer and the learner (:mod:`dapo.producer` and
:mod:`dapo.training`).

The producer scores every generated group into a :class:`ScoredGroup` and hands the trainer
a :class:`RolloutBatch` per rollout step: the groups to train on (plain data: ids, log-probs,
rewards, per-token versions) and the metrics of producing them. Nothing else crosses: the
learner knows no engine, scorer or environment, the producer no optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dapo.data.records import PromptRecord


@dataclass
class ScoredGroup:
    """One prompt's G responses after scoring (what the trainer needs to train on them)."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    sample_logprobs: list[list[float]]
    truncated: list[bool]
    rewards: list[float]  # correctness + length shaping
    correct: list[bool]
    record: PromptRecord | None = None
    step: int = 0  # rollout step that generated it (carried-over groups are older)
    penalty: list[float] = field(default_factory=list)  # the length shaping in `rewards`
    # Multi-turn episodes (see dapo.rollout.Group): 1 on the model's tokens, 0 on the
    # environment's; per-episode statistics. None for single-turn groups.
    model_mask: list[list[int]] | None = None
    episode_stats: list[dict[str, Any]] | None = None
    # The policy version that sampled each response token (streaming rollouts).
    versions: list[list[int]] | None = None
    # Whether `correct` means what the reward says (False: a reward with no notion of
    # correct, e.g. partial credit; `correct` is then reward > 0 and claims nothing).
    claims_correct: bool = True
    # Numeric fields the reward functions returned beside their scores, per response.
    info: list[dict[str, float]] | None = None

    def scores(self) -> list[float]:
        """Each response's score as the reward functions gave it: its reward less the
        length shaping added to it."""
        if not self.penalty:
            return list(self.rewards)
        return [r - p for r, p in zip(self.rewards, self.penalty, strict=True)]

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (no pickled objects)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if isinstance(self.record, PromptRecord):
            state["record"] = dataclasses.asdict(self.record)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any] | ScoredGroup) -> ScoredGroup:
        """A group from :meth:`to_state`'s data; a group object (a checkpoint of release
        a5216fc pickled them whole) is taken as it is, fields added since then set to their
        defaults."""
        if isinstance(state, cls):
            for f in dataclasses.fields(cls):
                if f.name not in vars(state):
                    default = f.default_factory() if callable(f.default_factory) else f.default
                    setattr(state, f.name, default)
            return state
        data = dict(state)
        if isinstance(data.get("record"), dict):
            data["record"] = PromptRecord(**data["record"])
        return cls(**data)

    @property
    def size(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the group's tokens (its step when versions are
        not known)."""
        found = [min(v) for v in self.versions or [] if v]
        return min([*found, self.step])


class RolloutBatch(NamedTuple):
    """One rollout step's batch as the producer hands it over: the groups with a learning
    signal, the metrics of everything generated for them, and the generated groups left
    out of training with the reason (filtered by dynamic sampling), for the transcripts."""

    groups: list[ScoredGroup]
    metrics: dict[str, float]
    left_out: Sequence[tuple[ScoredGroup, str]] = ()
