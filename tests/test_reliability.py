"""Reliability: crashes and resume, non-finite updates, misbehaving reward functions, bad
inputs (every row of docs/errors.md), unwritable and full output directories.

The crash tests SIGKILL real ``python -m dapo train`` processes at three moments: during
generation, during an update, and while a checkpoint is being written. The first two are
targeted by asking the process for its Python stack (``faulthandler`` on SIGUSR1, enabled
by a ``sitecustomize`` the test puts on the subprocess's PYTHONPATH: no hook in dapo) and
killing it right after a stack shows the wanted phase; the third by a watcher process that
kills as soon as the ``.tmp-step_*`` directory a checkpoint is written into receives its
first file (a kill that misses its moment starts a fresh run). After each kill every ``step_*``
checkpoint must load, and a resumed run must end with exactly the parameters (and the
per-step metrics) of an uninterrupted run with the same seed.
"""

from __future__ import annotations

import errno
import html
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import dapo.training.checkpoint as ckpt_mod
import dapo.training.learner
import dapo.training.record
import dapo.training.trainer
from dapo.cli import main
from dapo.config import load_config
from dapo.rewards import RewardFunctionWarning
from dapo.training.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from dapo.training.trainer import Trainer, TrainingError

HERE = Path(__file__).parent
REWARDS = HERE / "reliability_rewards.py"
ERRORS_DOC = HERE.parent / "docs" / "errors.md"


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reliability_rewards = _load_module(REWARDS)  # the helpers; workers load it by path too


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two torch threads on two busy cores are ~100x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_dashboard(monkeypatch):
    """The dashboard PNG is not what these tests are about and costs seconds per run."""
    monkeypatch.setattr(dapo.training.record, "plot_dashboard", lambda *a, **k: None)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    """32 small prompts in the reference format (faster to load than builtin:addition)."""
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


def base_overrides(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"data.train={data}",
        f"output_dir={out}",
        "seed=3",
        "train.steps=4",
        "train.prompts_per_step=2",
        "train.mini_batch_size=1",
        "rollout.num_generations=4",
        "rollout.max_completion_length=24",
        "algorithm.overlong_buffer=4",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        "reward.num_workers=1",
        f"reward.functions=[{{name: '{REWARDS}:mixed'}}]",
        *extra,
    ]


def quiet(_: str) -> None:
    pass


def metric_rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows]


# ==========================================================================================
# SIGKILL at three moments, then resume
# ==========================================================================================

# Dynamic sampling stays on (the mixed reward keeps random-model groups mixed), so the
# surplus carried over between steps is part of what a resume must restore. Two one-prompt
# mini-batches split into one-sample micro-batches make updates long enough to hit (and
# need old log-probs, another forward pass); checkpoints after every step give a
# checkpoint write to hit at every step, and keep_last=2 makes saves prune old ones.
CRASH_STEPS = 3
CRASH_EXTRA = (
    f"train.steps={CRASH_STEPS}",
    "train.micro_batch_tokens=64",
    "checkpoint.save_every=1",
    "checkpoint.keep_last=2",
    "checkpoint.save_final_model=true",
)
MOMENTS = ("generation", "update", "checkpoint")
# Kill once this many checkpoints exist: generation in the last step (so its resume starts
# from step 2, which carries a dynamic-sampling surplus with this seed), update in step 2
# or 3, the checkpoint while step 2's (or 3's) is written.
MIN_CHECKPOINTS = {"generation": 2, "update": 1}
SITECUSTOMIZE = (
    "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
)


@dataclass
class Kill:
    """What a killed run looked like."""

    moment: str
    out: Path
    proc: Any = None  # the current process, killed at teardown if still running
    evidence: str = ""  # the stack dumped just before the kill, or the half-written directory
    attempts: int = 0  # processes launched until the kill landed inside the moment
    seconds: float = 0.0
    error: str = ""
    log: list[str] = field(default_factory=list)


