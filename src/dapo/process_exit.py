"""How a ``dapo`` command's process ends: soon after its work, whatever threads are left.

:func:`exit_now` runs what the process still owes (the interpreter's executor shutdown,
non-daemon threads, atexit hooks, buffered output) and then ``os._exit``, skipping the slow
teardown of torch and vLLM objects; a watchdog bounds the wait and names what it waited for.

:func:`hold_interrupts`: Ctrl-C while the command starts up. Python raises
``KeyboardInterrupt`` wherever the main thread happens to be, and during start-up that is
often inside a library: a bare ``except`` there swallowed it (the run went on and exited 0),
a lazy import turned it into an ``ImportError``, a C++ callback aborted the process. So the
interrupt is held instead and taken at the command's next safe point
(:func:`take_interrupt`); a second Ctrl-C ends the process at once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

# How long a finished command may wait for threads and exit hooks before it ends anyway.
EXIT_WAIT_S = 10.0


_held: list[int] = []  # the interrupts held since hold_interrupts()


def hold_interrupts() -> None:
    """Hold Ctrl-C (SIGINT) until :func:`take_interrupt`; a second one exits with 130 at once.
    Main thread only (elsewhere signal handlers cannot be set): a no-op there."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _hold)


def _hold(signum: int, frame: Any) -> None:
    if _held:
        os.write(2, b"dapo: interrupted\n")
        os._exit(130)
    _held.append(signum)
    os.write(2, b"dapo: Ctrl-C: stopping once start-up reaches a safe point (Ctrl-C again: now)\n")


def take_interrupt(*, resume: bool = True) -> None:
    """A safe point: raise the held ``KeyboardInterrupt``, if any. ``resume`` gives Ctrl-C its
    usual effect again from here on (else it stays held: its owner installs its own)."""
    main = threading.current_thread() is threading.main_thread()
    if resume and main and signal.getsignal(signal.SIGINT) is _hold:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _held:
        _held.clear()
        raise KeyboardInterrupt


def pop_interrupt() -> bool:
    """Whether a Ctrl-C was held, which a handler installed since now takes over."""
    held = bool(_held)
    _held.clear()
    return held


def exit_now(status: int, wait_s: float = EXIT_WAIT_S) -> NoReturn:
    """End the process with ``status`` once what it still owes is done, within ``wait_s``.

    First the hooks the interpreter itself runs before joining threads (``concurrent.futures``
    registers its executors' shutdown there: without them an executor nobody shut down, ours
    or a library's, keeps its worker threads waiting for work for ever), then the non-daemon
    threads, the atexit functions and the buffered output. Past ``wait_s`` the process ends
    anyway, with one line naming the threads still alive: the run's files are written by
    then. The interpreter's own teardown of torch, transformers and vLLM objects is skipped:
    it only costs time (2 to 12 s a process on a 2-core CPU, measured)."""
    watchdog = threading.Thread(
        target=_exit_when_overdue, args=(status, wait_s), name="dapo-exit-watchdog", daemon=True
    )
    watchdog.start()
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        with contextlib.suppress(Exception):
            hook()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    _flush_and_exit(status)


def _exit_when_overdue(status: int, wait_s: float) -> None:
    """The exit's bound: after ``wait_s`` say what is still running, then end the process."""
    time.sleep(wait_s)
    frames = sys._current_frames()
    alive = [
        t
        for t in threading.enumerate()
        if t is not threading.current_thread() and not t.daemon and t.is_alive()
    ]
    where = ", ".join(f"{t.name!r} ({_where(frames.get(t.ident or -1))})" for t in alive)
    print(
        f"dapo: the command finished but its exit waited {wait_s:.0f} s for "
        f"{where or 'exit hooks'}; exiting anyway (status {status}; its files are written)",
        file=sys.stderr,
    )
    _flush_and_exit(status)


def _where(frame: Any) -> str:
    """``function at file:line`` of a thread's innermost frame."""
    if frame is None:
        return "no frame"
    code = frame.f_code
    return f"{code.co_name} at {Path(code.co_filename).name}:{frame.f_lineno}"


def _flush_and_exit(status: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
