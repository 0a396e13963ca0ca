"""Launch ``tests/dist_worker.py`` (or ``dapo``) on 2 gloo ranks, for the tests.

Two launchers: ``torchrun`` itself (``fork=False``: the user's command, and what vLLM's
launcher needs), and by default ranks forked from a process that has already imported
torch, transformers and dapo (``tests/rank_zygote.py``) with the environment torchrun gives
its ranks: the same ranks, gloo group and code, without the ~9 s each fresh rank spends on
imports on a 2-core CPU.

About one 2-rank FSDP run of the worker in a hundred on this 2-core CPU has a rank abort in
gloo ("terminate called without an active exception", SIGABRT) with no Python error, seen
in CI and reproduced once in 115 identical runs of one worker mode (2026-11-23). The results
of a run that finished are deterministic, so a worker run that died that way is run once
more, with a warning that says at which stage each rank was (the worker marks its stages in
``.rank{R}.stage``). Any other failure, or a second abort, fails the test.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from dapo.rollout.weight_channel import host_store

HERE = Path(__file__).resolve().parent

GLOO_ABORT = "terminate called without an active exception"


def stages(cwd: Path) -> dict[int, str]:
    """The last stage each rank of the latest worker run reached (from its marker files)."""
    out = {}
    for path in sorted(cwd.glob(".rank*.stage")):
        out[int(path.name[5:-6])] = path.read_text().strip()
    return out


def _report(proc: subprocess.CompletedProcess, cwd: Path) -> str:
    """The end of the output, with any Python stack faulthandler printed when a rank died."""
    err = proc.stderr
    fatal = err.find("Fatal Python error")
    head = err[fatal : fatal + 3000] + "\n...\n" if fatal >= 0 else ""
    return f"stages {stages(cwd)}\n{head}{proc.stdout[-3000:]}{err[-3000:]}"


def _stacks(err: str) -> str:
    """A timed-out rank's stderr: what it printed last, then the stacks faulthandler dumped."""
    fatal = err.find("Fatal Python error")
    if fatal < 0:
        return err[-4000:]
    return err[max(0, fatal - 1500) : fatal + 4000]


class Zygote:
    """The forking processes of ``tests/rank_zygote.py`` (plain, or with vLLM imported),
    each started on first use (one per test process) and ended with it."""

    procs: dict[bool, subprocess.Popen] = {}

    @classmethod
    def get(cls, vllm: bool = False) -> subprocess.Popen:
        proc = cls.procs.get(vllm)
        if proc is None or proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            argv = [sys.executable, str(HERE / "rank_zygote.py"), *(["--vllm"] if vllm else [])]
            proc = cls.procs[vllm] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
            )
            ready = proc.stdout.readline()
            assert json.loads(ready) == {"ready": True}, ready
            atexit.register(proc.stdin.close)
        return proc

    @classmethod
    def ask(cls, request: dict, vllm: bool = False) -> dict:
        """Send one request (a JSON line) to the zygote and return its reply."""
        zygote = cls.get(vllm)
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        return json.loads(zygote.stdout.readline())