def _phase(dump: str) -> str | None:
    """generation / update / checkpoint / other, from the main thread of a faulthandler dump."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    main_blocks = [b for b in blocks if "dapo/cli.py" in b]
    if not main_blocks:
        return None
    stack = main_blocks[-1]
    if "dapo/training/checkpoint.py" in stack:
        return "checkpoint"
    if "dapo/rollout/" in stack:
        return "generation"
    if re.search(r"dapo/training/(learner|forward)\.py", stack):
        # Gradient passes and optimizer steps, not the no-grad pass for the old log-probs.
        return "update-logprobs" if " in compute_logprobs" in stack else "update"
    return "other"


def _handles_sigusr1(pid: int) -> bool:
    """Whether the process has installed its SIGUSR1 handler (else the signal kills it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc: the checkpoint gate below is the only guard
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(caught and int(caught.group(1), 16) >> (signal.SIGUSR1 - 1) & 1)


def _launch(overrides: list[str], out: Path, site: Path, attempt: int) -> tuple[Any, Path]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    err = out.parent / f"{out.name}.stderr.{attempt}"
    cmd = [sys.executable, "-m", "dapo", "train", *overrides]
    with open(err, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=fh)
    return proc, err


def _kill_in_phase(proc: Any, err: Path, ckroot: Path, phase: str, deadline: float) -> str | None:
    """Probe the stack every ~20 ms once enough checkpoints exist; SIGKILL when it shows
    ``phase``."""
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
        ready = len(list(ckroot.glob("step_*"))) >= MIN_CHECKPOINTS[phase]
        if not ready or not _handles_sigusr1(proc.pid):
            continue
        size = err.stat().st_size
        proc.send_signal(signal.SIGUSR1)
        t = time.monotonic()
        while err.stat().st_size == size and time.monotonic() - t < 2 and proc.poll() is None:
            time.sleep(0.001)
        time.sleep(0.003)  # the rest of the dump
        with open(err, errors="replace") as fh:
            fh.seek(size)
            dump = fh.read()
        if _phase(dump) == phase:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return dump
    return None


# A separate, stdlib-only watcher process: it reacts within ~1 ms whatever this process
# (busy with the uninterrupted run, holding the GIL) is doing. It kills once the first file
# of the checkpoint (the weights) is being written into the temporary directory.
WATCHER = """
import os, re, signal, sys, time
root, pid, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
while True:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        names = []
    for name in names:
        m = re.match(r"\\.tmp-step_(\\d+)-", name)
        if m and int(m.group(1)) >= first and os.listdir(os.path.join(root, name)):
            os.kill(pid, signal.SIGKILL)
            print(name, flush=True)
            sys.exit(0)
    time.sleep(0.0005)
"""


def _kill_in_checkpoint_write(proc: Any, ckroot: Path, deadline: float) -> str | None:
    """SIGKILL while a checkpoint of step >= 2 is being written (its temp dir has a file)."""
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(ckroot), str(proc.pid), "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        seen = watcher.communicate()[0].strip()
    if proc.returncode != -signal.SIGKILL or not seen:
        return None
    left = sorted(p.name for p in ckroot.glob(".tmp-step_*"))
    if not left:  # the rename won the race: the kill came just after the write
        return None
    return f"{left[0]}: {sorted(os.listdir(ckroot / left[0]))}"


def _crash(moment: str, overrides: list[str], out: Path, site: Path, result: Kill) -> None:
    """Run until a kill lands inside ``moment``; after a miss, start afresh (3 tries)."""
    t0 = time.monotonic()
    ckroot = out / "checkpoints"
    try:
        for attempt in range(1, 4):
            result.attempts = attempt
            shutil.rmtree(out, ignore_errors=True)
            proc, err = _launch(overrides, out, site, attempt)
            result.proc = proc
            deadline = time.monotonic() + 150
            try:
                if moment == "checkpoint":
                    evidence = _kill_in_checkpoint_write(proc, ckroot, deadline)
                else:
                    evidence = _kill_in_phase(proc, err, ckroot, moment, deadline)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            result.log.append(f"attempt {attempt}: rc {proc.returncode}")
            if evidence is not None:
                result.evidence = evidence
                return
            if proc.returncode not in (0, -signal.SIGKILL):  # it failed: show why
                result.error = err.read_text(errors="replace")[-3000:]
                return
        result.error = f"no kill landed inside the moment in 3 runs: {result.log}"
    except BaseException as exc:  # reported by the test, not lost in the thread
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.seconds = time.monotonic() - t0


@pytest.fixture(scope="module")
def crash_runs(random_tiny_model, train_file, tmp_path_factory):
    """The three killed runs (concurrently) and an uninterrupted one (in this process)."""
    root = tmp_path_factory.mktemp("crash")
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    kills: dict[str, Kill] = {}
    threads = []
    for moment in MOMENTS:
        out = root / moment
        kills[moment] = Kill(moment, out)
        args = base_overrides(random_tiny_model, train_file, out, *CRASH_EXTRA)
        t = threading.Thread(target=_crash, args=(moment, args, out, site, kills[moment]))
        t.start()
        threads.append(t)
    base = root / "uninterrupted"
    t0 = time.monotonic()
    try:
        cfg = load_config(
            overrides=base_overrides(random_tiny_model, train_file, base, *CRASH_EXTRA)
        )
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dapo.training.record, "plot_dashboard", lambda *a, **k: None)
            Trainer(cfg, log=quiet).run()
        base_seconds = time.monotonic() - t0
        for t in threads:
            t.join()
        yield {"kills": kills, "base": base, "base_seconds": base_seconds}
    finally:
        for kill in kills.values():
            if kill.proc is not None and kill.proc.poll() is None:
                kill.proc.kill()
                kill.proc.wait()


def assert_checkpoints_complete(out: Path, model_dir: Path) -> list[int]:
    """Every step_* directory holds a whole, loadable checkpoint of its own step, whose files
    match its manifest."""
    from dapo.models import load_policy
    from dapo.training.manifest import verify_manifest

    model = load_policy(str(model_dir))
    steps = []
    for path in list_checkpoints(out / "checkpoints"):
        assert path.name.startswith("step_"), path
        assert verify_manifest(path) == [], path
        state = load_checkpoint(path, model)
        torch.load(path / "optimizer.pt", weights_only=False)
        assert state["step"] == int(path.name[len("step_") :])
        steps.append(state["step"])
    return steps


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.slow
def test_sigkill_then_resume_ends_like_an_uninterrupted_run(
    moment, crash_runs, random_tiny_model, train_file
):
    kill: Kill = crash_runs["kills"][moment]
    assert not kill.error, f"{moment}: {kill.error}\n{kill.log}"
    out = kill.out
    if moment == "checkpoint":
        # Killed inside the write: the temp directory is there, its step_* is not.
        tmp_name = kill.evidence.split(":")[0]
        step = int(re.match(r"\.tmp-step_(\d+)-", tmp_name).group(1))
        assert (out / "checkpoints" / tmp_name).is_dir()
        assert not (out / "checkpoints" / f"step_{step:06d}").exists()
    else:
        assert _phase(kill.evidence) == moment, kill.evidence
    steps = assert_checkpoints_complete(out, random_tiny_model)
    assert steps and max(steps) < CRASH_STEPS, steps
    logged = [r["step"] for r in metric_rows(out)]
    assert logged and max(logged) >= max(steps)

    cfg = load_config(
        overrides=base_overrides(random_tiny_model, train_file, out, *CRASH_EXTRA, "resume=true")
    )
    summary = Trainer(cfg, log=quiet).run()
    assert summary["steps"] == CRASH_STEPS and summary["resumed_from_step"] == max(steps)
    assert not list((out / "checkpoints").glob(".tmp-*")), "the next save removes strays"
    assert assert_checkpoints_complete(out, random_tiny_model) == [CRASH_STEPS - 1, CRASH_STEPS]

    base = crash_runs["base"]
    want = load_file(str(base / "final_model" / "model.safetensors"))
    got = load_file(str(out / "final_model" / "model.safetensors"))
    assert want.keys() == got.keys()
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"resumed run differs from the uninterrupted one by {worst}"
    # The same metrics at every step: the same data, samples, rewards and updates.
    assert metric_rows(out) == metric_rows(base)


