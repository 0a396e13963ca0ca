"""The Python API (dapo.train, dapo.make_trainer, dapo.make_config) on a random tiny model."""

from __future__ import annotations

import gc
import json
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from ranks import torchrun  # tests/ranks.py
from trainer_rewards import by_answer_class  # tests/trainer_rewards.py

import dapo
from dapo.cli import main as cli_main
from dapo.config import ConfigError, load_config
from dapo.data.tasks import load_task
from dapo.errors import ModelError, RewardFunctionWarning, TrainingError

HERE = Path(__file__).parent
ROOT = HERE.parent

# A 2-step run of 4 prompts x 4 responses of at most 12 tokens (as test_trainer's small_config).
SMALL = {
    "train.steps": 2,
    "train.prompts_per_step": 4,
    "train.mini_batch_size": 2,
    "rollout.num_generations": 4,
    "rollout.max_completion_length": 12,
    "algorithm.overlong_buffer": 4,
    "data.answer_key": "answer",
    "data.max_eval_prompts": 4,
    "logging.tensorboard": False,
    "logging.console": False,
    "checkpoint.save_every": 0,
    "checkpoint.save_final_model": False,
    "reward.num_workers": 1,
}


def rows(split: str, n: int) -> list[dict[str, str]]:
    """``n`` addition problems as row dicts with a prompt and an answer column."""
    return [
        {"prompt": r.prompt, "answer": r.ground_truth}
        for r in load_task("builtin:addition", split, n)
    ]


def parity(response: str, ground_truth: str) -> float:
    """Right for odd-length responses: groups of 4 are mostly mixed (a learning signal)."""
    return 1.0 if len(response) % 2 else -1.0


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def compare_runs():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compare_runs
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return compare_runs


# --- configuration ------------------------------------------------------------------------


def cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The message `dapo train` prints for a bad config."""
    assert cli_main(["train", "--print-config", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dapo: config error: ")
    return err.removeprefix("dapo: config error: ")


@pytest.mark.parametrize(
    ("kwargs", "cli"),
    [
        ({"train.lrr": 1e-3}, "train.lrr=1e-3"),  # a dotted key
        ({"trian": {"lr": 1e-3}}, "trian.lr=1e-3"),  # a section
        ({"train": {"stpes": 3}}, "train.stpes=3"),
        ({"num_train_epochs": 3}, "num_train_epochs=3"),  # TRL's name, no equivalent
        ({"preset": "grpoo"}, "preset=grpoo"),
        ({"train": {"steps": "many"}}, "train.steps=many"),
        ({"algorithm.clip_high": -1}, "algorithm.clip_high=-1"),
        ({"rollout": {"engine": "vlm"}}, "rollout.engine=vlm"),
    ],
)
def test_a_bad_keyword_gets_the_cli_message(kwargs, cli, capsys):
    with pytest.raises(ConfigError) as info:
        dapo.make_config(**kwargs)
    assert str(info.value) == cli_error(capsys, cli)
    with pytest.raises(ConfigError):  # make_trainer and train check the same way, first
        dapo.train(**kwargs)


def test_a_config_mapping_is_checked_as_a_yaml_file(tmp_path, capsys):
    bad = {"train": {"lr": 1e-3, "stpes": 3}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as from_dict:
        dapo.make_config(bad)
    with pytest.raises(ConfigError) as from_file:
        dapo.make_config(path)
    assert str(from_dict.value) == str(from_file.value) == cli_error(capsys, str(path))
    assert "did you mean `train.steps`?" in str(from_dict.value)


def test_yaml_mapping_dotted_keys_sections_and_preset_make_the_cli_config(tmp_path):
    base = {"seed": 3, "train": {"lr": 1e-4, "steps": 7}, "algorithm": {"clip_high": 0.3}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    cli = [
        "preset=grpo",
        "train.lr=2e-5",
        "rollout.temperature=0.7",
        "train.prompts_per_step=32",
        "model.lora.rank=4",
    ]
    expected = load_config(path, cli).to_dict()
    overrides = {
        "preset": "grpo",
        "train.lr": 2e-5,
        "rollout": {"temperature": 0.7},
        "train": {"prompts_per_step": 32},
        "model.lora.rank": 4,
    }
    assert dapo.make_config(path, **overrides).to_dict() == expected
    assert dapo.make_config(base, **overrides).to_dict() == expected
    assert dapo.make_config(load_config(path, ["preset=grpo"]), **overrides).to_dict() == expected
    with pytest.raises(ConfigError, match="cannot change a Config built with preset 'dapo'"):
        dapo.make_config(load_config(path), **overrides)
    # The caller's mappings are left as they were.
    assert base == {"seed": 3, "train": {"lr": 1e-4, "steps": 7}, "algorithm": {"clip_high": 0.3}}
    assert overrides["rollout"] == {"temperature": 0.7} and overrides["train"] == {
        "prompts_per_step": 32
    }
    cfg = dapo.make_config(base, **overrides)
    # grpo's own values, under the file's clip_high (file < overrides; preset < file)
    assert (cfg.preset, cfg.algorithm.dynamic_sampling, cfg.algorithm.clip_high) == (
        "grpo",
        False,
        0.3,
    )
    assert (cfg.train.lr, cfg.train.steps, cfg.train.prompts_per_step) == (2e-5, 7, 32)


def test_python_objects_are_checked_before_anything_runs(random_tiny_model, tmp_path):
    kw = {**SMALL, "model": str(random_tiny_model), "output_dir": str(tmp_path / "run")}
    with pytest.raises(
        ConfigError,
        match=r"reward_funcs\[1\] \(.*<locals>.<lambda>\(response\)\) "
        r"cannot be called in any form dapo knows: fn\(response, ground_truth\)",
    ):
        dapo.make_trainer(reward_funcs=[parity, lambda response: 0.0], **kw)
    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]: the weight must be a finite number"):
        dapo.make_trainer(reward_funcs=[(parity, float("nan"))], **kw)
    with pytest.raises(ConfigError, match=r"one pair goes in a list"):
        dapo.make_trainer(reward_funcs=(parity, 2.0), **kw)
    with pytest.raises(ConfigError, match=r"callbacks\[0\] = 3 is neither a function"):
        dapo.make_trainer(reward_funcs=parity, callbacks=[3], **kw)
    with pytest.raises(ConfigError, match="give its tokenizer too"):
        from dapo.models.tiny import build_model

        dapo.make_trainer(**{**kw, "model": build_model(40, seed=0)}, reward_funcs=parity)
    with pytest.raises(
        ConfigError, match=r"tools = 'f': give a list \(or one function or object\)"
    ):
        dapo.make_trainer(reward_funcs=parity, tools="f", **kw)
    with pytest.raises(ModelError, match="tokenizer = SimpleNamespace has no EOS token"):
        dapo.make_trainer(reward_funcs=parity, tokenizer=SimpleNamespace(eos_token_id=None), **kw)
    with pytest.raises(ConfigError, match=r"config = 5: give a YAML file path, a mapping of keys"):
        dapo.make_trainer(5, reward_funcs=parity, **kw)
    assert not (tmp_path / "run" / "config.yaml").exists()


# --- runs from Python ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_from_python_with_a_dataset_a_lambda_and_a_closure(random_tiny_model, tmp_path):
    """The rewards run in the worker process with what they captured: the lambda a local
    number, the closure a local path it appends each scored response to."""
    import datasets

    calls = tmp_path / "calls.txt"
    odd = 1

    def log_calls(response: str, ground_truth: str) -> float:
        with calls.open("a") as f:
            f.write(json.dumps([response, ground_truth]) + "\n")
        return 0.0

    recorded: list[tuple[int, dict]] = []
    train = datasets.Dataset.from_list(rows("train", 16))
    summary = dapo.train(
        model=str(random_tiny_model),
        output_dir=str(tmp_path / "run"),
        train_dataset=train,
        reward_funcs=[
            lambda response, ground_truth: 1.0 if len(response) % 2 == odd else -1.0,
            (log_calls, 0.5),
        ],
        callbacks=[lambda step, metrics: recorded.append((step, metrics))],
        **SMALL,
    )
    out = tmp_path / "run"
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "accuracy_before" not in summary  # no eval data given
    logged = metric_rows(out)
    assert [s for s, _ in recorded] == [r["step"] for r in logged] == [1, 2]
    for (_, metrics), row in zip(recorded, logged, strict=True):
        assert metrics == {k: v for k, v in row.items() if k not in ("step", "time")}
        assert metrics["reward/failures"] == 0.0
    scored = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(scored) == summary["samples_generated"]  # every response, in the worker
    assert {gt for _, gt in scored} <= {r["answer"] for r in rows("train", 16)}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["train"] == "<train_dataset: Dataset of 16 rows>"
    assert saved["data"]["eval"] is None


class Hooks:
    """Records every hook call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []

    def on_step(self, step: int, metrics: dict) -> None:
        self.calls.append(("step", step, metrics))

    def on_evaluate(self, step: int, metrics: dict) -> None:
        self.calls.append(("evaluate", step, metrics))

    def on_save(self, step: int, path: Path) -> None:
        self.calls.append(("save", step, path))


