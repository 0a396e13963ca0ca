"""Where agents run: worker processes for sync agents, an asyncio loop for ``async def`` ones.

:class:`AgentRunner` starts one agent call per episode and reports its end on a queue as
``("finished", token, reward, error, seconds)`` (or ``("worker_exit", tokens, text)`` when
a worker process dies with episodes running). Sync agents run on threads of
``num_workers`` worker processes (0: threads of this process), so a blocking agent does not
stall the trainer and a crash costs that worker's episodes, not the run; an agent past its
time-out is abandoned (its episode fails) and its worker replaced once the round is over.
``async def`` agents run on one event loop thread of this process, cancelled at their
time-out (an ``async`` agent that blocks the loop stalls the other async agents).
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import queue
import subprocess
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dapo.agents.worker import run_async, run_sync, worker_main
from dapo.environments import EnvironmentWarning
from dapo.environments.loading import import_spec
from dapo.errors import ConfigError
from dapo.worker_output import OutputCapture, UserOutput
from dapo.workers import exit_text, retire, start_worker, stop_workers


def load_agent_spec(agent: Any) -> tuple[Callable[..., Any], bytes | None, str]:
    """The agent function, the bytes a worker process loads it from (None: it cannot be
    sent; it then runs on threads of this process) and its name, from ``rollout.agent``
    (``module:function`` or ``path/file.py:function``) or a callable."""
    key = "rollout.agent"
    if isinstance(agent, str):
        fn = import_spec(agent, key)
        ref: tuple[str, Any] = ("spec", _absolute(agent))
        name = agent
    else:
        fn, ref, name = agent, ("object", agent), getattr(agent, "__qualname__", repr(agent))
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(
            f"`{key}` = {name!r} is not a function. Fix: give def agent(client, record) -> "
            "reward or None (or async def), as module:function or path/file.py:function"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ConfigError(
            f"`{key}` = {name!r} does not take (client, record). Fix: define it as "
            "def agent(client, record) -> reward or None"
        ) from None
    except ValueError:
        pass
    payload: bytes | None
    try:
        if ref[0] == "object":
            import cloudpickle

            payload = cloudpickle.dumps(ref)
        else:
            payload = pickle.dumps(ref)
        pickle.loads(payload)
    except Exception:
        payload = None
    return fn, payload, name


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    conn: Connection
    tokens: set[str] = field(default_factory=set)  # episodes running in it
    abandoned: set[str] = field(default_factory=set)  # timed-out episodes still running
    lock: threading.Lock = field(default_factory=threading.Lock)


class AgentRunner:
    """Starts agent episodes and reports their ends on ``events``. What agents print in
    the worker processes goes where ``output`` says (:class:`~dapo.worker_output.UserOutput`;
    default: the last MiB in memory); agents on threads of this process print to its
    console."""

    def __init__(
        self,
        agent: Any,
        events: queue.Queue,
        *,
        num_workers: int = 1,
        timeout_s: float = 300.0,
        output: UserOutput | None = None,
    ) -> None:
        self.fn, self.payload, self.name = load_agent_spec(agent)
        self.events, self.timeout_s = events, float(timeout_s)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        if num_workers > 0 and not self.is_async and self.payload is None:
            warnings.warn(
                f"agent {self.name!r} cannot be sent to worker processes (not picklable; "
                "functions defined in __main__ need the cloudpickle package): its episodes run "
                "on threads of this process (a crash there stops the run)",
                EnvironmentWarning,
                stacklevel=2,
            )
        self.num_workers = 0 if self.is_async or self.payload is None else num_workers
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self.output = OutputCapture("agent worker", output) if self.num_workers else None
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._tasks: dict[str, Any] = {}

    # --- starting episodes ----------------------------------------------------------------

    def start(self, token: str, base_url: str, key: str, record: Any) -> None:
        """Start the agent of one episode."""
        args = (token, base_url, key, record, self.timeout_s)
        if self.is_async:
            loop = self._event_loop()
            self._tasks[token] = asyncio.run_coroutine_threadsafe(self._async(*args), loop)
        elif self.num_workers == 0:
            threading.Thread(target=self._thread, args=args, name="dapo-agent", daemon=True).start()
        else:
            w = self._worker(self._next % self.num_workers)
            self._next += 1
            with w.lock:
                w.tokens.add(token)
            w.conn.send(args)

    def _thread(self, *args: Any) -> None:
        self.events.put(("finished", *run_sync(self.fn, *args)))

    async def _async(self, token: str, *args: Any) -> None:
        try:
            result = await asyncio.wait_for(run_async(self.fn, token, *args), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            return  # the episode loop times it out itself
        self.events.put(("finished", *result))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="dapo-agent-loop", daemon=True
            )
            self._loop_thread.start()
        return self._loop

    def _worker(self, i: int) -> _Worker:
        w = self._workers[i]
        if w is None or w.proc.poll() is not None:
            proc, conn = start_worker(worker_main, output=self.output)
            conn.send(self.payload)
            w = _Worker(proc, conn)
            if conn.recv() != "ready":
                raise RuntimeError("an agent worker did not start")
            self._workers[i] = w
            threading.Thread(
                target=self._read, args=(w,), name="dapo-agent-reader", daemon=True
            ).start()
        return w

    def _read(self, w: _Worker) -> None:
        """A worker's results, until it exits; then its running episodes fail."""
        while True:
            try:
                token, *rest = w.conn.recv()
            except (EOFError, OSError):
                break
            with w.lock:
                w.tokens.discard(token)
                w.abandoned.discard(token)
            self.events.put(("finished", token, *rest))
        with w.lock:
            lost, w.tokens = list(w.tokens - w.abandoned), set()
        if lost:
            code = w.proc.wait()
            self.events.put(("worker_exit", lost, f"the agent's worker process {exit_text(code)}"))

    # --- time-outs and shutdown -----------------------------------------------------------

    def abandon(self, token: str) -> None:
        """An episode past its time-out: cancel it (async) or leave it to end with its
        worker (:meth:`settle`)."""
        task = self._tasks.pop(token, None)
        if task is not None:
            task.cancel()
        for w in self._workers:
            if w is not None:
                with w.lock:
                    if token in w.tokens:
                        w.abandoned.add(token)

    def settle(self) -> None:
        """After a round: replace the workers that still run abandoned (hung) agents."""
        self._tasks.clear()
        for i, w in enumerate(self._workers):
            if w is not None and w.abandoned:
                with w.lock:
                    w.tokens.clear()
                retire(w)
                self._workers[i] = None

    def close(self) -> None:
        try:
            stop_workers([w for w in self._workers if w is not None])
        finally:
            if self.output is not None:  # what they printed last; the draining thread ends
                self.output.close()
        self._workers = [None] * self.num_workers
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
            self._loop, self._loop_thread = None, None


def _absolute(spec: str) -> str:
    """A file spec with its path made absolute (workers may have another working directory)."""
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        return f"{Path(module_part).expanduser().resolve()}:{attr}"
    return spec
