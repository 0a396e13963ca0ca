"""TRL and verl setups unchanged: their reward functions called as their trainers call them,
rewards on any scale under the default preset, their data layouts, plain reward specs."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from dapo.config import load_config
from dapo.errors import ConfigError, RewardFunctionWarning
from dapo.handover import ScoredGroup
from dapo.producer.dynamic_sampling import DynamicSampler, is_uniform
from dapo.rewards import RewardScorer, ScoreRequest
from dapo.rewards.user import SAMPLE, TRL, VERL, check_signature, reward_form

trl_rewards = pytest.importorskip("trl.rewards")

CHAT = [{"role": "user", "content": "What is 1/3 + 0? Think first."}]


def requests(texts, solution, *, chat=True, ids=None):
    return [
        ScoreRequest(
            t,
            "",
            prompt=CHAT if chat else CHAT[0]["content"],
            columns={"solution": solution},
            completion_ids=ids[i] if ids else list(range(len(t))),
        )
        for i, t in enumerate(texts)
    ]


TEXTS = [
    "<think>\nadd zero</think>\nSo \\boxed{\\frac{1}{3}}",
    "no thinking, \\boxed{\\frac{1}{2}}",
    "<think>hm</think> \\boxed{1/3}",
    "<think>x",
]


# --- the forms, recognised by their parameter names ---------------------------------------


def test_forms_are_recognised_by_parameter_names():
    def mine(response, ground_truth):
        return 1.0

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    assert reward_form(mine) == SAMPLE
    assert reward_form(compute_score) == VERL
    assert reward_form(trl_rewards.accuracy_reward) == TRL
    assert reward_form(trl_rewards.think_format_reward) == TRL
    assert reward_form(trl_rewards.get_soft_overlong_punishment(10, 4)) == TRL
    for fn in (mine, compute_score, trl_rewards.accuracy_reward):
        check_signature(fn, "reward_funcs[0]")  # none refused
    with pytest.raises(ConfigError, match="by position only"):
        check_signature(lambda completions, /, **kw: [0.0], "reward_funcs[0]")
    with pytest.raises(ConfigError, match="verl's compute_score.*cannot be called so"):
        check_signature(lambda solution_str, data_source: 0.0, "reward_funcs[0]")


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_rewards_score_what_they_return_when_called_directly(workers):
    overlong = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)
    funcs = [trl_rewards.accuracy_reward, trl_rewards.think_format_reward, overlong]
    weights = [1.0, 0.5, 2.0]
    ids = [list(range(n)) for n in (5, 14, 20, 25)]
    reqs = requests(TEXTS, "\\frac{1}{3}", ids=ids)
    with RewardScorer(list(zip(funcs, weights, strict=True)), num_workers=workers) as scorer:
        result = scorer.score(reqs)
    assert result.failures == 0
    completions = [[{"role": "assistant", "content": t}] for t in TEXTS]
    direct = [
        trl_rewards.accuracy_reward(completions, ["\\frac{1}{3}"] * 4),
        trl_rewards.think_format_reward(completions),
        overlong(ids),
    ]
    expected = [
        sum(w * v[i] for w, v in zip(weights, direct, strict=True) if v[i] is not None)
        for i in range(4)
    ]
    assert result.rewards == pytest.approx(expected)
    assert direct[0] == [1.0, 0.0, 1.0, 0.0]  # precondition: the rewards do differ
    assert direct[2][1] != 0.0 and direct[2][3] == -1.0


def test_trl_log_extra_numbers_are_kept_per_response_and_log_metric_per_call():
    def judged(completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])  # a number per completion: kept
        log_extra("note", [f"saw {c}" for c in completions])  # text: not a metric
        log_extra("short", [1.0])  # not one per completion: ignored
        log_metric("calls", 1.0)
        return [1.0 for _ in completions]

    reqs = [ScoreRequest(t, "") for t in ("a", "bbb", "cc")]
    with RewardScorer([(judged, 1.0)], num_workers=0) as scorer:
        result = scorer.score(reqs, groups=[range(0, 3)])
    assert result.infos == [{"calls": 1.0, "length": float(len(t))} for t in ("a", "bbb", "cc")]


def test_trl_none_is_not_applicable_and_a_group_is_one_call():
    calls = []

    def seen(prompts, completions, completion_ids, trainer_state, **columns):
        calls.append((len(completions), trainer_state.global_step, sorted(columns)))
        return [None if "skip" in c else 1.0 for c in completions]

    def fmt(completions, **kwargs):
        return [0.25 for _ in completions]

    reqs = [
        ScoreRequest(t, "", prompt="p", columns={"solution": "1", "level": 3}, step=7)
        for t in ("a", "skip", "c", "skip", "e")
    ]
    with RewardScorer([(seen, 1.0), (fmt, 2.0)], num_workers=0) as scorer:
        result = scorer.score(reqs, groups=[range(0, 3), range(3, 5)])
        alone = scorer.score(reqs[1:2], groups=[[0]])
    columns = ["level", "log_extra", "log_metric", "solution"]  # as TRL passes them
    assert calls[:2] == [(3, 7, columns), (2, 7, columns)]
    # None adds nothing (TRL's nansum), the other function still counts
    assert result.rewards == pytest.approx([1.5, 0.5, 1.5, 0.5, 1.5])
    assert result.unscorable == 0 and result.failures == 0
    with RewardScorer([(seen, 1.0)], num_workers=0) as scorer:
        with pytest.warns(RewardFunctionWarning, match="returned None .* scores 0") as said:
            assert scorer.score(reqs[1:2]).unscorable == 1
        assert len(said) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert scorer.score(reqs).unscorable == 2

    def by_source(completions, data_source):  # the row's data_source, named explicitly
        return [1.0 if s == "openai/gsm8k" else 0.0 for s in data_source]

    mixed = [ScoreRequest("a", "", "openai/gsm8k"), ScoreRequest("b", "", "math_dapo")]
    with RewardScorer([(by_source, 1.0)], num_workers=0) as scorer:
        assert scorer.score(mixed).rewards == [1.0, 0.0]
    assert alone.rewards == [0.5]


def test_a_trl_reward_that_raises_costs_its_group_and_a_bad_entry_its_sample():
    def flaky(completions, **kwargs):
        if any("boom" in c for c in completions):
            raise RuntimeError("boom")
        return ["x" if c == "bad" else 1.0 for c in completions]

    reqs = [ScoreRequest(t, "") for t in ("a", "boom", "c", "bad", "e")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with RewardScorer([(flaky, 1.0)], num_workers=1) as scorer:
            result = scorer.score(reqs, groups=[range(0, 3), range(3, 5)])
    assert result.rewards == [-1.0, -1.0, -1.0, -1.0, 1.0]
    assert (result.errors, result.bad_values) == (3, 1)


def test_a_trl_reward_past_the_time_limit_costs_its_group_not_the_run():
    def slow(completions, **kwargs):
        if "slow" in completions:
            import time

            time.sleep(30)
        return [1.0 for _ in completions]

    reqs = [ScoreRequest(t, "") for t in ("a", "slow", "c", "d")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with RewardScorer([(slow, 1.0)], num_workers=1, timeout_s=1.0) as scorer:
            result = scorer.score(reqs, groups=[range(0, 2), range(2, 4)])
    assert result.rewards == [-1.0, -1.0, 1.0, 1.0] and result.timeouts == 2


def test_verl_compute_score_gets_its_arguments_and_a_dict_gives_score_and_fields():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str.strip() == ground_truth
        return {
            "score": 1.0 if ok else 0.1,
            "acc": ok,
            "pred_len": len(solution_str),
            "src": data_source,
            "idx": extra_info["index"],
        }

    reqs = [
        ScoreRequest(t, "42", data_source="openai/gsm8k", columns={"extra_info": {"index": i}})
        for i, t in enumerate(["42", "41"])
    ]
    with RewardScorer([(compute_score, 1.0)], num_workers=1) as scorer:
        result = scorer.score(reqs)
    assert result.rewards == [1.0, 0.1] and result.correct == [True, False]
    assert result.claims_correct  # the acc field says what correct is
    assert result.infos == [
        {"acc": 1.0, "pred_len": 2.0, "idx": 0.0},
        {"acc": 0.0, "pred_len": 2.0, "idx": 1.0},
    ]


# --- "correct" only where the reward says it ------------------------------------------------


def test_correctness_is_claimed_only_by_rewards_that_say_it():
    def binary(response, ground_truth):
        return 1.0 if response == ground_truth else -1.0

    def partial(response, ground_truth):
        return 1.0 if response == ground_truth else 0.1

    def length(response, ground_truth):
        return -abs(20 - len(response))

    reqs = [ScoreRequest("7", "7"), ScoreRequest("8", "7")]
    for fn, claims in ((binary, True), (partial, False), (length, False)):
        with RewardScorer([(fn, 1.0)], num_workers=0) as scorer:
            assert scorer.score(reqs).claims_correct is claims, fn.__name__
    with RewardScorer(None, num_workers=0) as scorer:  # the built-in scorers: +1 or -1
        assert scorer.score([ScoreRequest("Answer: 7", "7")]).claims_correct


def group(scores, correct, claims, penalty=None):
    n = len(scores)
    penalty = penalty or [0.0] * n
    return ScoredGroup(
        prompt_ids=[1],
        response_ids=[[2]] * n,
        sample_logprobs=[[0.0]] * n,
        truncated=[False] * n,
        rewards=[s + p for s, p in zip(scores, penalty, strict=True)],
        correct=correct,
        penalty=penalty,
        claims_correct=claims,
    )


def test_auto_keeps_groups_by_accuracy_or_by_the_score_before_shaping():
    partial_same = group([0.1, 0.1], [True, True], claims=False)
    partial_mixed = group([0.1, 1.0], [True, True], claims=False)
    shaped_only = group([0.5, 0.5], [True, True], claims=False, penalty=[0.0, -0.5])
    assert is_uniform(partial_same, "auto") and not is_uniform(partial_mixed, "auto")
    assert is_uniform(shaped_only, "auto")  # the length shaping is no signal of the task
    assert is_uniform(partial_mixed, "acc")  # what the old default did: "all correct"
    binary = group([1.0, -1.0], [True, False], claims=True)
    assert not is_uniform(binary, "auto")
    sampler = DynamicSampler(1, metric="auto", max_rounds=1, round_cap="train")
    batch, stats = sampler.fill(lambda k: [partial_same, partial_mixed])
    assert batch == [partial_mixed]
    assert (stats.all_correct, stats.all_wrong, stats.uniform_other) == (0, 0, 1)


# --- configuration --------------------------------------------------------------------------


def test_a_list_of_bare_specs_reads_as_functions_of_weight_one():
    cfg = load_config(
        overrides=["reward.functions=[my_rewards:accuracy, {name: my_rewards:fmt, weight: 0.5}]"]
    )
    assert [(f.name, f.weight) for f in cfg.reward.functions] == [
        ("my_rewards:accuracy", 1.0),
        ("my_rewards:fmt", 0.5),
    ]
    assert cfg.algorithm.dynamic_sampling_metric == "auto"
    with pytest.raises(ConfigError, match=r"reward.functions\[0\]"):
        load_config(overrides=["reward.functions=[3]"])


# --- end to end: TRL's and verl's setups through dapo.train and the CLI --------------------

SMALL = [
    "train.steps=2",
    "train.prompts_per_step=4",
    "train.mini_batch_size=4",
    "rollout.num_generations=4",
    "rollout.max_completion_length=12",
    "algorithm.overlong_buffer=4",
    "logging.tensorboard=false",
    "logging.dashboard=false",
    "logging.console=false",
    "logging.transcripts_per_step=16",
    "checkpoint.save_every=0",
    "checkpoint.save_final_model=false",
    "evaluate=false",
]


def trl_rows(n: int = 8) -> list[dict]:
    return [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "solution": str(2 * i),
        }
        for i in range(n)
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_trl_rewards_train_unchanged_from_python_and_the_cli(tool_model, tmp_path):
    import datasets

    import dapo
    from dapo.cli import main as cli_main

    overlong = trl_rewards.get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=6)
    funcs = [trl_rewards.accuracy_reward, trl_rewards.think_format_reward, overlong]
    common = [*SMALL, f"model.name_or_path={tool_model}", "algorithm.overlong_penalty=false"]
    # The rewards of a random model barely differ: the run is about the calls, not learning.
    common.append("algorithm.dynamic_sampling=false")
    out = tmp_path / "python"
    dapo.train(
        load_config(overrides=[*common, f"output_dir={out}"]),
        train_dataset=datasets.Dataset.from_list(trl_rows()),
        reward_funcs=funcs,
    )
    seen = read_jsonl(out / "rollouts.jsonl")
    assert len(seen) == 32 and all(r["failure"] is None for r in seen)
    completions = [[{"role": "assistant", "content": r["turns"][0]["text"]}] for r in seen]
    solutions = [r["ground_truth"] for r in seen]
    lengths = [[0] * r["turns"][0]["tokens"] for r in seen]
    direct = [
        trl_rewards.accuracy_reward(completions, solutions),
        trl_rewards.think_format_reward(completions),
        overlong(lengths),
    ]
    expected = [sum(v[i] for v in direct if v[i] is not None) for i in range(len(seen))]
    assert [r["reward"] for r in seen] == pytest.approx(expected)
    assert len(set(direct[2])) > 1  # precondition: the lengths did differ

    # The same rows as a file and the same functions by name, through the CLI.
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in trl_rows()))
    module = tmp_path / "my_rewards.py"
    module.write_text(
        "from trl.rewards import get_soft_overlong_punishment\n"
        "overlong = get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=6)\n"
    )
    cli = tmp_path / "cli"
    argv = [
        "train",
        *common,
        f"data.train={data}",
        f"output_dir={cli}",
        f"reward.functions=[trl.rewards:accuracy_reward, trl.rewards:think_format_reward, "
        f"'{module}:overlong']",
    ]
    assert cli_main(argv) == 0
    again = read_jsonl(cli / "rollouts.jsonl")
    completions = [[{"role": "assistant", "content": r["turns"][0]["text"]}] for r in again]
    lengths = [[0] * r["turns"][0]["tokens"] for r in again]
    direct = [
        trl_rewards.accuracy_reward(completions, [r["ground_truth"] for r in again]),
        trl_rewards.think_format_reward(completions),
        overlong(lengths),
    ]
    expected = [sum(v[i] for v in direct if v[i] is not None) for i in range(len(again))]
    assert [r["reward"] for r in again] == pytest.approx(expected)


@pytest.mark.slow
def test_responses_no_trl_reward_judges_are_counted_per_step(tool_model, tmp_path):
    import datasets

    import dapo

    def judges_some(completions, **kwargs):  # "not applicable" to responses with a 7
        return [
            None if "7" in c[0]["content"] else float(len(c[0]["content"]) % 2) for c in completions
        ]

    out = tmp_path / "run"
    cfg = [*SMALL, f"model.name_or_path={tool_model}", "algorithm.dynamic_sampling=false"]
    with pytest.warns(RewardFunctionWarning, match="returned None"):
        dapo.train(
            load_config(overrides=[*cfg, f"output_dir={out}"]),
            train_dataset=datasets.Dataset.from_list(trl_rows()),
            reward_funcs=[judges_some],
        )
    seen = read_jsonl(out / "rollouts.jsonl")
    assert len(seen) == 32  # every sample of both steps
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/unscorable" in r]
    counts = [sum("7" in r["turns"][0]["text"] for r in seen if r["step"] == s) for s in (1, 2)]
    assert [r["reward/unscorable"] for r in steps] == counts
    assert sum(counts) > 0  # precondition: some responses were not judged


def verl_rows(n: int = 8, source: str = "openai/gsm8k") -> list[dict]:
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"{i} + {i}? Put the answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


@pytest.mark.slow
def test_a_verl_compute_score_returning_a_dict_trains_from_a_verl_parquet(tool_model, tmp_path):
    import pandas as pd

    from dapo.cli import main as cli_main
    from dapo.metrics.logger import read_metrics

    data = tmp_path / "train.parquet"
    pd.DataFrame(verl_rows()).to_parquet(data)
    module = tmp_path / "verl_reward.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'openai/gsm8k' and extra_info['split'] == 'train'\n"
        "    ok = solution_str.strip().endswith(ground_truth)\n"
        "    return {'score': 1.0 if ok else 0.0, 'acc': ok, 'pred_len': len(solution_str),\n"
        "            'index': extra_info['index']}\n"
    )
    out = tmp_path / "run"
    argv = [
        "train",
        *SMALL,
        f"model.name_or_path={tool_model}",
        "algorithm.dynamic_sampling=false",
        f"data.train={data}",
        f"output_dir={out}",
        f"reward.functions=['{module}:compute_score']",
    ]
    assert cli_main(argv) == 0
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "reward/mean" in m]
    assert len(steps) == 2
    seen = read_jsonl(out / "rollouts.jsonl")
    index = [int(r["ground_truth"]) / 2 for r in seen if r["step"] == 1]  # every sample
    assert len(index) == 16
    assert steps[0]["reward/extra_index"] == pytest.approx(sum(index) / len(index))
    assert steps[0]["reward/extra_pred_len"] > 0
    assert steps[0]["reward/failures"] == 0
    assert steps[0]["reward/acc"] == steps[0]["reward/extra_acc"]  # the dict's own acc


def test_gsm8k_rows_without_a_reward_get_the_gsm8k_scorer_named_at_start_up(
    tool_model, tmp_path, capsys
):
    import dapo

    rows = verl_rows(4) + verl_rows(2, source="math_dapo")
    for r in rows[4:]:
        r["prompt"][0]["content"] += " (dapo)"
    cfg = load_config(
        overrides=[*SMALL, f"model.name_or_path={tool_model}", f"output_dir={tmp_path / 'x'}"]
    )
    dapo.make_trainer(cfg, train_dataset=rows).close()
    said = capsys.readouterr().out
    gsm8k = "scoring data_source 'openai/gsm8k' with the built-in gsm8k scorer ('#### N'"
    assert gsm8k in said
    assert "scoring data_source 'math_dapo' with the built-in dapo_math scorer" in said
    with RewardScorer(None, num_workers=0) as scorer:
        result = scorer.score(
            [
                ScoreRequest("so 36 + 36 = 72\n#### 72", "72", "openai/gsm8k"),
                ScoreRequest("\\boxed{72}", "72", "openai/gsm8k"),
                ScoreRequest("#### 71", "72", "openai/gsm8k"),
                ScoreRequest("#### 72", "72", "math_dapo"),  # dapo_math wants Answer:
            ]
        )
    assert result.rewards == [1.0, 1.0, -1.0, -1.0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["negative_length", "partial_credit"],
)
def test_rewards_on_other_scales_train_under_the_default_preset(name, tmp_path):
    from dapo.metrics.logger import read_metrics
    from dapo.training.trainer import Trainer

    rewards = Path(__file__).with_name("trainer_rewards.py")
    out = tmp_path / name
    cfg = load_config(
        overrides=[
            "train.steps=5",
            "train.prompts_per_step=4",
            "train.mini_batch_size=4",
            "rollout.num_generations=4",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "data.max_eval_prompts=8",
            f"output_dir={out}",
            f"reward.functions=['{rewards}:{name}']",
        ]
    )
    assert cfg.preset == "dapo" and cfg.algorithm.dynamic_sampling and cfg.evaluate
    said: list[str] = []
    summary = Trainer(cfg, log=said.append).run()
    # no accuracy claimed where the reward has no notion of correct
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "reward/mean" in m]
    assert len(steps) == 5
    assert all("reward/acc" not in m for m in steps)  # no claim of "correct"
    assert all(m["sampling/all_correct_frac"] == m["sampling/all_wrong_frac"] == 0 for m in steps)


# --- data as TRL and verl users have it -----------------------------------------------------


def length_reward(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]


def takes_dict(response, ground_truth):
    return 1.0 if ground_truth["low"] <= len(response) <= ground_truth["high"] else -1.0


def test_a_prompt_only_dataset_needs_no_answer_when_no_reward_asks_for_one(
    random_tiny_model, tmp_path
):
    import dapo
    from dapo.errors import DataError

    rows = [{"prompt": f"Write {i} words."} for i in range(6)]
    cfg = load_config(
        overrides=[
            *SMALL,
            f"model.name_or_path={random_tiny_model}",
            f"output_dir={tmp_path / 'x'}",
        ]
    )
    trainer = dapo.make_trainer(cfg, train_dataset=rows, reward_funcs=length_reward)
    assert [r.ground_truth for r in trainer.rollouts.train_records] == [""] * 6
    trainer.close()
    # A reward that reads the answer (here the built-in scorer) still needs the column.
    with pytest.raises(DataError, match="reward_model.ground_truth"):
        dapo.make_trainer(cfg, train_dataset=rows)


def test_a_dict_answer_goes_whole_to_the_rewards_that_take_it(random_tiny_model, tmp_path):
    import dapo
    from dapo.errors import DataError
    from dapo.rewards import ScoreRequest

    rows = [
        {"prompt": f"Say {i}.", "reward_model": {"ground_truth": {"low": i, "high": 2 * i}}}
        for i in range(1, 5)
    ]
    cfg = load_config(
        overrides=[
            *SMALL,
            f"model.name_or_path={random_tiny_model}",
            f"output_dir={tmp_path / 'x'}",
        ]
    )
    trainer = dapo.make_trainer(cfg, train_dataset=rows, reward_funcs=takes_dict)
    records = trainer.rollouts.train_records
    assert records[1].ground_truth == {"low": 2, "high": 4}
    scored = trainer.rollouts.scorer.rewards.score(
        [
            ScoreRequest("abc", records[1].ground_truth),
            ScoreRequest("abcdef", records[1].ground_truth),
        ]
    )
    trainer.close()
    assert scored.rewards == [1.0, -1.0]
    with pytest.raises(DataError, match="a dict answer goes whole to reward functions"):
        dapo.make_trainer(cfg, train_dataset=rows)  # the built-in scorer reads text


# --- TRL's and verl's option names ----------------------------------------------------------


def test_verl_and_trl_names_are_translated_with_units_and_a_table(capsys):
    cfg = load_config(
        overrides=[
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.clip_ratio_c=3.0",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=acc",
            "reward_model.overlong_buffer.len=32",
            "trainer.total_training_steps=7",
            "trainer.test_freq=-1",
            "num_iterations=2",
        ]
    )
    assert cfg.logging.eval_every == 0  # verl's -1: never
    a, t = cfg.algorithm, cfg.train
    assert (a.clip_high, a.clip_c, a.dynamic_sampling, a.dynamic_sampling_metric) == (
        0.28,
        3.0,
        True,
        "acc",
    )
    assert (t.prompts_per_step, t.mini_batch_size, t.steps, t.epochs) == (8, 4, 7, 2)
    assert (cfg.rollout.num_generations, a.overlong_buffer) == (4, 32)
    table = capsys.readouterr().out
    assert "data.train_batch_size" in table and "-> train.prompts_per_step = 8" in table
    # TRL counts completions per device, dapo prompts: 8 x 2 / 4 = 4. A caller may take the
    # table (log=) instead of having it printed.
    told: list[str] = []
    cfg = load_config(
        overrides={
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "num_generations": 4,
            "loss_type": "dr_grpo",
        },
        log=told.append,
    )
    assert capsys.readouterr().out == ""
    assert len(told) == 1 and "per_device_train_batch_size" in told[0]
    assert (cfg.train.mini_batch_size, cfg.train.prompts_per_step) == (4, 4)
    assert cfg.algorithm.loss_agg == "seq-mean-token-sum-norm"


def test_every_name_that_cannot_be_used_is_in_one_error_with_its_reason():
    with pytest.raises(ConfigError) as info:
        load_config(
            overrides=[
                "num_train_epochs=3",
                "trainer.nnodes=2",
                "train.stpes=3",
                "actor_rollout_ref.actor.no_such_knob=1",
                "loss_type=sapo",
            ]
        )
    msg = str(info.value)
    assert msg.startswith("5 config names cannot be used:")
    assert "`num_train_epochs`: dapo counts rollout steps" in msg
    assert "`trainer.nnodes`: launch with torchrun --nnodes" in msg
    assert "`train.stpes`: did you mean `train.steps`?" in msg
    assert "`actor_rollout_ref.actor.no_such_knob`: a verl key dapo has no equivalent" in msg
    assert "`loss_type` = 'sapo': its value 'sapo' has no equivalent here" in msg


def test_no_trl_or_verl_name_is_answered_with_a_key_of_another_meaning():
    """Each documented TRL GRPOConfig name and verl key is translated (to a key of the same
    meaning, checked by hand in foreign.py's tables), refused or ignored with a reason, or
    unknown with no look-alike suggestion."""
    import dataclasses

    from trl import GRPOConfig

    from dapo.config import foreign

    names = [f.name for f in dataclasses.fields(GRPOConfig)] + list(foreign.VERL)
    for name in names:
        if name in foreign.TRL or name in foreign.VERL:
            continue  # the tables: reviewed meanings
        try:
            load_config(overrides={name: 1})
        except ConfigError as e:
            assert "did you mean" not in str(e), (name, str(e))
        else:
            pytest.fail(f"{name} was accepted without a translation")
    # names that TRL and verl users set and we misdirected: each now right or refused
    cfg = load_config(overrides={"num_iterations": 3, "save_steps": 10})
    assert (cfg.train.epochs, cfg.checkpoint.save_every) == (3, 10)
    with pytest.raises(ConfigError, match="dapo counts rollout steps"):
        load_config(overrides={"num_train_epochs": 2})


def test_a_trl_grpo_config_object_trains_with_its_values_and_reward_weights(
    random_tiny_model, tmp_path
):
    from trl import GRPOConfig

    import dapo

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        bf16=False,
        learning_rate=3e-6,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=24,
        reward_weights=[1.0, 0.5],
    )
    cfg = dapo.make_config(args)
    assert (cfg.train.lr, cfg.rollout.num_generations, cfg.train.prompts_per_step) == (
        3e-6,
        4,
        2,
    )
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.2)  # TRL: symmetric
    assert cfg.output_dir == str(tmp_path / "run")
    trainer = dapo.make_trainer(
        args,
        model=str(random_tiny_model),
        reward_funcs=[length_reward, length_reward],
        **{"data.train": "builtin:addition", "evaluate": False},
    )
    assert trainer.rollouts.scorer.rewards._plan.weights == [1.0, 0.5]
    trainer.close()
    with pytest.raises(ConfigError, match="needs one weight per reward function"):
        dapo.make_trainer(args, model=str(random_tiny_model), reward_funcs=[length_reward])


def _grpo_config_switches() -> list[str]:
    """Every true/false option of TRL's GRPOConfig, its own and TrainingArguments'."""
    import dataclasses
    import typing

    from trl import GRPOConfig

    hints = typing.get_type_hints(GRPOConfig)
    return [
        f.name
        for f in dataclasses.fields(GRPOConfig)
        if hints[f.name] is bool or bool in typing.get_args(hints[f.name])
    ]


# Switches whose effect shows only beside another setting: that setting, for the walk.
_BESIDE = {
    "vllm_importance_sampling_correction": {"use_vllm": True},  # TRL corrects vLLM's samples
    "use_bias_correction_kl": {"beta": 0.04},  # it weighs the KL term
}


def _from_grpo_config(name: str, value: bool, out: Path) -> tuple[object, dict, str]:
    """A GRPOConfig with ``name`` = ``value``, as dapo reads it: the config (or the error),
    the names taken from it, and the translation table."""
    from trl import GRPOConfig

    from dapo.config import foreign

    args = GRPOConfig(output_dir=str(out), use_cpu=True)
    for key, v in {**_BESIDE.get(name, {}), name: value}.items():
        setattr(args, key, v)  # as given to the constructor, past TRL's own checks
    taken = foreign.trl_names(args)
    told: list[str] = []
    try:
        cfg: object = load_config(taken, log=told.append)
    except ConfigError as exc:
        cfg = exc
    return cfg, taken, "\n".join(told)


@pytest.mark.filterwarnings("ignore")
def test_every_grpo_config_switch_is_translated_refused_or_ignored_at_both_values(tmp_path):
    """Each true/false option of GRPOConfig, set true and then false: translated to a dapo
    key that follows it, refused at the value dapo has no equivalent for (named, with the
    reason), or ignored with the reason in the table; a switch dapo translates or checks is
    taken at TRL's default too. From a mapping (a YAML file), each value is in the table or
    the error."""
    from dapo.config import foreign

    switches = _grpo_config_switches()
    assert "mask_truncated_completions" in switches and len(switches) > 40
    for name in switches:
        rule = foreign.TRL.get(name)
        assert rule is not None, f"GRPOConfig's `{name}` is in no rule of foreign.TRL"
        assert not rule.why, f"`{name}` is refused at both values; one of them is dapo's"
        got = {v: _from_grpo_config(name, v, tmp_path) for v in (True, False)}
        for v in (True, False):  # a mapping's names always reach the table or the error
            told: list[str] = []
            try:
                load_config(overrides={**_BESIDE.get(name, {}), name: v}, log=told.append)
            except ConfigError as exc:
                assert f"`{name}`" in str(exc), (name, v, str(exc))
            else:
                assert re.search(rf"\b{name}\b", "\n".join(told)), (name, v, told)
        if rule.ignore:
            for v, (cfg, taken, table) in got.items():
                assert not isinstance(cfg, ConfigError), (name, v, cfg)
                if name in taken:  # set away from TRL's default: the table says why
                    assert f"ignored: {rule.ignore}" in table, (name, v, table)
            continue
        if name == "bf16":  # TRL's default (bf16 unless fp16) is auto's choice on CUDA
            (on, taken_on, _), (off, taken_off, _) = got[True], got[False]
            assert "bf16" not in taken_on and on.train.precision == "auto"
            assert taken_off["bf16"] is False and off.train.precision == "fp32"
            continue
        for v, (_, taken, _) in got.items():
            assert taken.get(name) is v, f"`{name}` = {v} was not taken"
        refused = [v for v, (cfg, _, _) in got.items() if isinstance(cfg, ConfigError)]
        if refused:  # checked: one value is what dapo does, the other is refused
            (v,) = refused
            assert f"`{name}` = {v!r}: " in str(got[v][0]), (name, str(got[v][0]))
            assert not isinstance(got[not v][0], ConfigError)
        else:  # translated: the config follows the switch
            on, off = got[True][0].to_dict(), got[False][0].to_dict()
            assert on != off, f"`{name}`: true and false give the same config"


def test_trl_mask_truncated_completions_decides_the_overlong_filter_both_ways(tmp_path, capsys):
    """TRL's default (false) turns the DAPO preset's overlong filter off; true turns it on;
    the table says which value was TRL's default."""
    from trl import GRPOConfig

    import dapo

    for given in ({}, {"mask_truncated_completions": False}):
        cfg = dapo.make_config(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **given))
        assert cfg.preset == "dapo" and cfg.algorithm.overlong_filter is False
        assert cfg.algorithm.overlong_penalty is True  # TRL has no such setting: the preset's
    table = capsys.readouterr().out
    assert "mask_truncated_completions" in table
    assert "-> algorithm.overlong_filter = False  (TRL's default)" in table
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, mask_truncated_completions=True)
    assert dapo.make_config(args).algorithm.overlong_filter is True
    line = next(x for x in capsys.readouterr().out.splitlines() if "overlong_filter" in x)
    assert line.endswith("-> algorithm.overlong_filter = True")
    assert (
        load_config(overrides={"mask_truncated_completions": False}).algorithm.overlong_filter
        is False
    )


