"""A process that has imported torch, transformers and dapo once and forks the ranks of the
tests' two-rank runs from there (``tests/ranks.py``).

A fresh rank spends ~9 s of a 2-core CPU importing torch and transformers (and 18 s more
for vLLM and its engine's modules, with ``--vllm``) before it does anything, and a two-rank
test starts several groups; a forked rank starts in milliseconds with those modules already
loaded. It serves single processes too (a group of one). This process starts no thread (a
fork copies only the forking thread), computes nothing, and serves one group at a time:

    request (a JSON line on stdin):  {"ranks": [{"argv", "cwd", "env", "stdout", "stderr"}],
                                      "timeout": seconds, "grace": seconds (optional)}
    reply (a JSON line on stdout):   {"codes": [exit status per rank], "timed_out": bool,
                                      "outlived": [ranks that outlived a finished peer]}

A rank still running ``outlive`` seconds (default 60) after a peer ended successfully hangs
at its exit: it is stopped as below and named in ``outlived``. Ranks still running at the
timeout, or ``grace`` seconds (default 30) after another rank of
the group failed (as torchrun stops a failed rank's peers), are stopped with SIGABRT, which
makes faulthandler print their Python stacks to their stderr, then SIGKILL.

or one process started and left running (a server beside the test's trainers):

    request:  {"spawn": {"argv", "cwd", "env", "stdout", "stderr"}, "status_file": path}
    reply:    {"pid": pid}; its exit status is written to status_file once it has ended

Each rank runs ``argv`` as ``python ARGV`` would (``-c code``, ``-m module ...`` or
``script.py ...``) with the given environment and working directory, its output in the given
files; an exit status like ``subprocess``'s (negative: the signal that ended it).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401 - imported here once, for every rank forked afterwards
import torch.distributed  # noqa: F401
import transformers  # noqa: F401
from matplotlib.figure import Figure  # noqa: F401 - every run's dashboard (~1 s)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401

import dapo.cli  # noqa: F401
import dapo.training.trainer  # noqa: F401

# vLLM's package imports lazily: without these, each engine's first ``vllm.LLM`` spends ~7 s
# importing its entry point, config, engine core, CPU worker and model runner.
VLLM_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.core.kv_cache_manager",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.layers.quantization.online",
    "vllm.triton_utils.dispatcher",
    "compressed_tensors.compressors",
)

if "--vllm" in sys.argv[1:]:  # the flavour for runs with rollout.engine=vllm (+18 s of imports)
    from dapo.rollout.vllm_engine import import_vllm

    import_vllm()
    for name in VLLM_MODULES:
        importlib.import_module(name)

# Everything imported so far lives as long as the ranks: out of the collector's sight, a
# rank's gc.collect() (vLLM's engine start calls it 5 times: 3.8 s of an 8 s start) walks
# only what the rank itself made.
gc.freeze()


def run_rank(spec: dict) -> int:
    """In the forked child: become the rank ``spec`` describes and run it; its status."""
    out = os.open(spec["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    same = spec["stderr"] == spec["stdout"]  # 2>&1
    err = out if same else os.open(spec["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.clear()
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    # A rank still running at the group's deadline is sent SIGABRT first: its threads' Python
    # stacks go to its stderr, so a hang says where it hung.
    faulthandler.enable(all_threads=True)
    argv = spec["argv"]
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, spec["cwd"])
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
    except BaseException:  # noqa: BLE001 - a rank's crash is its status, as in a process
        traceback.print_exc()
        return 1


def fork_rank(spec: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the zygote's, not the rank's
        DETACHED.clear()
        status = 1
        try:
            status = run_rank(spec)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(status)
    return pid


# How long the other ranks of a group may run on once one has failed (as torchrun, which
# stops them at once, would not let them): long enough to end with their own error where
# they are about to, short of the group's timeout where they wait for the failed rank.
FAILED_PEER_GRACE_S = 30.0
# How long a rank may outlive a peer that finished successfully: the ranks of a finished run
# leave together (a last barrier, then each writes nothing more), so one still running after
# this hangs at its exit.
OUTLIVE_S = 60.0


def stop(pids: list[int]) -> None:
    """SIGABRT (faulthandler prints each one's Python stacks to its stderr), then SIGKILL."""
    for pid in pids:
        os.kill(pid, signal.SIGABRT)
    time.sleep(2.0)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # harmless on one already ended and not yet reaped


def serve_group(request: dict) -> dict:
    pids = [fork_rank(spec) for spec in request["ranks"]]
    codes: dict[int, int] = {}
    deadline = time.monotonic() + float(request["timeout"])
    outlive_deadline = float("inf")
    a_rank_failed, timed_out, outlived = False, False, []
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    if codes[pid] != 0 and not timed_out:  # failed on its own
                        grace = float(request.get("grace", FAILED_PEER_GRACE_S))
                        deadline = min(deadline, time.monotonic() + grace)
                        a_rank_failed = True
                    elif codes[pid] == 0:
                        outlive = float(request.get("outlive", OUTLIVE_S))
                        outlive_deadline = min(outlive_deadline, time.monotonic() + outlive)
        running = [pid for pid in pids if pid not in codes]
        if running:
            now = time.monotonic()
            if now > outlive_deadline and not (timed_out or outlived or a_rank_failed):
                outlived = [pids.index(pid) for pid in running]
                stop(running)
            elif now > deadline and not (timed_out or outlived):
                timed_out = True
                stop(running)
            time.sleep(0.02)
    return {
        "codes": [codes[pid] for pid in pids],
        "timed_out": timed_out and not a_rank_failed,
        "outlived": outlived,
    }


# Processes started with a "spawn" request (servers a test runs beside its trainers): pid ->
# the file their exit status is written to once the zygote has reaped them.
DETACHED: dict[int, str] = {}


def reap_detached(*_: object) -> None:
    """SIGCHLD: record the exit status of each detached process that has ended."""
    for pid, status_file in list(DETACHED.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            del DETACHED[pid]
            with open(status_file + ".tmp", "w") as fh:
                fh.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(status_file + ".tmp", status_file)


def spawn(request: dict) -> dict:
    """Fork one process and answer at once with its pid (not waited for: see DETACHED)."""
    pid = fork_rank(request["spawn"])
    DETACHED[pid] = request["status_file"]
    reap_detached()  # in case it ended before it was registered
    return {"pid": pid}


def main() -> None:
    signal.signal(signal.SIGCHLD, reap_detached)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            reply = spawn(request) if "spawn" in request else serve_group(request)
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
