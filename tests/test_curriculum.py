"""data.curriculum=easy_first: the competence schedule, the ranking, the pool the stream
draws from, determinism and resume. Pure Python, no model."""

from __future__ import annotations

import math
import pickle

import pytest

from dapo.data.curriculum import (
    Curriculum,
    competence,
    easiest_first,
    field_difficulties,
    measured_difficulties,
)
from dapo.data.prompts import PromptStream
from dapo.data.records import PromptRecord
from dapo.errors import DataError


def test_competence_grows_like_a_square_root_from_the_start_share_to_one():
    assert competence(0, 0.2, 100) == pytest.approx(0.2)
    # By hand: sqrt(0.2^2 + (1 - 0.2^2) * 25/100) = sqrt(0.28).
    assert competence(25, 0.2, 100) == pytest.approx(math.sqrt(0.28))
    assert competence(100, 0.2, 100) == 1.0 and competence(500, 0.2, 100) == 1.0
    values = [competence(s, 0.1, 50) for s in range(60)]
    assert values == sorted(values)
    assert competence(0, 0.5, 0) == 1.0  # no pacing: every prompt from the start


def test_easiest_first_breaks_ties_by_the_seeded_order():
    assert easiest_first([2.0, 0.0, 1.0, 0.0], ties=[0.1, 0.9, 0.5, 0.3]) == [3, 1, 2, 0]


def test_measured_difficulty_is_one_minus_the_pass_rate_and_unseen_prompts_are_average():
    assert measured_difficulties([1.0, 0.25, None]) == pytest.approx([0.0, 0.75, 0.375])
    assert measured_difficulties([None, None]) == [0.5, 0.5]


def test_the_stream_draws_only_from_the_pool_of_the_easiest():
    difficulty = [i % 5 for i in range(100)]  # 20 prompts of each level 0..4
    cur = Curriculum(100, seed=3, start=0.2, steps=10, difficulty=difficulty)
    stream = PromptStream(100, 3)
    stream.use_pool(*cur.pool(0))
    early = stream.take(200)
    assert {difficulty[i] for i in early} == {0}  # the easiest 20%: level 0 only
    assert len(set(early)) == 20  # and all of them, uniformly
    order, size = cur.pool(5)
    assert size == math.ceil(competence(5, 0.2, 10) * 100)
    stream.use_pool(order, size)
    mid = stream.take(2000)
    assert set(mid) == set(order[:size])
    stream.use_pool(*cur.pool(10))
    assert len(set(stream.take(3000))) == 100  # the whole set by step S


def test_measured_curriculum_puts_solved_prompts_first():
    cur = Curriculum(6, seed=0, start=0.34, steps=10, difficulty=None)
    assert cur.measured
    order, size = cur.pool(0, [0.1, 1.0, None, 0.9, 0.0, None])
    assert order[:2] == [1, 3] and order[-2:] == [0, 4] and size == 3


def test_pool_draws_are_a_pure_function_of_seed_and_position():
    """Every rank draws the same prompts; a resumed stream draws as the uninterrupted one."""
    cur = Curriculum(50, seed=1, start=0.3, steps=4, difficulty=[float(i % 7) for i in range(50)])
    whole = PromptStream(50, 1)
    draws = []
    for step in range(6):
        whole.use_pool(*cur.pool(step))
        draws.append(whole.take(9))
    first = PromptStream(50, 1)
    for step in range(3):
        first.use_pool(*cur.pool(step))
        assert first.take(9) == draws[step]
    resumed = PromptStream(50, 1)
    resumed.load_state_dict(pickle.loads(pickle.dumps(first.state_dict())))
    for step in range(3, 6):
        resumed.use_pool(*cur.pool(step))
        assert resumed.take(9) == draws[step]
    other_seed = PromptStream(50, 2)
    other_seed.use_pool(*cur.pool(5))
    assert other_seed.take(9) != draws[5]


def _records(values: list) -> list[PromptRecord]:
    return [
        PromptRecord(f"p{i}", "1", uid=f"u{i}", extra={"meta": {"level": v}})
        for i, v in enumerate(values)
    ]


def test_difficulty_field_values_must_be_numbers():
    assert field_difficulties(_records([3, 1.5, "2"]), "meta.level") == [3.0, 1.5, 2.0]
    with pytest.raises(
        DataError,
        match=r"uid=u1: data.difficulty_key='meta.level' holds 'hard', not a finite number",
    ):
        field_difficulties(_records([1, "hard"]), "meta.level")
    with pytest.raises(
        DataError,
        match=r"uid=u0: data.difficulty_key='meta.levle', but the row has no such field \(did you mean 'meta.level'\?\)",
    ):
        field_difficulties(_records([1]), "meta.levle")
