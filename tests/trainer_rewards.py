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


def constant_half(response: str, ground_truth: str) -> float:
    """The same reward for everything: no learning signal anywhere."""
    return 0.5


def odd_length(response: str, ground_truth: str) -> float:
    """Right when the response has an odd length: mixed groups, learnable by any policy."""
    return 1.0 if len(response) % 2 else -1.0


def one_argument(response: str) -> float:
    """No place for the ground truth: no form dapo knows calls it."""
    return float(len(response) % 2)


def swapped(ground_truth: str, response: str) -> float:
    """The arguments in the other order."""
    return 1.0 if ground_truth in response else -1.0


def raises(response: str, ground_truth: str) -> float:
    raise RuntimeError("this reward always fails")


def prompt_only(response: str, ground_truth: str) -> float:
    """Depends on the prompt, never on the response: every group is uniform."""
    return 1.0 if int(ground_truth) % 2 == 0 else -1.0


def negative_length(response: str, ground_truth: str) -> float:
    """TRL's quick-start reward on dapo's signature: every value at or below 0."""
    return -abs(20 - len(response))


def partial_credit(response: str, ground_truth: str) -> float:
    """0.1 for a wrong answer, 1.0 for a right one: every value above 0."""
    from dapo.rewards import dapo_math_score

    return 1.0 if dapo_math_score(response, ground_truth) > 0 else 0.1
