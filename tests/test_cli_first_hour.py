"""The command line a new user meets first: help, --print-prompt, dapo show, Ctrl-C,
compact warnings and the summary's failure counts."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from test_transcripts import TOK, episode_group, single_turn  # tests/test_transcripts.py

import dapo.cli
from dapo.cli import _print_summary, compact_warnings, main
from dapo.environments import EnvironmentWarning
from dapo.metrics import TranscriptWriter, transcript_records
from dapo.models.tiny import BUILD_ENV


def test_help_mentions_multi_turn_and_the_python_entry_point(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert main(["train", "--help"]) == 0
    train = capsys.readouterr().out
    for text in (top, train):
        for key in ("rollout.environment", "rollout.tools", "rollout.max_turns", "dapo.train"):
            assert key in text, key
    assert "show" in top and "--print-prompt" in train and "builtin:tiny-tool" in train


def test_print_prompt_renders_a_single_turn_prompt_without_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(BUILD_ENV, "1")  # a model asked for would be built
    assert main(["train", "--print-prompt", "data.train=builtin:addition"]) == 0
    out, err = capsys.readouterr()
    from dapo.data.tasks import load_task

    first = load_task("builtin:addition", "train", 1)[0]
    assert out == first.prompt + ("" if first.prompt.endswith("\n") else "\n")
    assert f"{len(first.prompt)} tokens" in err and "data.max_prompt_length=128" in err
    assert not (tmp_path / "cache").exists()  # no built-in model was built


def test_print_prompt_shows_a_multi_turn_opening_with_its_tools(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(BUILD_ENV, "1")  # a model asked for would be built
    argv = [
        "train",
        "--print-prompt",
        "model.name_or_path=builtin:tiny-tool",
        "data.train=builtin:calculator",
        "rollout.environment=calculator",
        "rollout.max_turns=3",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "multi-turn opening" in err
    from dapo.data.tasks import load_task

    (message,) = load_task("builtin:calculator", "train", 1)[0].prompt  # reset's opening
    # The tools, then the opening, as builtin:tiny-tool's template renders them.
    assert out == f"tools: add\nU: {message['content']}\nA: \n"
    assert not (tmp_path / "cache").exists()


def test_show_prints_the_rollouts_of_a_step(tmp_path, capsys):
    with TranscriptWriter(tmp_path) as w:
        w.write(transcript_records(1, [single_turn()], None, TOK, k=1, seed=0))
        w.write(transcript_records(2, [episode_group()], [[0.5, -0.5]], TOK, k=2, seed=0))
    assert main(["show", str(tmp_path), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("step 2  group 0") == 2 and "step 1 " not in out
    assert "--- environment (" in out and "tool call add(" in out
    assert main(["show", str(tmp_path)]) == 0  # the last step by default
    assert "step 2  group 0" in capsys.readouterr().out
    assert main(["show", str(tmp_path), "--last", "2"]) == 0
    assert "step 1  group 0" in capsys.readouterr().out
    assert main(["show", str(tmp_path), "--step", "9"]) == 2
    assert "no rollouts of step 9 (steps: 1..2)" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "none")]) == 1
    assert "no transcripts at" in capsys.readouterr().err


def test_ctrl_c_prints_one_line_with_the_checkpoint_and_how_to_resume(
    tmp_path, monkeypatch, capsys
):
    class Interrupted:
        def __init__(self, cfg):
            (Path(cfg.output_dir) / "checkpoints" / "step_000004").mkdir(parents=True)

        def run(self):
            raise KeyboardInterrupt

    monkeypatch.setattr("dapo.training.trainer.Trainer", Interrupted)
    out = tmp_path / "run"
    assert main(["train", f"output_dir={out}", "train.steps=9"]) == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"last checkpoint: {out / 'checkpoints' / 'step_000004'}" in line
    assert line.endswith(f"dapo train output_dir={out} train.steps=9 resume=true")


def test_dapo_warnings_are_one_line_under_dapo_train():
    path = str(Path(dapo.cli.__file__).with_name("config") / "rules.py")
    with compact_warnings():
        ours = warnings.formatwarning("it hung", EnvironmentWarning, "/x/user.py", 3, "src")
        inside = warnings.formatwarning("risky", UserWarning, path, 80, "warnings.warn(")
        theirs = warnings.formatwarning("old", DeprecationWarning, "/x/user.py", 3, "src")
    assert ours == "EnvironmentWarning: it hung\n" and inside == "UserWarning: risky\n"
    assert "/x/user.py:3" in theirs  # other code's warnings keep their source
    assert "/x/user.py" in warnings.formatwarning("m", EnvironmentWarning, "/x/user.py", 3, "")


def test_the_summary_prints_failure_counts(tmp_path, capsys):
    _print_summary({"steps": 3, "wall_seconds": 1, "failures": {"reward": 5, "env": 0}}, tmp_path)
    out = capsys.readouterr().out
    assert "failures: reward 5 (" in out and "env 0" not in out
    assert f"dashboard: {tmp_path / 'dashboard.png'}" in out
    _print_summary({"steps": 3, "wall_seconds": 1}, tmp_path, dashboard=False)
    out = capsys.readouterr().out
    assert "failures" not in out
    assert f"dashboard: off (dapo plot {tmp_path} draws it)" in out


@pytest.fixture(autouse=True)
def _restore_warning_format():
    original = warnings.formatwarning
    yield
    warnings.formatwarning = original


RUN_WITH_A_LATE_THREAD = """
import atexit, sys, threading, time
import dapo.cli

def fake_main():
    def late_writer():
        time.sleep(0.3)
        print("thread done", flush=True)
    threading.Thread(target=late_writer).start()
    atexit.register(print, "atexit ran")
    print("buffered, not flushed", end="")
    return 3

dapo.cli.main = fake_main
dapo.cli.run()
print("never printed")
"""


def test_the_dapo_command_waits_for_threads_and_exit_functions_then_exits_with_mains_status():
    """``run`` skips the interpreter's teardown but nothing a run still owes: a non-daemon
    thread finishes, atexit functions run, buffered output is flushed, and the status is
    main's."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITH_A_LATE_THREAD], capture_output=True, text=True
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, not flushedthread done\natexit ran\n"


def test_python_dash_m_dapo_prints_and_returns_the_status():
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "dapo", "presets"], capture_output=True, text=True)
    assert ok.returncode == 0 and "dapo" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "dapo", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr
