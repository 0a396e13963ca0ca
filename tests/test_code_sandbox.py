"""The code scorer's sandbox under attack: programs that try to get out, each contained.

Every attack is a program that prints ``ESCAPED`` when it gets what it wants, judged
against a test expecting ``ESCAPED``: it must score -1. After each test no process of this
process's sandboxes is left (:func:`_sandbox_processes`) and no file exists where the
attacks try to write (:data:`_TARGETS`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from dapo.rewards import sandbox
from dapo.rewards.code import code_reward
from dapo.rewards.sandbox import Limits, isolation_problem, run_program

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces"
)

FAST = {"test_timeout_s": 1.0, "program_timeout_s": 3.0}
_MARK = f"dapo-escape-{os.getpid()}"
_TARGETS = [Path("/dev/shm") / _MARK, Path.home() / _MARK, Path.cwd() / _MARK, Path("/tmp") / _MARK]


def _sandbox_processes() -> list[int]:
    """Live processes of this process's sandbox users (:func:`sandbox.sandbox_uid`'s range)."""
    base = sandbox._UID_BASE + (os.getpid() % (sandbox._UID_SLOTS // 16)) * 16
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if base <= uid < base + 16:
            found.append(int(entry.name))
    return found


def _children() -> list[int]:
    """This process's live children (a bwrap left running would be one)."""
    me, found = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me and fields[0] != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def contained(tmp_path):
    """Each attack leaves no process and no file outside its sandbox."""
    problem = isolation_problem()
    assert problem is None, f"no sandbox here ({problem}); `make setup` installs bubblewrap"
    # What lives before the test (an earlier test's worker pools in this pytest process)
    # is not the test's.
    before = set(_sandbox_processes()), set(_children())
    yield tmp_path

    def new() -> tuple[set[int], set[int]]:
        return set(_sandbox_processes()) - before[0], set(_children()) - before[1]

    deadline = time.monotonic() + 3
    while any(new()) and time.monotonic() < deadline:
        time.sleep(0.05)
    sandboxed, children = new()
    assert not sandboxed, "a sandboxed process outlived its program"
    assert not children, "a sandbox (bwrap) outlived its program"
    left = [str(p) for p in [*_TARGETS, tmp_path / _MARK] if p.exists()]
    for p in left:
        p.unlink()
    assert left == [], f"a program wrote outside its directory: {left}"


def _home_entries() -> list[str]:
    """The home directory's entries, but the one the interpreter lives under."""
    home = Path.home()
    mine = {Path(sys.base_prefix), Path(os.path.realpath(sys.executable))}
    keep = [p for p in home.iterdir() if not any(p in m.parents for m in mine)]
    assert keep, "the home directory has nothing to hide: the test would prove nothing"
    return [str(p) for p in keep]


def _fails(program: str, **limits: float) -> dict[str, float]:
    """Score ``program`` against a test that only an escape passes; it must fail."""
    truth = {"inputs": [""], "outputs": ["ESCAPED"]}
    result = code_reward(f"```python\n{program}\n```", truth, **{**FAST, **limits})
    assert result["score"] == -1.0 and result["acc"] == 0.0
    return result


def test_a_plain_program_passes_so_the_attacks_fail_for_their_own_reasons():
    out = code_reward("```python\nprint('ESCAPED')\n```", {"inputs": [""], "outputs": ["ESCAPED"]})
    assert out["score"] == 1.0


def test_no_connection_reaches_a_server_on_the_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(3)
    accepted: list[object] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    result = _fails(
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "print('ESCAPED')"
    )
    thread.join()
    server.close()
    assert accepted == [] and result["runtime_error"] == 1.0


def test_no_name_resolves_and_no_address_is_reachable():
    run = run_program(
        "import socket\n"
        "for host in ['example.com', 'localhost']:\n"
        "    try:\n"
        "        print(host, socket.getaddrinfo(host, 80)[0][4])\n"
        "    except OSError as e:\n"
        "        print(host, 'no', type(e).__name__)\n"
        "for addr in [('1.1.1.1', 53), ('8.8.8.8', 443), ('::1', 80)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1)\n"
        "        print('ESCAPED')\n"
        "    except OSError as e:\n"
        "        print(addr[0], 'no', type(e).__name__)\n",
        [{"stdin": ""}],
        Limits(**FAST),
    )
    out = run.tests[0].out
    assert "example.com no" in out and "ESCAPED" not in out
    assert out.count(" no ") >= 4


