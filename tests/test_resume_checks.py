"""What ``resume=true`` refuses, drops or says, checked from the checkpoint's trainer state
before the model, the tokenizer or the data load (``dapo.training.resume``).

One real 1-step run (a random tiny model, 32 prompts, well under a second) gives the
checkpoint; each test resumes a copy of it. The loaders are patched to fail where a test
asserts that nothing loads.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import dapo
import dapo.models
import dapo.training.learner
import dapo.training.loading
import dapo.training.trainer
from dapo.cli import main
from dapo.config import Config, load_config
from dapo.errors import NothingToTrain, TrainingError
from dapo.training.checkpoint import read_trainer_state
from dapo.training.learner import Learner
from dapo.training.resume import (
    RULES,
    check_before_loading,
    config_keys,
    continue_state,
    drop_note,
    flatten,
    nothing_to_train,
    refusal,
    rules_table,
    world_size_note,
)
from dapo.training.trainer import Trainer

HERE = Path(__file__).parent
DOCS = HERE.parent / "docs"
REWARDS = HERE / "reliability_rewards.py"
STEP_1 = Path("checkpoints") / "step_000001"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two torch threads on two busy cores are ~100x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
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


@pytest.fixture(scope="module")
def paths(random_tiny_model, train_file) -> dict[str, Path]:
    return {"model": random_tiny_model, "data": train_file}


def overrides(paths: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """A 1-step run that checkpoints; with dynamic sampling, so that it carries a group over."""
    return [
        f"model.name_or_path={paths['model']}",
        f"data.train={paths['data']}",
        f"output_dir={out}",
        "seed=3",
        "train.steps=1",
        "train.prompts_per_step=2",
        "train.mini_batch_size=1",
        "rollout.num_generations=4",
        "rollout.max_completion_length=24",
        "algorithm.overlong_buffer=4",
        "evaluate=false",
        "health.enabled=false",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        "checkpoint.save_every=1",
        "checkpoint.save_final_model=false",
        "reward.num_workers=0",
        f"reward.functions=[{{name: '{REWARDS}:mixed'}}]",
        *extra,
    ]


@pytest.fixture(scope="module")
def finished(paths, tmp_path_factory) -> Path:
    """The output directory of a finished 1-step run (copy it before resuming)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    Trainer(load_config(overrides=overrides(paths, out)), log=lambda _: None).run()
    return out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run to resume."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