def test_crash_timings_are_reported(crash_runs, record_property):
    """Not a check: puts the kill times and attempts in the JUnit report (and -rA output)."""
    for moment, kill in crash_runs["kills"].items():
        record_property(f"{moment}_seconds", round(kill.seconds, 1))
        record_property(f"{moment}_attempts", kill.attempts)
        frames = re.findall(r'File "[^"]*/(dapo/\w+\.py)", line \d+ in (\w+)', kill.evidence)
        where = " <- ".join(f"{f}:{fn}" for f, fn in frames[:4]) or kill.evidence or kill.error
        print(
            f"{moment}: killed {kill.seconds:.1f} s after launch (attempt {kill.attempts}) "
            f"in {where}"
        )
    print(f"uninterrupted run: {crash_runs['base_seconds']:.1f} s")


# ==========================================================================================
# Non-finite loss or gradients
# ==========================================================================================


NAN_EXTRA = (
    "algorithm.dynamic_sampling=false",
    "train.max_nonfinite_updates=2",
    "train.micro_batch_tokens=100000",  # one micro-batch: one loss call per update
)


def inject_nan(monkeypatch, trainer: Trainer, nan_at: set[tuple[int, int]]) -> dict:
    """Make the loss NaN at (rollout step, update of that step). Returns the weights as
    they were at the latest NaN update: the last good state when training stops there."""
    import dapo.training.learner

    real_loss = dapo.training.learner.alg.compute_loss
    calls: dict[int, int] = {}
    weights_at_nan: dict[str, torch.Tensor] = {}

    def compute_loss(*args, **kwargs):
        step = trainer.step
        k = calls[step] = calls.get(step, -1) + 1
        loss, stats = real_loss(*args, **kwargs)
        if (step, k) in nan_at:
            weights_at_nan.update(
                {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}
            )
            loss = loss * float("nan")
        return loss, stats

    monkeypatch.setattr(dapo.training.learner.alg, "compute_loss", compute_loss)
    return weights_at_nan


