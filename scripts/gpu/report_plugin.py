"""A pytest plugin for ``make test-gpu``: one JSON line per test phase, written as it ends.

Loaded with ``-p report_plugin`` (this folder on ``PYTHONPATH``); writes to the file named by
``$DAPO_GPU_REPORT``. Written line by line, so that a run stopped at the command's time
budget still reports every test that finished (pytest's JUnit XML is written at the end).
"""

from __future__ import annotations

import json
import os
from typing import Any

REPORT_ENV = "DAPO_GPU_REPORT"


def _message(report: Any) -> str:
    """The skip reason, or the end of the failure (the assertion and its values)."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    return (crash or str(longrepr).strip().splitlines()[-1])[-1500:]


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    line = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 2),
        "message": _message(report),
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")
