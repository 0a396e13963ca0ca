"""A run loses no work to a cluster's faults: one writer per run directory, SIGTERM and Ctrl-C
saved at a safe point, and a write that fails stops cleanly.

Real processes and real signals: runs forked from the tests' zygote (``tests/ranks.py``:
torch and dapo already imported, so a run starts in a second) are sent SIGTERM at moments
spread over their whole run, and each must leave a checkpoint and a summary marked
interrupted, and resume to exactly the metrics of an uninterrupted run with the same seed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import dapo.atomic
import dapo.training.record
from dapo.cli import main
from dapo.config import load_config
from dapo.errors import TrainingError
from dapo.training.manifest import verify_manifest
from dapo.training.run_lock import LOCK_FILE, RunLock
from dapo.training.trainer import Trainer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from ranks import Zygote, forked, forked_popen  # noqa: E402 - tests/ranks.py
from test_reliability import base_overrides, metric_rows, quiet  # noqa: E402

# save_every=0: every stop must save the checkpoint itself (none is there from the loop).
RUN = ("train.steps=4", "checkpoint.save_every=0", "checkpoint.save_final_model=false")
TRIALS = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two torch threads on two busy cores are ~100x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_dashboard(monkeypatch):
    monkeypatch.setattr(dapo.training.record, "plot_dashboard", lambda *a, **k: None)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    """32 small prompts in the reference format (as in test_reliability)."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i} + {i + 3}. End with Answer: N"}],
            "reward_model": {"ground_truth": str(2 * i + 3)},
            "data_source": "math_dapo",
        }
        for i in range(32)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return base_overrides(model, data, out, *RUN, *extra)


@pytest.fixture(scope="module")
def uninterrupted(random_tiny_model, train_file, tmp_path_factory) -> dict[str, Any]:
    """The run every interrupted one must end like, and how long its training took."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    trainer = Trainer(load_config(overrides=args(random_tiny_model, train_file, out)), log=quiet)
    t0 = time.monotonic()
    trainer.run()
    return {"out": out, "run_s": time.monotonic() - t0}


def handles(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` installed (``/proc``'s SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(caught and int(caught.group(1), 16) >> (sig - 1) & 1)


def launch(cli_args: list[str], log: Path) -> Any:
    """``python -m dapo train ARGS``, forked by the zygote, its output in ``log``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(log, "wb") as fh:
        return forked_popen(
            [sys.executable, "-m", "dapo", "train", *cli_args],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            vllm=False,
        )