@pytest.fixture
def nothing_loads(monkeypatch) -> None:
    """Every way to the tokenizer, the data, the policy or a built-in model's build fails."""

    def fail(what: str) -> Any:
        def loaded(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{what} was called: the check came too late")

        return loaded

    monkeypatch.setattr(dapo.training.trainer, "load_spec_and_tokenizer", fail("tokenizer"))
    monkeypatch.setattr(dapo.training.trainer, "Rollouts", fail("the prompts"))
    monkeypatch.setattr(dapo.training.loading, "resolve_model_path", fail("the model path"))
    monkeypatch.setattr(dapo.training.loading, "load_tokenizer", fail("load_tokenizer"))
    monkeypatch.setattr(Learner, "from_config", fail("Learner.from_config"))
    monkeypatch.setattr(dapo.training.learner, "load_policy", fail("load_policy"))
    monkeypatch.setattr(dapo.models, "load_policy", fail("load_policy"))


def resumed(paths: dict[str, Path], out: Path, *extra: str) -> Config:
    return load_config(overrides=overrides(paths, out, "resume=true", "train.steps=2", *extra))


# --- every key has a rule, and the docs say the same --------------------------------------


def test_every_config_key_has_a_rule():
    """A key added to the schema fails here until RULES (src/dapo/training/resume.py) says
    whether a resumed run may change it."""
    keys = config_keys()
    assert set(keys) == set(flatten(Config().to_dict()))  # every leaf, nested ones too
    missing = [k for k in keys if k not in RULES]
    assert not missing, f"add a rule for each to RULES in dapo/training/resume.py: {missing}"
    assert set(RULES) == set(keys), f"rules of no key: {set(RULES) - set(keys)}"
    for key, rule in RULES.items():
        assert rule.why and not rule.why.endswith("."), key
        assert not (rule.refused and rule.drops), key


def test_the_docs_table_is_the_rules():
    text = (DOCS / "guides" / "checkpoints.md").read_text()
    table = re.search(r"<!-- resume-rules:start[^>]*-->(.*)<!-- resume-rules:end -->", text, re.S)
    assert table, "docs/guides/checkpoints.md lost its resume-rules markers"
    assert table.group(1).strip() == rules_table().strip(), (
        "docs/guides/checkpoints.md is behind RULES: put the output of `python -c 'from "
        "dapo.training.resume import rules_table; print(rules_table())'` between its markers"
    )


def test_the_documented_messages_are_the_code_s():
    """The rows of docs/errors.md tested here quote the messages exactly."""
    documented = []
    for line in (DOCS / "errors.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and "test_resume_checks.py" in cells[3]:
            documented.append(html.unescape(re.match(r"`([^`]*)`", cells[2]).group(1)))
    old, new = Config(), Config()
    old.data.train, new.data.train = "DIR/train.jsonl", "DIR/other.jsonl"
    carry = {"sampler": {"carry": [{}]}, "rollout_queue": None}
    steps = load_config(overrides=["output_dir=/nonexistent", "train.steps=1"])
    assert documented == [
        refusal(old.to_dict(), new.to_dict(), Path("OUT/checkpoints/step_000001")),
        nothing_to_train({"step": 2, "summary": {}}, steps),
        drop_note(carry, [("rollout.num_generations", 4, 2)]),
        world_size_note(2, 1, 2),
    ]


# --- refused before anything loads --------------------------------------------------------


def test_a_changed_model_is_refused_without_loading_it(paths, run, nothing_loads, capsys):
    """builtin:tiny-long would first be built (minutes): the refusal comes before."""
    cfg = resumed(paths, run, "model.name_or_path=builtin:tiny-long")
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, log=lambda _: None)
    model = paths["model"]
    assert str(info.value) == (
        f"cannot resume from {run / STEP_1}: model.name_or_path '{model}' there, "
        "'builtin:tiny-long' now (the checkpoint holds that model's weights). Resume with "
        f"model.name_or_path={model}, or choose a new output_dir to start a new run."
    )
    # The command line: one line, exit code 1.
    argv = ["train", *overrides(paths, run, "resume=true", "model.name_or_path=builtin:tiny-long")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"dapo: error: {info.value}"


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("data.train=OTHER", "data.train"),
        ("seed=4", "seed"),
        ("data.shuffle=false", "data.shuffle"),
        ("data.max_prompt_length=100", "data.max_prompt_length"),
        ("train.weight_decay=0.0", "train.weight_decay"),
        ("algorithm.skip_uniform_prompts=true algorithm.skip_key=problem_id", "algorithm.skip_key"),
    ],
)
def test_a_refused_change_stops_before_anything_loads(paths, run, nothing_loads, change, key):
    other = run.parent / "other.jsonl"
    shutil.copy(paths["data"], other)
    cfg = resumed(paths, run, *change.replace("OTHER", str(other)).split())
    with pytest.raises(TrainingError) as info:
        Trainer(cfg, log=lambda _: None)
    message = str(info.value)
    old = flatten(read_trainer_state(run / STEP_1)["config"])[key]
    assert message.startswith(f"cannot resume from {run / STEP_1}: {key} {old!r} there, ")
    assert RULES[key].why in message and "\n" not in message
    assert "choose a new output_dir to start a new run" in message


