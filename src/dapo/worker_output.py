"""What worker processes print: :class:`OutputCapture` drains each worker's stdout and
stderr (one pipe per worker, :func:`dapo.workers.start_worker`) on a daemon thread of its
pool and keeps it in a file of the run (:data:`USER_OUTPUT_FILE`), at most a limit per worker
and rollout step; the rest is counted and dropped. Nothing reaches the trainer's console.

The pools own their capture (:class:`~dapo.rewards.pool.WorkerPool`,
:class:`~dapo.environments.pool.EnvironmentPool`): it starts with the pool and its thread
ends in the pool's ``close``. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path

USER_OUTPUT_FILE = "user_output.log"  # in the run's output directory
DEFAULT_OUTPUT_LIMIT = 64 * 1024  # bytes kept per worker and rollout step (logging.user_output_kb)
_MEMORY_KEPT = 1 << 20  # what a capture without a file keeps: the last MiB
_LAST_WORDS = 2000  # the end of each worker's output, kept for messages (a start-up traceback)
_READ_SIZE = 1 << 16
_STOP_GRACE_S = 1.0  # close(): how long to wait for the workers' pipes to end


@dataclass(frozen=True)
class UserOutput:
    """Where a pool's workers' stdout and stderr go: appended to the file ``path`` (None:
    kept in memory, the last MiB), at most ``limit`` bytes per worker and step (the rest
    counted and dropped). ``label`` prefixes the workers' names in the file (a rank)."""

    path: Path | None = None
    limit: int = DEFAULT_OUTPUT_LIMIT
    label: str = ""

    @classmethod
    def of_run(cls, output_dir: str | Path, limit_kb: int, label: str = "") -> UserOutput:
        """The run's file in ``output_dir``, ``limit_kb`` KiB per worker and step."""
        return cls(Path(output_dir) / USER_OUTPUT_FILE, int(limit_kb) * 1024, label)


@dataclass(eq=False)
class _Source:
    """One worker's output pipe and its counts in the current step."""

    name: str
    fd: int | None  # None once the pipe has ended
    kept: int = 0
    dropped: int = 0
    last: bytes = b""


class _Sink:
    """Where kept output goes: a header ``==> TAG <==`` on its own line whenever the writer
    or the step changes."""

    def __init__(self) -> None:
        self.tag: str | None = None
        self.at_line_start = True

    def frame(self, tag: str, data: bytes, own_line: bool) -> bytes:
        head = b""
        if tag != self.tag or (own_line and not self.at_line_start):
            head = b"" if self.at_line_start else b"\n"
        if tag != self.tag:
            head += f"==> {tag} <==\n".encode()
            self.tag = tag
        self.at_line_start = data.endswith(b"\n")
        return head + data


class _FileSink(_Sink):
    """The run's file, shared by the pools that write to it."""

    _open: dict[Path, _FileSink] = {}
    _registry_lock = threading.Lock()

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path, self.users = path, 0
        self.lock = threading.Lock()
        self.fd: int | None = None

    @classmethod
    def acquire(cls, path: Path) -> _FileSink:
        with cls._registry_lock:
            sink = cls._open.get(path)
            if sink is None:
                sink = cls._open[path] = cls(path)
            sink.users += 1
            return sink

    def release(self) -> None:
        with self._registry_lock:
            self.users -= 1
            if self.users == 0:
                del self._open[self.path]
                with self.lock:
                    if self.fd is not None:
                        os.close(self.fd)
                        self.fd = None

    def write(self, tag: str, data: bytes, own_line: bool = False) -> None:
        with self.lock:
            if self.fd is None:  # created at the first output, subject to the umask
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
            view = memoryview(self.frame(tag, data, own_line))
            while view:
                view = view[os.write(self.fd, view) :]


