"""What user code prints in worker processes (reward functions, environments, tools): kept
in a file of the run, capped per worker and step, the rest counted, never in the console;
and workers that die with the trainer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from dapo.environments import EnvironmentPool, EnvironmentWarning, load_environment
from dapo.rewards import RewardScorer, ScoreRequest
from dapo.worker_output import DEFAULT_OUTPUT_LIMIT, USER_OUTPUT_FILE, OutputCapture, UserOutput
from dapo.workers import start_worker

HERE = Path(__file__).parent
FIXTURES = HERE / "printing_fixtures.py"
ENVS = "sample_environments"  # tests/sample_environments.py (tests/ is on sys.path)
LIMIT = 4096
BIG = 10_000_000 + 1  # one print of 10 MB, with its newline
HEADER = re.compile(r"^==> (.+) <==$", re.M)
DROPPED = re.compile(r"^\[(\d+) more bytes dropped: .*\]$\n?", re.M)


def req(response: str) -> ScoreRequest:
    return ScoreRequest(response, "7", "math_dapo")


def stretches(text: str) -> list[tuple[str, str]]:
    """``(header, what follows it)`` for each header (``reward worker PID, rollout step N``)
    of the file, without the lines of bytes dropped, and without the newline that ends a
    stretch cut mid-line (a header, or a line of bytes dropped, starts on a line of its
    own: the tests' cut stretches end mid-line, their whole ones with a newline of theirs)."""
    parts = HEADER.split(text)
    assert parts[0] == "", "the file starts with a header"
    out = []
    for tag, body in zip(parts[1::2], parts[2::2], strict=True):
        body = DROPPED.sub("", body.removeprefix("\n"))
        out.append((tag, body.removesuffix("\n") if re.search(r"[oe ]\n$", body) else body))
    return out


def output_per_worker_and_step(text: str) -> dict[str, str]:
    """What each worker printed in each step, as kept in the file."""
    joined: dict[str, str] = {}
    for tag, body in stretches(text):
        joined[tag] = joined.get(tag, "") + body
    return joined


def kept_per_worker_and_step(text: str) -> dict[str, int]:
    """Bytes of each worker's output kept in each step."""
    return {tag: len(body.encode()) for tag, body in output_per_worker_and_step(text).items()}


def capture_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dapo-output")}


@pytest.fixture(autouse=True)
def no_capture_thread_left():
    """Every test's pools stop the threads that drain their workers' output (the threads of
    pools other tests left to the garbage collector aside)."""
    before = capture_threads()
    yield
    assert not capture_threads() - before


def test_a_reward_function_printing_10_mb_reaches_neither_the_console_nor_the_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / USER_OUTPUT_FILE
    batch = [req("NOISY Answer: 7"), req("Answer: 7"), req("NOISY Answer: 8")]
    with RewardScorer(
        [(f"{FIXTURES}:noisy", 1.0)], num_workers=1, output=UserOutput(path, LIMIT)
    ) as scorer:
        result = scorer.score(batch)
        printed = 2 * 2 * BIG + len("said Answer: 7\n") + len("warned Answer: 7\n")
        assert scorer.output_dropped == printed - LIMIT  # counted before score() returns
        (pid,) = scorer.worker_pids
    assert result.rewards == [1.0, 1.0, -1.0] and result.failures == 0
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 1000  # 40 MB without the capture
    text = path.read_text()
    assert path.stat().st_size < LIMIT + 400  # the limit, two headers, the line of drops
    assert kept_per_worker_and_step(text) == {f"reward worker {pid}, start-up": LIMIT}
    assert DROPPED.findall(text) == [str(printed - LIMIT)]  # written at the step's end


def test_small_output_is_kept_whole_and_the_limit_starts_again_at_each_step(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / USER_OUTPUT_FILE
    with RewardScorer(
        [(f"{FIXTURES}:noisy", 1.0)], num_workers=2, output=UserOutput(path, LIMIT)
    ) as scorer:
        scorer.output_step("rollout step 1")
        scorer.score([req(f"Answer: {i}") for i in range(6)])
        assert scorer.output_dropped == 0
        scorer.output_step("rollout step 2")
        scorer.score([req("NOISY"), req("NOISY again"), req("NOISY once more")])
        dropped = scorer.output_dropped
    assert dropped >= 3 * 2 * BIG - 2 * LIMIT
    assert not capfd.readouterr().out
    text = path.read_text()
    said = "".join(output_per_worker_and_step(text).values())
    # Each call's lines, whole, in the order its worker printed them. Line breaks aside: a
    # worker's `print` may reach the pipe as the text and then its newline, and another
    # worker's stretch between the two puts the newline on a line of its own.
    flat = said.replace("\n", "")
    for i in range(6):
        assert f"said Answer: {i}warned Answer: {i}" in flat, said
    kept = kept_per_worker_and_step(text)
    step2 = {tag: n for tag, n in kept.items() if tag.endswith("rollout step 2")}
    assert step2 and all(n == LIMIT for n in step2.values())  # each worker's own limit
    assert sum(map(int, DROPPED.findall(text))) == dropped


def test_an_environment_and_a_tool_that_print_are_captured_alike(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / USER_OUTPUT_FILE
    warnings.simplefilter("ignore", EnvironmentWarning)
    spec = load_environment(f"{ENVS}:Noisy")
    with EnvironmentPool(spec, num_workers=1, output=UserOutput(path, LIMIT)) as pool:
        pool.output_step("rollout step 1")
        (o,) = pool.reset([{"prompt": "hi"}])
        pool.step([(o.episode, "quiet")])
        assert pool.output_dropped == 0
        pool.step([(o.episode, "noisy")])
        assert pool.output_dropped == 2 * BIG - (LIMIT - len("heard quiet\ngrumbled quiet\n"))
        (pid,) = pool.worker_pids
    tools = load_environment(tools=[f"{ENVS}:shout"])
    call = '<tool_call>{"name": "shout", "arguments": {"word": "hey"}}</tool_call>'
    with EnvironmentPool(tools, num_workers=1, output=UserOutput(path, LIMIT)) as pool:
        (o,) = pool.reset([{"prompt": "hi"}])
        (r,) = pool.step([(o.episode, call)])
        assert r.messages[0]["content"] == "done" and r.tool_calls == 1
        assert pool.output_dropped == len("hey " * 1_000_000) + 1 - LIMIT
        (tool_pid,) = pool.worker_pids
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 1000
    text = path.read_text()
    assert "heard quiet\ngrumbled quiet\n" in text
    assert kept_per_worker_and_step(text) == {
        f"environment worker {pid}, rollout step 1": LIMIT,
        f"environment worker {tool_pid}, start-up": LIMIT,
    }


def test_without_a_file_the_output_is_kept_in_memory_not_printed(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with RewardScorer([(f"{FIXTURES}:noisy", 1.0)], num_workers=1) as scorer:
        scorer.score([req("hello"), req("NOISY")])
        pool = scorer._pool()
        assert pool is not None
        text = pool.output.text()
    assert "said hello\nwarned hello\n" in text
    assert len(text) < DEFAULT_OUTPUT_LIMIT + 400
    assert not capfd.readouterr().out


def test_the_capture_thread_is_a_daemon_that_ends_with_its_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = capture_threads()
    scorer = RewardScorer([(f"{FIXTURES}:noisy", 1.0)], num_workers=1)
    (thread,) = capture_threads() - before
    assert thread.daemon
    scorer.close()
    assert not thread.is_alive()

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no more processes")

    monkeypatch.setattr("dapo.rewards.pool.start_worker", refuse)
    with pytest.raises(OSError, match="no more processes"):
        RewardScorer([(f"{FIXTURES}:noisy", 1.0)], num_workers=1)
    monkeypatch.setattr("dapo.environments.pool.start_worker", refuse)
    with pytest.raises(OSError, match="no more processes"):
        EnvironmentPool(load_environment(f"{ENVS}:Noisy"), num_workers=1)
    assert not capture_threads() - before


def test_a_worker_that_dies_at_start_up_is_reported_with_the_end_of_its_output(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from printing_fixtures import dies_at_start

    capture = OutputCapture("test worker")
    try:
        proc, conn = start_worker(dies_at_start, output=capture)
        assert proc.wait(30) == 4
        conn.close()
        assert "Traceback: the worker could not start" in capture.last_words(proc.pid)
    finally:
        capture.close()
    monkeypatch.setattr("dapo.rewards.pool.main", dies_at_start)
    with (
        RewardScorer([(f"{FIXTURES}:noisy", 1.0)], num_workers=1) as scorer,
        pytest.raises(
            RuntimeError,
            match=r"(?s)exited with code 4 during start-up; the end of "
            r"its output:\nTraceback: the worker could not start",
        ),
    ):
        scorer.score([req("a")])
    assert "could not start" not in capfd.readouterr().err


# A trainer stand-in: a reward pool whose function hangs; the test SIGKILLs this process.
TRAINER = """
import sys
from dapo.rewards import RewardScorer, ScoreRequest
scorer = RewardScorer([(sys.argv[1], 1.0)], num_workers=1, timeout_s=300)
scorer.score([ScoreRequest("a", "7")])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_sigkilled_trainer_takes_its_reward_workers_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    env = dict(os.environ, DAPO_TEST_PID_FILE=str(pid_file), OMP_NUM_THREADS="1")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, f"{FIXTURES}:hang_and_say_where"], env=env
    )
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        assert _alive(worker)  # in the reward function's sleep(60)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        trainer.kill()
        trainer.wait()


@pytest.mark.slow
def test_dapo_train_keeps_a_reward_that_prints_10_mb_per_call_out_of_the_console(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dapo",
        "train",
        f"output_dir={out}",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.mini_batch_size=2",
        "rollout.num_generations=2",
        "evaluate=false",
        "algorithm.dynamic_sampling=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.user_output_kb=4",
        f"reward.functions=[{FIXTURES}:noisy_always]",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert len(done.stdout) + len(done.stderr) < 20_000  # 160 MB without the capture
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/output_dropped_bytes" in s]
    assert len(steps) == 2
    calls = 2 * 2  # prompts x generations, one round: one worker
    assert [s["reward/output_dropped_bytes"] for s in steps] == [calls * 2 * BIG - LIMIT] * 2
    text = (out / USER_OUTPUT_FILE).read_text()
    kept = {t: n for t, n in kept_per_worker_and_step(text).items() if "rollout step" in t}
    assert [tag.split(", ")[1] for tag in kept] == ["rollout step 1", "rollout step 2"]
    assert all(n == LIMIT for n in kept.values())
    assert DROPPED.findall(text) == [str(calls * 2 * BIG - LIMIT)] * 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, not yet reaped by its new parent) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
