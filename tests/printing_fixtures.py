"""Reward functions and a worker entry point that print, for tests/test_user_output.py
(loaded by file spec in reward workers, or imported: tests/ is on sys.path)."""

from __future__ import annotations

import os
import sys
import time

from dapo.rewards import dapo_math_score


def noisy(response: str, ground_truth: str) -> float:
    """Prints 10 MB to stdout and to stderr on responses containing NOISY; else one short
    line to each (``said <response>``, ``warned <response>``), then the DAPO score."""
    if "NOISY" in response:
        print("o" * 10_000_000)
        print("e" * 10_000_000, file=sys.stderr)
    else:
        print(f"said {response}")
        print(f"warned {response}", file=sys.stderr)
    return dapo_math_score(response, ground_truth)


def noisy_always(response: str, ground_truth: str) -> float:
    """Prints 10 MB to stdout and to stderr on every call, then the DAPO score."""
    print("o" * 10_000_000)
    print("e" * 10_000_000, file=sys.stderr)
    return dapo_math_score(response, ground_truth)


def dies_at_start(conn: object, *fds: int) -> None:
    """A worker entry point that prints a traceback-like line and exits at once."""
    print("Traceback: the worker could not start", file=sys.stderr)
    sys.exit(4)


def hang_and_say_where(response: str, ground_truth: str) -> float:
    """Writes its process id to the file named by ``DAPO_TEST_PID_FILE``, then hangs."""
    with open(os.environ["DAPO_TEST_PID_FILE"], "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(60)
    return 0.0