def train_with_hooks(model: Path, out: Path, **settings) -> tuple[Hooks, dict]:
    """SMALL (with ``settings``) on 16 training and 4 held-out rows; its hook calls, summary."""
    hooks = Hooks()
    summary = dapo.train(
        model=str(model),
        output_dir=str(out),
        train_dataset=rows("train", 16),
        eval_dataset=rows("test", 4),
        reward_funcs=[parity],
        callbacks=hooks,
        **{**SMALL, **settings},
    )
    return hooks, summary


@pytest.mark.slow
def test_hooks_see_every_step_evaluation_and_checkpoint(random_tiny_model, tmp_path):
    out = tmp_path / "run"
    hooks, summary = train_with_hooks(
        random_tiny_model,
        out,
        **{"train.steps": 3, "logging.eval_every": 2, "checkpoint.save_every": 2},
    )
    kinds = [(kind, step) for kind, step, _ in hooks.calls]
    assert kinds == [
        ("evaluate", 0),
        ("step", 1),
        ("evaluate", 2),
        ("save", 2),
        ("step", 2),
        ("step", 3),
        ("evaluate", 3),
        ("save", 3),
    ]
    evaluations = [m for kind, _, m in hooks.calls if kind == "evaluate"]
    assert [e["val/acc"] for e in evaluations] == [
        r["val/acc"] for r in metric_rows(out) if "val/acc" in r
    ]
    assert all(e["val/n"] == 4 for e in evaluations)  # 4 prompts x 1 response
    assert evaluations[0]["val/acc"] == summary["accuracy_before"]
    assert evaluations[-1]["val/acc"] == summary["accuracy_after"]
    step_2 = next(m for kind, s, m in hooks.calls if kind == "step" and s == 2)
    assert step_2["val/acc"] == evaluations[1]["val/acc"]
    saves = [p for kind, _, p in hooks.calls if kind == "save"]
    assert saves == [out / "checkpoints" / "step_000002", out / "checkpoints" / "step_000003"]
    assert all(p.is_dir() for p in saves)


@pytest.mark.slow
def test_dapo_train_releases_its_trainer_before_leaving_the_group(
    random_tiny_model, tmp_path, monkeypatch
):
    """As `dapo train` does: the trainer (and its distributed objects) is freed before the
    process group is destroyed, not after, when a peer may be gone."""
    import weakref

    import dapo.api

    made: list[weakref.ref] = []
    real_make = dapo.api.make_trainer

    def make(*a, **k):
        trainer = real_make(*a, **k)
        made.append(weakref.ref(trainer))
        return trainer

    alive_at_destroy: list[bool] = []
    real_destroy = dapo.api.D.destroy

    def destroy() -> None:
        gc.collect()  # what D.destroy does first: a cycle alone does not keep it
        alive_at_destroy.append(made[0]() is not None)
        real_destroy()

    monkeypatch.setattr(dapo.api, "make_trainer", make)
    monkeypatch.setattr(dapo.api.D, "destroy", destroy)
    dapo.train(
        model=str(random_tiny_model), output_dir=str(tmp_path / "run"),
        train_dataset=rows("train", 8), reward_funcs=[parity], evaluate=False,
        **{**SMALL, "train.steps": 1},
    )  # fmt: skip
    assert alive_at_destroy == [False]


def test_zero_steps_only_evaluates_once(random_tiny_model, tmp_path):
    """train.steps=0 "only evaluates": one evaluation, before == after, no training step."""
    out = tmp_path / "run"
    hooks, summary = train_with_hooks(random_tiny_model, out, **{"train.steps": 0})
    assert [(kind, step) for kind, step, _ in hooks.calls] == [("evaluate", 0)]
    assert summary["steps"] == 0 and summary["samples_generated"] == 0
    assert summary["accuracy_after"] == summary["accuracy_before"]
    assert [r for r in metric_rows(out) if "val/acc" in r] == [
        {"step": 0, "time": metric_rows(out)[0]["time"], "val/acc": summary["accuracy_before"]}
    ]