def forked(
    args: tuple[str, ...] | list[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    ranks: int = 1,
    vllm: bool = False,
    grace: float | None = None,
    outlive: float | None = None,
) -> subprocess.CompletedProcess:
    """``python ARGS`` as ``ranks`` processes forked by the zygote (``ranks`` > 1: with
    torchrun's rank environment); the result as ``subprocess.run`` gives it (the ranks'
    outputs one after the other, the first failing status). Ranks still running ``grace``
    seconds (the zygote's default: 30) after another failed are stopped, their stacks in
    their stderr; so are ranks still running ``outlive`` seconds (default 60) after another
    finished, and that fails: every rank's process must end, not only write its files."""
    # As torchrun's agent does, this process hosts the group's store and every rank is its
    # client: the store binds a port the OS picks as it listens, where a port chosen free
    # beforehand for rank 0 to bind could be taken in between by any other process on this
    # host (rank 0 then dies of EADDRINUSE and rank 1 waits for its store).
    store = host_store("127.0.0.1", ranks) if ranks > 1 else None
    run_id = f"dapo-tests-{uuid.uuid4().hex[:12]}"  # a port may come again; this id may not
    specs = []
    for rank in range(ranks):
        rank_env = dict(env)
        if ranks > 1:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                ROLE_WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(store.port),
                TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID=run_id,
            )
        out, err = cwd / f".rank{rank}.out", cwd / f".rank{rank}.err"
        specs.append(
            {"argv": list(args), "cwd": str(cwd), "env": rank_env, "stdout": str(out),
             "stderr": str(err)}
        )  # fmt: skip
    request = {"ranks": specs, "timeout": timeout}
    if grace is not None:
        request["grace"] = grace
    if outlive is not None:
        request["outlive"] = outlive
    try:
        reply = Zygote.ask(request, vllm)
    finally:
        del store
    outs = [Path(r["stdout"]).read_text(errors="replace") for r in specs]
    errs = [Path(r["stderr"]).read_text(errors="replace") for r in specs]
    for r in specs:
        Path(r["stdout"]).unlink()
        Path(r["stderr"]).unlink()
    cmd = ["rank_zygote", *args]
    if reply.get("outlived"):  # a finished run whose process did not end: its stacks
        tails = "\n".join(f"--- rank {i} stderr ---\n{_stacks(errs[i])}" for i in reply["outlived"])
        raise AssertionError(
            f"{' '.join(cmd)}: rank(s) {reply['outlived']} still running {outlive or 60} s after "
            f"a peer had finished (a process that does not end); codes {reply['codes']}\n{tails}"
        )
    if reply["timed_out"]:  # the ranks' stacks at the deadline are in their stderr
        tails = "\n".join(f"--- rank {i} stderr ---\n{_stacks(e)}" for i, e in enumerate(errs))
        raise AssertionError(
            f"{' '.join(cmd)} timed out after {timeout} s; stages {stages(cwd)}\n{tails}"
        )
    code = next((c for c in reply["codes"] if c != 0), 0)
    return subprocess.CompletedProcess(cmd, code, "".join(outs), "".join(errs))


def torchrun(
    *args: str,
    cwd: Path,
    timeout: int = 600,
    retry_abort: bool | None = None,
    fork: bool = True,
    vllm: bool = False,
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` in ``cwd``,
    or (``fork``, the default) the same 2 ranks forked by the zygote (``vllm``: the one that
    has imported vLLM).

    ``retry_abort`` (default: when the script is the worker, whose runs are idempotent):
    run again once if a rank died of the gloo abort above.
    """
    if retry_abort is None:
        retry_abort = any(a.endswith("dist_worker.py") for a in args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *args,
    ]
    for attempt in (1, 2):
        for marker in cwd.glob(".rank*.stage"):
            marker.unlink()
        if fork:
            proc = forked(args, cwd, env, timeout, ranks=2, vllm=vllm)
        else:
            proc = subprocess.run(
                cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
        if proc.returncode == 0 or not retry_abort or GLOO_ABORT not in proc.stderr:
            break
        if attempt == 1:
            warnings.warn(
                f"a gloo rank aborted ({GLOO_ABORT!r}) at stages {stages(cwd)}; "
                "running the worker once more",
                stacklevel=2,
            )
    assert proc.returncode == 0, _report(proc, cwd)
    return proc


class ForkedProcess:
    """A process the zygote forked and left running, with the part of ``subprocess.Popen``'s
    interface the tests use (``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``)."""

    def __init__(self, pid: int, status_file: Path) -> None:
        self.pid, self.status_file = pid, status_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.status_file.exists():
            self.returncode = int(self.status_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forked_popen(
    cmd: list[str], *, env: dict[str, str], stdout: Any, stderr: Any, vllm: bool = True
) -> ForkedProcess:
    """``subprocess.Popen(cmd, ...)`` for ``cmd = [python, ARGS...]``, the process forked by
    the zygote (with vLLM imported: a ``dapo vllm-serve`` starts ~25 s sooner) and left
    running beside the test. ``stdout`` and ``stderr`` are open files, or ``stderr`` is
    ``subprocess.STDOUT``, as ``dapo.rollout.server.launch`` passes them."""
    assert cmd[0] == sys.executable, cmd
    path = Path(stdout.name)
    stdout.close()
    err = path if stderr == subprocess.STDOUT else Path(stderr.name)
    status_file = path.with_name(path.name + ".status")
    status_file.unlink(missing_ok=True)
    spec = {"argv": cmd[1:], "cwd": os.getcwd(), "env": env, "stdout": str(path),
            "stderr": str(err)}  # fmt: skip
    reply = Zygote.ask({"spawn": spec, "status_file": str(status_file)}, vllm)
    return ForkedProcess(reply["pid"], status_file)
