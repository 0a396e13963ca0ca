"""The timed scoring pool: reward functions in persistent worker processes.

:class:`RewardScorer` runs the scorers (or user functions given as ``module:function``)
in persistent worker processes with a per-call timeout, so a hung or crashing reward
function costs one sample (scored -1.0) and never the training run. The workers are
fresh interpreters that import only the rewards package (not torch, not the training script).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any

from dapo.errors import RewardFunctionWarning
from dapo.rewards.math import SCORERS, scorer_for_source
from dapo.rewards.user import (
    _ERROR,
    _OK,
    _SPEC_FORMS,
    _TIMEOUT,
    _Fn,
    _is_file_spec,
    _load_entry,
    _run_item,
    _split_spec,
)
from dapo.rewards.worker import _PROGRESS, BOOT

logger = logging.getLogger(__name__)


_STARTUP_TIMEOUT_S = 120.0
_MAX_UNBLAMED_RETRIES = 2
_CHUNKS_PER_WORKER = 2


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
        return _PROGRESS.unpack_from(self.progress, 0)[0]


def _shutdown_workers(workers: list[_Worker]) -> None:
    """Ask every worker to exit (EOF), then reap it, killing stragglers."""
    for w in workers:
        with contextlib.suppress(OSError):
            w.conn.close()
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.progress.close()
    workers.clear()


# ---------------------------------------------------------------------------
# RewardScorer
# ---------------------------------------------------------------------------


@dataclass
class ScoreRequest:
    """One response to score."""

    response: str
    ground_truth: str
    data_source: str = "math_dapo"


@dataclass
class ScoreResult:
    """Rewards of a batch and how many samples failed (failed samples score -1.0)."""

    rewards: list[float]
    correct: list[bool]
    failures: int = 0
    timeouts: int = 0
    errors: int = 0
    bad_values: int = 0


@dataclass
class _Plan:
    """What to run: function table entries (display name, load spec) and weights."""

    entries: list[tuple[str, str]]
    weights: list[float]
    fixed_ids: tuple[int, ...] | None  # None: one built-in scorer chosen per data source
    warm: list[str] = field(default_factory=list)


class RewardScorer:
    """Scores responses with reward functions in persistent worker processes.

    ``functions`` is a list of ``(name, weight)``, ``name`` a :data:`SCORERS` key or a
    ``module:function`` / ``file.py:function`` spec; the reward is the weighted sum. User
    functions are called as ``fn(response, ground_truth, data_source=...)`` when they
    accept ``data_source`` (or ``**kwargs``), else ``fn(response, ground_truth)``.
    Without functions, each request gets the built-in scorer
    ``scorer_for_source(data_source, source_scorers, default_scorer)`` with weight 1
    (``source_scorers`` and ``default_scorer`` only apply then).

    Each reward-function call on one sample may take at most ``timeout_s``; a worker
    stuck longer is killed and replaced, and the other samples it held are retried. A
    sample whose function times out, raises, or returns a non-number/NaN/inf scores
    -1.0 whatever the weights; each kind of failure is warned about once per function
    (:class:`RewardFunctionWarning`). ``num_workers=0`` scores in the calling thread
    without any timeout: for debugging only. Concurrent :meth:`score` calls from
    several threads are serialised by a lock.
    """

    def __init__(
        self,
        functions: list[tuple[str, float]] | None = None,
        *,
        source_scorers: dict[str, str] | None = None,
        default_scorer: str = "dapo_math",
        timeout_s: float = 5.0,
        num_workers: int = 1,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(
                f"timeout_s (reward.timeout_s) must be a positive number of seconds, got {timeout_s!r}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers (reward.num_workers) must be an int >= 0, got {num_workers!r}; "
                "use 0 for in-process debugging or 1+ worker processes"
            )
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._source_scorers = dict(source_scorers or {})
        self._default_scorer = default_scorer
        self._plan, local = self._make_plan(functions)
        self._local_table = local
        self._source_ids: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._poll_s = min(0.05, self.timeout_s / 10)
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown_workers, self._workers)
        self._fill_pool()

    # -- construction -------------------------------------------------------

    def _make_plan(self, functions: list[tuple[str, float]] | None) -> tuple[_Plan, list[_Fn]]:
        if not functions:
            for source in self._source_scorers:
                scorer_for_source(source, self._source_scorers, self._default_scorer)
            scorer_for_source("", None, self._default_scorer)
            names = list(SCORERS)
            used = {self._default_scorer, *self._source_scorers.values()}
            plan = _Plan(
                [(n, n) for n in names], [1.0] * len(names), None, sorted(used - {"dapo_math"})
            )
            return plan, [_load_entry(n, n) for n in names]
        entries, weights, local = [], [], []
        for i, item in enumerate(functions):
            try:
                name, weight = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"reward.functions[{i}] must be a (name, weight) pair, got {item!r}"
                ) from None
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(
                    f"reward.functions[{i}] weight must be a finite number, got {weight!r}"
                )
            name = str(name)
            if name in SCORERS:
                load_spec = name
            elif ":" in name:
                module_part, attr = _split_spec(name)
                if module_part == "__main__" and self.num_workers > 0:
                    raise ValueError(
                        f"reward.functions[{i}] {name!r}: worker processes cannot see functions "
                        "of the main script; move it to a module, or name the script's file "
                        "('path/to/script.py:function', guarded by if __name__ == '__main__')"
                    )
                if _is_file_spec(module_part):  # workers must find it whatever their cwd
                    module_part = str(Path(module_part).expanduser().resolve())
                load_spec = f"{module_part}:{attr}"
            else:
                raise ValueError(
                    f"reward.functions[{i}] name {name!r} is neither a built-in scorer "
                    f"({', '.join(sorted(SCORERS))}) nor a spec {_SPEC_FORMS}"
                )
            local.append(_load_entry(name, load_spec))  # fail here, not in a worker
            entries.append((name, load_spec))
            weights.append(float(weight))
        warm = sorted({spec for _, spec in entries if spec in SCORERS} - {"dapo_math"})
        return _Plan(entries, weights, tuple(range(len(entries))), warm), local

    # -- public API ---------------------------------------------------------

    def score(self, requests: list[ScoreRequest]) -> ScoreResult:
        """Score a batch; never raises for a misbehaving reward function."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer is closed; create a new one")
            plans = [self._fn_ids(r.data_source) for r in requests]
            if not requests:
                outcomes: list[tuple[Any, ...]] = []
            elif self.num_workers == 0:
                outcomes = [
                    _run_item(self._local_table, ids, r.response, r.ground_truth, r.data_source)
                    for r, ids in zip(requests, plans, strict=True)
                ]
            else:
                outcomes = self._score_in_pool(requests, plans)
            return self._assemble(outcomes, plans)

    def score_groups(
        self, texts: Sequence[Sequence[str]], truths: Sequence[tuple[str, str]]
    ) -> tuple[list[list[float]], list[list[bool]], ScoreResult]:
        """Score responses grouped by prompt: ``texts[i]`` are the responses to a prompt
        whose ``(ground_truth, data_source)`` is ``truths[i]``. Returns the rewards and
        correctness per group, and the flat :class:`ScoreResult` (failure counts)."""
        requests = [
            ScoreRequest(response=text, ground_truth=truth, data_source=source)
            for group, (truth, source) in zip(texts, truths, strict=True)
            for text in group
        ]
        result = self.score(requests)
        rewards: list[list[float]] = []
        correct: list[list[bool]] = []
        start = 0
        for group in texts:
            rewards.append(list(result.rewards[start : start + len(group)]))
            correct.append(list(result.correct[start : start + len(group)]))
            start += len(group)
        return rewards, correct, result

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers]

    @property
    def worker_startup_s(self) -> list[float]:
        """Start-up time (spawn to ready) of each ready worker, in seconds."""
        return [w.startup_s for w in self._workers if w.startup_s is not None]

    # -- helpers ------------------------------------------------------------

    def _fn_ids(self, data_source: str) -> tuple[int, ...]:
        if self._plan.fixed_ids is not None:
            return self._plan.fixed_ids
        fid = self._source_ids.get(data_source)
        if fid is None:
            name = scorer_for_source(data_source, self._source_scorers, self._default_scorer)
            fid = self._source_ids[data_source] = list(SCORERS).index(name)
        return (fid,)

    def _assemble(
        self, outcomes: list[tuple[Any, ...]], plans: list[tuple[int, ...]]
    ) -> ScoreResult:
        result = ScoreResult(rewards=[], correct=[])
        for outcome, ids in zip(outcomes, plans, strict=True):
            if outcome[0] == _OK:
                reward = sum(
                    self._plan.weights[f] * v for f, v in zip(ids, outcome[1], strict=True)
                )
                result.rewards.append(reward)
                result.correct.append(reward > 0)
                continue
            kind, fid, detail = outcome
            result.rewards.append(-1.0)
            result.correct.append(False)
            result.failures += 1
            if kind == _TIMEOUT:
                result.timeouts += 1
            elif kind == _ERROR:
                result.errors += 1
            else:
                result.bad_values += 1
            name = self._plan.entries[fid][0] if fid is not None else "<reward worker>"
            self._warn_once(kind, name, detail)
        return result

    def _warn_once(self, kind: str, name: str, detail: str) -> None:
        if (name, kind) in self._warned:
            return
        self._warned.add((name, kind))
        if kind == _TIMEOUT:
            text = (
                f"reward function {name!r} took longer than {self.timeout_s:g} s on a sample; "
                "the sample scored -1.0 and its worker was restarted. Make the function "
                "faster or raise reward.timeout_s."
            )
        elif kind == _ERROR:
            text = (
                f"reward function {name!r} raised {detail}; the sample scored -1.0. Fix the "
                "function, or catch the error and return a number."
            )
        else:
            text = (
                f"reward function {name!r} returned {detail}, not a finite number; the sample "
                "scored -1.0. Return an int or float (bools count as 0/1)."
            )
        warnings.warn(
            text + " (Warned once per function and kind of failure.)",
            RewardFunctionWarning,
            stacklevel=4,
        )

    # -- worker pool --------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = Pipe(duplex=True)
        progress_fd = (
            os.memfd_create("dapo-reward-progress") if hasattr(os, "memfd_create") else _temp_fd()
        )
        try:
            os.ftruncate(progress_fd, _PROGRESS.size)
            progress = mmap.mmap(progress_fd, _PROGRESS.size)
            boot = BOOT
            proc = subprocess.Popen(
                [sys.executable, "-c", boot, str(child_conn.fileno()), str(progress_fd)],
                pass_fds=(child_conn.fileno(), progress_fd),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child_conn.close()
            os.close(progress_fd)
        parent_conn.send(list(sys.path))
        parent_conn.send(("init", self._plan.entries, self._plan.warm))
        return _Worker(proc, parent_conn, progress, time.monotonic())

    def _fill_pool(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())

    def _retire(self, w: _Worker) -> None:
        """Kill a worker, reap it and drop it from the pool (a fresh one replaces it)."""
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
        w.conn.close()
        w.progress.close()
        self._workers.remove(w)

    def _score_in_pool(
        self, requests: list[ScoreRequest], plans: list[tuple[int, ...]]
    ) -> list[tuple[Any, ...]]:
        n = len(requests)
        run = _Run(
            items=[
                (i, r.response, r.ground_truth, r.data_source, ids)
                for i, (r, ids) in enumerate(zip(requests, plans, strict=True))
            ],
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
        except (
            BaseException
        ):  # e.g. Ctrl-C: results still in flight must not leak into the next call
            for w in [w for w in self._workers if w.chunk is not None]:
                self._retire(w)
            raise
        self._fill_pool()  # replacements start now, not at the next call
        return run.outcomes  # type: ignore[return-value]

    def _send_chunk(self, w: _Worker, ids: list[int], run: _Run) -> None:
        w.chunk = ids
        w.last_progress = w.read_progress()
        w.call_seen_at = time.monotonic()
        try:
            w.conn.send([run.items[i] for i in ids])
        except OSError:  # it died while idle: requeue and replace
            self._fail_chunk(w, _ERROR, run)

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
                self._fail_chunk(w, _ERROR, run)
                return
            code = w.proc.wait()
            self._retire(w)
            raise RuntimeError(
                f"a reward worker {_exit_text(code)} during start-up; its error output is above"
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
        if kind == _TIMEOUT:
            detail = f"timed out after {self.timeout_s:g} s"
        else:
            detail = f"WorkerDied: the worker process {_exit_text(w.proc.returncode)}"
        if value:
            pos, fid = (value >> 16) - 1, value & 0xFFFF
            if 0 <= pos < len(chunk) and run.outcomes[chunk[pos]] is None:
                run.outcomes[chunk[pos]] = (kind, fid, detail)
        rest = [i for i in chunk if run.outcomes[i] is None]
        if not value:  # died between calls, nothing to blame: retry a bounded number of times
            for i in rest:
                run.retries[i] += 1
                if run.retries[i] > _MAX_UNBLAMED_RETRIES:
                    run.outcomes[i] = (_ERROR, None, detail)
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
                self._fail_chunk(w, _TIMEOUT, run)


@dataclass
class _Run:
    """State of one :meth:`RewardScorer.score` call on the pool."""

    items: list[tuple[Any, ...]]
    outcomes: list[tuple[Any, ...] | None]
    retries: list[int]  # requeues of a sample after a worker death with no call to blame
    pending: deque[list[int]] = field(default_factory=deque)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _temp_fd() -> int:
    """An unlinked temporary file for the progress slot (where memfd_create is missing)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="dapo-reward-")
    os.unlink(path)
    return fd
