"""Reward functions for tests/test_reliability.py, loaded by file spec in reward workers.

``mixed`` gives random-model groups a learning signal (so dynamic sampling never stalls
and every update has a real gradient). ``flaky`` misbehaves in every way a user function
can: it hangs once (the first call of the whole run, recorded in the file named by
``DAPO_TEST_HANG_MARKER``), raises on some responses and returns a non-number on others.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def mixed(response: str, ground_truth: str) -> float:
    """+1 for responses of odd length, -1 for even: random groups are almost always mixed."""
    return 1.0 if len(response) % 2 else -1.0


def flaky_kind(response: str) -> str:
    """What ``flaky`` does with ``response`` (after the one hang): raise, bad, or ok."""
    k = len(response) % 4
    return "raise" if k == 0 else "bad" if k == 1 else "ok"


def flaky(response: str, ground_truth: str) -> object:
    marker = os.environ.get("DAPO_TEST_HANG_MARKER")
    if marker:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:  # the first call of the run: record the response, then hang
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(response)
            time.sleep(120)
    kind = flaky_kind(response)
    if kind == "raise":
        raise RuntimeError("flaky reward function failed on purpose")
    if kind == "bad":
        return "not a number"
    return mixed(response, ground_truth)


def hung_response(marker: str | os.PathLike[str]) -> str | None:
    """The response ``flaky`` hung on, or None when it never hung."""
    path = Path(marker)
    return path.read_text(encoding="utf-8") if path.exists() else None
