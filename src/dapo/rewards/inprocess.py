"""Reward functions that cannot go to a worker process, run in this one with a time limit.

A Python callable that cloudpickle cannot serialise (it captures a lock, an open file, a
socket, a CUDA context...) runs in the training process. :class:`ThreadRunner` runs it on a
helper thread and waits: an exception or a non-number costs its sample as in a worker, and a
call longer than ``timeout_s`` is abandoned (the sample scores a time-out) and the remaining
samples go on in a fresh thread. A thread cannot be killed, so the abandoned call keeps
running in the background until it returns: it costs CPU, never the run.
"""

from __future__ import annotations

import threading
import time

from dapo.rewards.user import (
    ERROR,
    TIMEOUT,
    Outcome,
    RewardFn,
    Sample,
    describe_exception,
    run_item,
)

Item = tuple[tuple[Sample, ...], tuple[int, ...]]  # samples, fn ids


class ThreadRunner:
    """Runs the functions of ``table`` on samples in a helper thread, each call at most
    ``timeout_s`` long (see the module's docstring)."""

    def __init__(self, table: list[RewardFn | None], timeout_s: float) -> None:
        self.table = table
        self.timeout_s = timeout_s
        self._poll_s = min(0.05, timeout_s / 10)

    def run(self, items: list[Item]) -> list[list[Outcome] | Outcome]:
        """The outcomes of each item (:func:`~dapo.rewards.user.run_item`), in order; one
        outcome for an item whose call timed out."""
        outcomes: list[list[Outcome] | Outcome] = []
        while len(outcomes) < len(items):
            job = _Job(self.table, items[len(outcomes) :])
            outcomes += job.wait(self.timeout_s, self._poll_s)
        return outcomes


class _Job:
    """One helper thread working through a list of samples."""

    def __init__(self, table: list[RewardFn | None], items: list[Item]) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._results: list[list[Outcome] | Outcome] = []
        self._call: tuple[int, float] | None = None  # (fn id, start) of the call in progress
        self._abandoned = False
        thread = threading.Thread(
            target=self._work, args=(table, items), name="dapo-reward", daemon=True
        )
        thread.start()

    def _on_call(self, fid: int) -> None:
        with self._lock:
            self._call = (fid, time.monotonic())

    def _work(self, table: list[RewardFn | None], items: list[Item]) -> None:
        try:
            for samples, ids in items:
                outcome = run_item(table, ids, samples, self._on_call)
                with self._lock:
                    if self._abandoned:
                        return
                    self._results.append(outcome)
                    self._call = None
        except BaseException as e:  # SystemExit and the like: they cost the sample
            with self._lock:
                fid = self._call[0] if self._call else None
                self._results.append((ERROR, fid, describe_exception(e)))
        finally:
            self._done.set()

    def wait(self, timeout_s: float, poll_s: float) -> list[list[Outcome] | Outcome]:
        """The outcomes of the samples done, ending with a time-out if a call overran (the
        samples after it are not run by this job)."""
        while not self._done.wait(poll_s):
            with self._lock:
                if self._call is not None and time.monotonic() - self._call[1] >= timeout_s:
                    self._abandoned = True
                    detail = f"timed out after {timeout_s:g} s"
                    return [*self._results, (TIMEOUT, self._call[0], detail)]
        with self._lock:
            return list(self._results)