def test_nonfinite_updates_are_skipped_counted_and_stop_with_last_good_state(
    random_tiny_model, train_file, tmp_path, monkeypatch
):
    import dapo.training.learner

    real_loss = dapo.training.learner.alg.compute_loss
    out = tmp_path / "run"
    trainer = Trainer(
        load_config(overrides=base_overrides(random_tiny_model, train_file, out, *NAN_EXTRA)),
        log=quiet,
    )
    # Step 1: one bad update of two (skipped, counted; the good one resets the count).
    # Step 2: two bad updates in a row = train.max_nonfinite_updates: stop.
    last_good = inject_nan(monkeypatch, trainer, {(1, 0), (2, 0), (2, 1)})
    with pytest.raises(TrainingError) as info:
        trainer.run()
    msg = str(info.value)
    saved = out / "checkpoints" / "step_000002"
    assert "2 updates in a row had a non-finite loss or gradient" in msg
    assert "stopped at rollout step 2" in msg and str(saved) in msg
    assert "train.lr" in msg and "train.max_nonfinite_updates" in msg

    rows = metric_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/skipped_updates"] == 0 and rows[0]["actor/updates"] == 2
    assert rows[1]["actor/skipped_updates"] == 1 and rows[1]["actor/updates"] == 1

    weights = load_file(str(saved / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert last_good and all(
        torch.equal(weights[n], t) for n, t in last_good.items() if n in weights
    )
    # The saved state resumes (the cause gone) to the end.
    monkeypatch.setattr(dapo.training.learner.alg, "compute_loss", real_loss)
    overrides = base_overrides(random_tiny_model, train_file, out, *NAN_EXTRA, "resume=true")
    assert Trainer(load_config(overrides=overrides), log=quiet).run()["steps"] == 4


def test_resume_keeps_the_count_of_nonfinite_updates_in_a_row(
    random_tiny_model, train_file, tmp_path, monkeypatch
):
    """Uninterrupted, NaN at the last update of step 1 and the first of step 2 stops the
    run (2 in a row). A crash between them (after step 2's checkpoint) must not reset the
    count."""
    out = tmp_path / "run"
    args = base_overrides(random_tiny_model, train_file, out, *NAN_EXTRA, "checkpoint.save_every=1")
    first = Trainer(load_config(overrides=[*args, "train.steps=2"]), log=quiet)
    inject_nan(monkeypatch, first, {(1, 1)})
    first.run()  # "crashes" right after the checkpoint of step 2
    resumed = Trainer(load_config(overrides=[*args, "resume=true"]), log=quiet)
    inject_nan(monkeypatch, resumed, {(2, 0)})
    with pytest.raises(TrainingError, match="2 updates in a row"):
        resumed.run()


# ==========================================================================================
# Reward functions that raise, hang, or return non-numbers
# ==========================================================================================


@pytest.mark.slow
def test_raising_hanging_and_bad_reward_functions_do_not_stop_training(
    random_tiny_model, train_file, tmp_path, monkeypatch
):
    marker = tmp_path / "hung-on"
    monkeypatch.setenv("DAPO_TEST_HANG_MARKER", str(marker))  # the workers inherit it
    out = tmp_path / "run"
    cfg = load_config(
        overrides=base_overrides(
            random_tiny_model,
            train_file,
            out,
            f"reward.functions=[{{name: '{REWARDS}:flaky'}}]",
            "reward.timeout_s=1.0",
            "algorithm.dynamic_sampling=false",
            "train.steps=2",
        )
    )
    trainer = Trainer(cfg, log=quiet)
    responses: list[str] = []
    real_score = trainer.rollouts.scorer.rewards.score

    def score(requests, groups=None):
        responses.extend(r.response for r in requests)
        return real_score(requests, groups)

    trainer.rollouts.scorer.rewards.score = score
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = trainer.run()
    assert summary["steps"] == 2

    hung = reliability_rewards.hung_response(marker)
    assert hung is not None and hung in responses
    kinds = [reliability_rewards.flaky_kind(r) for r in responses]
    expected = sum(k != "ok" for k in kinds) + (reliability_rewards.flaky_kind(hung) == "ok")
    assert expected > 1
    rows = metric_rows(out)
    assert rows[-1]["reward/failures_total"] == expected
    assert sum(r.get("reward/failures", 0) for r in rows) == expected  # per-step counts
    texts = " ".join(
        str(w.message) for w in caught if issubclass(w.category, RewardFunctionWarning)
    )
    assert "took longer than 1 s" in texts and "raised RuntimeError" in texts
    assert "not a finite number" in texts


# ==========================================================================================
# Output directory: not writable, disk full during a checkpoint
# ==========================================================================================


def test_output_dir_under_a_regular_file_fails_before_training(
    random_tiny_model, train_file, tmp_path
):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    cfg = load_config(overrides=base_overrides(random_tiny_model, train_file, blocker / "run"))
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, log=quiet)
    msg = str(info.value)
    assert f"`output_dir` = '{blocker / 'run'}' is not writable (Not a directory)" in msg
    assert "choose another directory" in msg


def _tiny_training_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("failing", ["weights", "optimizer", "trainer-state"])
def test_full_disk_during_save_keeps_earlier_checkpoints(tmp_path, monkeypatch, failing):
    root = tmp_path / "checkpoints"
    model, opt = _tiny_training_state()
    save_checkpoint(root, 1, model, opt, {"step": 1})
    before = _tree(root)
    opt.step()

    def enospc(path: Any) -> None:
        Path(path).write_bytes(b"partial")  # the file system took a few bytes, then filled up
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real_save = torch.save
    if failing == "weights":
        monkeypatch.setattr(ckpt_mod, "save_file", lambda tensors, path: enospc(path))
    else:
        target = "optimizer.pt" if failing == "optimizer" else "trainer_state.pt"

        def save(obj, path, *a, **k):
            if Path(path).name == target:
                enospc(path)
            return real_save(obj, path, *a, **k)

        monkeypatch.setattr(ckpt_mod.torch, "save", save)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, 2, model, opt, {"step": 2})
    msg = str(info.value)
    assert f"could not write the checkpoint of step 2 in {root}" in msg
    assert "No space left" in msg and "Free disk space" in msg and "another output_dir" in msg
    assert "earlier checkpoints are intact" in msg and "resume=true" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert _tree(root) == before  # no temp dir, no step_000002, step_000001 byte-identical
    fresh, fresh_opt = _tiny_training_state(seed=1)
    assert load_checkpoint(root / "step_000001", fresh, fresh_opt) == {"step": 1}


