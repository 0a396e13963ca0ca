"""Dynamic sampling: fill the training batch with groups that carry a learning signal.

A group whose responses all score the same (all correct or all wrong) has zero advantage
everywhere and contributes no gradient. DAPO keeps sampling until the batch holds the
wanted number of groups with ``0 < correct < G``. Unlike the reference recipe, qualifying
groups beyond the batch size are by default carried over to the next rollout step instead of
being thrown away, so no qualifying rollout is wasted; ``keep_surplus=False`` throws them away
as the paper does, so that every trained group was sampled at the step that trains it.

When ``max_rounds`` generation rounds do not fill the batch, ``round_cap="train"`` (the
default) trains on the qualifying groups found (a short batch, or no update at all when
there are none; ``max_empty_steps`` such empty steps in a row stop the run) and
``round_cap="stop"`` stops the run, keeping the groups found for a resumed run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dapo.choices import RoundCap
from dapo.errors import DynamicSamplingError
from dapo.handover import ScoredGroup

ADVICE = (
    "Raise algorithm.max_gen_rounds, raise rollout.num_generations (more responses per "
    "prompt make mixed groups likelier), use harder prompts if most groups are all correct "
    "or easier ones (or a stronger model) if most are all wrong, or set "
    "algorithm.dynamic_sampling=false."
)


def is_uniform(group: ScoredGroup, metric: str = "acc") -> bool:
    """True when every response of the group has the same accuracy (or shaped reward);
    ``auto``: the accuracy where the reward says what correct is, else the reward functions'
    score (before the length shaping, as the paper's filter ignores it)."""
    if metric == "auto":
        values = group.correct if group.claims_correct else group.scores()
    else:
        values = group.correct if metric == "acc" else group.rewards
    return len(set(values)) <= 1


def _count_uniform(stats: FillStats, group: ScoredGroup) -> None:
    """Count a uniform group as all correct, all wrong, or neither (uniform by reward, or a
    reward that does not say what correct is)."""
    if group.claims_correct and all(group.correct):
        stats.all_correct += 1
    elif group.claims_correct and not any(group.correct):
        stats.all_wrong += 1
    else:
        stats.uniform_other += 1


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
    discarded: int = 0  # surplus thrown away (keep_surplus=False)
    dropped: int = 0  # generated groups neither trained nor kept for a later step
    short: bool = False  # the round cap cut the batch short (round_cap="train")
    note: str = ""  # what happened at the round cap, for the caller to warn with

    def as_metrics(self) -> dict[str, float]:
        """The call's counts, and the shares of the groups it generated: left out when it
        generated none (a step trained on the previous one's surplus), where a share of
        nothing would read as 0 on the console, the dashboard and the health checks."""
        gen = self.generated_groups
        uniform = self.all_correct + self.all_wrong + self.uniform_other
        shares: dict[str, float] = {}
        if gen:
            shares = {
                "sampling/all_correct_frac": self.all_correct / gen,
                "sampling/all_wrong_frac": self.all_wrong / gen,
                "sampling/uniform_groups": uniform / gen,
                # Only dropped groups are waste: with dynamic sampling off every generated
                # group trains (uniform ones too, with zero advantage), and carried-over ones
                # train later.
                "sampling/wasted_frac": (self.dropped + self.discarded) / gen,
            }
        return {
            "sampling/gen_rounds": float(self.rounds),
            "sampling/generated_groups": float(gen),
            **shares,
            "sampling/carried_in": float(self.carried_in),
            "sampling/carried_over": float(self.carried_out),
            "sampling/surplus_discarded": float(self.discarded),
            "sampling/short_batch": float(self.short),
            "sampling/trained_groups": float(self.kept),
        }


class DynamicSampler:
    """Collects ``target`` groups per rollout step, generating as many rounds as needed.

    ``produce(k)`` must generate and score ``k`` new prompts' groups. With ``enabled=False``
    one round of exactly ``target`` prompts is produced and every group is kept (GRPO).
    ``round_cap``, ``max_empty_steps`` and ``keep_surplus``: see the module docstring.
    """

    def __init__(
        self,
        target: int,
        *,
        enabled: bool = True,
        metric: str = "acc",
        max_rounds: int = 8,
        max_prompts_per_round: int | None = None,
        round_cap: RoundCap = "train",
        max_empty_steps: int = 3,
        keep_surplus: bool = True,
    ) -> None:
        self.target = target
        self.enabled = enabled
        self.metric = metric
        self.max_rounds = max_rounds
        self.max_prompts_per_round = max_prompts_per_round or 4 * target
        self.carry: list[ScoredGroup] = []
        self.keep_rate = 1.0  # running estimate of the share of groups that qualify
        self.round_cap = round_cap
        self.max_empty_steps = max_empty_steps
        self.empty_in_a_row = 0  # steps in a row without any qualifying group
        self.keep_surplus = keep_surplus

    def fill(
        self,
        produce: Callable[[int], list[ScoredGroup]],
        diagnose: Callable[[], str] | None = None,
    ) -> tuple[list[ScoredGroup], FillStats]:
        """This step's batch: ``produce(k)`` generates and scores ``k`` prompts' groups;
        ``diagnose()`` names the likely cause when the round cap is reached (the cut-off
        responses, a reward with one value: :func:`dapo.health.diagnose_groups`), said before
        the advice on prompt difficulty."""
        stats = FillStats()
        if not self.enabled:
            groups = produce(self.target)
            stats.rounds, stats.generated_groups, stats.kept = 1, len(groups), len(groups)
            for g in groups:
                if is_uniform(g, "auto"):
                    _count_uniform(stats, g)
            return groups, stats

        batch = self.carry[: self.target]
        self.carry = self.carry[self.target :]
        stats.carried_in = len(batch)
        while len(batch) < self.target:
            if stats.rounds >= self.max_rounds:
                return self._at_cap(batch, stats, diagnose() if diagnose else "")
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
                    _count_uniform(stats, g)
            if groups:
                rate = kept_now / len(groups)
                self.keep_rate = 0.5 * self.keep_rate + 0.5 * rate
        surplus = batch[self.target :]
        if self.keep_surplus:
            self.carry = surplus + self.carry
        else:
            stats.discarded = len(surplus)
        batch = batch[: self.target]
        stats.kept = len(batch)
        stats.carried_out = len(self.carry)
        self.empty_in_a_row = 0
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
        return min(
            self.max_prompts_per_round, max(need, math.ceil(need / max(self.keep_rate, 0.05) * 1.1))
        )

    def _at_cap(
        self, batch: list[ScoredGroup], stats: FillStats, cause: str = ""
    ) -> tuple[list[ScoredGroup], FillStats]:
        """The round cap is reached with ``len(batch) < target`` (the carry-over is empty
        then): stop, train a short batch, or skip the update (none qualified). ``cause``: the
        diagnosed cause, said before the generic advice."""
        have, cap = len(batch), f"algorithm.max_gen_rounds={self.max_rounds}"
        seen = self._situation(stats) + (f" {cause}" if cause else "")
        if self.round_cap == "stop":
            self.carry = batch + self.carry  # nothing qualifying is lost
            raise DynamicSamplingError(
                f"dynamic sampling stopped after {stats.rounds} generation rounds ({cap}, "
                f"algorithm.round_cap=stop) with {have} of {self.target} groups that have a "
                f"learning signal. {seen} {ADVICE} With algorithm.round_cap=train the step "
                "would train on the groups found (or skip its update if none) instead."
            )
        stats.kept, stats.short = have, True
        if have:
            self.empty_in_a_row = 0
            stats.note = (
                f"dynamic sampling reached {cap} with {have} of {self.target} groups that "
                f"have a learning signal: training on those {have} (a short batch, "
                f"algorithm.round_cap=train). {seen} {ADVICE} algorithm.round_cap=stop stops "
                "the run at the cap instead."
            )
            return batch, stats
        self.empty_in_a_row += 1
        limit = f"algorithm.max_empty_steps={self.max_empty_steps}"
        if self.empty_in_a_row >= self.max_empty_steps:
            raise DynamicSamplingError(
                f"dynamic sampling found no group with a learning signal in "
                f"{self.empty_in_a_row} rollout steps in a row ({stats.rounds} generation "
                f"rounds each, {cap}; {limit}); stopped. {seen} {ADVICE}"
            )
        stats.note = (
            f"dynamic sampling found no group with a learning signal in {stats.rounds} "
            f"generation rounds ({cap}): this step's update is skipped ({self.empty_in_a_row} "
            f"such step(s) in a row; {limit} stops the run). {seen} {ADVICE}"
        )
        return batch, stats

    @staticmethod
    def _situation(stats: FillStats) -> str:
        gen = max(1, stats.generated_groups)
        return (
            f"Of {stats.generated_groups} groups generated this step, "
            f"{stats.all_correct / gen:.0%} were all correct and "
            f"{stats.all_wrong / gen:.0%} were all wrong."
        )

    def drop_older_than(self, version: int) -> int:
        """Drop carried-over groups with a token sampled before ``version`` (too stale for
        the next batch under a staleness bound); how many were dropped."""
        kept = [g for g in self.carry if g.oldest_version >= version]
        dropped = len(self.carry) - len(kept)
        self.carry = kept
        return dropped

    def state_dict(self) -> dict[str, Any]:
        return {
            "carry": [g.to_state() for g in self.carry],
            "keep_rate": self.keep_rate,
            "empty_in_a_row": self.empty_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.carry = [ScoredGroup.from_state(g) for g in state["carry"]]
        self.keep_rate = float(state["keep_rate"])
        self.empty_in_a_row = int(state["empty_in_a_row"])
