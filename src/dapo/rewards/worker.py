"""The scoring worker process: load the reward functions, then score chunks until EOF.

Runs in a fresh interpreter started by :class:`~dapo.rewards.pool.WorkerPool` (the parent
side, owned by :class:`~dapo.rewards.scorer.RewardScorer`). It imports only the rewards
package and :mod:`dapo.workers` (and what the reward functions need): not torch, not the
training script. Functions
given as Python callables arrive pickled with cloudpickle and are unpickled here.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from multiprocessing.connection import Connection

from dapo.rewards.math import SCORERS
from dapo.rewards.sandbox import isolation_problem
from dapo.rewards.user import Outcome, load_entry, run_item
from dapo.workers import flush_output

PROGRESS = struct.Struct("<Q")  # shared slot: ((position in chunk + 1) << 16) | fn id, 0 = idle
_FLUSH_INTERVAL_S = 0.2  # a worker reports finished samples at least this often


def main(conn: Connection, progress_fd: int) -> None:
    """Entry point of a scoring worker (:func:`dapo.workers.start_worker`): load the
    functions, then score chunks until EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    progress = mmap.mmap(progress_fd, PROGRESS.size)
    os.close(progress_fd)
    # The parent closing the pipe (close(), exit) is the normal way to stop a worker.
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        _worker_loop(conn, progress)


def _worker_loop(conn: Connection, progress: mmap.mmap) -> None:
    _, entries, warm, options = conn.recv()
    try:
        table = [load_entry(name, source, options) for name, source in entries]
    except BaseException as e:
        flush_output()
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    for name in warm:  # pay first-call costs (imports, sympy caches) before the first batch
        with contextlib.suppress(Exception):
            if name == "code":  # the trial sandbox, once per worker
                isolation_problem()
            else:
                SCORERS[name]("Answer: 1/2", "0.5")
    flush_output()  # what the functions' imports printed belongs to the start-up
    conn.send(("ready", os.getpid()))
    while True:
        chunk = conn.recv()
        if chunk is None:
            return
        out: list[tuple[int, list[Outcome]]] = []
        last_flush = time.monotonic()
        for pos, (item_id, samples, fn_ids) in enumerate(chunk):
            if out and time.monotonic() - last_flush >= _FLUSH_INTERVAL_S:
                flush_output()  # what the calls printed arrives before their results
                conn.send(("results", out, False))
                out, last_flush = [], time.monotonic()
            base = (pos + 1) << 16

            def on_call(fid: int, base: int = base) -> None:
                PROGRESS.pack_into(progress, 0, base | fid)

            out.append((item_id, run_item(table, fn_ids, samples, on_call)))
        PROGRESS.pack_into(progress, 0, 0)
        flush_output()
        conn.send(("results", out, True))
