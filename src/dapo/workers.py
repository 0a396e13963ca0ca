"""What the reward and environment worker pools share: starting, stopping and describing
their worker processes, and loading and describing the user code those run.

:mod:`dapo.rewards.pool` and :mod:`dapo.environments.pool` each keep worker processes,
fresh interpreters that run user code. Workers import this module: it imports the standard
library only (workers import neither torch nor the trainer).

What workers print (user code's ``print``, warnings, tracebacks; file descriptors 1 and 2)
goes to a pipe per worker that the pool's :class:`~dapo.worker_output.OutputCapture` drains:
into a file of the run, at most a limit per worker and rollout step, the rest counted and
dropped, never into the trainer's console. A worker dies with the trainer (SIGKILL, via
``PR_SET_PDEATHSIG`` on Linux), even while user code runs in it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from dapo.worker_output import OutputCapture

# What a fresh interpreter runs to become a worker. argv: the pipe's file descriptor, the
# trainer's process id, the entry point ("module:function", called with the pipe and the
# further arguments as ints). On Linux it first asks the kernel for SIGKILL when the
# trainer dies (PR_SET_PDEATHSIG = 1), then checks that the trainer did not die before
# that. A Ctrl-C, SIGTERM or early-warning signal (checkpoint.stop_signals) sent to the
# whole process group or job leaves it to the trainer, which finishes (or abandons) the step
# and stops its workers itself; the kernel kills it with the trainer. It takes the parent's
# sys.path first, so that it imports what the parent imports. Its stdout is line-buffered: what a worker printed before a kill is in the capture.
_BOOT = (
    "import os, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    try:\n"
    "        import ctypes\n"
    "        ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "    except Exception:\n"
    "        pass\n"
    "if os.getppid() != int(sys.argv[2]):\n"  # the trainer is already gone
    "    os._exit(0)\n"
    "if sys.platform.startswith('linux'):\n"  # the trainer stops its workers on these
    "    import signal\n"
    "    for name in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGUSR1', 'SIGUSR2'):\n"
    "        signal.signal(getattr(signal, name), signal.SIG_IGN)\n"
    "for stream in (sys.stdout, sys.stderr):\n"
    "    try:\n"
    "        stream.reconfigure(line_buffering=True)\n"
    "    except Exception:\n"
    "        pass\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "try:\n"
    "    sys.path[:] = conn.recv()\n"
    "except EOFError:\n"  # the pool was closed before this worker started
    "    sys.exit(0)\n"
    "import importlib\n"
    "module, _, function = sys.argv[3].partition(':')\n"
    "getattr(importlib.import_module(module), function)(conn, *map(int, sys.argv[4:]))\n"
)


class WorkerProcess(Protocol):
    """A pool's handle of one worker: the process and the parent's end of its pipe."""

    proc: subprocess.Popen[bytes]
    conn: Connection


W = TypeVar("W", bound=WorkerProcess)


def start_worker(
    entry: Callable[..., None], *fds: int, output: OutputCapture | None = None
) -> tuple[subprocess.Popen[bytes], Connection]:
    """A fresh interpreter that takes this process's ``sys.path``, then calls ``entry`` (a
    module-level function) with its end of a pipe and ``fds``, file descriptors it inherits.
    Its stdout and stderr go to ``output`` (without one: this process's). Returns the
    process and this end of the pipe.

    On Linux the worker is killed when the thread that started it ends (the kernel's
    parent-death signal follows the creating thread, not the process): start workers
    from a thread that outlives them, such as the main thread or the rollout producer."""
    parent_conn, child_conn = Pipe(duplex=True)
    target = f"{entry.__module__}:{entry.__qualname__}"
    out_r = out_w = None
    if output is not None:
        out_r, out_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOT,
                str(child_conn.fileno()),
                str(os.getpid()),
                target,
                *map(str, fds),
            ],
            pass_fds=(child_conn.fileno(), *fds),
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
        )
    except BaseException:
        parent_conn.close()
        if out_r is not None:
            os.close(out_r)
        raise
    finally:
        child_conn.close()
        if out_w is not None:
            os.close(out_w)
    if output is not None and out_r is not None:
        output.add(out_r, proc.pid)
    parent_conn.send(list(sys.path))
    return proc, parent_conn


def flush_output() -> None:
    """Flush this worker's stdout and stderr (after each call of user code, before its
    result is sent: the parent then holds all the call printed,
    :meth:`~dapo.worker_output.OutputCapture.sync`)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def retire(worker: WorkerProcess) -> int | None:
    """Kill the worker if it still runs, reap it and close its pipe; its exit code."""
    if worker.proc.poll() is None:
        worker.proc.kill()
    code = worker.proc.wait()
    worker.conn.close()
    return code


def stop_workers(workers: list[W]) -> None:
    """Ask every worker to exit (EOF on its pipe), reap it, killing those still running
    after 2 s, and empty ``workers``."""
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
    workers.clear()


def exit_text(code: int | None) -> str:
    """How a process ended, for messages: ``was killed by SIGKILL``, ``exited with code 3``."""
    if code is not None and code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def describe_exception(exc: BaseException, limit: int) -> str:
    """``Type: message (at file:line in function)`` of the innermost frame, where ``exc``
    was raised, at most ``limit`` characters: what a message says of user code's error."""
    text = f"{type(exc).__name__}: {exc}"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        text += f" (at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"
    return text[:limit]


class NotPythonError(ImportError):
    """:func:`import_file` was given a file that no importer loads."""


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module of the Python file at ``path`` (absolute, existing), imported once under
    a name of its own: ``prefix``, the file's stem and a hash of its path, so that two files
    of one name do not collide and loading a file again returns its module.

    Raises :class:`NotPythonError` for a file that is not Python, and whatever running the
    file raises (the half-run module is then forgotten)."""
    stem = re.sub(r"\W", "_", path.stem)
    name = f"{prefix}{stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise NotPythonError(f"cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
