"""The harness: runs one program on its tests inside the sandbox (standard library only).

:mod:`dapo.rewards.sandbox` starts a fresh interpreter (``python -I -S -B -c`` this file's
text) inside bubblewrap and writes one JSON request to its stdin: the program, the tests'
inputs (never their expected outputs: the comparison happens outside, so a program that
reads the harness's memory learns nothing it could forge), the limits and, when the
trainer runs as root, the user id to drop to. It answers one JSON line per event on
stdout: ``{"compile": "ok"}`` or ``{"compile": "error", ...}``, then one line per test
with its status (``ok``, ``error``, ``timeout``, ``output_limit``), what the program
printed and, for function-call tests, the JSON of the returned value.

Each test runs in a forked child (the program compiled once, a fresh ``__main__`` per
test) with its own CPU limit; the harness enforces the wall limit and the output cap, and
after each test kills every process of the sandbox's user but itself (``kill(-1)``), so a
daemon a test left behind cannot touch the next one.
"""

import builtins
import contextlib
import json
import math
import os
import resource
import selectors
import signal
import sys
import time

_ERR_BYTES = 2000  # the end of a failing test's stderr kept for the report


def _limits(req):
    """Lower (hard and soft) the limits every process of the sandbox inherits."""
    mb = 1 << 20
    for kind, value in (
        (resource.RLIMIT_NPROC, req["max_processes"] + 1),  # +1: the harness itself
        (resource.RLIMIT_FSIZE, req["max_file_mb"] * mb),
        (resource.RLIMIT_NOFILE, req["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))


def _drop_privileges(uid):
    """Become ``uid`` (root outside only): every capability goes with the change of user,
    and the process stops being dumpable (no /proc/<harness>/fd or ptrace for the tests)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _not_dumpable():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def _child(code, test, req, fds):
    """In the forked child: wire the pipes, limit CPU and memory, run the program."""
    in_r, out_w, err_w, res_w = fds
    if not req["isolated"]:
        os.setpgid(0, 0)  # unisolated: the test's processes are its group, killed as one
    os.dup2(in_r, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, res_w)
    os.closerange(res_w + 1, 65536)
    cpu = int(math.ceil(req["test_timeout_s"])) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    memory = req["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    # the program's own streams on the test's pipes, for its life (closed by os._exit)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    builtins.exit = builtins.quit = sys.exit
    status = 0
    functional = "fn" in test
    scope = {"__name__": "solution" if functional else "__main__", "__builtins__": builtins}
    try:
        exec(code, scope)
        if functional:
            value = _function(scope, test["fn"])(*test["args"])
            os.write(res_w, json.dumps(value, default=repr).encode())
    except SystemExit as e:
        status = 0 if e.code in (None, 0) and not functional else 1
    except BaseException as e:  # the program's own failure: reported, never raised
        print(f"{type(e).__name__}: {e}"[:_ERR_BYTES], file=sys.stderr)
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = 1
    os._exit(status)


def _function(scope, name):
    """The function a functional test calls: a top-level one, else a method of ``Solution``
    (LeetCode's form)."""
    fn = scope.get(name)
    if callable(fn):
        return fn
    solution = scope.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    raise NameError(f"the program defines no function {name!r}")


def _run_test(code, test, req):
    """Fork a child for one test; collect its output within the wall and output limits."""
    pipes = [os.pipe() for _ in range(4)]
    pid = os.fork()
    if pid == 0:
        try:
            _child(code, test, req, (pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]))
        finally:
            os._exit(1)
    os.close(pipes[0][0])
    for _r, w in pipes[1:]:
        os.close(w)
    writer, data = pipes[0][1], test.get("stdin", "").encode()
    os.set_blocking(writer, False)
    sel = selectors.DefaultSelector()
    chunks = {pipes[1][0]: [], pipes[2][0]: [], pipes[3][0]: []}
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    if data:
        sel.register(writer, selectors.EVENT_WRITE)
    else:
        os.close(writer)
    limit, size, status, code_ = req["max_output_bytes"], 0, None, None
    deadline = time.monotonic() + req["test_timeout_s"]
    while sel.get_map() and status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        events = sel.select(min(left, 0.02))
        if not events and code_ is not None:
            break  # it ended and printed nothing more: a daemon may hold the pipes open
        for key, _ in events:
            fd = key.fd
            if fd == writer:
                try:
                    data = data[os.write(fd, data[:65536]) :]
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(fd)
                    os.close(fd)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                sel.unregister(fd)
                continue
            chunks[fd].append(chunk)
            size += len(chunk)
            if size > limit:
                status = "output_limit"
                break
        if code_ is None:
            code_ = _reap(pid, 0)
    if code_ is None and status is None:
        code_ = _reap(pid, deadline)
        status = None if code_ is not None else "timeout"
    try:
        if req["isolated"]:  # the test's processes, daemons included; not the harness
            os.kill(-1, signal.SIGKILL)
        else:  # never kill(-1) outside a sandbox: that is every process of the user
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left
        pass
    if code_ is None:
        code_ = _reap(pid, time.monotonic() + 1.0)
    for fd in [*chunks, writer]:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
    out, err, res = (b"".join(chunks[p[0]]) for p in pipes[1:])
    if status is None:
        status = "ok" if code_ == 0 else "error"
    if status == "error" and code_ is not None and code_ < 0 and -code_ in _CPU_SIGNALS:
        status = "timeout"
    return {
        "status": status,
        "out": out[:limit].decode("utf-8", "replace"),
        "value": res[:limit].decode("utf-8", "replace") if res else None,
        "err": err[-_ERR_BYTES:].decode("utf-8", "replace"),
    }


_CPU_SIGNALS = (signal.SIGXCPU, signal.SIGKILL)


def _reap(pid, deadline):
    """The child's exit code (negative: killed by that signal), or None at the deadline."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


def _send(obj):
    os.write(1, (json.dumps(obj) + "\n").encode())


def main():
    req = json.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _limits(req)
    if req.get("uid") is not None:
        _drop_privileges(req["uid"])
    _not_dumpable()
    try:
        code = compile(req["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as e:
        _send({"compile": "error", "detail": f"{type(e).__name__}: {e}"[:_ERR_BYTES]})
        return
    _send({"compile": "ok"})
    for i, test in enumerate(req["tests"]):
        _send({"i": i, **_run_test(code, test, req)})


if __name__ == "__main__":
    main()
