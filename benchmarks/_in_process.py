"""Running a benchmark's child work in this process instead of a fresh one.

The benchmark scripts start a process per training run or per measured side (a clean
slate for timing and memory). With ``DAPO_BENCH_IN_PROCESS=1`` (their smoke tests, at tiny
sizes) they call the same function in the running process instead, one at a time: that
saves the ~9 s a fresh process spends importing torch and transformers on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

IN_PROCESS_ENV = "DAPO_BENCH_IN_PROCESS"
_ONE_AT_A_TIME = threading.Lock()


def in_process() -> bool:
    """Whether child work runs in this process (``DAPO_BENCH_IN_PROCESS=1``)."""
    return os.environ.get(IN_PROCESS_ENV) == "1"


def run_here(fn: Callable[[], int | None], threads: int, log: Path) -> int:
    """``fn()`` on ``threads`` torch threads (restored after), its console output in ``log``;
    the exit status a process running it would have (``SystemExit``'s code, 1 on an
    exception, whose traceback goes to the log)."""
    import torch

    with _ONE_AT_A_TIME, log.open("w") as fh:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                return fn() or 0
        except SystemExit as exc:  # argparse's usage errors: the status a process exits with
            return exc.code if isinstance(exc.code, int) else 1
        except Exception:
            traceback.print_exc(file=fh)
            return 1
        finally:
            torch.set_num_threads(before)