def test_verl_switches_are_translated_refused_or_ignored_at_both_values():
    """verl's true/false keys (its ppo_trainer.yaml and the DAPO recipe): each value is
    translated to a dapo key that follows it, refused with the key named, or ignored in the
    table. verl has no overlong filter (its overlong shaping is overlong_buffer)."""
    keys = [
        "data.shuffle",
        "data.filter_overlong_prompts",
        "data.return_raw_chat",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.model.use_liger",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.use_torch_compile",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.rollout.enforce_eager",
        "actor_rollout_ref.rollout.free_cache_engine",
        "reward_model.enable",
        "reward_model.overlong_buffer.enable",
        "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.use_kl_in_reward",
        "algorithm.filter_groups.enable",
        "trainer.balance_batch",
        "trainer.val_before_train",
    ]
    translated = {}
    for key in keys:
        got = {}
        for v in (True, False):
            told: list[str] = []
            try:
                got[v] = load_config(overrides={key: v}, log=told.append).to_dict()
            except ConfigError as exc:
                assert f"`{key}`" in str(exc) and "did you mean" not in str(exc), str(exc)
                continue
            dapo_key = key in {"data.shuffle"}  # dapo's own key of the same name
            assert dapo_key or re.search(rf"\b{key}\b", "\n".join(told)), (key, v, told)
        if len(got) == 2 and got[True] != got[False]:
            translated[key] = got
    assert set(translated) == {
        "data.shuffle",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.actor.use_kl_loss",
        "reward_model.overlong_buffer.enable",
        "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.filter_groups.enable",
        "trainer.val_before_train",
    }
    # use_kl_loss alone is verl's KL loss at its default coefficient; false is none
    kl = translated["actor_rollout_ref.actor.use_kl_loss"]
    assert (kl[True]["algorithm"]["beta"], kl[False]["algorithm"]["beta"]) == (0.001, 0.0)
    adv = translated["algorithm.norm_adv_by_std_in_grpo"]
    assert adv[False]["algorithm"]["advantage_scale"] == "none"  # Dr. GRPO's
    both = load_config(
        overrides={"algorithm.adv_estimator": "grpo", "algorithm.norm_adv_by_std_in_grpo": False}
    )
    assert both.algorithm.advantage_scale == "none"


def test_a_trl_reward_returning_the_wrong_number_of_values_costs_its_group():
    def short(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    reqs = [ScoreRequest(t, "") for t in "abcd"]
    with (
        pytest.warns(RewardFunctionWarning, match="a list of 1 values for 2 completions"),
        RewardScorer([(short, 1.0)], num_workers=0) as scorer,
    ):
        result = scorer.score(reqs, groups=[range(0, 2), range(2, 4)])
    assert result.rewards == [-1.0] * 4 and result.bad_values == 4
