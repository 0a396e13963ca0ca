"""The sandbox: run a model's program on test inputs where it can reach nothing of ours.

Each program runs in its own bubblewrap (``bwrap``) sandbox, started fresh for it and torn
down with it:

- **namespaces**: its own PID namespace (it sees only its own processes: not the trainer,
  not the other programs), network namespace (no interface but its own loopback: nothing
  of the host's, not even 127.0.0.1), IPC and UTS namespaces, and a mount namespace whose
  root is read-only: the interpreter's directories bound read-only, ``/proc`` of its own
  PID namespace, a minimal ``/dev``, and one writable directory, ``/tmp``, a private
  size-limited tmpfs that vanishes with the sandbox. No home, no project, no run directory.
- **environment**: empty (``--clearenv``): no API key or token of the trainer's.
- **user**: run by root, the harness drops to a user of its own (one per concurrent
  sandbox, :func:`sandbox_uid`), losing every capability; run by another user, bwrap maps
  that user in a user namespace of its own with every capability dropped and no nested
  user namespace (``--disable-userns``).
- **limits** (rlimits, lowered in the sandbox, which cannot raise them again): processes
  and threads, address space, CPU time per test, file size, open files; the harness adds
  the wall time per test and the output cap (:mod:`dapo.rewards.harness`), and this module
  the wall time of the whole program. At any limit every process of the sandbox dies: the
  harness kills its user's processes after each test, and killing bwrap takes down its PID
  namespace, daemons included (``--die-with-parent``, which also covers a scoring worker
  that dies).

Why bubblewrap: it is the maintained, audited set-up of these kernel mechanisms (Flatpak's
sandbox), a 50 KB C program that starts in about a millisecond, packaged by every Linux
distribution; doing the same from Python (ctypes ``unshare``, mounts, ``pivot_root``)
would be more code of ours to get right, and slower to start.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo.rewards import harness

_HARNESS = Path(harness.__file__).read_text(encoding="utf-8")
_UID_BASE = 1_000_000  # the users sandboxes run as, when the trainer runs as root
_UID_SLOTS = 4096
_uid_counter = itertools.count()
_uid_lock = threading.Lock()


class SandboxUnavailable(RuntimeError):
    """Programs cannot be isolated here (no bwrap, no namespaces): the scorer refuses."""


@dataclass(frozen=True)
class Limits:
    """What one program may use (the ``reward.code`` settings of the same names)."""

    test_timeout_s: float = 2.0
    program_timeout_s: float = 4.0
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20


@dataclass
class TestRun:
    """How one test ran: ``status`` (``ok``, ``error``, ``timeout``, ``output_limit``, or
    ``not_run`` when the program's time ran out first), what it printed, the JSON of a
    function's return value, and the end of its stderr."""

    status: str
    out: str = ""
    value: str | None = None
    err: str = ""


@dataclass
class ProgramRun:
    """How a program ran: ``compile_error`` (then no test ran) and one :class:`TestRun` per
    test, in order."""

    compile_error: str | None = None
    tests: list[TestRun] = field(default_factory=list)


def sandbox_uid() -> int:
    """A user id for the next sandbox (root only): unique among this process's concurrent
    sandboxes and, by the process id, almost surely among other processes', so that each
    sandbox's process limit counts its own processes only."""
    with _uid_lock:
        slot = next(_uid_counter) % 16
    return _UID_BASE + (os.getpid() % (_UID_SLOTS // 16)) * 16 + slot


def _ro_system_paths() -> list[str]:
    """bwrap arguments that show the interpreter and its libraries, read-only."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(top), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    for extra in (sys.base_prefix, str(Path(os.path.realpath(sys.executable)).parent.parent)):
        if not extra.startswith(("/usr/", "/bin/", "/lib")) and extra != "/usr":
            # bwrap gives the directories it makes on the way the modes of the host's
            # (/root: 0700), which the sandbox's user could not cross
            for parent in reversed(Path(extra).parents[:-1]):
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", extra, extra]
    if Path("/etc/ld.so.cache").exists():
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


@functools.lru_cache(maxsize=1)
def bwrap_path() -> str | None:
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )


def command(limits: Limits) -> list[str]:
    """The bwrap command line that runs the harness in a fresh sandbox."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable("bwrap (bubblewrap) is not installed")
    args = [
        bwrap,
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    if os.geteuid() != 0:
        args += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    args += _ro_system_paths()
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", str(limits.max_file_mb << 20), "--tmpfs", "/tmp"]
    args += ["--chdir", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/"]
    args += [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _HARNESS]
    return args


def unisolated_command() -> list[str]:
    """``reward.code.sandbox=none``: the harness as a plain subprocess (limits only)."""
    return [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _HARNESS]


@functools.lru_cache(maxsize=1)
def isolation_problem() -> str | None:
    """Why programs cannot be isolated here, or None when a trial sandbox works."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    try:
        args = command(Limits())
    except SandboxUnavailable as e:
        return str(e)
    probe = [*args[: args.index("-c") + 1], "print(1)"]
    try:
        done = subprocess.run(probe, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"a trial sandbox failed: {e}"
    if done.returncode != 0 or done.stdout.strip() != b"1":
        said = done.stderr.decode(errors="replace").strip()[-300:]
        return f"a trial sandbox failed ({said or f'exit status {done.returncode}'})"
    return None


def run_program(
    program: str, tests: list[dict[str, Any]], limits: Limits, *, isolated: bool = True
) -> ProgramRun:
    """Run ``program`` on ``tests`` (``{"stdin": text}`` or ``{"fn": name, "args": [...]}``)
    in a fresh sandbox (``isolated=False``: a plain subprocess with the same limits, for
    ``reward.code.sandbox=none``). Never raises for anything the program does; a test not
    reached within ``limits.program_timeout_s`` is ``not_run``."""
    return _collect(start_program(program, tests, limits, isolated=isolated))


@dataclass
class _Started:
    proc: subprocess.Popen[bytes]
    ntests: int
    deadline: float
    stop_on_failure: bool = False
    workdir: str | None = None  # the unisolated program's working directory, removed after


def start_program(
    program: str,
    tests: list[dict[str, Any]],
    limits: Limits,
    *,
    isolated: bool = True,
    stop_on_failure: bool = False,
) -> _Started:
    """Start a sandbox on ``program`` without waiting (:func:`collect` waits), so that a
    step's programs run side by side."""
    if isolated and isolation_problem() is not None:
        raise SandboxUnavailable(isolation_problem())
    uid = sandbox_uid() if isolated and os.geteuid() == 0 else None
    request = {
        "program": program,
        "tests": tests,
        "uid": uid,
        "isolated": isolated,
        **{k: getattr(limits, k) for k in Limits.__dataclass_fields__},
    }
    args = command(limits) if isolated else unisolated_command()
    workdir = None if isolated else tempfile.mkdtemp(prefix="dapo-code-")
    proc = subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={},
        cwd=workdir or "/",
        start_new_session=True,
        close_fds=True,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(request).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.program_timeout_s
    return _Started(proc, len(tests), deadline, stop_on_failure, workdir)


def collect(started: list[_Started]) -> list[ProgramRun]:
    """Wait for started programs, each until its results are in or its deadline passes
    (then its sandbox is killed, whatever it started with it)."""
    runs = [ProgramRun() for _ in started]
    buffers = [b"" for _ in started]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(started):
        assert s.proc.stdout is not None
        os.set_blocking(s.proc.stdout.fileno(), False)
        sel.register(s.proc.stdout, selectors.EVENT_READ, i)
    try:
        while sel.get_map():
            now = time.monotonic()
            for key in list(sel.get_map().values()):
                if started[key.data].deadline <= now:
                    sel.unregister(key.fileobj)
            if not sel.get_map():
                break
            left = min(started[k.data].deadline for k in sel.get_map().values()) - now
            for key, _ in sel.select(max(0.0, left)):
                i = key.data
                chunk = os.read(key.fd, 1 << 16)
                done = not chunk
                buffers[i] += chunk
                *lines, buffers[i] = buffers[i].split(b"\n")
                for line in lines:
                    done |= _take(runs[i], line, started[i])
                if done:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        for s in started:
            _kill(s.proc)
            if s.workdir is not None:
                shutil.rmtree(s.workdir, ignore_errors=True)
    for run, s in zip(runs, started, strict=True):
        if run.compile_error is None:
            run.tests += [TestRun("not_run")] * (s.ntests - len(run.tests))
    return runs


def _take(run: ProgramRun, line: bytes, started: _Started) -> bool:
    """Record one line of the harness; True when nothing more is needed from it."""
    try:
        msg = json.loads(line)
    except ValueError:
        return False
    if "compile" in msg:
        if msg["compile"] != "ok":
            run.compile_error = str(msg.get("detail", "SyntaxError"))
            return True
        return False
    test = TestRun(str(msg["status"]), str(msg["out"]), msg.get("value"), str(msg["err"]))
    run.tests.append(test)
    return len(run.tests) >= started.ntests or (started.stop_on_failure and test.status != "ok")


def _collect(started: _Started) -> ProgramRun:
    return collect([started])[0]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill bwrap's session (its PID namespace goes with it) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a process the kernel will not reap
        proc.wait(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()
