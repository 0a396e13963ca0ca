"""Reward functions for the trainer tests (loaded by spec inside reward worker processes)."""

from __future__ import annotations


def by_answer_class(response: str, ground_truth: str) -> float:
    """Uniform groups on purpose: answers divisible by 3 are always right, answers that
    leave remainder 1 always wrong, and the rest right when the response length is odd
    (so those groups are almost always mixed)."""
    value = int(ground_truth)
    if value % 3 == 0:
        return 1.0
    if value % 3 == 1:
        return -1.0
    return 1.0 if len(response) % 2 else -1.0


def always_wrong(response: str, ground_truth: str) -> float:
    return -1.0


def rarely_mixed(response: str, ground_truth: str) -> float:
    """Mixed groups for answers divisible by 4 (right when the response length is odd), all
    wrong otherwise: a round of a few prompts seldom fills a batch."""
    if int(ground_truth) % 4 == 0:
        return 1.0 if len(response) % 2 else -1.0
    return -1.0
