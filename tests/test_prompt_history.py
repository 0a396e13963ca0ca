"""The skip rule of algorithm.skip_uniform_prompts: streaks, the cap, exploration,
determinism across processes (ranks) and resume. Pure Python, no model."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from dapo.data.prompts import PromptStream
from dapo.producer.prompt_history import PromptHistory, should_skip, skip_probability

SRC = Path(__file__).resolve().parents[1] / "src"
ALL_RIGHT, ALL_WRONG, MIXED = [True] * 4, [False] * 4, [True, False, True, True]


def test_skip_probability_rises_with_the_streak_and_stays_below_the_cap():
    cap = 0.8
    # By hand: cap * (1 - 2^-n).
    assert skip_probability(0, cap) == 0.0
    assert skip_probability(1, cap) == pytest.approx(0.4)
    assert skip_probability(2, cap) == pytest.approx(0.6)
    assert skip_probability(3, cap) == pytest.approx(0.7)
    probs = [skip_probability(n, cap) for n in range(200)]
    assert all(a < b or b == cap for a, b in zip(probs, probs[1:], strict=False))  # rising
    assert max(probs) <= cap
    assert skip_probability(5, 0.0) == 0.0


def test_the_streak_counts_uniform_groups_of_either_kind_and_a_mixed_group_ends_it():
    h = PromptHistory()
    assert h.streak("p") == 0 and h.pass_rate("p") is None and h.groups("p") == 0
    h.record("p", ALL_RIGHT)
    assert h.streak("p") == 1
    h.record("p", ALL_WRONG)  # all wrong after all right: still no learning signal
    assert h.streak("p") == 2
    h.record("p", ALL_RIGHT)
    assert h.streak("p") == 3
    h.record("p", MIXED)
    assert h.streak("p") == 0
    h.record("p", ALL_WRONG)
    assert h.streak("p") == 1
    assert h.groups("p") == 5
    assert h.pass_rate("p") == pytest.approx((4 + 0 + 4 + 3 + 0) / 20)
    assert h.streak("other") == 0 and len(h) == 1


def test_no_streak_never_skips():
    assert not any(should_skip(0, pos, "p", 0, 0.99) for pos in range(5000))


@pytest.mark.parametrize("streak", [1, 2, 30])
def test_skip_frequency_matches_the_probability_and_exploration_remains(streak):
    """Over many draws the share skipped is P(skip); even a prompt uniform every time so
    far is still generated on about 1 - cap of its draws (exploration)."""
    cap, n = 0.9, 20000
    skipped = sum(should_skip(3, pos, "easy", streak, cap) for pos in range(n))
    p = skip_probability(streak, cap)
    assert skipped / n == pytest.approx(p, abs=0.015)
    assert n - skipped > 0.08 * n  # generated on at least ~1 - cap of the draws


def test_decisions_differ_across_positions_keys_and_seeds():
    """The coin is fresh for each draw (not one verdict per prompt forever)."""
    runs = [
        [should_skip(seed, pos, key, 1, 0.9) for pos in range(400)]
        for seed in (0, 1)
        for key in ("a", "b")
    ]
    assert all(0 < sum(r) < len(r) for r in runs)
    assert len({tuple(r) for r in runs}) == 4


def _decisions_in_a_fresh_process(hash_seed: str) -> list[bool]:
    code = (
        "from dapo.producer.prompt_history import should_skip;"
        "print(''.join('1' if should_skip(7, pos, f'uid-{pos % 13}', pos % 5, 0.9) else '0' "
        "for pos in range(500)))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return [c == "1" for c in out.stdout.strip()]


def test_every_process_decides_the_same():
    """Ranks are separate processes (with different str-hash salts): the rule must not
    depend on anything but its arguments."""
    here = [should_skip(7, pos, f"uid-{pos % 13}", pos % 5, 0.9) for pos in range(500)]
    assert _decisions_in_a_fresh_process("1") == here
    assert _decisions_in_a_fresh_process("12345") == here
    assert 0 < sum(here) < len(here)


def _simulate(stream: PromptStream, history: PromptHistory, outcomes, steps: int, per_step: int):
    """What a trainer does with the rule: draw prompts skipping by streak, then record
    the generated prompts' groups. Returns what was generated and skipped, per step."""
    log = []
    for _ in range(steps):

        def skip(index: int, position: int) -> bool:
            key = f"uid-{index}"
            return should_skip(11, position, key, history.streak(key), 0.9)

        taken, skipped = stream.take_skipping(per_step, skip)
        for i in taken:
            history.record(f"uid-{i}", outcomes(i))
        log.append((taken, skipped))
    return log


def _outcome(i: int) -> list[bool]:
    # A third always solved, a third never, the rest mixed: a persistent difficulty.
    return ALL_RIGHT if i % 3 == 0 else ALL_WRONG if i % 3 == 1 else MIXED


def test_resumed_history_and_stream_decide_as_the_uninterrupted_run():
    n, per_step = 30, 8
    full = _simulate(PromptStream(n, 5), PromptHistory(), _outcome, 12, per_step)
    stream, history = PromptStream(n, 5), PromptHistory()
    first = _simulate(stream, history, _outcome, 5, per_step)
    # A checkpoint pickles the states; a fresh process builds new objects and loads them.
    saved = pickle.loads(
        pickle.dumps({"stream": stream.state_dict(), "history": history.state_dict()})
    )
    stream2, history2 = PromptStream(n, 5), PromptHistory()
    stream2.load_state_dict(saved["stream"])
    history2.load_state_dict(saved["history"])
    rest = _simulate(stream2, history2, _outcome, 7, per_step)
    assert first + rest == full
    assert history2.state_dict() == _replay_history(full)


def _replay_history(log) -> dict:
    h = PromptHistory()
    for taken, _ in log:
        for i in taken:
            h.record(f"uid-{i}", _outcome(i))
    return h.state_dict()


def test_skipping_passes_over_uniform_prompts_but_keeps_rounds_full():
    """Persistently uniform prompts are skipped more and more as their streaks grow; every
    step still gets its full number of prompts; skipped ones are never in the taken list."""
    stream = PromptStream(30, 5)
    log = _simulate(stream, PromptHistory(), _outcome, 40, 8)
    assert all(len(taken) == 8 for taken, _ in log)
    # Every draw is consumed, generated or skipped: the stream moves on past skipped ones.
    assert stream.position == sum(len(t) + len(s) for t, s in log)
    late = log[20:]
    generated = [i for taken, _ in late for i in taken]
    mixed_share = sum(i % 3 == 2 for i in generated) / len(generated)
    # Without skipping a third of the draws are mixed; with it, far more.
    assert mixed_share > 0.6
    skipped = [i for _, s in late for i in s]
    assert skipped and all(i % 3 != 2 for i in skipped)  # mixed prompts are never skipped
    # Exploration: uniform prompts are still generated now and then.
    assert any(i % 3 == 0 for i in generated) and any(i % 3 == 1 for i in generated)