@pytest.mark.slow
def test_a_callback_stops_the_run_which_resumes_as_if_never_stopped(random_tiny_model, tmp_path):
    kw = {
        **SMALL,
        "train.steps": 4,
        "model": str(random_tiny_model),
        "train_dataset": rows("train", 16),
        "reward_funcs": [parity],
    }
    whole, part = tmp_path / "whole", tmp_path / "part"
    dapo.train(output_dir=str(whole), **kw)
    summary = dapo.train(output_dir=str(part), callbacks=[lambda step, m: step >= 2], **kw)
    assert summary["steps"] == 2
    assert summary["stopped_early"] == "a callback asked to stop after rollout step 2"
    assert (part / "checkpoints" / "step_000002").is_dir()
    assert json.loads((part / "summary.json").read_text()) == summary
    resumed = dapo.train(output_dir=str(part), resume=True, **kw)
    assert (resumed["steps"], resumed["resumed_from_step"]) == (4, 2)
    assert "stopped_early" not in resumed
    runs = compare_runs()
    a, b = runs.load(whole), runs.load(part)
    assert len(a) == 4 and runs.differences(a, b, runs.TIMING, tol=0.0) == []


@pytest.mark.slow
def test_a_callback_that_raises_stops_cleanly_and_is_named(random_tiny_model, tmp_path):
    def boom(step: int, metrics: dict) -> None:
        if step == 2:
            raise ValueError("no metric named acc")

    out = tmp_path / "run"
    with pytest.raises(TrainingError) as info:
        dapo.train(
            model=str(random_tiny_model),
            output_dir=str(out),
            train_dataset=rows("train", 16),
            reward_funcs=[parity],
            callbacks=[boom],
            **{**SMALL, "train.steps": 4},
        )
    msg = str(info.value)
    assert msg.startswith(
        "callback 'test_a_callback_that_raises_stops_cleanly_and_is_named.<locals>.boom' raised "
        "ValueError: no metric named acc in on_step at rollout step 2; the run stopped there"
    ), msg
    assert "resume=true" in msg
    assert isinstance(info.value.__cause__, ValueError)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stopped_early"].startswith("callback ")
    assert (out / "checkpoints" / "step_000002").is_dir()
    assert [r["step"] for r in metric_rows(out)] == [1, 2]