def wait_for(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def last_weights(out: Path) -> dict[str, torch.Tensor]:
    newest = sorted((out / "checkpoints").glob("step_*"))[-1]
    return load_file(str(newest / "model.safetensors"))


# ==========================================================================================
# One writer per run directory
# ==========================================================================================


def test_a_second_writer_is_refused_and_the_first_run_completes(
    random_tiny_model, train_file, uninterrupted, tmp_path, capsys
):
    """While a run trains, a second `dapo train` on its directory (resume=true, or a fresh
    start) is refused in one line naming the first run's process, and writes nothing there;
    the first run ends with all its steps, as if alone."""
    out = tmp_path / "run"
    first_args = args(random_tiny_model, train_file, out)
    first = launch(first_args, tmp_path / "first.log")
    wait_for(lambda: handles(first.pid, signal.SIGTERM), what="the first run to train")
    config_before = (out / "config.yaml").read_bytes()
    for extra in (["resume=true"], []):
        assert main(["train", *first_args, *extra]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        refusal = [line for line in err if "is in use by another run" in line]
        assert refusal == [
            f"dapo: error: `output_dir` = '{out}' is in use by another run (pid {first.pid} on "
            f"host {os.uname().nodename}, started {refusal[0].split('started ')[1].split(')')[0]}"
            "): one run writes to a directory at a time. Wait for it to end or stop it, then "
            "resume with resume=true; or choose another output_dir"
        ], err
    assert first.wait(timeout=180) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert (out / "config.yaml").read_bytes() == config_before
    assert metric_rows(out) == metric_rows(uninterrupted["out"])
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert (out / LOCK_FILE).read_text() == ""  # released: the next run may start
    assert main(["train", *first_args, "resume=true"]) == 0  # already at step 4: exits 0
    assert "already at step 4" in capsys.readouterr().out


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_notice(tmp_path):
    """A process that took the lock and died (SIGKILL: nothing released it) leaves its
    description in the file but no lock: the next run takes it over, saying whose it was."""
    code = (
        "import sys; from pathlib import Path; from dapo.training.run_lock import RunLock\n"
        "lock = RunLock.acquire(Path(sys.argv[1]))\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainingError, match=rf"in use by another run \(pid {holder.pid} on"):
            RunLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    said: list[str] = []
    lock = RunLock.acquire(tmp_path, log=said.append)
    assert lock.held
    with pytest.raises(TrainingError, match="in use by another Trainer of this process, built"):
        RunLock.acquire(tmp_path)  # a notebook cell run again, the first trainer not closed
    assert said == [
        f"took over the lock of {tmp_path / LOCK_FILE}, left by a run that has ended "
        f"(pid {holder.pid} on host {os.uname().nodename}, started {said[0].split('started ')[1]}"
    ]
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""
    again: list[str] = []
    RunLock.acquire(tmp_path, log=again.append).release()  # a released lock: no notice
    assert again == []


# ==========================================================================================
# SIGTERM and Ctrl-C
# ==========================================================================================


def interrupt_and_check(
    run_args: list[str], out: Path, log: Path, sig: int, delay: float
) -> dict[str, Any] | None:
    """Send ``sig`` ``delay`` s after the run installed its handlers; the summary's
    ``interrupted`` entry, or None when the run had ended first."""
    shutil.rmtree(out, ignore_errors=True)
    proc = launch(run_args, log)
    wait_for(
        lambda: handles(proc.pid, signal.SIGTERM) or proc.poll() is not None,
        what="the run to train",
    )
    assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
    time.sleep(delay)
    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    text = log.read_text(errors="replace")
    if code == 0 or (code == -signal.SIGTERM and "== dapo run summary ==" in text):
        return None  # the run had ended (a SIGTERM after it, while the process exits: no handler)
    name = signal.Signals(sig).name
    assert code == (130 if sig == signal.SIGINT else 143), text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    stop = summary["interrupted"]
    assert "error" not in summary
    assert stop["signal"] == name and summary["steps"] == stop["step"]
    checkpoint = Path(stop["checkpoint"])
    assert checkpoint == out / "checkpoints" / f"step_{stop['step']:06d}"
    assert verify_manifest(checkpoint) == []
    assert stop["resume"] == f"dapo train {out / 'config.yaml'} resume=true"
    lines = text.splitlines()
    assert f"{name}: stopping at the next safe point to save a checkpoint" in text
    assert lines[-1] == (
        f"dapo: {name}: stopped at rollout step {stop['step']}, saved in {checkpoint}. "
        f"Resume with: {stop['resume']}"
    )
    assert "Traceback" not in text
    # What was logged is what the checkpoint holds: no step past it, none missing.
    assert [r["step"] for r in metric_rows(out)] == list(range(1, stop["step"] + 1))
    return stop


@pytest.mark.slow
def test_sigterm_at_random_moments_saves_and_resumes_to_the_same_metrics(
    random_tiny_model, train_file, uninterrupted, tmp_path
):
    """10 SIGTERMs at moments spread over the whole run (a random point in each tenth of
    it), and a Ctrl-C: each leaves a verified checkpoint and a summary marked interrupted,
    and resuming it ends with exactly the metrics and weights of the uninterrupted run."""
    rng = random.Random(65)
    run_s = uninterrupted["run_s"]
    want_rows = metric_rows(uninterrupted["out"])
    want_weights = last_weights(uninterrupted["out"])
    stops = []
    for trial in range(TRIALS + 1):
        sig = signal.SIGINT if trial == TRIALS else signal.SIGTERM
        delay = (trial % TRIALS + rng.random()) / TRIALS * run_s
        out = tmp_path / f"trial{trial}"
        stop = None
        for _ in range(3):  # a signal after the end of the run: sooner
            stop = interrupt_and_check(
                args(random_tiny_model, train_file, out),
                out,
                tmp_path / f"trial{trial}.log",
                sig,
                delay,
            )
            if stop is not None:
                break
            delay /= 2
        assert stop is not None, f"trial {trial}: every run ended before its signal"
        stops.append((round(delay, 2), stop["step"]))
        resumed = Trainer(
            load_config(overrides=args(random_tiny_model, train_file, out, "resume=true")),
            log=quiet,
        ).run()
        assert resumed["resumed_from_step"] == stop["step"] and "interrupted" not in resumed
        assert metric_rows(out) == want_rows, f"trial {trial} (stopped at {stop['step']})"
        got = last_weights(out)
        assert all(torch.equal(got[k], v) for k, v in want_weights.items()), trial
    print(f"(delay s, step saved) per trial: {stops}; uninterrupted run {run_s:.1f} s")
    assert len({step for _, step in stops}) >= 3, stops  # early, middle and late stops


def test_a_grace_period_exceeded_exits_with_its_line(random_tiny_model, train_file, tmp_path):
    """A checkpoint that cannot be saved within checkpoint.signal_grace_s: the process ends
    anyway at the deadline, with one line that says so and what is left."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = launch(args(random_tiny_model, train_file, out, "checkpoint.signal_grace_s=0.001"), log)
    wait_for(lambda: handles(proc.pid, signal.SIGTERM), what="the run to train")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    text = log.read_text()
    assert text.splitlines()[-1] == (
        "dapo: SIGTERM: no checkpoint could be saved within checkpoint.signal_grace_s=0.001 s; "
        "exiting without it (no checkpoint was saved). Raise checkpoint.signal_grace_s (below "
        "the scheduler's kill wait) or save more often (checkpoint.save_every)"
    ), text[-2000:]


def test_ctrl_c_during_start_up_is_one_line_and_130(random_tiny_model, train_file, tmp_path):
    """Ctrl-C while the modules import (a fresh interpreter) or while the trainer is built (a
    forked one, modules imported): one line, status 130, no traceback."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    fresh = subprocess.Popen(
        [sys.executable, "-m", "dapo", "train", *args(random_tiny_model, train_file, out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    time.sleep(1.0)
    fresh.send_signal(signal.SIGINT)
    stdout, stderr = fresh.communicate(timeout=60)
    assert fresh.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith(
        "dapo: interrupted"
    ), stderr[-2000:]
    log = tmp_path / "forked.log"
    for delay in (0.3, 0.1, 0.02):  # while the trainer is built, before its handlers
        forked_run = launch(args(random_tiny_model, train_file, out), log)
        time.sleep(delay)
        if not handles(forked_run.pid, signal.SIGTERM):
            break
        forked_run.kill()
        forked_run.wait()
    forked_run.send_signal(signal.SIGINT)
    assert forked_run.wait(timeout=60) == 130
    text = log.read_text()
    assert "Traceback" not in text and text.strip().splitlines()[-1].startswith(
        "dapo: interrupted"
    ), text[-2000:]


def _children(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
def test_two_ranks_stop_at_the_same_step_on_sigterm(random_tiny_model, tmp_path):
    """SIGTERM to rank 1 alone, mid-run: both ranks stop at the same step boundary, one
    checkpoint of it, both exit 143; the run resumes on two ranks to the metrics of an
    uninterrupted two-rank run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def two_rank_args(out: Path, *extra: str) -> list[str]:
        return [
            "-m",
            "dapo",
            "train",
            f"model.name_or_path={random_tiny_model}",
            f"output_dir={out}",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "algorithm.overlong_buffer=4",
            "algorithm.dynamic_sampling=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "evaluate=false",
            "train.steps=6",
            *extra,
        ]

    whole = tmp_path / "whole"
    done = forked(two_rank_args(whole), tmp_path, env, timeout=300, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "run"
    result: dict[str, Any] = {}
    zygote = Zygote.get().pid
    before = set(_children(zygote))
    thread = threading.Thread(
        target=lambda: result.update(
            proc=forked(two_rank_args(out), tmp_path, env, timeout=300, ranks=2)
        )
    )
    thread.start()
    wait_for(lambda: len(set(_children(zygote)) - before) == 2, what="two ranks")
    ranks = sorted(set(_children(zygote)) - before)  # forked in rank order
    wait_for(lambda: all(handles(p, signal.SIGTERM) for p in ranks), what="both ranks to train")
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, what="step 1")
    os.kill(ranks[1], signal.SIGTERM)
    thread.join(timeout=300)
    proc = result["proc"]
    assert proc.returncode == 143, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    stop = summary["interrupted"]
    assert stop["signal"] == "SIGTERM"  # rank 0, which writes the summary, learnt it from rank 1
    assert stop["resume"].startswith("torchrun --nproc_per_node 2 -m dapo train ")
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stop['step']:06d}"]
    assert [r["step"] for r in metric_rows(out)] == list(range(1, stop["step"] + 1))
    resumed = forked(two_rank_args(out, "resume=true"), tmp_path, env, timeout=300, ranks=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metric_rows(out) == metric_rows(whole)


# ==========================================================================================
# A write that fails
# ==========================================================================================


def _failing_write(name: str, at: int):
    """``os.write`` that, on the ``at``-th write to a file called ``name``, writes half the
    bytes and then fails as a full disk does."""
    real = os.write
    seen = {"n": 0}

    def write(fd: int, data: Any) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith("/" + name):
            seen["n"] += 1
            if seen["n"] == at:
                real(fd, bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    return write


@pytest.mark.parametrize("name", ["metrics.jsonl", "rollouts.jsonl"])
def test_a_full_disk_at_a_log_write_stops_cleanly_and_resumes(
    name, random_tiny_model, train_file, uninterrupted, tmp_path, capsys, monkeypatch
):
    """A full disk in the middle of step 3's line of metrics.jsonl (or of its transcripts):
    one line naming the file, the free space and the fix; the file holds whole lines only,
    the summary says what stopped the run, and resume=true ends like the uninterrupted run."""
    out = tmp_path / "run"
    run_args = args(random_tiny_model, train_file, out, "checkpoint.save_every=1")
    monkeypatch.setattr(dapo.atomic.os, "write", _failing_write(name, at=3))
    assert main(["train", *run_args]) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    free = re.search(r"; (\d+) MiB free on its file system\)", err[-1])
    assert free and err[-1] == (
        f"dapo: error: could not write {out / name} (No space left on device; {free.group(1)} "
        "MiB free on its file system). Free disk space (or raise the quota), then continue "
        "with resume=true: nothing half-written was left in it, and the checkpoints are as "
        "they were"
    )
    raw = (out / name).read_bytes()
    assert raw.endswith(b"\n") and all(json.loads(x) for x in raw.splitlines())
    assert {json.loads(x)["step"] for x in raw.splitlines()} == {1, 2}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["error"].startswith(f"OutputWriteError: could not write {out / name}")
    assert main(["train", *run_args, "resume=true"]) == 0
    assert metric_rows(out) == metric_rows(uninterrupted["out"])


def test_a_failed_export_names_final_model_and_the_fix(tmp_path):
    """A full disk while safetensors writes the final model (its error is not an OSError):
    the run's one line names the directory, the free space and that resume exports again;
    no manifest is left to vouch for the half-written files."""
    from dapo.errors import OutputWriteError
    from dapo.training.export import export_final_model
    from dapo.training.manifest import MANIFEST

    class SafetensorError(Exception):
        pass

    class Model:
        def save_pretrained(self, path: Path, state_dict: dict) -> None:
            path.mkdir(parents=True, exist_ok=True)
            (path / "model.safetensors").write_bytes(b"half")
            raise SafetensorError("Error while serializing: No space left on device (os error 28)")

    final = tmp_path / "final_model"
    final.mkdir()
    (final / MANIFEST).write_text("{}")  # an earlier export's
    with pytest.raises(OutputWriteError) as caught:
        export_final_model(final, Model(), tokenizer=None, weights={})
    assert str(caught.value).startswith(f"could not write {final} (Error while serializing: ")
    assert str(caught.value).endswith(
        "Free disk space (or raise the quota), then continue with resume=true: it has no "
        "manifest until an export ends (resume=true exports it again)"
    )
    assert not (final / MANIFEST).exists()
