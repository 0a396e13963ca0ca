"""The environment pool: one environment instance per episode, in worker processes.

:class:`EnvironmentPool` creates each episode's instance in a worker process (the pattern
of the reward pool, :mod:`dapo.rewards.pool`; both start and stop their workers with
:mod:`dapo.workers`) and runs batched ``reset`` / ``step`` calls over many episodes. A call
that raises, returns malformed output, takes longer than ``timeout_s`` or kills its worker
ends that episode with a recorded reason (and a one-line
:class:`~dapo.environments.base.EnvironmentWarning`, once per kind); never the run.

A killed or crashed worker takes its other episodes' instances with it. They are rebuilt
in the replacement worker by replaying their calls (``reset``, then each ``step`` with the
same assistant text); an episode whose replay answers differently ends as ``lost``. So a
hang costs one episode, provided environments depend only on the record and the turns.

What environments and tools print in the workers goes to the pool's
:class:`~dapo.worker_output.OutputCapture` (a file of the run, capped per worker and step),
not to the console; in-process episodes (``num_workers=0``) print where the trainer prints.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from dapo.environments.base import EnvironmentWarning, Message
from dapo.environments.loading import EnvironmentSpec
from dapo.environments.worker import EpisodeHost, new_result, worker_main
from dapo.worker_output import OutputCapture, UserOutput
from dapo.workers import exit_text, retire, start_worker, stop_workers

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    """The environment's answer for one episode: its messages, the final reward (or
    ``None``), whether the episode ended, and why it ended early when it did."""

    episode: int
    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False  # the episode is over (also on a failure or a bad tool call)
    failure: str | None = None  # the environment failed: "timeout: ...", "raised: ...", ...
    bad_tool_call: str | None = None  # the model's tool call did not parse (its failure)
    tool_calls: int = 0
    tool_errors: int = 0  # unknown tool, bad arguments, or the tool raised
    seconds: float = 0.0  # time spent in the environment's code


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    spawned_at: float
    ready: bool = False
    batch: list[_Op] | None = None  # the batch in flight
    answered: int = 0  # results of the batch received so far
    deadline: float = math.inf  # when the running operation times out


@dataclass
class _Op:
    index: int | None  # position in the caller's batch; None: a replay
    episode: int
    kind: str
    arg: Any


@dataclass
class _Log:
    """What the parent keeps of a live episode, to rebuild it in another worker."""

    record: Any
    worker: _Worker | None
    started: bool = False
    texts: list[str] = field(default_factory=list)
    replies: list[list[Message]] = field(default_factory=list)


class EnvironmentPool:
    """Episodes' environments in ``num_workers`` worker processes (0: in this process,
    without time-outs; also where the spec cannot be sent to a process).

    ``reset(records)`` starts one episode per record and returns their opening messages;
    ``step([(episode, assistant_text), ...])`` runs one turn of each; an episode whose
    :class:`Outcome` says ``done`` is over, and ``end(episodes)`` releases episodes that
    stop for another reason (a limit). Calls from several threads are serialised.

    The workers' stdout and stderr go where ``output`` says
    (:class:`~dapo.worker_output.UserOutput`; default: the last MiB in memory), at most its
    limit per worker and step (:meth:`output_step`), the rest counted (:attr:`output_dropped`)
    and dropped.
    """

    def __init__(
        self,
        spec: EnvironmentSpec,
        *,
        num_workers: int = 1,
        timeout_s: float = 30.0,
        output: UserOutput | None = None,
    ):
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(
                f"`rollout.env_timeout_s` must be a positive number of seconds, got {timeout_s!r}"
            )
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"`rollout.env_workers` must be an int >= 0, got {num_workers!r}; 0 runs the "
                "environments in the training process (no time-outs)"
            )
        self.spec, self.timeout_s = spec, float(timeout_s)
        self._payload = spec.payload() if num_workers > 0 else None
        if num_workers > 0 and self._payload is None:
            warnings.warn(
                f"environment {spec.name!r} cannot be sent to worker processes (not picklable; "
                "objects defined in __main__ need the cloudpickle package): its episodes run "
                "in this process, without time-outs",
                EnvironmentWarning,
                stacklevel=2,
            )
            num_workers = 0
        self.num_workers = num_workers
        self.counters = {"worker_restarts": 0, "replays": 0}
        self._host = EpisodeHost(spec.factory, spec.tools, spec.parser, spec.name)
        self._logs: dict[int, _Log] = {}
        self._lost: dict[int, dict[str, Any]] = {}  # failed replays, until their ops are answered
        self._next_episode = 0
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self.output = OutputCapture("environment worker", output) if num_workers else None
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self.output)
        try:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._spawn())
        except BaseException:
            self._finalizer()
            raise

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for the chat template's ``tools=``."""
        return self.spec.schemas

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def output_step(self, step: str) -> None:
        """What the workers print from here on belongs to ``step`` (``rollout step 3``),
        with a fresh limit per worker."""
        if self.output is not None:
            self.output.new_step(step)

    @property
    def output_dropped(self) -> int:
        """Bytes the workers printed over the limit, dropped, over the pool's life."""
        return self.output.dropped if self.output is not None else 0

    def reset(self, records: Sequence[Any]) -> list[Outcome]:
        """Start one episode per record (a new environment instance each); their ids are
        the outcomes' ``episode``."""
        with self._lock:
            load = {id(w): 0 for w in self._workers}
            for log in self._logs.values():
                if log.worker is not None:
                    load[id(log.worker)] += 1
            ops = []
            for record in records:
                episode, self._next_episode = self._next_episode, self._next_episode + 1
                worker = min(self._workers, key=lambda w: load[id(w)]) if self._workers else None
                if worker is not None:
                    load[id(worker)] += 1
                self._logs[episode] = _Log(record, worker)
                ops.append((episode, "reset", record))
            return self._run(ops)

    def step(self, turns: Sequence[tuple[int, str]]) -> list[Outcome]:
        """Give each episode its assistant turn; the environments' answers, in order."""
        with self._lock:
            unknown = [e for e, _ in turns if e not in self._logs]
            if unknown:
                raise ValueError(f"episodes {unknown[:5]} are not live (ended or never started)")
            return self._run([(episode, "step", text) for episode, text in turns])

    def end(self, episodes: Iterable[int]) -> None:
        """Release the environments of episodes that ended without a ``done`` (a limit)."""
        with self._lock:
            by_worker: dict[_Worker | None, list[int]] = {}
            for episode in episodes:
                log = self._logs.pop(episode, None)
                if log is not None:
                    by_worker.setdefault(log.worker, []).append(episode)
            for worker, ids in by_worker.items():
                if worker is None:
                    for episode in ids:
                        self._host.envs.pop(episode, None)
                else:
                    with contextlib.suppress(OSError):
                        worker.conn.send(("drop", ids))

    def close(self) -> None:
        """Stop the worker processes and the draining of their output (idempotent)."""
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running a batch -------------------------------------------------------------

    def _run(self, ops: list[tuple[int, str, Any]]) -> list[Outcome]:
        if self._closed:
            raise RuntimeError("EnvironmentPool is closed; create a new one")
        if self.num_workers == 0:
            results = []
            for episode, kind, arg in ops:
                results.append(self._host.run(episode, kind, arg))
                self._bookkeep(episode, kind, arg, results[-1])
        else:
            results = self._run_in_workers(ops)
        return [self._outcome(op[0], r) for op, r in zip(ops, results, strict=True)]

    def _bookkeep(self, episode: int, kind: str, arg: Any, result: dict[str, Any]) -> None:
        log = self._logs.get(episode)
        if log is None:
            return
        if result["failure"] is not None or result["done"]:
            del self._logs[episode]
        elif kind == "reset":
            log.started = True
        elif kind == "step":
            log.texts.append(arg)
            log.replies.append(result["messages"])

    def _outcome(self, episode: int, result: dict[str, Any]) -> Outcome:
        failure = None
        if result["failure"] is not None:
            kind, detail = result["failure"]
            failure = f"{kind}: {detail}"
            self._warn_once(kind, self.spec.name, self._failure_text(kind, detail))
        for tool, error in result["raised"]:
            self._warn_once(
                "tool",
                tool,
                (
                    f"tool {tool!r} raised {error}; its error text went to the model as the tool's "
                    "reply (counted in the tool errors)"
                ),
            )
        return Outcome(
            episode=episode,
            messages=result["messages"],
            reward=result["reward"],
            done=bool(result["done"] or failure is not None),
            failure=failure,
            bad_tool_call=result["bad_tool_call"],
            tool_calls=result["tool_calls"],
            tool_errors=result["tool_errors"],
            seconds=result["seconds"],
        )

    def _failure_text(self, kind: str, detail: str) -> str:
        name = self.spec.name
        if kind == "timeout":
            return (
                f"environment {name!r}: {detail}; the episode ended and the worker was "
                "restarted. Make the environment faster or raise rollout.env_timeout_s"
            )
        if kind in ("died", "lost"):
            return f"environment {name!r}: {detail}; the episode ended"
        return f"environment {name!r}: {detail}; the episode ended. Fix the environment"

    def warn_once(self, kind: str, text: str) -> None:
        """An :class:`EnvironmentWarning` with ``text``, once per pool and ``kind``."""
        if (kind, "") in self._warned:
            return
        self._warned.add((kind, ""))
        warnings.warn(text, EnvironmentWarning, stacklevel=3)

    def _warn_once(self, kind: str, name: str, text: str) -> None:
        if (kind, name) in self._warned:
            return
        self._warned.add((kind, name))
        warnings.warn(
            text + " (warned once per environment or tool and kind of failure)",
            EnvironmentWarning,
            stacklevel=5,
        )

    # -- the worker processes ------------------------------------------------------------

    def _spawn(self) -> _Worker:
        proc, conn = start_worker(worker_main, output=self.output)
        conn.send(("init", self._payload, self.spec.name))
        return _Worker(proc, conn, time.monotonic())

    def _run_in_workers(self, ops: list[tuple[int, str, Any]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(ops)
        queues: dict[_Worker, deque[_Op]] = {}
        for w in list(self._workers):  # a worker that died while idle: rebuild its episodes
            if w.proc.poll() is not None:
                self._lose(w, "died", results, queues)
        for i, (episode, kind, arg) in enumerate(ops):
            worker = self._logs[episode].worker
            assert worker is not None
            queues.setdefault(worker, deque()).append(_Op(i, episode, kind, arg))
        try:
            while any(r is None for r in results):
                for w in list(self._workers):
                    if w.ready and w.batch is None and queues.get(w):
                        self._send(w, list(queues.pop(w)), results, queues)
                busy = [w for w in self._workers if not w.ready or w.batch is not None]
                if not busy and not any(queues.values()):
                    raise RuntimeError(
                        "EnvironmentPool: operations left with no worker to run them"
                    )
                now = time.monotonic()
                wait_s = min([0.05] + [max(0.0, w.deadline - now) for w in busy])
                for conn in wait([w.conn for w in busy], wait_s):
                    worker = next((w for w in busy if w.conn is conn), None)
                    if worker is not None and worker in self._workers:
                        self._receive(worker, results, queues)
                self._check_deadlines(results, queues)
        except BaseException:  # e.g. Ctrl-C: answers in flight must not leak into the next call
            for w in [w for w in self._workers if w.batch is not None]:
                self._retire(w)
                self._workers.append(self._spawn())
            self._logs.clear()
            raise
        if self.output is not None:
            self.output.sync()  # what the calls printed counts in this step
        return results  # type: ignore[return-value]

    def _send(
        self, w: _Worker, ops: list[_Op], results: list[Any], queues: dict[_Worker, deque[_Op]]
    ) -> None:
        live = []
        for op in ops:  # an episode lost in a failed replay gets the replay's failure
            if op.kind != "reset" and op.episode not in self._logs and op.index is not None:
                results[op.index] = self._lost.pop(op.episode, None) or _failed(
                    "lost", "the episode was lost with its worker", 0.0
                )
            else:
                live.append(op)
        if not live:
            return
        w.batch, w.answered = live, 0
        w.deadline = time.monotonic() + self._op_timeout(live[0])
        try:
            w.conn.send(("run", [(op.episode, op.kind, op.arg) for op in live]))
        except OSError:  # it died while idle
            self._lose(w, "died", results, queues)

    def _op_timeout(self, op: _Op) -> float:
        # A replay runs reset and every earlier step again.
        return self.timeout_s * (1 + len(op.arg[1])) if op.kind == "replay" else self.timeout_s

    def _receive(self, w: _Worker, results: list[Any], queues: dict[_Worker, deque[_Op]]) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                code = w.proc.wait()
                self._retire(w)
                said = self.output.last_words(w.proc.pid).strip() if self.output else ""
                raise RuntimeError(
                    f"an environment worker {exit_text(code)} during start-up"
                    + (f"; the end of its output:\n{said}" if said else "; it printed nothing")
                ) from None
            self._lose(w, "died", results, queues)
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "init_error":
            self._retire(w)
            raise RuntimeError(
                f"an environment worker could not load {self.spec.name!r}: {msg[1]}. Fix: the "
                "environment's module must import in a fresh Python process (check PYTHONPATH)"
            )
        else:
            _, pos, result = msg
            assert w.batch is not None
            op = w.batch[pos]
            w.answered = pos + 1
            self._answer(op, result, results)
            if w.answered == len(w.batch):
                w.batch, w.deadline = None, math.inf
            else:
                w.deadline = time.monotonic() + self._op_timeout(w.batch[w.answered])

    def _answer(self, op: _Op, result: dict[str, Any], results: list[Any]) -> None:
        """Take one operation's result (at once: a later loss of the worker replays from it)."""
        if op.index is not None:
            failure = result["failure"]
            if failure is not None and failure[0] == "lost" and op.episode in self._lost:
                result = self._lost.pop(op.episode)  # its replay failed: say why
            results[op.index] = result
            self._bookkeep(op.episode, op.kind, op.arg, result)
        elif result["failure"] is not None:  # a replay failed: the episode is lost
            self._logs.pop(op.episode, None)
            self._lost[op.episode] = result

    def _check_deadlines(self, results: list[Any], queues: dict[_Worker, deque[_Op]]) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.ready and now - w.spawned_at > _STARTUP_TIMEOUT_S:
                self._retire(w)
                raise RuntimeError(
                    f"an environment worker did not start within {_STARTUP_TIMEOUT_S:g} s"
                )
            if w.ready and w.batch is not None and now > w.deadline:
                self._lose(w, "timeout", results, queues)

    def _lose(
        self, w: _Worker, kind: str, results: list[Any], queues: dict[_Worker, deque[_Op]]
    ) -> None:
        """``w`` hung or died: fail the call it was running, replace it, and rebuild its other
        episodes in the new worker before the calls it had not run."""
        blamed, rest = None, []
        if w.batch is not None and w.answered < len(w.batch):
            blamed, rest = w.batch[w.answered], w.batch[w.answered + 1 :]
        pending = rest + list(queues.pop(w, ()))
        code = self._retire(w)
        self.counters["worker_restarts"] += 1
        if blamed is not None:
            if kind == "timeout":
                detail = f"{blamed.kind} took longer than {self._op_timeout(blamed):g} s"
                seconds = self._op_timeout(blamed)
            else:
                detail = f"the worker process {exit_text(code)} during {blamed.kind}"
                seconds = 0.0
            self._logs.pop(blamed.episode, None)
            self._answer(blamed, _failed(kind, detail, seconds), results)
        new = self._spawn()
        self._workers.append(new)
        replays = []
        for episode, log in self._logs.items():
            if log.worker is w:
                log.worker = new
                if log.started:
                    arg = (log.record, list(log.texts), [list(r) for r in log.replies])
                    replays.append(_Op(None, episode, "replay", arg))
        self.counters["replays"] += len(replays)
        queues[new] = deque(replays + pending)

    def _retire(self, w: _Worker) -> int | None:
        code = retire(w)
        if w in self._workers:
            self._workers.remove(w)
        return code


def _shutdown(workers: list[_Worker], output: OutputCapture | None) -> None:
    """Stop the workers, then take in what they printed last and stop draining."""
    try:
        stop_workers(workers)
    finally:
        if output is not None:
            output.close()


def _failed(kind: str, detail: str, seconds: float) -> dict[str, Any]:
    result = new_result()
    result.update(failure=(kind, detail), seconds=seconds)
    return result