class _MemorySink(_Sink):
    """Without a file: the last MiB, for :meth:`OutputCapture.text`."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, tag: str, data: bytes, own_line: bool = False) -> None:
        self.data += self.frame(tag, data, own_line)
        del self.data[:-_MEMORY_KEPT]

    def release(self) -> None:
        pass


class OutputCapture:
    """What a pool's worker processes print (their stdout and stderr, file descriptors 1 and
    2, through one pipe each), drained continuously by one daemon thread so that a worker
    never blocks on a full pipe, and written as ``settings`` (:class:`UserOutput`) says: at
    most ``settings.limit`` bytes per worker and step (:meth:`new_step`), each stretch under
    a header ``==> reward worker 1234, rollout step 3 <==``; what is over the limit is
    counted (:attr:`dropped`, and a line at the step's end) and dropped.

    ``kind`` names the workers (``reward worker``). :meth:`close` (the owning pool's) reads
    what the stopped workers left and ends the thread. Code that runs in the trainer's own
    process (``reward.num_workers=0``, ``rollout.env_workers=0``, a callable that cannot be
    pickled) is not captured: its output goes where the trainer's goes.
    """

    def __init__(self, kind: str, settings: UserOutput | None = None) -> None:
        settings = settings or UserOutput()
        if settings.limit < 0:
            raise ValueError(f"the output limit must be >= 0 bytes, got {settings.limit}")
        self.kind = f"{settings.label}{kind}"
        self.path, self.limit = settings.path, settings.limit
        self.step = "start-up"
        self.dropped = 0  # bytes dropped over the capture's life
        self._sink: _FileSink | _MemorySink | None = None
        self._sources: dict[int, _Source] = {}  # by worker pid
        self._lock = threading.Lock()
        self._stop_at: float | None = None
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(
            target=self._drain, name=f"dapo-output-{kind.replace(' ', '-')}", daemon=True
        )
        self._thread.start()

    def add(self, fd: int, pid: int) -> None:
        """Drain ``fd``, the read end of worker ``pid``'s output pipe (this capture closes it)."""
        os.set_blocking(fd, False)
        with self._lock:
            if self._closed:
                os.close(fd)
                return
            self._sources[pid] = _Source(f"{self.kind} {pid}", fd)
        self._wake()

    def new_step(self, step: str) -> None:
        """Output from here on belongs to ``step`` (``rollout step 3``), with a new limit per
        worker; the step before gets its line of bytes dropped."""
        with self._lock:
            self._read_ready()
            self._end_step()
            self.step = step

    def sync(self) -> None:
        """Take in what the workers have written so far (a worker flushes before it sends a
        result, so after the result all it printed is counted)."""
        with self._lock:
            self._read_ready()

    def last_words(self, pid: int) -> str:
        """The end of what worker ``pid`` printed (for a message about its death), or ''."""
        with self._lock:
            self._read_ready()
            source = self._sources.get(pid)
            return source.last.decode(errors="replace") if source is not None else ""

    def text(self) -> str:
        """What was kept, when there is no file (for tests and messages); else ''."""
        with self._lock:
            sink = self._sink
            return sink.data.decode(errors="replace") if isinstance(sink, _MemorySink) else ""

    def close(self) -> None:
        """Read what the (stopped) workers left, until their pipes end or a short grace has
        passed, then stop the thread, write the last step's line and close the pipes
        (idempotent)."""
        with self._lock:
            if self._stop_at is not None:  # closed, or being closed by another thread
                return
            self._stop_at = time.monotonic() + _STOP_GRACE_S
        self._wake()
        self._thread.join(_STOP_GRACE_S + 2.0)
        with self._lock:
            self._closed = True
            if not self._thread.is_alive():
                self._read_ready()
            self._end_step()
            for source in self._sources.values():
                if source.fd is not None and not self._thread.is_alive():
                    os.close(source.fd)
                    source.fd = None
            self._sources.clear()
            if self._sink is not None:
                self._sink.release()
                self._sink = None
            if not self._thread.is_alive():
                os.close(self._wake_r)
                os.close(self._wake_w)

    # -- the drain thread and its helpers (called with the lock held) ----------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: it is awake already; closed: it is over
            os.write(self._wake_w, b"x")

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._stop_at is not None and (
                    time.monotonic() >= self._stop_at
                    or all(s.fd is None for s in self._sources.values())
                ):
                    return
                fds = [s.fd for s in self._sources.values() if s.fd is not None]
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            events = poller.poll(200 if self._stop_at is not None else 1000)
            with self._lock:
                if any(fd == self._wake_r for fd, _ in events):
                    with contextlib.suppress(OSError):
                        while os.read(self._wake_r, 4096):
                            pass
                ready = {fd for fd, _ in events}
                for source in list(self._sources.values()):
                    if source.fd is not None and source.fd in ready:
                        self._read(source, _READ_SIZE * 16)

    def _read_ready(self) -> None:
        """Read every pipe until it has nothing more now."""
        for source in list(self._sources.values()):
            self._read(source, None)

    def _read(self, source: _Source, budget: int | None) -> None:
        """Read ``source`` until it has nothing now, or ``budget`` bytes (a worker that
        prints without pause does not hold the lock forever)."""
        taken = 0
        while source.fd is not None and (budget is None or taken < budget):
            try:
                data = os.read(source.fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the worker exited (and whatever it started)
                os.close(source.fd)
                source.fd = None
                return
            taken += len(data)
            self._take(source, data)

    def _take(self, source: _Source, data: bytes) -> None:
        source.last = (source.last + data)[-_LAST_WORDS:]
        keep = data[: max(0, self.limit - source.kept)]
        if keep and not self._write(source, keep):
            keep = b""
        source.kept += len(keep)
        over = len(data) - len(keep)
        source.dropped += over
        self.dropped += over

    def _write(self, source: _Source, data: bytes, own_line: bool = False) -> bool:
        """Write under ``source``'s header; False where the file cannot be written (a full
        disk): the bytes then count as dropped, and draining goes on."""
        try:
            if self._sink is None:
                self._sink = _FileSink.acquire(self.path) if self.path else _MemorySink()
            self._sink.write(f"{source.name}, {self.step}", data, own_line)
        except OSError:
            return False
        return True

    def _end_step(self) -> None:
        """The step's line of bytes dropped per worker; the counts start again."""
        for pid, source in list(self._sources.items()):
            if source.dropped:
                self._write(
                    source,
                    f"[{source.dropped} more bytes dropped: over the {self.limit} bytes kept "
                    "per worker and step, logging.user_output_kb]\n".encode(),
                    own_line=True,
                )
            source.kept = source.dropped = 0
            if source.fd is None:
                del self._sources[pid]
