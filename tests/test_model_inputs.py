"""Tests for ``dapo.models.inputs``: padding and the shared prefix of a batch of prompts."""

from __future__ import annotations

from dapo.models.inputs import after_prefix, left_pad, shared_prefix


def test_left_pad_ends_every_row_at_the_last_column():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_the_shared_prefix_leaves_every_prompt_a_token_and_must_pay_for_its_pass():
    system = list(range(100, 140))  # 40 shared tokens
    prompts = [system + [1, 2], system + [1, 3, 4], system + [5]]
    # The common prefix is 41 tokens for the first two, 40 with the third.
    assert shared_prefix(prompts, pass_cost=0) == 40
    assert shared_prefix(prompts[:2], pass_cost=0) == 41
    # A prompt that is all prefix keeps its last token: that token predicts the response.
    assert shared_prefix([system, system + [7]], pass_cost=0) == 39
    assert shared_prefix([system, system], pass_cost=0) == 39
    # Worth a pass only when (n - 1) x length positions exceed its cost: 2 x 40 = 80.
    assert shared_prefix(prompts, pass_cost=79) == 40
    assert shared_prefix(prompts, pass_cost=80) == 0
    assert shared_prefix([system + [1]], pass_cost=0) == 0  # one prompt: nothing to share
    assert shared_prefix([[1, 2, 3], [4, 2, 3]], pass_cost=0) == 0


def test_after_a_prefix_the_rest_is_left_padded_and_its_positions_continue():
    ids, mask, pos = after_prefix([[1, 2, 3, 4], [1, 2, 5]], prefix=2, pad_id=0)
    assert ids.tolist() == [[3, 4], [0, 5]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]  # [prefix | padding | rest]
    assert pos[mask[:, 2:] > 0].tolist() == [2, 3, 2]  # each rest starts at position 2
    # No prefix: plain left padding, positions from 0.
    ids, mask, pos = after_prefix([[7, 8], [9]], prefix=0, pad_id=0)
    assert ids.tolist() == [[7, 8], [0, 9]] and mask.tolist() == [[1, 1], [0, 1]]
    assert pos[mask > 0].tolist() == [0, 1, 0]
