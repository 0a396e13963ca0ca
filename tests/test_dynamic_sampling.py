"""Tests for ``dapo.producer.dynamic_sampling``: the dynamic sampler that fills a batch with mixed groups.

The sampler is driven by a fake ``produce(k)`` that hands out synthetic
:class:`ScoredGroup` objects with chosen correctness patterns and records everything it
produced, so every expectation below (which groups qualify, how many were all correct,
what must be carried over) is derived from the fake's own record, not from the sampler.
"""

from __future__ import annotations

import io
import itertools
import pickle
import random
import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from dapo.producer.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingError,
    ScoredGroup,
    is_uniform,
)
from dapo.training.checkpoint import load_state_file

FIXTURES = Path(__file__).parent / "fixtures"

G = 4
MIXED = (True, False, False, True)
MIXED2 = (False, True, False, False)
ALL_OK = (True,) * G
ALL_BAD = (False,) * G

_ids = itertools.count()


def make_group(correct: Iterable[bool], rewards: Iterable[float] | None = None) -> ScoredGroup:
    correct = list(correct)
    rewards = [1.0 if c else 0.0 for c in correct] if rewards is None else list(rewards)
    n = len(correct)
    uid = next(_ids)
    return ScoredGroup(
        prompt_ids=[uid],
        response_ids=[[2 + i] for i in range(n)],
        sample_logprobs=[[-1.0] for _ in range(n)],
        truncated=[False] * n,
        rewards=rewards,
        correct=correct,
        record=uid,
    )


def mixed_acc(g: ScoredGroup) -> bool:
    """Independent definition of 'has a learning signal' by accuracy."""
    return 0 < sum(g.correct) < len(g.correct)


class FakeProducer:
    """``produce(k)``: k groups whose correctness patterns come from ``patterns``."""

    def __init__(self, patterns: Iterable[tuple[bool, ...] | ScoredGroup]) -> None:
        self.patterns = iter(patterns)
        self.calls: list[int] = []
        self.produced: list[ScoredGroup] = []

    def __call__(self, k: int) -> list[ScoredGroup]:
        self.calls.append(k)
        out = []
        for _ in range(k):
            item = next(self.patterns)  # StopIteration here means the sampler over-asked
            out.append(item if isinstance(item, ScoredGroup) else make_group(item))
        self.produced.extend(out)
        return out

    def qualifying(self) -> list[ScoredGroup]:
        return [g for g in self.produced if mixed_acc(g)]


