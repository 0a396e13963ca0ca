"""Sample reward functions for tests/test_rewards.py, loaded by spec inside worker processes.

Each misbehaves only on responses carrying its marker, so one batch can mix good and bad
samples.
"""

from __future__ import annotations

import os
import sys
import time

from dapo.rewards import dapo_math_score


def sleepy(response: str, ground_truth: str) -> float:
    """Hangs on responses containing SLEEP, else the DAPO score."""
    if "SLEEP" in response:
        time.sleep(60)
    return dapo_math_score(response, ground_truth)


def raises(response: str, ground_truth: str) -> float:
    """Raises on responses containing RAISE, else the DAPO score."""
    if "RAISE" in response:
        raise ValueError(f"cannot score {response[:12]!r}")
    return dapo_math_score(response, ground_truth)


def returns_string(response: str, ground_truth: str) -> object:
    """Returns a string on responses containing STRING."""
    return "1.0" if "STRING" in response else dapo_math_score(response, ground_truth)


def returns_nan(response: str, ground_truth: str) -> float:
    """Returns NaN on responses containing NAN, inf on INF."""
    if "NAN" in response:
        return float("nan")
    if "INF" in response:
        return float("inf")
    return dapo_math_score(response, ground_truth)


def returns_bool(response: str, ground_truth: str) -> bool:
    """True when the response contains the ground truth (a bool counts as 0/1)."""
    return ground_truth in response


def length_score(response: str, ground_truth: str) -> float:
    """Response length in tens of characters."""
    return len(response) / 10


def by_source(response: str, ground_truth: str, data_source: str = "") -> float:
    """1.0 for data source 'good', -1.0 otherwise: checks that data_source is passed."""
    return 1.0 if data_source == "good" else -1.0


def with_kwargs(response: str, ground_truth: str, **kwargs: object) -> float:
    """Like by_source but takes data_source through **kwargs."""
    return 1.0 if kwargs.get("data_source") == "good" else -1.0


def crashes(response: str, ground_truth: str) -> float:
    """Kills its own process on responses containing CRASH."""
    if "CRASH" in response:
        os._exit(3)
    return dapo_math_score(response, ground_truth)


def worker_pid(response: str, ground_truth: str) -> float:
    """The id of the process that runs the function."""
    return float(os.getpid())


def torch_loaded(response: str, ground_truth: str) -> float:
    """1.0 when torch is imported in this process, else 0.0."""
    return 1.0 if "torch" in sys.modules else 0.0


NOT_A_FUNCTION = 3
