"""Dynamic sampling: fill the training batch with groups that carry a learning signal.

A group whose responses all score the same (all correct or all wrong) has zero advantage
everywhere and contributes no gradient. DAPO keeps sampling until the batch holds the
wanted number of groups with ``0 < correct < G``. Unlike the reference recipe, qualifying
groups beyond the batch size are carried over to the next rollout step instead of being
thrown away, so no qualifying rollout is wasted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dapo.errors import DynamicSamplingError


@dataclass
class ScoredGroup:
    """One prompt's G responses after scoring (what the trainer needs to train on them)."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    sample_logprobs: list[list[float]]
    truncated: list[bool]
    rewards: list[float]  # correctness + length shaping
    correct: list[bool]
    record: Any = None  # the PromptRecord
    step: int = 0  # rollout step that generated it (carried-over groups are older)
    penalty: list[float] = field(default_factory=list)  # the length shaping in `rewards`

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Groups pickled by earlier versions (checkpoint carry-over) lack `penalty` and
        # may hold the removed `extra`.
        state.pop("extra", None)
        state.setdefault("penalty", [])
        self.__dict__.update(state)

    @property
    def size(self) -> int:
        return len(self.response_ids)


def is_uniform(group: ScoredGroup, metric: str = "acc") -> bool:
    """True when every response of the group has the same accuracy (or reward)."""
    values = group.correct if metric == "acc" else group.rewards
    return len(set(values)) <= 1


@dataclass
class FillStats:
    """What one call to :meth:`DynamicSampler.fill` did."""

    rounds: int = 0
    generated_groups: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    uniform_other: int = 0  # uniform by reward though not by accuracy (metric "reward")
    kept: int = 0
    carried_in: int = 0  # groups taken from the previous step's surplus
    carried_out: int = 0  # surplus kept for the next step
    dropped: int = 0  # generated groups neither trained nor kept for a later step

    def as_metrics(self) -> dict[str, float]:
        gen = max(1, self.generated_groups)
        uniform = self.all_correct + self.all_wrong + self.uniform_other
        return {
            "sampling/gen_rounds": float(self.rounds),
            "sampling/generated_groups": float(self.generated_groups),
            "sampling/all_correct_frac": self.all_correct / gen,
            "sampling/all_wrong_frac": self.all_wrong / gen,
            "sampling/uniform_groups": uniform / gen,
            "sampling/carried_in": float(self.carried_in),
            "sampling/carried_over": float(self.carried_out),
            # Only dropped groups are waste: with dynamic sampling off every generated group
            # trains (uniform ones too, with zero advantage), and carried-over ones train later.
            "sampling/wasted_frac": self.dropped / gen,
        }


class DynamicSampler:
    """Collects ``target`` groups per rollout step, generating as many rounds as needed.

    ``produce(k)`` must generate and score ``k`` new prompts' groups. With ``enabled=False``
    one round of exactly ``target`` prompts is produced and every group is kept (GRPO).
    """

    def __init__(
        self,
        target: int,
        *,
        enabled: bool = True,
        metric: str = "acc",
        max_rounds: int = 8,
        max_prompts_per_round: int | None = None,
    ) -> None:
        self.target = target
        self.enabled = enabled
        self.metric = metric
        self.max_rounds = max_rounds
        self.max_prompts_per_round = max_prompts_per_round or 4 * target
        self.carry: list[ScoredGroup] = []
        self.keep_rate = 1.0  # running estimate of the share of groups that qualify

    def fill(self, produce: Callable[[int], list[ScoredGroup]]) -> tuple[list[ScoredGroup], FillStats]:
        stats = FillStats()
        if not self.enabled:
            groups = produce(self.target)
            stats.rounds, stats.generated_groups, stats.kept = 1, len(groups), len(groups)
            for g in groups:
                if is_uniform(g, "acc"):
                    if all(g.correct):
                        stats.all_correct += 1
                    else:
                        stats.all_wrong += 1
            return groups, stats

        batch = self.carry[: self.target]
        self.carry = self.carry[self.target :]
        stats.carried_in = len(batch)
        while len(batch) < self.target:
            if stats.rounds >= self.max_rounds:
                self.carry = batch + self.carry  # nothing qualifying is lost
                raise DynamicSamplingError(self._cap_message(stats, len(batch)))
            groups = produce(self._round_size(self.target - len(batch)))
            stats.rounds += 1
            stats.generated_groups += len(groups)
            kept_now = 0
            for g in groups:
                if not is_uniform(g, self.metric):
                    batch.append(g)
                    kept_now += 1
                else:
                    stats.dropped += 1
                    if all(g.correct):
                        stats.all_correct += 1
                    elif not any(g.correct):
                        stats.all_wrong += 1
                    else:
                        stats.uniform_other += 1
            if groups:
                rate = kept_now / len(groups)
                self.keep_rate = 0.5 * self.keep_rate + 0.5 * rate
        self.carry = batch[self.target :] + self.carry
        batch = batch[: self.target]
        stats.kept = len(batch)
        stats.carried_out = len(self.carry)
        return batch, stats

    def first_round_size(self) -> int:
        """Prompts the next :meth:`fill` generates in its first round (0 when the carried-over
        groups fill the batch); asynchronous rollouts generate that round ahead."""
        if not self.enabled:
            return self.target
        need = self.target - min(len(self.carry), self.target)
        return self._round_size(need) if need > 0 else 0

    def _round_size(self, need: int) -> int:
        """Prompts to generate for ``need`` more groups: over-sampled by the keep rate."""
        return min(self.max_prompts_per_round, max(need, math.ceil(need / max(self.keep_rate, 0.05) * 1.1)))

    def _cap_message(self, stats: FillStats, have: int) -> str:
        gen = max(1, stats.generated_groups)
        return (
            f"dynamic sampling stopped after {stats.rounds} generation rounds "
            f"(algorithm.max_gen_rounds={self.max_rounds}) with {have} of {self.target} groups "
            f"that have a learning signal. Of {stats.generated_groups} groups generated this "
            f"step, {stats.all_correct / gen:.0%} were all correct and "
            f"{stats.all_wrong / gen:.0%} were all wrong. Raise algorithm.max_gen_rounds, raise "
            "rollout.num_generations (more responses per prompt make mixed groups likelier), "
            "use harder prompts if most groups are all correct or easier ones (or a stronger "
            "model) if most are all wrong, or set algorithm.dynamic_sampling=false."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"carry": self.carry, "keep_rate": self.keep_rate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carry = list(state["carry"])
        self.keep_rate = float(state["keep_rate"])
