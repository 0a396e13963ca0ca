"""The paper as written: its evaluation protocol, its main run's settings at any scale, and
its dynamic sampling (surplus discarded) as a switch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dapo.cli import main
from dapo.config import PRESETS, Config, load_config
from dapo.config.describe import run_plan
from dapo.config.fields import hints
from dapo.data import load_records
from dapo.evaluation.protocol import EvalProtocol, common_repeats, samples_per_problem
from dapo.handover import ScoredGroup
from dapo.producer.dynamic_sampling import DynamicSampler


def _paper_column(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every key's *paper* value, as the configuration reference shows it."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        tp = hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_paper_column(tp, f"{prefix}{f.name}."))
        elif "paper" in f.metadata:
            value = yaml.safe_load(f.metadata["paper"])
            out[f"{prefix}{f.name}"] = float(value) if "float" in str(tp) else value
    return out


def _get(cfg: Config, path: str) -> object:
    value: object = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


# --------------------------------------------------------------------------- settings


def test_dapo_paper_sets_every_value_of_the_paper_column() -> None:
    column = _paper_column()
    assert len(column) >= 20  # the column the reference documents, not an empty walk
    cfg = load_config(overrides=["preset=dapo_paper"])
    wrong = {k: (_get(cfg, k), v) for k, v in column.items() if _get(cfg, k) != v}
    assert not wrong, f"dapo_paper differs from the paper column: {wrong}"
    # and it sets nothing the column does not document, beyond the `dapo` rung it builds on
    extra = set(PRESETS["dapo_paper"][1]) - set(PRESETS["dapo"][1]) - set(column)
    assert not extra


def test_dapo_presets_lists_dapo_paper(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dapo_paper "))
    assert "paper" in line


def test_the_overlong_buffer_follows_the_maximum_length_unless_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--print-config", "rollout.max_completion_length=20480"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algorithm"]["overlong_buffer"] == 4096  # the paper's 4096 of 20480
    assert load_config().algorithm.overlong_buffer == round(0.2 * 64)
    cfg = load_config(overrides=["rollout.max_completion_length=1000"])
    assert cfg.algorithm.overlong_buffer == 200
    kept = load_config(
        overrides=["rollout.max_completion_length=1000", "algorithm.overlong_buffer=50"]
    )
    assert kept.algorithm.overlong_buffer == 50


def test_the_start_up_line_states_updates_and_the_overlong_window() -> None:
    scaled = load_config(overrides=["train.prompts_per_step=512"])
    assert "32 optimizer updates" in run_plan(scaled)  # 512 / the default mini-batch 16
    paper = load_config(overrides=["preset=dapo_paper"])
    line = run_plan(paper)
    assert "512 prompts x 16 responses, 16 optimizer updates" in line
    assert "over 16384 tokens penalised, down to -1 at 20480" in line
    off = load_config(overrides=["preset=grpo"])
    assert "soft overlong punishment off" in run_plan(off)


# --------------------------------------------------------------------------- surplus


def _group(step: int, index: int) -> ScoredGroup:
    """A mixed group (one right, one wrong) tagged with the step that generated it."""
    return ScoredGroup(
        prompt_ids=[index],
        response_ids=[[1], [2]],
        sample_logprobs=[[0.0], [0.0]],
        truncated=[False, False],
        rewards=[1.0, -1.0],
        correct=[True, False],
        step=step,
    )


def _steps(keep_surplus: bool, n_steps: int = 4) -> tuple[list[list[int]], list[dict]]:
    """The generating step of every trained group, per step, with 5 mixed groups generated
    per round for a batch of 3 (a surplus of 2 each step)."""
    sampler = DynamicSampler(3, keep_surplus=keep_surplus, max_prompts_per_round=5)
    trained, metrics = [], []
    for step in range(n_steps):
        batch, stats = sampler.fill(lambda k, s=step: [_group(s, i) for i in range(5)])
        trained.append([g.step for g in batch])
        metrics.append(stats.as_metrics())
    return trained, metrics


def test_keep_surplus_false_trains_no_group_generated_at_an_earlier_step() -> None:
    trained, metrics = _steps(keep_surplus=False)
    for step, origins in enumerate(trained):
        assert origins == [step] * 3
    assert all(m["sampling/carried_in"] == 0 for m in metrics)
    assert all(m["sampling/surplus_discarded"] == 2 for m in metrics)
    # the default carries it: the same run then trains groups of earlier steps
    carried, metrics = _steps(keep_surplus=True)
    assert any(o != step for step, origins in enumerate(carried) for o in origins)
    assert all(m["sampling/surplus_discarded"] == 0 for m in metrics)


def test_keep_surplus_defaults_per_preset() -> None:
    assert load_config().algorithm.keep_surplus is True
    assert load_config(overrides=["preset=dapo_paper"]).algorithm.keep_surplus is False


def test_a_run_with_keep_surplus_false_trains_only_fresh_groups(tmp_path: Path) -> None:
    from dapo.training.trainer import Trainer

    cfg = load_config(
        overrides={
            "output_dir": str(tmp_path / "run"),
            "train.steps": 3,
            "train.prompts_per_step": 2,
            "algorithm.keep_surplus": False,
            "evaluate": False,
            "logging.dashboard": False,
            "checkpoint.save_every": 0,
        }
    )
    Trainer(cfg, log=lambda _: None).run()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "sampling/carried_in" in x]
    assert len(steps) == 3
    assert all(x["sampling/carried_in"] == 0 and x["sampling/carried_over"] == 0 for x in steps)
    # more than two qualifying groups were generated somewhere, and thrown away
    assert sum(x["sampling/surplus_discarded"] for x in steps) > 0


# --------------------------------------------------------------------------- evaluation


def test_repeated_rows_are_counted_per_distinct_prompt() -> None:
    rows = [{"prompt": p, "reward_model": {"ground_truth": "1"}} for p in "abacab"]
    records, stats = load_records(rows)
    assert [r.prompt for r in records] == ["a", "b", "c"]
    assert stats.repeats == [3, 2, 1]
    _, stats = load_records(rows, dedupe=False)
    assert stats.repeats == [3, 2, 1]


def test_samples_per_problem_follows_the_data_unless_set() -> None:
    assert samples_per_problem(None, common_repeats([32] * 30)) == 32
    assert samples_per_problem(None, common_repeats([4, 2])) == 1  # uneven: one each
    assert samples_per_problem(None, common_repeats([])) == 1  # a built-in task: no repeats
    assert samples_per_problem(8, common_repeats([32] * 30)) == 8
    assert common_repeats([3, 3]) == 3 and common_repeats([3, 1]) is None
    assert str(EvalProtocol(32, 1.0, 0.7, 30)) == "avg@32, T 1.0, top-p 0.7, 30 problems"


def _aime_shaped(path: Path, problems: int, repeats: int) -> Path:
    """Held-out addition problems in the DAPO format, each repeated ``repeats`` times
    (interleaved, as the AIME file holds its 30 problems x 32)."""
    from dapo.data.tasks import load_task

    distinct = {r.prompt: r for r in load_task("builtin:addition", "test", n=4 * problems)}
    records = list(distinct.values())[:problems]
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": r.prompt,
            "ability": "MATH",
            "reward_model": {"ground_truth": r.ground_truth, "style": "rule"},
            "extra_info": {"index": i},
        }
        for _ in range(repeats)
        for i, r in enumerate(records)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_training_time_accuracy_is_avg_at_k_and_agrees_with_dapo_eval(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problems, k = 12, 32
    data = _aime_shaped(tmp_path / "aime_shaped.parquet", problems, k)
    out = tmp_path / "run"
    common = ["rollout.max_completion_length=32", "data.max_prompt_length=64"]
    assert main(["train", f"output_dir={out}", "train.steps=0", f"data.eval={data}", *common]) == 0
    printed = capsys.readouterr().out
    protocol = f"avg@{k}, T 1.0, top-p 0.7, {problems} problems"
    assert f"held-out accuracy ({protocol}):" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_protocol"] == protocol
    trained = summary["accuracy_before"]

    report = tmp_path / "eval.json"
    args = ["eval", "builtin:tiny", "--data", str(data), "--max-tokens", "32"]
    assert main([*args, "--seed", "1", "--output", str(report)]) == 0
    evaluated = json.loads(report.read_text())
    assert evaluated["k"] == k and evaluated["problems"] == problems
    assert evaluated["protocol"] == protocol  # both name the same protocol alike
    measured = evaluated["overall"][f"avg@{k}"]
    # Two estimates of one avg@32 from different seeds: the standard error of their
    # difference over 12 x 32 samples is at most sqrt(2 * 0.25 / 384) = 0.036.
    assert 0.1 < measured < 0.95  # a model that is sometimes right: the check has teeth
    print(f"avg@{k}: training-time {trained:.3f}, dapo eval {measured:.3f}")
    assert abs(trained - measured) < 0.12, (trained, measured)