def test_a_fork_bomb_is_contained():
    result = _fails(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    assert result["timeout"] == 1.0 or result["runtime_error"] == 1.0


def test_allocating_past_the_memory_limit_fails():
    result = _fails("x = bytearray(8 << 30)\nprint('ESCAPED')", memory_mb=256)
    assert result["runtime_error"] == 1.0
    _fails("a = []\nwhile True:\n    a.append(bytearray(50 << 20))", memory_mb=256)


def test_printing_without_end_stops_at_the_output_cap():
    start = time.monotonic()
    run = run_program("while True:\n    print('x' * 1000)", [{"stdin": ""}], Limits(**FAST))
    assert run.tests[0].status == "output_limit"
    assert len(run.tests[0].out) <= Limits().max_output_bytes
    assert time.monotonic() - start < 1.0  # the cap, not the time limit, stopped it
    _fails("while True:\n    print('x' * 1000)")


def test_sleeping_forever_is_stopped_at_the_time_limit():
    start = time.monotonic()
    result = _fails("import time\ntime.sleep(3600)")
    assert result["timeout"] == 1.0
    assert time.monotonic() - start < 2.5


@pytest.mark.parametrize("detach", ["if os.fork(): os._exit(0)", "os.setsid()"])
def test_a_daemon_does_not_outlive_its_program(detach):
    run = run_program(
        "import os, time\n"
        "if os.fork() == 0:\n"
        f"    {detach}\n"
        "    time.sleep(30)\n"
        "    open('/tmp/still-here', 'w').write('x')\n"
        "print('parent done')",
        [{"stdin": ""}, {"stdin": ""}],
        Limits(**FAST),
    )
    assert run.compile_error is None
    assert [t.status for t in run.tests] == ["ok", "ok"]
    # the fixture checks that no process of the sandbox is left


def test_the_trainers_environment_run_files_proc_and_home_are_out_of_reach(monkeypatch, tmp_path):
    monkeypatch.setenv("DAPO_TEST_API_KEY", "s3cret")
    secret = tmp_path / "checkpoint.txt"
    secret.write_text("ESCAPED")
    for program in (
        "import os\nprint('ESCAPED' if 's3cret' in str(os.environ) else 'no')",
        f"print(open({str(secret)!r}).read())",
        f"print('ESCAPED' if b's3cret' in open('/proc/{os.getpid()}/environ', 'rb').read() else 0)",
        "import os\nprint('ESCAPED' if any(f'/proc/{p}' for p in os.listdir('/proc') "
        f"if p == '{os.getpid()}') else 'no')",
        # the home's own entries (the interpreter's directory may be bound below it)
        f"import os\nprint('ESCAPED' if any(os.path.lexists(p) for p in {_home_entries()!r}) "
        "else 'no')",
        f"import os\nprint('ESCAPED' if os.path.exists({str(Path.cwd())!r}) else 'no')",
    ):
        _fails(program)
    run = run_program("import os\nprint(sorted(os.listdir('/proc')))", [{"stdin": ""}], Limits())
    pids = [p for p in eval(run.tests[0].out) if p.isdigit()]  # noqa: S307 - our own output
    assert str(os.getpid()) not in pids and len(pids) <= 4  # init, harness, the test


def test_writes_outside_its_directory_fail(tmp_path):
    for path in [*_TARGETS[:3], tmp_path / _MARK]:
        _fails(f"open({str(path)!r}, 'w').write('x')\nprint('ESCAPED')")
    _fails(  # through a symlink made in its own /tmp
        "import os\n"
        f"os.symlink({str(tmp_path)!r}, '/tmp/link')\n"
        f"open('/tmp/link/{_MARK}', 'w').write('x')\n"
        "print('ESCAPED')"
    )
    _fails("open('/usr/escape', 'w')\nprint('ESCAPED')")
    run = run_program(  # its own /tmp is writable, within the file size limit
        "open('/tmp/ok', 'w').write('x' * 100)\nprint(len(open('/tmp/ok').read()))\n"
        "open('/tmp/big', 'wb').write(b'x' * (32 << 20))",
        [{"stdin": ""}],
        Limits(**FAST),
    )
    assert run.tests[0].out.startswith("100") and run.tests[0].status == "error"


def test_killing_or_tracing_the_parent_or_the_trainer_fails():
    trainer = os.getpid()
    _fails(f"import os, signal\nos.kill({trainer}, signal.SIGKILL)\nprint('ESCAPED')")
    _fails("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('ESCAPED')")
    _fails("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('ESCAPED')")
    _fails(
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('ESCAPED' if libc.ptrace(16, os.getppid(), 0, 0) == 0 else 'no')"  # ATTACH
    )
    assert os.getpid() == trainer  # still here


def test_a_program_cannot_raise_its_own_limits():
    _fails(
        "import resource\n"
        "ok = 0\n"
        "for r in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_CPU,\n"
        "          resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE):\n"
        "    try:\n"
        "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        ok += 1\n"
        "    except (ValueError, OSError):\n"
        "        pass\n"
        "print('ESCAPED' if ok else 'no')"
    )


def test_the_harness_never_sees_the_expected_outputs():
    # a program that searches the harness's frames finds the test's input, never its answer
    program = (
        "import sys\n"
        "seen, found, todo, f = set(), set(), [], sys._getframe()\n"
        "while f:\n"
        "    todo += list(f.f_locals.values())\n"
        "    f = f.f_back\n"
        "while todo:\n"
        "    v = todo.pop()\n"
        "    if id(v) in seen:\n"
        "        continue\n"
        "    seen.add(id(v))\n"
        "    if isinstance(v, dict):\n"
        "        todo += list(v.values())\n"
        "    elif isinstance(v, (list, tuple)):\n"
        "        todo += list(v)\n"
        "    elif isinstance(v, str) and v[:3] in ('INP', 'ANS') and len(v) == 9:\n"
        "        found.add(v)\n"
        "print(' '.join(sorted(found)))"
    )
    run = run_program(program, [{"stdin": "INPUT-777"}], Limits())
    assert "INPUT-777" in run.tests[0].out and "ANSWER" not in run.tests[0].out
    truth = {"inputs": ["INPUT-777"], "outputs": ["ANSWER-42"]}
    assert code_reward(f"```python\n{program}\n```", truth)["score"] == -1.0


def test_the_leftover_checks_see_a_running_sandbox():
    # the fixture's checks would see a sandbox that outlived its program
    started = sandbox.start_program("import time\ntime.sleep(30)", [{"stdin": ""}], Limits())
    deadline = time.monotonic() + 5
    while not _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _sandbox_processes() and started.proc.pid in _children()
    sandbox._kill(started.proc)