def test_several_refused_keys_are_named_in_one_line():
    old, new = Config(), Config()
    new.seed, new.data.shuffle = 1, False
    message = refusal(old.to_dict(), new.to_dict(), Path("ckpt"))
    assert message is not None and "\n" not in message
    assert "data.shuffle True there, False now (" in message and "seed 0 there, 1 now (" in message
    assert "Resume with data.shuffle=true, seed=0, or choose a new output_dir" in message


def test_refusals_that_matter_only_in_some_runs():
    """LoRA's alpha and layers without LoRA, the history's key without a history: free."""
    base = Config()
    for edit in (
        lambda c: setattr(c.model.lora, "alpha", 8.0),
        lambda c: setattr(c.model.lora, "target_modules", ["q_proj"]),
        lambda c: setattr(c.algorithm, "skip_key", "problem_id"),
    ):
        new = Config()
        edit(new)
        assert refusal(base.to_dict(), new.to_dict(), Path("ckpt")) is None
        lora = Config()
        lora.model.lora.rank, lora.algorithm.skip_uniform_prompts = 4, True
        changed = Config()
        changed.model.lora.rank, changed.algorithm.skip_uniform_prompts = 4, True
        edit(changed)
        assert refusal(lora.to_dict(), changed.to_dict(), Path("ckpt")) is not None
    # A key the checkpoint's config lacks (added since its release) is not compared.
    saved = Config().to_dict()
    del saved["seed"]
    new = Config()
    new.seed = 5
    assert refusal(saved, new.to_dict(), Path("ckpt")) is None


# --- free changes that drop the held groups ----------------------------------------------


def test_a_changed_group_size_drops_the_carry_over_and_trains_on(paths, run):
    """The checkpoint carries a group of 4 responses over; with G=2 it is dropped (before,
    the first step stopped: all groups of a batch must have the same number of responses)."""
    assert len(read_trainer_state(run / STEP_1)["sampler"]["carry"]) == 1
    lines: list[str] = []
    with pytest.warns(UserWarning, match=r"rollout.num_generations 4 -> 2, train.steps 1 -> 2"):
        summary = Trainer(resumed(paths, run, "rollout.num_generations=2"), log=lines.append).run()
    assert (
        "rollout.num_generations 4 -> 2: dropping the checkpoint's 1 carried-over group (made "
        "under the old setting; not trained on)"
    ) in lines
    assert summary["resumed_from_step"] == 1 and summary["steps"] == 2


def test_continue_state_drops_what_the_changes_make_unusable():
    group = {"response_ids": [[1]] * 4}
    saved = Config()
    saved.rollout.max_staleness = 1
    state = {
        "config": saved.to_dict(),
        "sampler": {"carry": [group, group], "keep_rate": 0.5, "empty_in_a_row": 0},
        "rollout_queue": {"3": {"groups": [group], "metrics": {}}},
    }

    def after(edit: Any) -> tuple[int, int]:
        cfg = Config()
        cfg.rollout.max_staleness = 1
        edit(cfg)
        out = continue_state(state, cfg.to_dict())
        return len(out["sampler"]["carry"]), len(out["rollout_queue"] or {})

    assert after(lambda c: None) == (2, 1)
    assert after(lambda c: setattr(c.train, "lr", 1e-5)) == (2, 1)
    assert after(lambda c: setattr(c.rollout, "num_generations", 16)) == (0, 0)
    assert after(lambda c: setattr(c.rollout, "temperature", 0.7)) == (0, 0)
    assert after(lambda c: setattr(c.rollout, "max_staleness", 2)) == (2, 0)
    assert after(lambda c: setattr(c.algorithm, "dynamic_sampling", False)) == (0, 1)
    assert len(state["sampler"]["carry"]) == 2  # the loaded state itself is left alone
    # A key the checkpoint's config lacks (added since its release) drops nothing.
    older = {**state, "config": {k: v for k, v in state["config"].items() if k != "rollout"}}
    assert len(continue_state(older, Config().to_dict())["rollout_queue"]) == 1
    changes = [("rollout.max_staleness", 1, 2), ("train.lr", 1e-4, 1e-5)]
    assert drop_note(state, changes) == (
        "rollout.max_staleness 1 -> 2: dropping the checkpoint's 1 batch filled ahead (made "
        "under the old setting; not trained on)"
    )
    assert drop_note(state, [("train.lr", 1e-4, 1e-5)]) is None


