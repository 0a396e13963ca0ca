"""Launch ``tests/dist_worker.py`` (or ``dapo``) on 2 gloo ranks with torchrun, for the tests.

About one 2-rank FSDP run of the worker in a hundred on this 2-core CPU has a rank abort in
gloo ("terminate called without an active exception", SIGABRT) with no Python error, seen
in CI and reproduced once in 115 identical runs of one worker mode (2026-11-23). The results
of a run that finished are deterministic, so a worker run that died that way is run once
more, with a warning that says at which stage each rank was (the worker marks its stages in
``.rank{R}.stage``). Any other failure, or a second abort, fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

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


def torchrun(
    *args: str, cwd: Path, timeout: int = 600, retry_abort: bool | None = None
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` in ``cwd``.

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
