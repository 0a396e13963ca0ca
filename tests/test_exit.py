"""A finished command ends: whatever threads and executors its libraries or the user's code
leave behind, the process exits within a bound, with its status, saying what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

LEFT_OPEN = """
from concurrent.futures import ThreadPoolExecutor
import dapo.process_exit
pool = ThreadPoolExecutor(max_workers=2)
print(pool.submit(lambda: 'task ran').result(), flush=True)
dapo.process_exit.exit_now(4)
"""

NEVER_ENDS = """
import threading
import dapo.process_exit
def wait_for_a_signal_that_never_comes():
    threading.Event().wait()
threading.Thread(target=wait_for_a_signal_that_never_comes, name='stuck-reader').start()
dapo.process_exit.exit_now(3, wait_s=1)
"""


def _python(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    return proc, time.monotonic() - start


def test_an_executor_nobody_shut_down_does_not_hold_the_exit():
    """A ThreadPoolExecutor left open keeps its idle workers waiting for work; the exit runs
    the interpreter's executor shutdown first, so the process ends at once with its status
    and without a word about threads."""
    proc, _ = _python(LEFT_OPEN)
    assert proc.returncode == 4, proc.stderr
    assert proc.stdout == "task ran\n"
    assert "exiting anyway" not in proc.stderr


def test_a_thread_that_never_ends_is_named_and_the_exit_comes_after_the_bound():
    proc, seconds = _python(NEVER_ENDS)
    assert proc.returncode == 3, proc.stderr
    assert seconds < 30
    assert "'stuck-reader'" in proc.stderr
    assert "wait at threading.py" in proc.stderr  # where it waits
    assert "exiting anyway (status 3" in proc.stderr


def test_closing_a_trainer_leaves_none_of_its_threads_running(random_tiny_model, tmp_path):
    """The producer thread of streaming rollouts and the in-process scorer's threads are
    owned by the objects that start them and ended by ``close``."""
    import dapo.training.record
    from dapo.config import load_config
    from dapo.training.trainer import Trainer

    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+{i}=", "reward_model": {"ground_truth": str(2 * i)}} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = set(threading.enumerate())
    cfg = load_config(
        overrides=[
            f"model.name_or_path={random_tiny_model}",
            f"data.train={data}",
            f"output_dir={tmp_path / 'run'}",
            "train.steps=2",
            "train.prompts_per_step=2",
            "train.mini_batch_size=2",
            "rollout.num_generations=2",
            "rollout.max_completion_length=8",
            "algorithm.overlong_buffer=2",
            "algorithm.dynamic_sampling=false",
            "rollout.max_staleness=1",
            "reward.num_workers=0",
            "evaluate=false",
            "logging.console=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "checkpoint.save_final_model=false",
        ]
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dapo.training.record, "plot_dashboard", lambda *a, **k: None)
        Trainer(cfg, log=lambda _: None).run()
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    ours = [t.name for t in left if t.name.startswith("dapo-") or not t.daemon]
    assert not ours, f"threads still running after the run: {ours}"


REWARD_LEAVES_A_POOL = """
from concurrent.futures import ThreadPoolExecutor

POOL = ThreadPoolExecutor(max_workers=2)  # never shut down, as libraries' pools often are


def leaky(response, ground_truth):
    return POOL.submit(lambda: 1.0 if len(response) % 2 else -1.0).result()
"""


@pytest.mark.slow
def test_dapo_train_ends_although_its_reward_function_left_an_executor_open(
    random_tiny_model, tmp_path
):
    """The reward function runs in the trainer's process (reward.num_workers=0) and leaves a
    thread pool open: the command still ends within seconds of its summary, status 0."""
    rewards = tmp_path / "leaky_rewards.py"
    rewards.write_text(REWARD_LEAVES_A_POOL)
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [
        sys.executable,
        "-m",
        "dapo",
        "train",
        f"model.name_or_path={random_tiny_model}",
        f"data.train={data}",
        f"output_dir={tmp_path / 'run'}",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.mini_batch_size=2",
        "rollout.num_generations=2",
        "rollout.max_completion_length=8",
        "algorithm.overlong_buffer=2",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "checkpoint.save_final_model=false",
        "reward.num_workers=0",
        f"reward.functions=[{{name: '{rewards}:leaky'}}]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err_fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_fh, text=True, env=env)
    seen: list[float] = []

    def watch() -> None:  # the summary's time; the pipe ends when the process does
        for line in proc.stdout:
            if "== dapo run summary ==" in line:
                seen.append(time.monotonic())

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.monotonic()
    reader.join(timeout=5)
    err = err_file.read_text()
    assert code == 0, err[-3000:]
    assert seen and ended - seen[0] < 15, (seen, ended)
    assert "exiting anyway" not in err
    assert json.loads((Path(tmp_path) / "run" / "summary.json").read_text())["steps"] == 1


_SWALLOWING_LIBRARY = """
import os, signal, sys, time
from dapo.process_exit import hold_interrupts, take_interrupt
hold_interrupts()
try:  # a library's bare except, which a KeyboardInterrupt raised here would not get past
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
except:  # noqa: E722
    print("swallowed", flush=True)
print("start-up done", flush=True)
if sys.argv[1] == "twice":
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("not reached", flush=True)
try:
    take_interrupt()
except KeyboardInterrupt:
    print("taken", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("presses", ["once", "twice"])
def test_ctrl_c_during_start_up_is_held_past_a_library_that_would_swallow_it(presses):
    """Held, the interrupt cannot be lost in a library's start-up code: it is taken at the
    next safe point; a second Ctrl-C ends the process at once with 130."""
    done = subprocess.run(
        [sys.executable, "-c", _SWALLOWING_LIBRARY, presses],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130, done.stderr
    assert "swallowed" not in done.stdout and "start-up done" in done.stdout
    assert "stopping once start-up reaches a safe point" in done.stderr
    if presses == "once":
        assert done.stdout.splitlines()[-1] == "taken"
    else:
        assert "not reached" not in done.stdout and "taken" not in done.stdout
        assert done.stderr.splitlines()[-1] == "dapo: interrupted"