# --- nothing to train ----------------------------------------------------------------------


def test_nothing_to_train_exits_0_from_the_cli_before_anything_loads(
    paths, run, nothing_loads, capsys
):
    assert main(["train", *overrides(paths, run, "resume=true")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == (
        "already at step 1 (train.steps=1): nothing to train; raise train.steps to continue"
    )


def test_nothing_to_train_returns_the_saved_summary_from_python(paths, run, nothing_loads):
    cfg = load_config(overrides=overrides(paths, run, "resume=true"))
    saved = json.loads((run / "summary.json").read_text())
    assert saved["steps"] == 1
    assert dapo.train(cfg) == saved
    with pytest.raises(NothingToTrain) as info:
        Trainer(cfg, log=lambda _: None)
    assert info.value.step == 1 and info.value.summary == saved


def test_when_there_is_nothing_to_train(tmp_path):
    def line(step: int, *extra: str, summary: dict | None = None, **state: Any) -> str | None:
        (tmp_path / "summary.json").unlink(missing_ok=True)
        if summary is not None:
            (tmp_path / "summary.json").write_text(json.dumps(summary))
        cfg = load_config(overrides=[f"output_dir={tmp_path}", *extra])
        return nothing_to_train({"step": step, "summary": {}, **state}, cfg)

    done = "already at step 3 (train.steps=2): nothing to train; raise train.steps to continue"
    assert line(3, "train.steps=2") == done
    assert line(2, "train.steps=3") is None
    assert line(3, "train.steps=0") is None  # evaluates the checkpoint
    # At exactly train.steps: nothing to do once the run finished, else it finishes.
    assert line(2, "train.steps=2", summary={"steps": 2}) is not None
    assert line(2, "train.steps=2") is None
    assert line(2, "train.steps=2", summary={"steps": 2, "error": "KeyboardInterrupt"}) is None
    assert line(2, "train.steps=5", "train.sample_budget=100", samples_generated=128) == (
        "already generated 128 responses at step 2 (train.sample_budget=100): nothing to "
        "train; raise train.sample_budget to continue"
    )


# --- another world size --------------------------------------------------------------------


def test_another_world_size_is_said_in_one_line(paths, run):
    state = read_trainer_state(run / STEP_1)
    assert state["world_size"] == 1  # recorded by every checkpoint
    cfg = resumed(paths, run)
    lines: list[str] = []
    with pytest.warns(UserWarning, match="train.steps 1 -> 2"):
        check_before_loading(cfg, run / STEP_1, 1, lines.append)
    assert lines == []
    state["world_size"] = 2  # as a 2-rank run would have saved it
    torch.save(state, run / STEP_1 / "trainer_state.pt")
    with pytest.warns(UserWarning, match="train.steps 1 -> 2"):
        check_before_loading(cfg, run / STEP_1, 1, lines.append)
    assert lines == [
        "resuming a run of 2 ranks on 1: weights, optimizer state and data position carry "
        "over; sampling seeds are per rank, so from step 1 the run follows a 1-rank "
        "trajectory, not the 2-rank one it would have"
    ]
    assert world_size_note(1, 2, 5) == (
        "resuming a run of 1 rank on 2: weights, optimizer state and data position carry "
        "over; sampling seeds are per rank, so from step 5 the run follows a 2-rank "
        "trajectory, not the 1-rank one it would have"
    )
    assert world_size_note(None, 2, 5) is None  # a checkpoint from before it was recorded
