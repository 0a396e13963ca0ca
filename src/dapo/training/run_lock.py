"""One writer per run directory.

A run takes an exclusive ``flock`` on ``OUTPUT_DIR/.dapo-lock`` before it writes anything
there and holds it until it ends; the operating system releases it when the process dies,
however it dies. The file holds the holder's host, process id and start time, so that a
second run on the same directory (``resume=true`` included) is refused in one line naming
the holder, and a lock file left by a process that has died is taken over with a notice (a run that ends releases the lock and empties the file).

On a local file system the lock is exact. On NFS (v4, or v3 with its lock manager) Linux
turns ``flock`` into a POSIX lock that the server keeps, so runs on two hosts exclude each
other too; a host that dies holds it until the server's lease expires (NFSv4: 90 s by
default) or, on NFSv3, until that host restarts or an administrator clears it. On
file systems without locking (some FUSE mounts, NFS mounted ``nolock``) ``flock`` fails or
succeeds everywhere: the former is said in a warning and the run goes on unguarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dapo.errors import TrainingError
from dapo.parallel import distributed as D

LOCK_FILE = ".dapo-lock"


class RunLock:
    """The held lock of one run directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd
        self._finalizer = weakref.finalize(self, _close, fd)

    @classmethod
    def acquire(cls, out: Path, log: Callable[[str], None] = print) -> RunLock:
        """Lock ``out`` for this process, or raise :class:`TrainingError` naming its holder."""
        path = out / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise TrainingError(
                f"`output_dir` = {str(out)!r}: cannot open its lock file {path} ({exc.strerror})"
                "; choose a writable directory"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if _same_process(holder):  # a Trainer built here and not run or closed
                    raise TrainingError(
                        f"`output_dir` = {str(out)!r} is in use by another Trainer of this "
                        "process, built and not run or closed: call its close() (run() closes "
                        "it too), or choose another output_dir"
                    ) from exc
                raise TrainingError(
                    f"`output_dir` = {str(out)!r} is in use by another run ({_describe(holder)})"
                    ": one run writes to a directory at a time. Wait for it to end or stop it, "
                    "then resume with resume=true; or choose another output_dir"
                ) from exc
            warnings.warn(
                f"`output_dir` = {str(out)!r} cannot be locked on this file system "
                f"({exc.strerror}): nothing stops a second run from writing there at the "
                "same time; make sure only one does",
                UserWarning,
                stacklevel=2,
            )
            return cls(path, None)
        previous = _read(fd)
        if previous.get("pid") and not _same_process(previous):
            log(
                f"took over the lock of {path}, left by a run that has ended ({_describe(previous)})"
            )
        _write(fd, {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()})
        return cls(path, fd)

    @property
    def held(self) -> bool:
        """Whether this process holds an operating-system lock (False where none can be had)."""
        return self._fd is not None and self._finalizer.alive

    def release(self) -> None:
        """Free the directory for the next run (idempotent). The file stays, empty."""
        self._finalizer()


def _close(fd: int | None) -> None:
    """Empty the file (a holder found there later died without releasing it), then close."""
    if fd is not None:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the last descriptor of the open file releases the flock


def lock_run_dir(out: Path, is_main: bool, log: Callable[[str], None]) -> RunLock | None:
    """Rank 0 locks ``out`` for the whole job (the ranks share it); every rank raises the
    same error when it is held elsewhere. The lock (rank 0), or None."""
    lock, error = None, None
    if is_main:
        try:
            lock = RunLock.acquire(out, log)
        except TrainingError as exc:
            error = str(exc)
    if D.current().enabled:
        error = D.all_gather_objects(error)[0]
    if error is not None:
        raise TrainingError(error)
    return lock


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _write(fd: int, holder: dict[str, Any]) -> None:
    data = (json.dumps(holder) + "\n").encode("utf-8")
    with contextlib.suppress(OSError):  # the lock holds without the description
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _same_process(holder: dict[str, Any]) -> bool:
    return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %z")