def same_objects(a: list[ScoredGroup], b: list[ScoredGroup]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------
# One fill
# --------------------------------------------------------------------------------------


def test_fill_returns_target_mixed_groups_and_counts_uniform_ones():
    # Low yield (2 of 7 qualify), so several rounds are needed.
    cycle = [MIXED, ALL_OK, ALL_BAD, ALL_OK, MIXED2, ALL_BAD, ALL_OK]
    producer = FakeProducer(itertools.cycle(cycle))
    sampler = DynamicSampler(6, max_rounds=50)

    batch, stats = sampler.fill(producer)

    assert len(batch) == 6
    assert all(mixed_acc(g) for g in batch)
    produced = producer.produced
    assert len(producer.calls) >= 2  # precondition: the test exercises more than one round
    assert stats.rounds == len(producer.calls)
    assert stats.generated_groups == len(produced)
    assert stats.all_correct == sum(all(g.correct) for g in produced)
    assert stats.all_wrong == sum(not any(g.correct) for g in produced)
    assert stats.uniform_other == 0
    assert stats.kept == 6
    assert stats.carried_in == 0
    # The batch is the first six qualifying groups in production order; the rest is carried.
    qualifying = producer.qualifying()
    assert same_objects(batch, qualifying[:6])
    assert same_objects(sampler.carry, qualifying[6:])
    assert stats.carried_out == len(qualifying) - 6

    metrics = stats.as_metrics()
    assert metrics["sampling/gen_rounds"] == len(producer.calls)
    assert metrics["sampling/all_correct_frac"] == pytest.approx(
        sum(all(g.correct) for g in produced) / len(produced)
    )


def test_surplus_is_carried_over_and_comes_first_next_call():
    producer = FakeProducer(itertools.repeat(MIXED))
    sampler = DynamicSampler(4)

    batch1, stats1 = sampler.fill(producer)
    first = list(producer.produced)
    surplus = len(first) - 4
    assert surplus > 0  # precondition: the first round over-generates (all groups qualify)
    assert same_objects(batch1, first[:4])
    assert same_objects(sampler.carry, first[4:])
    assert stats1.carried_in == 0
    assert stats1.carried_out == surplus

    batch2, stats2 = sampler.fill(producer)
    assert stats2.carried_in == surplus
    assert same_objects(batch2[:surplus], first[4:])  # carried groups lead the batch
    new = producer.produced[len(first) :]
    assert same_objects(batch2[surplus:], new[: 4 - surplus])
    assert same_objects(sampler.carry, new[4 - surplus :])
    assert stats2.carried_out == len(sampler.carry)
    assert len(batch2) == 4


def test_large_carry_fills_batch_without_generating():
    carried = [make_group(MIXED) for _ in range(9)]
    sampler = DynamicSampler(4)
    sampler.load_state_dict({"carry": carried, "keep_rate": 1.0, "empty_in_a_row": 0})
    producer = FakeProducer([])  # any call would raise StopIteration

    batch, stats = sampler.fill(producer)

    assert producer.calls == []
    assert stats.rounds == 0
    assert same_objects(batch, carried[:4])
    assert same_objects(sampler.carry, carried[4:])
    assert (stats.carried_in, stats.carried_out, stats.kept) == (4, 5, 4)
    # Shares of the groups generated: none were, so none are reported (not zeros).
    m = stats.as_metrics()
    shares = {"all_correct_frac", "all_wrong_frac", "uniform_groups", "wasted_frac"}
    assert not {f"sampling/{k}" for k in shares} & set(m)
    assert m["sampling/generated_groups"] == 0 and m["sampling/carried_in"] == 4
    assert m["sampling/trained_groups"] == 4 and m["sampling/gen_rounds"] == 0


def test_nothing_qualifying_is_dropped_across_calls():
    rng = random.Random(0)
    choices = [MIXED, MIXED2, ALL_OK, ALL_BAD, ALL_OK]
    producer = FakeProducer(rng.choice(choices) for _ in itertools.count())
    sampler = DynamicSampler(5, max_rounds=50)

    used: list[ScoredGroup] = []
    for _ in range(7):
        batch, stats = sampler.fill(producer)
        assert len(batch) == 5
        assert all(mixed_acc(g) for g in batch)
        assert stats.carried_out == len(sampler.carry)
        used.extend(batch)

    qualifying_ids = {id(g) for g in producer.qualifying()}
    used_ids = [id(g) for g in used]
    carry_ids = [id(g) for g in sampler.carry]
    assert len(set(used_ids)) == len(used_ids)  # nothing trained on twice
    assert not set(used_ids) & set(carry_ids)
    assert set(used_ids) | set(carry_ids) == qualifying_ids
    assert len(used) + len(sampler.carry) == len(qualifying_ids)


# --------------------------------------------------------------------------------------
# The round cap
# --------------------------------------------------------------------------------------


def test_round_cap_error_message_and_carry_kept():
    old = make_group(MIXED2)  # carried in from an earlier step
    # max_prompts_per_round=4 with target 4 makes every round ask for exactly 4 prompts, so
    # 5 rounds generate 20 groups: 1 mixed, 15 all correct (75%), 4 all wrong (20%).
    patterns = [MIXED] + [ALL_OK] * 15 + [ALL_BAD] * 4
    producer = FakeProducer(patterns)
    sampler = DynamicSampler(4, max_rounds=5, max_prompts_per_round=4, round_cap="stop")
    sampler.load_state_dict({"carry": [old], "keep_rate": 1.0, "empty_in_a_row": 0})

    with pytest.raises(DynamicSamplingError) as info:
        sampler.fill(producer)

    assert producer.calls == [4] * 5  # precondition for the percentages below
    msg = str(info.value)
    assert re.search(r"\b5 (generation )?rounds\b", msg), msg
    assert "75%" in msg and "20%" in msg, msg
    assert "algorithm.max_gen_rounds" in msg
    assert "rollout.num_generations" in msg
    assert "algorithm.round_cap=stop" in msg and "algorithm.round_cap=train" in msg
    # The carried-in group and the one that qualified are kept, in that order.
    assert same_objects(sampler.carry, [old, producer.produced[0]])

    # The next step starts from them.
    producer2 = FakeProducer(itertools.repeat(MIXED))
    batch, stats = sampler.fill(producer2)
    assert same_objects(batch[:2], [old, producer.produced[0]])
    assert stats.carried_in == 2


def test_round_cap_without_any_qualifying_group():
    producer = FakeProducer(itertools.repeat(ALL_BAD))
    sampler = DynamicSampler(3, max_rounds=2, round_cap="stop")
    with pytest.raises(DynamicSamplingError) as info:
        sampler.fill(producer)
    assert len(producer.calls) == 2
    msg = str(info.value)
    assert "100%" in msg  # all wrong
    assert re.search(r"(?<![\d.])0%", msg), msg  # none all correct
    assert sampler.carry == []


def test_round_cap_train_returns_the_short_batch_with_a_note():
    old = make_group(MIXED2)  # carried in from an earlier step
    # Rounds of exactly 4 prompts: 3 rounds make 12 groups, 2 of them mixed (9 all correct,
    # 1 all wrong), so with the carried-in one the batch has 3 of 8 groups.
    patterns = [ALL_OK, MIXED, ALL_OK, ALL_OK] + [ALL_OK] * 4 + [ALL_BAD, ALL_OK, MIXED2, ALL_OK]
    producer = FakeProducer(patterns)
    sampler = DynamicSampler(8, max_rounds=3, max_prompts_per_round=4)
    sampler.load_state_dict({"carry": [old], "keep_rate": 1.0, "empty_in_a_row": 2})

    batch, stats = sampler.fill(producer)

    assert producer.calls == [4, 4, 4]
    assert same_objects(batch, [old] + producer.qualifying())
    assert sampler.carry == []
    assert sampler.empty_in_a_row == 0  # a step that trains ends a run of empty steps
    assert stats.short and stats.kept == 3 and stats.rounds == 3
    m = stats.as_metrics()
    assert m["sampling/short_batch"] == 1.0 and m["sampling/trained_groups"] == 3.0
    note = stats.note
    assert "algorithm.max_gen_rounds=3 with 3 of 8 groups" in note
    assert "training on those 3" in note and "algorithm.round_cap=stop" in note
    assert "75% were all correct and 8% were all wrong" in note  # 9/12 and 1/12
    assert "Raise algorithm.max_gen_rounds" in note

    # A full batch has no note and is not short.
    batch, stats = DynamicSampler(2).fill(FakeProducer(itertools.repeat(MIXED)))
    assert len(batch) == 2 and not stats.short and stats.note == ""
    assert stats.as_metrics()["sampling/short_batch"] == 0.0


def test_steps_without_any_mixed_group_skip_then_stop():
    sampler = DynamicSampler(3, max_rounds=2, max_empty_steps=3)
    for k in (1, 2):
        batch, stats = sampler.fill(FakeProducer(itertools.repeat(ALL_BAD)))
        assert batch == [] and stats.short and stats.kept == 0
        assert sampler.empty_in_a_row == k
        assert "update is skipped" in stats.note and f"({k} such step(s) in a row" in stats.note
        assert "algorithm.max_empty_steps=3" in stats.note
    # The count survives a checkpoint.
    again = DynamicSampler(3, max_rounds=2, max_empty_steps=3)
    again.load_state_dict(pickle.loads(pickle.dumps(sampler.state_dict())))
    assert again.empty_in_a_row == 2
    with pytest.raises(DynamicSamplingError) as info:
        again.fill(FakeProducer(itertools.repeat(ALL_BAD)))
    msg = str(info.value)
    assert "no group with a learning signal in 3 rollout steps in a row" in msg
    assert "algorithm.max_empty_steps=3" in msg and "100% were all wrong" in msg
    assert "Raise algorithm.max_gen_rounds" in msg and "rollout.num_generations" in msg

    # A step that finds a group in between starts the count again.
    sampler = DynamicSampler(3, max_rounds=1, max_empty_steps=2, max_prompts_per_round=3)
    sampler.fill(FakeProducer(itertools.repeat(ALL_BAD)))
    batch, _ = sampler.fill(FakeProducer([ALL_BAD, MIXED, ALL_BAD]))
    assert len(batch) == 1 and sampler.empty_in_a_row == 0
    sampler.fill(FakeProducer(itertools.repeat(ALL_BAD)))
    assert sampler.empty_in_a_row == 1


# --------------------------------------------------------------------------------------
# Disabled, metrics, state
# --------------------------------------------------------------------------------------


def test_disabled_does_one_round_and_keeps_uniform_groups():
    patterns = [ALL_OK, MIXED, ALL_BAD, ALL_BAD, MIXED2, ALL_OK, ALL_OK]
    producer = FakeProducer(patterns)
    sampler = DynamicSampler(7, enabled=False)

    batch, stats = sampler.fill(producer)

    assert producer.calls == [7]
    assert same_objects(batch, producer.produced)
    assert stats.rounds == 1
    assert stats.generated_groups == 7
    assert stats.kept == 7
    assert stats.all_correct == 3
    assert stats.all_wrong == 2


def test_wasted_frac_counts_only_dropped_groups():
    """Regression: wasted_frac used to equal uniform_groups even with dynamic sampling off,
    where the uniform groups are trained on (with zero advantage), not wasted."""
    patterns = [ALL_OK, MIXED, ALL_BAD, ALL_BAD, MIXED2, ALL_OK, ALL_OK]
    _, off = DynamicSampler(7, enabled=False).fill(FakeProducer(patterns))
    m = off.as_metrics()
    assert m["sampling/uniform_groups"] == pytest.approx(5 / 7)
    assert m["sampling/wasted_frac"] == 0.0

    # On: the uniform groups are dropped; a qualifying surplus is carried over, not wasted.
    producer = FakeProducer([ALL_OK, MIXED, ALL_BAD, MIXED2, MIXED, ALL_OK])
    sampler = DynamicSampler(2, max_prompts_per_round=6)
    _, on = sampler.fill(producer)
    dropped = sum(len(set(g.correct)) == 1 for g in producer.produced)
    assert on.carried_out == len(producer.produced) - dropped - 2 > 0
    assert on.as_metrics()["sampling/wasted_frac"] == pytest.approx(
        dropped / len(producer.produced)
    )


def test_reward_metric_keeps_groups_with_equal_accuracy_but_different_rewards():
    def groups():
        # All correct, but one response is penalised (e.g. soft overlong punishment).
        same_acc = make_group(ALL_OK, rewards=[1.0, 0.5, 1.0, 1.0])
        # Mixed accuracy but identical rewards.
        same_reward = make_group(MIXED, rewards=[0.5] * G)
        plain = make_group(MIXED2)
        return [same_acc, same_reward, plain]

    by_reward = groups()
    sampler = DynamicSampler(2, metric="reward", max_rounds=50)
    batch, stats = sampler.fill(FakeProducer(itertools.chain(by_reward, itertools.repeat(MIXED2))))
    assert any(g is by_reward[0] for g in batch)
    assert not any(g is by_reward[1] for g in batch + sampler.carry)
    assert stats.uniform_other == 1
    assert stats.all_correct == 0

    by_acc = groups()
    sampler = DynamicSampler(2, metric="acc", max_rounds=50)
    batch, stats = sampler.fill(FakeProducer(itertools.chain(by_acc, itertools.repeat(MIXED2))))
    assert not any(g is by_acc[0] for g in batch + sampler.carry)
    assert any(g is by_acc[1] for g in batch)
    assert stats.all_correct == 1


def test_state_dict_round_trip_keeps_the_carry():
    producer = FakeProducer(itertools.repeat(MIXED))
    s1 = DynamicSampler(4)
    s1.fill(producer)
    assert s1.carry  # precondition: there is something to carry
    carry = list(s1.carry)
    state = s1.state_dict()

    # Plain data, as a checkpoint stores it: loadable without unpickling any object.
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    s2 = DynamicSampler(4)
    s2.load_state_dict(torch.load(buf, weights_only=True))
    assert s2.carry == carry
    assert s2.keep_rate == s1.keep_rate
    batch, stats = s2.fill(FakeProducer(itertools.repeat(MIXED2)))
    assert batch[: len(carry)] == carry
    assert stats.carried_in == len(carry)

    # The saved state is a snapshot: the sampler moving on does not change it.
    s1.fill(producer)
    assert state["carry"] == [g.to_state() for g in carry]


def test_carry_over_pickled_whole_by_release_a5216fc_still_loads():
    """Release a5216fc pickled the carried-over groups as ScoredGroup objects into
    trainer_state.pt (tests/fixtures/trainer_state_a5216fc.pt: 2 groups carried at step 2 of
    `dapo train seed=2 train.steps=2 train.prompts_per_step=4 train.mini_batch_size=4
    rollout.num_generations=4 evaluate=false checkpoint.save_every=1`)."""
    state = load_state_file(FIXTURES / "trainer_state_a5216fc.pt")
    pickled = state["sampler"]["carry"]
    assert len(pickled) == 2 and all(type(g) is ScoredGroup for g in pickled)
    expected = [dict(vars(g)) for g in pickled]
    sampler = DynamicSampler(4)
    sampler.load_state_dict(state["sampler"])
    assert [len(g.response_ids) for g in sampler.carry] == [4, 4]
    for group, old in zip(sampler.carry, expected, strict=True):
        for name, value in old.items():
            assert getattr(group, name) == value
        assert not is_uniform(group)
    # and it is written back as plain data
    buf = io.BytesIO()
    torch.save(sampler.state_dict(), buf)
    buf.seek(0)
    assert DynamicSampler(4).load_state_dict(torch.load(buf, weights_only=True)) is None


def test_older_groups_take_their_ratio_against_the_policy_that_sampled_them() -> None:
    """A group generated at an earlier rollout step (carried over by dynamic sampling, or
    generated ahead by rollout.async_steps=1) gets the engine's sampling log-probs as the
    ratio's old log-probs: the behaviour policy. A group of this step gets none (the trainer
    computes them), and so does every group when the engine's log-probs are not the exact
    sampling distribution (top-p / top-k truncation)."""
    import torch

    from dapo.training.batch import build_samples

    def group(step: int, lps: list[list[float]]) -> ScoredGroup:
        return ScoredGroup(
            prompt_ids=[5, 6],
            response_ids=[[1, 2], [3]],
            sample_logprobs=lps,
            truncated=[False, False],
            rewards=[1.0, -1.0],
            correct=[True, False],
            step=step,
        )

    old, fresh = group(2, [[-0.5, -1.5], [-2.0]]), group(3, [[-0.1, -0.2], [-0.3]])
    samples = build_samples([old, fresh], step=3)
    assert [s.old_logprobs.tolist() for s in samples[:2]] == [[-0.5, -1.5], [-2.0]]
    assert all(s.old_logprobs.dtype == torch.float32 for s in samples[:2])
    assert [s.old_logprobs for s in samples[2:]] == [None, None]
    inexact = build_samples([old, fresh], step=3, exact_sampling_logprobs=False)
    assert all(s.old_logprobs is None for s in inexact)