@pytest.mark.slow
def test_the_same_config_as_yaml_and_as_python_gives_the_same_metrics(random_tiny_model, tmp_path):
    """`dapo train run.yaml` with files and a module:function reward, and dapo.train with the
    config as keyword arguments, in-memory data and the function itself: 3 identical steps."""
    import datasets

    train, held_out = rows("train", 16), rows("test", 4)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    nested: dict = {}
    for key, value in {**SMALL, "train.steps": 3, "logging.eval_every": 2}.items():
        section, leaf = key.split(".")
        nested.setdefault(section, {})[leaf] = value
    config = {
        "model": {"name_or_path": str(random_tiny_model)},
        "output_dir": str(tmp_path / "yaml"),
        **nested,
        "data": {
            **nested["data"],
            "train": str(tmp_path / "train.jsonl"),
            "eval": str(tmp_path / "eval.jsonl"),
        },
        "reward": {
            **nested["reward"],
            "functions": [{"name": f"{HERE / 'trainer_rewards.py'}:by_answer_class"}],
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["train", str(tmp_path / "run.yaml")]) == 0

    dapo.train(
        model=str(random_tiny_model),
        output_dir=str(tmp_path / "python"),
        train_dataset=datasets.Dataset.from_list(train),
        eval_dataset=held_out,
        reward_funcs=[by_answer_class],
        **{**SMALL, "train.steps": 3},
        logging={"eval_every": 2, "tensorboard": False, "dashboard": False, "console": False},
    )
    runs = compare_runs()
    a, b = runs.load(tmp_path / "yaml"), runs.load(tmp_path / "python")
    assert [r["step"] for r in a] == [0, 1, 2, 3, 3]  # val/acc at 0, every 2 steps and after
    assert runs.differences(a, b, runs.TIMING, tol=0.0) == []


@pytest.mark.slow
def test_a_reward_callable_that_raises_or_hangs_costs_samples_not_the_run(
    random_tiny_model, tmp_path
):
    """A closure that raises on some responses and hangs once (a marker file it captured
    says it hung already): each costs its sample, reward/failures counts them."""
    marker = tmp_path / "hung"

    def flaky(response: str, ground_truth: str) -> float:
        if len(response) % 3 == 0:
            raise ArithmeticError("a third of the responses")
        if not marker.exists():
            marker.touch()
            time.sleep(60)  # killed at reward.timeout_s
        return parity(response, ground_truth)

    recorded: list[dict] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        summary = dapo.train(
            model=str(random_tiny_model),
            output_dir=str(tmp_path / "run"),
            train_dataset=rows("train", 16),
            reward_funcs=flaky,
            callbacks=lambda step, m: recorded.append(m),
            **{**SMALL, "reward.timeout_s": 1.0},
        )
    assert time.monotonic() - start < 50  # the hung call was cut, not waited for
    assert summary["steps"] == 2 and marker.exists()
    failures = [m["reward/failures"] for m in recorded]  # per step
    totals = [m["reward/failures_total"] for m in recorded]  # the running count
    assert failures[0] >= 2 and totals == [failures[0], failures[0] + failures[1]]
    texts = [str(w.message) for w in caught if issubclass(w.category, RewardFunctionWarning)]
    assert any("raised ArithmeticError: a third of the responses" in t for t in texts), texts
    assert any("took longer than 1 s" in t for t in texts), texts


@pytest.mark.slow
def test_a_loaded_model_and_tokenizer_are_trained_in_place_as_a_loaded_path(
    random_tiny_model, tmp_path
):
    """A model given in bfloat16 is cast to the precision's float32 as a loaded path is, its
    layers checkpointed and given LoRA adapters; step by step with make_trainer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo.models.activation_checkpointing import is_checkpointed

    model = AutoModelForCausalLM.from_pretrained(random_tiny_model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(random_tiny_model)
    kw = {
        **SMALL,
        "train.precision": "fp32",
        "model.gradient_checkpointing": True,
        "output_dir": str(tmp_path / "run"),
        "train_dataset": rows("train", 16),
        "eval_dataset": rows("test", 4),
        "reward_funcs": [parity],
    }
    trainer = dapo.make_trainer(model=model, tokenizer=tokenizer, **{**kw, "model.lora.rank": 4})
    try:
        assert trainer.model is model and trainer.tokenizer is tokenizer
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert is_checkpointed(model) and trainer.learner.peft is not None
        assert trainer.cfg.model.name_or_path == str(random_tiny_model)  # what config.yaml says
        trainable, total = trainer.learner.parameter_counts
        assert 0 < trainable < total
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        metrics, groups = trainer.train_step()
        assert metrics["actor/updates"] >= 1 and len(groups) == 4
        changed = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and not torch.equal(p, before[n])
        ]
        assert changed  # the object the caller holds was trained
        assert 0.0 <= trainer.evaluate()["acc"] <= 1.0
    finally:
        trainer.close()
    # Without a tokenizer, the model's name_or_path names it (as a loaded path's would).
    plain = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    trainer = dapo.make_trainer(model=plain, **{**kw, "output_dir": str(tmp_path / "b")})
    try:
        assert trainer.tokenizer.name_or_path == str(random_tiny_model)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_script_calling_dapo_train_runs_on_two_ranks(random_tiny_model, tmp_path):
    """torchrun starts the script on 2 ranks; a callback asks rank 1 alone to stop after
    step 2 and every rank stops there, with the same summary."""
    out = tmp_path / "run"
    torchrun(
        str(HERE / "api_worker.py"), str(random_tiny_model), str(out), cwd=tmp_path, timeout=300
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["seen"] for r in ranks] == [[1, 2], [1, 2]]
    # The same summary on every rank but each rank's own clock (wall_seconds, 0.1 s apart
    # on a busy machine).
    summaries = [r["summary"] for r in ranks] + [json.loads((out / "summary.json").read_text())]
    for summary in summaries:
        summary.pop("wall_seconds")
    assert summaries[0] == summaries[1] == summaries[2]
    assert ranks[0]["summary"]["steps"] == 2
    assert (out / "checkpoints" / "step_000002").is_dir()
    assert [r["step"] for r in metric_rows(out)] == [1, 2]


# --- the first hour from Python: multi-turn, dotted mappings, typos, sub-packages -------


def multiturn_kw(tool_model: Path, out: Path) -> dict:
    """A 1-step run of 4 calculator prompts x 4 episodes on the random tool model."""
    return {
        **SMALL,
        "train.steps": 1,
        "rollout.max_completion_length": 40,
        "model": str(tool_model),
        "output_dir": str(out),
        "data.train": "builtin:calculator",
        "data.answer_key": "reward_model.ground_truth",
        "evaluate": False,
    }


@pytest.mark.slow
def test_an_environment_object_gets_more_than_one_turn(tool_model, tmp_path):
    from sample_environments import TwoTurns, half_right  # tests/sample_environments.py

    kw = multiturn_kw(tool_model, tmp_path / "env")
    summary = dapo.train(
        environment=TwoTurns, reward_funcs=half_right, rollout={"max_turns": 3}, **kw
    )
    assert summary["steps"] == 1
    row = metric_rows(tmp_path / "env")[0]
    assert row["env/turns_mean"] > 1  # TwoTurns answered the first turn: a second one ran


@pytest.mark.slow
def test_tool_functions_get_more_than_one_turn(tool_model, tmp_path):
    from sample_environments import add, half_right

    kw = multiturn_kw(tool_model, tmp_path / "tools")
    trainer = dapo.make_trainer(
        tools=[add], reward_funcs=half_right, **{**kw, "rollout.max_turns": 2}
    )
    try:
        assert trainer.cfg.rollout.max_turns == 2
        metrics, groups = trainer.train_step()
        assert len(groups) == 4 and "env/turns_mean" in metrics
    finally:
        trainer.close()


def test_max_turns_still_needs_something_to_answer():
    with pytest.raises(ConfigError, match="more than one turn needs something to answer"):
        dapo.make_config(rollout={"max_turns": 3})


def test_a_mapping_may_use_dotted_keys_as_the_command_line(tmp_path, capsys):
    mixed = {"train.steps": 5, "train": {"lr": 1e-5}, "rollout.temperature": 0.7}
    expected = load_config(None, ["train.steps=5", "train.lr=1e-5", "rollout.temperature=0.7"])
    assert dapo.make_config(mixed).to_dict() == expected.to_dict()
    path = tmp_path / "dotted.yaml"
    path.write_text(yaml.safe_dump(mixed))
    assert dapo.make_config(path).to_dict() == expected.to_dict()
    # Given twice: an error naming both forms.
    with pytest.raises(ConfigError) as info:
        dapo.make_config({"train.steps": 5, "train": {"steps": 6}})
    assert str(info.value) == (
        "`train.steps` is given twice, as `train.steps` (5) and as `train` (6); give it once"
    )
    with pytest.raises(ConfigError, match=r"`train\.lr` is given twice, as `train` \(1e-05\)"):
        dapo.make_config(train={"lr": 1e-5}, **{"train.lr": 2e-5})
    # The same value twice is no conflict.
    assert dapo.make_config({"train.steps": 5, "train": {"steps": 5}}).train.steps == 5


def test_an_unknown_key_never_suggests_itself():
    with pytest.raises(ConfigError) as info:
        dapo.make_config({"train": {"train.steps": 5}})
    assert "did you mean `train.train.steps`" not in str(info.value)
    with pytest.raises(ConfigError, match=r"`train\.stepz`: did you mean `train\.steps`\?"):
        dapo.make_config({"train.stepz": 5})


@pytest.mark.parametrize(
    ("typo", "keyword"),
    [("train_datset", "train_dataset"), ("reward_func", "reward_funcs"), ("tool", "tools")],
)
def test_a_keyword_typo_suggests_the_keyword(typo, keyword):
    with pytest.raises(ConfigError, match=rf"`{typo}=`: did you mean `{keyword}=`\?"):
        dapo.train(**{typo: [1]})


def test_sub_packages_are_attributes_of_dapo_without_torch():
    code = (
        "import sys, dapo; env = dapo.environments.Environment; "
        "assert env.__name__ == 'Environment'; "
        "assert dapo.config.Config and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    import subprocess

    src = str(Path(dapo.__file__).parents[1])
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_no_evaluation_of_in_memory_data_is_not_said_of_a_file(random_tiny_model, tmp_path):
    from dapo.run_inputs import RunInputs
    from dapo.training.trainer import Trainer

    heard: list[str] = []
    cfg = dapo.make_config(
        **{**SMALL, "model.name_or_path": str(random_tiny_model), "output_dir": str(tmp_path)},
        **{"data.train": "<train_dataset: list of 8 rows>"},
    )
    trainer = Trainer(cfg, inputs=RunInputs(train_dataset=rows("train", 8)), log=heard.append)
    trainer.close()
    (note,) = [m for m in heard if "no held-out evaluation" in m]
    assert "a file has no held-out split" not in note
    assert "a data set given from Python" in note and "eval_dataset=" in note
