"""The worker pool: reward functions in persistent worker processes, each call timed.

:class:`WorkerPool` keeps ``num_workers`` fresh interpreters (:mod:`dapo.rewards.worker`),
hands them chunks of samples and watches a shared progress slot per worker: a call that runs
longer than ``timeout_s`` gets its worker killed and replaced, costing that one sample
(``TIMEOUT``), and the rest of the chunk is requeued. A worker that dies costs the call it
was in (``ERROR``); with no call to blame its samples are retried a bounded number of times.
What the workers print goes to the pool's :class:`~dapo.worker_output.OutputCapture` (a
file of the run, capped per worker and step), not to the console.
"""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from dapo.rewards.user import ERROR, TIMEOUT, Outcome, Sample, Source
from dapo.rewards.worker import PROGRESS, main
from dapo.worker_output import OutputCapture, UserOutput
from dapo.workers import exit_text, retire, start_worker, stop_workers

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0
_MAX_UNBLAMED_RETRIES = 2
_CHUNKS_PER_WORKER = 2

Item = tuple[tuple[Sample, ...], tuple[int, ...]]  # samples, fn ids


@dataclass(eq=False)
class _Worker:
    """Parent-side handle of one worker process."""

    proc: subprocess.Popen[bytes]
    conn: Connection
    progress: mmap.mmap
    spawned_at: float
    ready: bool = False
    startup_s: float | None = None
    chunk: list[int] | None = None  # request indices of the chunk in flight
    last_progress: int = 0
    call_seen_at: float = 0.0

    def read_progress(self) -> int:
        return PROGRESS.unpack_from(self.progress, 0)[0]


def _shutdown_workers(workers: list[_Worker], output: OutputCapture) -> None:
    """Close the progress slots (a worker has its own mapping), stop the workers, then
    take in what they printed last and stop draining their output."""
    try:
        for w in workers:
            w.progress.close()
        stop_workers(workers)
    finally:
        output.close()