def test_full_disk_during_training_stops_with_a_clear_error_and_resumes(
    random_tiny_model, train_file, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    overrides = base_overrides(
        random_tiny_model,
        train_file,
        out,
        "checkpoint.save_every=1",
        "algorithm.dynamic_sampling=false",
        "train.steps=3",
    )
    real_save_file = ckpt_mod.save_file

    def save_file(tensors, path):
        if "step_000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save_file(tensors, path)

    monkeypatch.setattr(ckpt_mod, "save_file", save_file)
    with pytest.raises(CheckpointError, match="No space left"):
        Trainer(load_config(overrides=overrides), log=quiet).run()
    assert sorted(os.listdir(out / "checkpoints")) == ["step_000001"]
    monkeypatch.setattr(ckpt_mod, "save_file", real_save_file)  # space freed
    summary = Trainer(load_config(overrides=[*overrides, "resume=true"]), log=quiet).run()
    assert summary["steps"] == 3 and summary["resumed_from_step"] == 1


def test_interrupted_resave_and_prune_never_hide_a_checkpoint(tmp_path):
    """Crash windows inside save_checkpoint that the SIGKILL tests cannot aim at."""
    root = tmp_path / "checkpoints"
    model, opt = _tiny_training_state()
    save_checkpoint(root, 1, model, opt, {"step": 1})
    # Killed between moving step_1 aside (to re-save it) and renaming the new one in.
    os.replace(root / "step_000001", root / ".tmp-old-step_000001-999")
    (root / ".tmp-step_000001-999").mkdir()
    assert [p.name for p in list_checkpoints(root)] == [".tmp-old-step_000001-999"]
    fresh, _ = _tiny_training_state(seed=1)
    assert load_checkpoint(list_checkpoints(root)[-1], fresh) == {"step": 1}
    save_checkpoint(root, 2, model, opt, {"step": 2})  # restores step_1, drops the stray
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002"]
    # Pruning renames out of the step_* namespace before deleting: killed in the middle,
    # only a .tmp-del-* directory is left, and the next save removes it.
    (root / ".tmp-del-step_000000-999").mkdir()
    save_checkpoint(root, 3, model, opt, {"step": 3}, keep_last=2)
    assert sorted(os.listdir(root)) == ["step_000002", "step_000003"]


def test_damaged_checkpoint_gives_a_clear_error(tmp_path):
    root = tmp_path / "checkpoints"
    model, opt = _tiny_training_state()
    path = save_checkpoint(root, 1, model, opt, {"step": 1})
    (path / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"could not read .*optimizer\.pt .*damaged"):
        load_checkpoint(path, model, opt)
    (path / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete: trainer_state.pt missing"):
        load_checkpoint(path, model, opt)


def _unshare_available() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


REAL_FS_SCRIPT = """
import sys, os, torch
torch.set_num_threads(1)
from dapo.training.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from dapo.config import load_config
from dapo.training.trainer import Trainer, TrainingError
ro, small = sys.argv[1], sys.argv[2]
try:
    Trainer(load_config(overrides=[f"output_dir={ro}/run"]), log=print)
except TrainingError as exc:
    print("RO:", exc)
torch.manual_seed(0)
model = torch.nn.Linear(1000, 1000)  # 4 MB of weights, 8 MB of Adam state
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 1000)).sum().backward()
opt.step()
save_checkpoint(small, 1, model, opt, {"step": 1})
try:
    save_checkpoint(small, 2, model, opt, {"step": 2})
except CheckpointError as exc:
    print("FULL:", exc)
print("LEFT:", sorted(os.listdir(small)))
print("LOADS:", load_checkpoint(list_checkpoints(small)[-1], model, opt))
"""


@pytest.mark.skipif(not _unshare_available(), reason="needs `unshare -m` and mount (root)")
@pytest.mark.slow
def test_real_read_only_and_full_file_systems(tmp_path):
    """A read-only tmpfs and a 16 MB tmpfs in a private mount namespace (gone with it)."""
    ro, small = tmp_path / "ro", tmp_path / "small"
    ro.mkdir()
    small.mkdir()
    script = tmp_path / "script.py"
    script.write_text(REAL_FS_SCRIPT)
    shell = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {ro} && mount -t tmpfs -o size=16m tmpfs {small} "
        f"&& exec {sys.executable} {script} {ro} {small}/checkpoints"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, env=env, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = {
        ln.split(":", 1)[0]: ln.split(":", 1)[1].strip()
        for ln in res.stdout.splitlines()
        if ":" in ln
    }
    assert lines["RO"] == (
        f"`output_dir` = '{ro}/run' is not writable (Read-only file system); "
        "choose another directory"
    )
    full = lines["FULL"]
    assert f"could not write the checkpoint of step 2 in {small}/checkpoints" in full
    assert "No space left on the file system" in full and "Free disk space" in full
    assert lines["LEFT"] == "['step_000001']"
    assert lines["LOADS"] == "{'step': 1}"


# ==========================================================================================
# Bad configuration and data: every row of docs/errors.md
# ==========================================================================================


@pytest.fixture(scope="module")
def bad_inputs(random_tiny_model, tmp_path_factory) -> Path:
    """A directory of broken files; error messages show it as DIR."""
    d = tmp_path_factory.mktemp("bad")
    good = '{"prompt": "What is 1+1?", "reward_model": {"ground_truth": "2"}}\n'
    files = {
        "empty.jsonl": "",
        "bad_json.jsonl": good + '{"prompt": "What is 2+2?", "reward_model": \n',
        "not_object.jsonl": good + "[1, 2]\n",
        "no_prompt.jsonl": '{"question": "What is 1+1?", "reward_model": {"ground_truth": "2"}}\n',
        "no_answer.jsonl": '{"prompt": "What is 1+1?", "answer": "2"}\n',
        "null_answer.jsonl": '{"prompt": "What is 1+1?", "reward_model": {"ground_truth": null}}\n',
        "empty_prompt.jsonl": good + '{"prompt": "  ", "reward_model": {"ground_truth": "2"}}\n',
        "splits.json": '{"train_a": [], "train_b": []}',
        "data.csv": "prompt,answer\nWhat is 1+1?,2\n",
        "bad.parquet": "PAR1 this is not parquet",
        "config.yaml": "train:\n  lr: [1e-6\n",
        "list.yaml": "- train.lr=1e-6\n",
        "not_a_dir": "a file",
        "fake.gguf": "not a gguf file",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "latin1.jsonl").write_bytes(good.encode() + b'{"prompt": "caf\xe9", "reward_model": 1}\n')
    notok = d / "model_without_tokenizer"
    shutil.copytree(random_tiny_model, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    noweights = d / "model_without_weights"
    shutil.copytree(random_tiny_model, noweights)
    (noweights / "model.safetensors").unlink()
    (d / "has_checkpoints" / "checkpoints" / "step_000001").mkdir(parents=True)
    (d / "header_only.gguf").write_bytes(b"GGUF" + bytes(20))
    try:  # a GGUF file of an architecture transformers cannot read (metadata only)
        import gguf

        w = gguf.GGUFWriter(d / "rwkv.gguf", "rwkv6")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    except ImportError:
        pass  # its case skips
    return d


# id -> (arguments after `dapo train`, substrings that must be in the message)
BAD_INPUTS: dict[str, tuple[list[str], list[str]]] = {
    "unknown-key": (["train.lrr=1e-5"], ["`train.lrr`", "did you mean `train.lr`"]),
    "other-library-name": (["num_train_epochs=3"], ["`num_train_epochs`", "train.steps"]),
    "model-dtype": (["model.dtype=bfloat16"], ["`model.dtype`", "`train.precision`"]),
    "unknown-section": (["trian.lr=1e-5"], ["`trian`", "`train`"]),
    "wrong-type-int": (["train.steps=ten"], ["`train.steps`", "integer", "'ten'"]),
    "wrong-type-number": (["train.lr=fast"], ["`train.lr`", "number", "'fast'"]),
    "wrong-type-bool": (["algorithm.dynamic_sampling=maybe"], ["true or false", "'maybe'"]),
    "not-a-choice": (["algorithm.loss_agg=token_mean"], ["`algorithm.loss_agg`", "'token-mean'"]),
    "not-finite": (["train.lr=.nan"], ["`train.lr`", "finite"]),
    "section-as-value": (["train=5"], ["`train`", "mapping"]),
    "not-key-value": (["train.steps=2", "steps100"], ["'steps100'", "key.path=value"]),
    "unknown-preset": (["preset=dappo"], ["`preset`", "`dapo`", "dapo presets"]),
    "mini-batch-not-divisor": (
        ["train.prompts_per_step=16", "train.mini_batch_size=3"],
        ["`train.mini_batch_size` = 3", "divisor of train.prompts_per_step (16)"],
    ),
    "one-generation": (
        ["rollout.num_generations=1"],
        ["`rollout.num_generations` = 1", "at least 2"],
    ),
    "buffer-too-long": (
        ["rollout.max_completion_length=64", "algorithm.overlong_buffer=64"],
        ["`algorithm.overlong_buffer` = 64", "rollout.max_completion_length (64)"],
    ),
    "zero-lr": (["train.lr=0"], ["`train.lr` = 0.0", "positive"]),
    "top-p-above-1": (["rollout.top_p=1.5"], ["`rollout.top_p` = 1.5", "(0, 1]"]),
    "keep-no-checkpoint": (
        ["checkpoint.keep_last=0"],
        ["`checkpoint.keep_last` = 0", "at least 1"],
    ),
    "gspo-token-mean": (
        ["algorithm.policy_loss=gspo"],
        ["`algorithm.loss_agg` = 'token-mean'", "seq-mean-token-mean"],
    ),
    "dual-clip-not-ppo": (
        ["preset=cispo", "algorithm.clip_c=3"],
        ["`algorithm.clip_c` = 3.0", "policy_loss=cispo"],
    ),
    "dual-clip-kl-cov": (
        ["preset=kl_cov", "algorithm.clip_c=3"],
        ["`algorithm.clip_c` = 3.0", "entropy_control=kl_cov", "entropy_control=clip_cov"],
    ),
    "entropy-control-not-ppo": (
        ["preset=gspo", "algorithm.entropy_control=kl_cov"],
        ["`algorithm.entropy_control` = 'kl_cov'", "policy_loss=ppo"],
    ),
    "is-cap-below-1": (["algorithm.is_cap=0.5"], ["`algorithm.is_cap` = 0.5", ">= 1"]),
    "tis-cap-renamed": (["algorithm.tis_cap=2"], ["`algorithm.tis_cap`", "`algorithm.is_cap`"]),
    "lora-target-missing": (
        ["model.lora.rank=4", "model.lora.target_modules=[q_prj]"],
        ["`model.lora.target_modules`", "'q_prj'", "q_proj"],
    ),
    "skip-cap-one": (
        ["algorithm.skip_uniform_prompts=true", "algorithm.skip_max_prob=1"],
        ["`algorithm.skip_max_prob` = 1.0", "[0, 1)"],
    ),
    "skip-key-missing": (
        ["algorithm.skip_uniform_prompts=true", "algorithm.skip_key=problem_id"],
        ["algorithm.skip_key='problem_id'", "no such field", "['reward_model']"],
    ),
    "difficulty-key-without-curriculum": (
        ["data.difficulty_key=level"],
        ["`data.difficulty_key` = 'level'", "data.curriculum=easy_first"],
    ),
    "difficulty-not-a-number": (
        ["data.curriculum=easy_first", "data.difficulty_key=reward_model"],
        ["data.difficulty_key='reward_model'", "not a finite number"],
    ),
    "vllm-not-installed": (
        ["rollout.engine=vllm"],
        ["vLLM is not installed", "pip install 'dapo[vllm]'"],
    ),
    "server-without-url": (
        ["rollout.engine=vllm-server"],
        ["`rollout.server_url` = None", "dapo vllm-serve"],
    ),
    "server-not-running": (
        [
            "rollout.engine=vllm-server",
            "rollout.server_url=http://127.0.0.1:9",
            "rollout.server_timeout_s=1",
        ],
        ["no rollout server answers at http://127.0.0.1:9", "dapo vllm-serve MODEL --port 9"],
    ),
    "max-staleness-out-of-range": (
        ["rollout.max_staleness=65"],
        ["`rollout.max_staleness` = 65", "in [0, 64]"],
    ),
    "partial-rollouts-without-staleness": (
        ["rollout.partial_rollouts=true"],
        ["`rollout.partial_rollouts` = True", "rollout.max_staleness >= 1"],
    ),
    "async-steps-and-max-staleness": (
        ["rollout.async_steps=1", "rollout.max_staleness=2"],
        ["`rollout.async_steps` = 1", "give only `rollout.max_staleness`"],
    ),
    "async-with-top-p": (
        ["rollout.max_staleness=1", "rollout.top_p=0.9", "algorithm.is_cap=null"],
        ["`rollout.max_staleness` = 1", "algorithm.is_cap"],
    ),
    "loglinear-without-streaming": (
        ["algorithm.proximal_logprobs=loglinear"],
        ["`algorithm.proximal_logprobs` = 'loglinear'", "rollout.max_staleness > 0"],
    ),
    "staleness-with-sync-every": (
        ["rollout.engine=vllm", "rollout.max_staleness=1", "rollout.vllm_sync_every=2"],
        ["`rollout.vllm_sync_every` = 2", "use 1"],
    ),
    "config-file-missing": (["DIR/missing.yaml"], ["config file not found", "DIR/missing.yaml"]),
    "config-file-not-yaml": (["DIR/config.yaml"], ["DIR/config.yaml", "not valid YAML"]),
    "config-file-not-mapping": (["DIR/list.yaml"], ["DIR/list.yaml", "mapping"]),
    "data-missing": (["data.train=DIR/missing.parquet"], ["DIR/missing.parquet", "not found"]),
    "data-unsupported-type": (["data.train=DIR/data.csv"], ["'.csv'", ".parquet, .jsonl or .json"]),
    "data-empty": (["data.train=DIR/empty.jsonl"], ["DIR/empty.jsonl", "empty", "0 rows"]),
    "data-invalid-json": (["data.train=DIR/bad_json.jsonl"], ["row 1 (line 2)", "invalid JSON"]),
    "data-row-not-object": (["data.train=DIR/not_object.jsonl"], ["row 1 (line 2)", "list"]),
    "data-not-utf8": (["data.train=DIR/latin1.jsonl"], ["line 2", "not UTF-8"]),
    "data-prompt-key-missing": (
        ["data.train=DIR/no_prompt.jsonl"],
        ["row 0", "'prompt'", "['question', 'reward_model']"],
    ),
    "data-answer-missing": (
        ["data.train=DIR/no_answer.jsonl"],
        ["'reward_model.ground_truth'", "answer_key"],
    ),
    "data-answer-null": (["data.train=DIR/null_answer.jsonl"], ["row 0", "ground truth is None"]),
    "data-empty-prompt": (["data.train=DIR/empty_prompt.jsonl"], ["row 1", "empty prompt"]),
    "data-json-several-splits": (
        ["data.train=DIR/splits.json"],
        ["['train_a', 'train_b']", "split"],
    ),
    "data-corrupt-parquet": (["data.train=DIR/bad.parquet"], ["DIR/bad.parquet", "parquet"]),
    "prompts-all-too-long": (["data.max_prompt_length=4"], ["data.max_prompt_length=4", "raise"]),
    "model-missing": (
        ["model.name_or_path=DIR/no_such_model"],
        ["`model.name_or_path`", "no such directory"],
    ),
    "model-is-a-file": (
        ["model.name_or_path=DIR/not_a_dir"],
        ["`model.name_or_path`", "is a file"],
    ),
    "gguf-not-gguf": (
        ["model.name_or_path=DIR/fake.gguf"],
        ["not a GGUF file", "download it again"],
    ),
    "gguf-not-installed": (
        ["model.name_or_path=DIR/header_only.gguf"],
        ["`gguf` package", "pip install 'dapo[gguf]'"],
    ),
    "gguf-unsupported-architecture": (
        ["model.name_or_path=DIR/rwkv.gguf"],
        ["'rwkv6'", "cannot be read by transformers", "config.json"],
    ),
    "model-without-tokenizer": (
        ["model.name_or_path=DIR/model_without_tokenizer"],
        ["has no tokenizer", "`model.tokenizer`"],
    ),
    "tokenizer-missing": (
        ["model.tokenizer=DIR/no_tokenizer"],
        ["`model.tokenizer`", "no such directory"],
    ),
    "model-without-weights": (
        ["model.name_or_path=DIR/model_without_weights"],
        ["could not load the model", "weights"],
    ),
    "longer-than-context": (
        ["data.max_prompt_length=1000", "rollout.max_completion_length=100"],
        ["data.max_prompt_length (1000)", "rollout.max_completion_length (100)", "context"],
    ),
    "reward-file-missing": (
        ["reward.functions=[{name: 'DIR/rewards.py:score'}]"],
        ["DIR/rewards.py", "not found"],
    ),
    "reward-not-a-function": (
        ["reward.functions=[{name: 'HERE/reliability_rewards.py:os'}]"],
        ["'os'", "not a function"],
    ),
    "reward-unknown-name": (["reward.functions=[{name: 'math'}]"], ["'math'", "built-in scorer"]),
    "output-dir-under-a-file": (["output_dir=DIR/not_a_dir/run"], ["`output_dir`", "not writable"]),
    "output-dir-has-a-run": (
        ["output_dir=DIR/has_checkpoints"],
        ["resume=true", "another output_dir"],
    ),
}


def _documented() -> dict[str, tuple[str, str]]:
    """id -> (exit code, message) from the table of docs/errors.md."""
    rows = {}
    for line in ERRORS_DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            message = html.unescape(cells[4].replace("\\|", "|"))
            rows[cells[0].strip("`")] = (cells[3], message)
    return rows


def _matches(documented: str, actual: str) -> bool:
    """Exact, except that `[...]` in the documentation stands for any text."""
    pattern = ".*?".join(re.escape(part) for part in documented.split("[...]"))
    return re.fullmatch(pattern, actual, flags=re.S) is not None


def _documented_round_cap_messages() -> list[str]:
    """The messages of the round-cap rows of "Problems while training" in docs/errors.md."""
    rows = []
    for line in ERRORS_DOC.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and "dynamic sampling" in cells[2]:
            rows.append(html.unescape(cells[2].strip("`")))
    return rows


def _matches_with_placeholders(documented: str, actual: str) -> bool:
    """The documented message with its placeholders: a lone capital letter (S, R, H, ...)
    stands for a number, `(...)`, `...` and `[the advice above]` for any text."""
    pattern = re.escape(documented)
    for placeholder in (r"\(\.\.\.\)", r"\.\.\.", r"\[the\ advice\ above\]"):
        pattern = pattern.replace(placeholder, ".*?")
    pattern = re.sub(r"\b[A-Z]\b", r"\\d+", pattern)
    return re.fullmatch(pattern, actual, flags=re.S) is not None


def test_round_cap_messages_are_the_documented_ones():
    """Both round_cap settings, a step without signal and the stop after max_empty_steps
    give the messages of docs/errors.md (the trainer warns with "rollout step S: " + note)."""
    from dapo.errors import DynamicSamplingError
    from dapo.producer.dynamic_sampling import DynamicSampler, ScoredGroup

    def group(correct: list[bool]) -> ScoredGroup:
        n = len(correct)
        return ScoredGroup(
            [1], [[2]] * n, [[0.0]] * n, [False] * n, [float(c) for c in correct], correct
        )

    def produce_one_mixed(k: int) -> list[ScoredGroup]:
        return [group([True, False])] + [group([False, False]) for _ in range(k - 1)]

    def produce_all_wrong(k: int) -> list[ScoredGroup]:
        return [group([False, False]) for _ in range(k)]

    documented = _documented_round_cap_messages()
    assert len(documented) == 4, documented
    short_doc, skipped_doc, stopped_doc, stop_doc = documented

    def sampler(cap: str) -> DynamicSampler:
        return DynamicSampler(4, max_rounds=2, round_cap=cap, max_empty_steps=2)

    train = sampler("train")
    batch, stats = train.fill(produce_one_mixed)
    assert 0 < len(batch) < 4 and stats.short
    assert _matches_with_placeholders(short_doc, f"rollout step 3: {stats.note}"), (
        short_doc,
        stats.note,
    )
    batch, stats = train.fill(produce_all_wrong)
    assert batch == [] and stats.short
    assert _matches_with_placeholders(skipped_doc, f"rollout step 4: {stats.note}"), (
        skipped_doc,
        stats.note,
    )
    with pytest.raises(DynamicSamplingError) as stopped:
        train.fill(produce_all_wrong)
    assert _matches_with_placeholders(stopped_doc, str(stopped.value)), (
        stopped_doc,
        str(stopped.value),
    )
    with pytest.raises(DynamicSamplingError) as stop:
        sampler("stop").fill(produce_one_mixed)
    assert _matches_with_placeholders(stop_doc, str(stop.value)), (stop_doc, str(stop.value))
    # The placeholders stand for numbers and elided text only: the wrong setting's message fails.
    assert not _matches_with_placeholders(stop_doc, f"rollout step 3: {stats.note}")


def test_every_bad_input_is_documented():
    assert set(_documented()) == set(BAD_INPUTS)


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_the_documented_error(
    case, bad_inputs, random_tiny_model, train_file, capsys, monkeypatch
):
    monkeypatch.chdir(bad_inputs)
    if case == "vllm-not-installed":  # as on a machine without the optional extra
        from dapo.rollout import vllm_engine

        monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    if case == "gguf-not-installed":
        from dapo.models import gguf as dapo_gguf

        monkeypatch.setattr(dapo_gguf, "gguf_available", lambda: False)
    if case == "gguf-unsupported-architecture":
        pytest.importorskip("gguf", reason="the gguf extra is not installed")
    args, fragments = BAD_INPUTS[case]
    args = [a.replace("DIR", str(bad_inputs)).replace("HERE", str(HERE)) for a in args]
    base = [
        f"model.name_or_path={random_tiny_model}",
        f"data.train={train_file}",
        f"output_dir={bad_inputs / 'out' / case}",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "train.steps=1",
    ]
    # A config file comes first; overrides last, so that they win over the base ones.
    argv = ["train", args[0], *base] if args[0].endswith(".yaml") else ["train", *base, *args]
    rc = main(argv)
    err = capsys.readouterr().err.replace(str(bad_inputs), "DIR").replace(str(HERE), "HERE")
    start = re.search(r"(?m)^dapo: ", err)  # after any progress bars
    err = err[start.start() if start else 0 :].strip()
    assert rc != 0 and err.startswith("dapo: ")
    for fragment in fragments:
        assert fragment in err, (case, fragment, err)
    code, message = _documented()[case]
    assert code == str(rc), (case, rc, err)
    assert _matches(message, err), f"{case}: docs/errors.md says\n{message}\nactual:\n{err}"
