"""The reward of the real-model tier's task (loaded by spec, ``path.py:function``)."""

from __future__ import annotations

import re


def yes_no(response: str, ground_truth: str) -> float:
    """+1 when the first "yes" or "no" of the response is the ground truth, else -1."""
    found = re.search(r"\b(yes|no)\b", response.lower())
    return 1.0 if found is not None and found.group(1) == ground_truth else -1.0