class WorkerPool:
    """``num_workers`` worker processes that load the functions ``entries`` (``(display name,
    source)`` pairs, :func:`~dapo.rewards.user.load_entry`) and run them on samples, each
    call limited to ``timeout_s``. ``warm`` names built-in scorers to call once at start-up.
    Workers start at once, and again whenever one is retired. Their stdout and stderr go
    where ``output`` says (:class:`~dapo.worker_output.UserOutput`; default: kept in memory)."""

    def __init__(
        self,
        entries: list[tuple[str, Source]],
        warm: list[str],
        num_workers: int,
        timeout_s: float,
        output: UserOutput | None = None,
        options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.entries = entries
        self.options = options or {}
        self.warm = warm
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._poll_s = min(0.05, timeout_s / 10)
        self._workers: list[_Worker] = []
        self.output = OutputCapture("reward worker", output)
        self._finalizer = weakref.finalize(self, _shutdown_workers, self._workers, self.output)
        try:
            self._fill_pool()
        except BaseException:
            self._finalizer()
            raise

    def run(self, items: list[Item]) -> list[list[Outcome] | Outcome]:
        """The outcomes of each item (:func:`~dapo.rewards.user.run_item`: one per sample),
        in order; one outcome for an item whose call timed out or whose worker died."""
        n = len(items)
        run = _Run(
            items=[(i, *item) for i, item in enumerate(items)],
            outcomes=[None] * n,
            retries=[0] * n,
        )
        size = max(1, min(256, -(-n // (_CHUNKS_PER_WORKER * self.num_workers))))
        run.pending.extend(list(range(s, min(s + size, n))) for s in range(0, n, size))
        try:
            while any(o is None for o in run.outcomes):
                self._fill_pool()
                for w in self._workers:
                    if w.ready and w.chunk is None and run.pending:
                        self._send_chunk(w, run.pending.popleft(), run)
                active = [w for w in self._workers if not w.ready or w.chunk is not None]
                for conn in wait([w.conn for w in active], self._wait_s(active)):
                    self._receive(next(w for w in active if w.conn is conn), run)
                self._enforce_timeouts(run)
        except BaseException:  # e.g. Ctrl-C: results in flight must not leak into the next run
            for w in [w for w in self._workers if w.chunk is not None]:
                self._retire(w)
            raise
        self._fill_pool()  # replacements start now, not at the next call
        self.output.sync()  # what the calls printed counts in this step
        return run.outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the worker processes and the draining of their output (idempotent)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers]

    @property
    def startup_s(self) -> list[float]:
        """Start-up time (spawn to ready) of each ready worker, in seconds."""
        return [w.startup_s for w in self._workers if w.startup_s is not None]

    def _spawn(self) -> _Worker:
        progress_fd = (
            os.memfd_create("dapo-reward-progress") if hasattr(os, "memfd_create") else _temp_fd()
        )
        try:
            os.ftruncate(progress_fd, PROGRESS.size)
            progress = mmap.mmap(progress_fd, PROGRESS.size)
            proc, conn = start_worker(main, progress_fd, output=self.output)
        finally:
            os.close(progress_fd)
        conn.send(("init", self.entries, self.warm, self.options))
        return _Worker(proc, conn, progress, time.monotonic())

    def _fill_pool(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _retire(self, w: _Worker) -> None:
        """Kill a worker, reap it and drop it from the pool (a fresh one replaces it)."""
        retire(w)
        w.progress.close()
        self._workers.remove(w)

    def _send_chunk(self, w: _Worker, ids: list[int], run: _Run) -> None:
        w.chunk = ids
        w.last_progress = w.read_progress()
        w.call_seen_at = time.monotonic()
        try:
            w.conn.send([run.items[i] for i in ids])
        except OSError:  # it died while idle: requeue and replace
            self._fail_chunk(w, ERROR, run)

    def _wait_s(self, active: list[_Worker]) -> float:
        """How long to block: until the nearest call deadline, at most one poll period."""
        now = time.monotonic()
        wait_s = self._poll_s
        for w in active:
            if w.ready and w.last_progress:
                wait_s = min(wait_s, max(0.0, w.call_seen_at + self.timeout_s - now))
        return wait_s

    def _receive(self, w: _Worker, run: _Run) -> None:
        """Handle one message from ``w`` (or its death)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if w.ready:
                self._fail_chunk(w, ERROR, run)
                return
            code = w.proc.wait()
            self._retire(w)
            raise RuntimeError(
                f"a reward worker {exit_text(code)} during start-up"
                + _last_words(self.output, w.proc.pid)
            ) from None
        if msg[0] == "ready":
            w.ready = True
            w.startup_s = time.monotonic() - w.spawned_at
            logger.debug("reward worker %d ready in %.3f s", msg[1], w.startup_s)
        elif msg[0] == "init_error":
            self._retire(w)
            raise RuntimeError(f"a reward worker could not load the reward functions: {msg[1]}")
        else:
            _, results, finished = msg
            for item_id, outcome in results:
                if run.outcomes[item_id] is None:
                    run.outcomes[item_id] = outcome
            if finished:
                w.chunk = None

    def _fail_chunk(self, w: _Worker, kind: str, run: _Run) -> None:
        """Blame the call in progress on ``w``, retire ``w`` and requeue the rest of its chunk."""
        value = w.read_progress()
        chunk = w.chunk or []
        self._retire(w)
        if kind == TIMEOUT:
            detail = f"timed out after {self.timeout_s:g} s"
        else:
            detail = f"WorkerDied: the worker process {exit_text(w.proc.returncode)}"
        if value:
            pos, fid = (value >> 16) - 1, value & 0xFFFF
            if 0 <= pos < len(chunk) and run.outcomes[chunk[pos]] is None:
                run.outcomes[chunk[pos]] = (kind, fid, detail)
        rest = [i for i in chunk if run.outcomes[i] is None]
        if not value:  # died between calls, nothing to blame: retry a bounded number of times
            for i in rest:
                run.retries[i] += 1
                if run.retries[i] > _MAX_UNBLAMED_RETRIES:
                    run.outcomes[i] = (ERROR, None, detail)
            rest = [i for i in rest if run.outcomes[i] is None]
        if rest:
            run.pending.appendleft(rest)

    def _enforce_timeouts(self, run: _Run) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready:
                if now - w.spawned_at > _STARTUP_TIMEOUT_S:
                    self._retire(w)
                    raise RuntimeError(
                        f"a reward worker did not start within {_STARTUP_TIMEOUT_S:g} s"
                    )
                continue
            if w.chunk is None:
                continue
            value = w.read_progress()
            if value != w.last_progress:
                w.last_progress, w.call_seen_at = value, now
            elif value and now - w.call_seen_at >= self.timeout_s:
                logger.info("reward worker %d timed out; replacing it", w.proc.pid)
                self._fail_chunk(w, TIMEOUT, run)


@dataclass
class _Run:
    """State of one :meth:`RewardScorer.score` call on the pool."""

    items: list[tuple[Any, ...]]  # (index, *Item)
    outcomes: list[list[Outcome] | Outcome | None]
    retries: list[int]  # requeues of a sample after a worker death with no call to blame
    pending: deque[list[int]] = field(default_factory=deque)


def _last_words(output: OutputCapture, pid: int) -> str:
    """The end of what a dead worker printed (its traceback), for a message."""
    text = output.last_words(pid).strip()
    return f"; the end of its output:\n{text}" if text else "; it printed nothing"


def _temp_fd() -> int:
    """An unlinked temporary file for the progress slot (where memfd_create is missing)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="dapo-reward-")
    os.unlink(path)
    return fd
