"""Does a finished `dapo train` end? Runs a command N times and measures, each time, the
seconds from its run summary (``== dapo run summary ==`` on stdout) to the end of the
process (for torchrun: of every rank and torchrun itself).

    python scripts/exit_check.py                 # 10 x two ranks, colocated vLLM on the CPU
    python scripts/exit_check.py --runs 3 -- -m dapo train train.steps=1 evaluate=false

Exit status 1 when a repetition did not end within --bound seconds of its summary (it is
then killed, with its process tree) or failed; each repetition's figures are printed.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

SUMMARY = "== dapo run summary =="
REPRODUCTION = [
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "dapo",
    "train",
    "rollout.engine=vllm",
    "train.steps=2",
    "evaluate=false",
]


def one_run(args: list[str], out_dir: str, bound: float, limit: float) -> tuple[str, float | None]:
    """(what happened, seconds from the summary to the exit) of one repetition."""
    cmd = [sys.executable, *args, f"output_dir={out_dir}"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killed whole at a time-out
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines: queue.Queue[tuple[float, str | None]] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put((time.monotonic(), line))
        lines.put((time.monotonic(), None))

    threading.Thread(target=read, daemon=True).start()
    start, summary_at, tail = time.monotonic(), None, []
    while True:
        deadline = (summary_at + bound) if summary_at else (start + limit)
        try:
            at, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            what = "no exit" if summary_at else "no summary"
            return f"{what} within the bound; killed. Last lines:\n{''.join(tail[-5:])}", None
        if line is None:
            break
        tail.append(line)
        if summary_at is None and SUMMARY in line:
            summary_at = at
    code = proc.wait()
    if summary_at is None:
        return f"ended with status {code} before a summary:\n{''.join(tail[-15:])}", None
    seconds = time.monotonic() - summary_at
    return (f"status {code}" if code else "ok"), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--bound", type=float, default=30.0, help="seconds after the summary")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds to the summary")
    parser.add_argument("args", nargs="*", help="python arguments (default: the reproduction)")
    ns = parser.parse_args()
    args = ns.args or REPRODUCTION
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.runs):
            what, seconds = one_run(args, os.path.join(tmp, f"run{i}"), ns.bound, ns.limit)
            shown = f"{seconds:.1f} s from summary to exit" if seconds is not None else "-"
            print(f"run {i + 1}/{ns.runs}: {what}; {shown}", flush=True)
            failed += what != "ok"
    print(f"{ns.runs - failed} of {ns.runs} ended within {ns.bound:.0f} s of their summary")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
