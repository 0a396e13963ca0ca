"""Run health (dapo.health): each symptom induced on a tiny run and warned within 3 rollout
steps, naming the metric, its value, the cause and the fix; the checks' thresholds against
hand-made metric sequences; what a failed run leaves to read."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dapo.config import load_config
from dapo.errors import ConfigError, DynamicSamplingError, HealthError, HealthWarning
from dapo.health import KINDS, HealthMonitor, diagnose_groups
from dapo.metrics.logger import read_metrics
from dapo.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
REWARDS = Path(__file__).with_name("trainer_rewards.py")


def config(model: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            "train.steps=3",
            "train.prompts_per_step=4",
            "train.mini_batch_size=4",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "algorithm.overlong_buffer=4",
            "algorithm.max_gen_rounds=2",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "reward.num_workers=0",
            *extra,
        ]
    )


def reward(name: str) -> str:
    return f"reward.functions=[{{name: '{REWARDS}:{name}'}}]"


def run(
    cfg, *, error: type[BaseException] | None = None
) -> tuple[list[str], dict, Exception | None]:
    """Train; the health warnings' texts, summary.json and the error the run stopped with."""
    caught = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = Trainer(cfg, log=lambda _: None)
        if error is None:
            trainer.run()
        else:
            with pytest.raises(error) as info:
                trainer.run()
            caught = info.value
    texts = [str(w.message) for w in seen if issubclass(w.category, HealthWarning)]
    summary = json.loads((Path(cfg.output_dir) / "summary.json").read_text())
    return texts, summary, caught


def first_steps(summary: dict) -> dict[str, int]:
    return {h["kind"]: h["step"] for h in summary["health"]}


# --- the symptoms, induced -----------------------------------------------------------------


def test_truncation_is_named_under_dapo_and_grpo(random_tiny_model, tmp_path):
    # Two tokens: a random model's responses all hit the limit.
    cut = ("rollout.max_completion_length=2", "algorithm.overlong_buffer=1")
    texts, summary, exc = run(
        config(random_tiny_model, tmp_path / "dapo", *cut, "logging.dashboard=true"),
        error=DynamicSamplingError,
    )
    assert first_steps(summary)["truncation"] == 1
    (text,) = [t for t in texts if "(truncation" in t]
    share = read_metrics(tmp_path / "dapo")[0]["response_length/clip_ratio"]
    assert share > 0.9 and f"response_length/clip_ratio = {share:.4g} (threshold 0.5)" in text
    assert "rollout.max_completion_length=2" in text and "run-health.md#truncation" in text
    # Dynamic sampling's stop names the cause before the advice on prompt difficulty.
    message = str(exc)
    cause = message.index("cut off at rollout.max_completion_length=2")
    assert cause < message.index("use harder prompts")
    assert summary["error"].startswith("DynamicSamplingError: ")  # written though it failed
    assert (tmp_path / "dapo" / "dashboard.png").is_file()

    # GRPO (no dynamic sampling) used to print normal progress and exit 0.
    texts, summary, _ = run(config(random_tiny_model, tmp_path / "grpo", *cut, "preset=grpo"))
    steps = first_steps(summary)
    assert steps["truncation"] == 1 and steps["zero_gradients"] <= 3
    m = read_metrics(tmp_path / "grpo")
    assert [x.get("health/truncation") for x in m] == [1.0, 1.0, 1.0]
    assert m[-1]["health/warnings"] == float(len(summary["health"]))


def test_a_constant_reward_is_named_with_its_value(random_tiny_model, tmp_path):
    texts, summary, exc = run(
        config(random_tiny_model, tmp_path / "dapo", reward("constant_half")),
        error=DynamicSamplingError,
    )
    assert first_steps(summary)["constant_reward"] == 2  # health.uniform_steps=2
    (text,) = [t for t in texts if "(constant_reward" in t]
    assert "the reward was 0.5 for every response of the last 2 rollout steps" in text
    m = read_metrics(tmp_path / "dapo")
    assert [x["reward/score_max"] - x["reward/score_min"] for x in m] == [0.0, 0.0]
    assert "the reward was 0.5 for every one of the" in str(exc)
    texts, summary, _ = run(
        config(random_tiny_model, tmp_path / "grpo", reward("constant_half"), "preset=grpo")
    )
    steps = first_steps(summary)
    assert steps["constant_reward"] == 2 and steps["zero_gradients"] == 2


def test_a_reward_of_the_prompt_alone_makes_every_group_uniform(random_tiny_model, tmp_path):
    texts, summary, exc = run(
        config(random_tiny_model, tmp_path / "run", reward("prompt_only"), "preset=grpo")
    )
    assert first_steps(summary)["uniform_groups"] == 2
    (text,) = [t for t in texts if "(uniform_groups" in t]
    m = read_metrics(tmp_path / "run")[1]
    correct, wrong = m["sampling/all_correct_frac"], m["sampling/all_wrong_frac"]
    assert correct + wrong == 1.0 and 0 < correct < 1  # uniform groups of both kinds
    assert f"({correct:.0%} all correct, {wrong:.0%} all wrong)" in text


def test_near_greedy_sampling_names_the_temperature(random_tiny_model, tmp_path):
    texts, summary, exc = run(
        config(
            random_tiny_model, tmp_path / "run", reward("odd_length"), "rollout.temperature=0.01"
        ),
        error=DynamicSamplingError,
    )
    assert first_steps(summary)["near_greedy"] == 1
    (text,) = [t for t in texts if "(near_greedy" in t]
    assert "rollout.temperature=0.01" in text and "Raise rollout.temperature" in text
    assert "rollout.temperature=0.01 samples nearly greedily" in str(exc)


def test_entropy_collapsing_with_flat_accuracy_names_clip_high(random_tiny_model, tmp_path):
    # A high learning rate on a reward the tiny model cannot learn in a few steps: the
    # entropy falls while the accuracy does not move (flat_acc wide enough for the noise).
    cfg = config(
        random_tiny_model,
        tmp_path / "run",
        reward("odd_length"),
        "preset=grpo",
        "train.steps=6",
        "train.lr=0.05",
        "health.entropy_floor=0.5",
        "health.flat_acc=0.5",
        "health.baseline_steps=1",
    )
    texts, summary, _ = run(cfg)
    m = [x for x in read_metrics(tmp_path / "run") if "actor/entropy" in x]
    first = first_steps(summary)["entropy_collapse"]
    # Warned at the first step whose entropy is below half the first step's.
    expected = next(x["step"] for x in m[1:] if x["actor/entropy"] < 0.5 * m[0]["actor/entropy"])
    assert first == expected
    (text,) = [t for t in texts if "(entropy_collapse" in t]
    # The GRPO preset's clip_high is the symmetric 0.2; Clip-Higher's 0.28 is named as the fix.
    assert "algorithm.clip_high (now 0.2;" in text and "Clip-Higher is 0.28" in text
    assert "rollout.temperature (now 1)" in text


def test_zero_gradients_for_two_steps_are_named(random_tiny_model, tmp_path):
    texts, summary, _ = run(
        config(random_tiny_model, tmp_path / "run", reward("always_wrong"), "preset=grpo")
    )
    assert first_steps(summary)["zero_gradients"] == 2
    (text,) = [t for t in texts if "(zero_gradients" in t]
    assert "actor/grad_norm = 0" in text


def test_engine_mismatch_quantiles_and_warning(random_tiny_model, tmp_path, monkeypatch):
    """The engine's log-probs made to disagree with the trainer's on a share of tokens: the
    quantiles and the share outside [0.8, 1.25] are logged and the mismatch is warned."""
    from dapo.rollout.hf_engine import HFEngine

    generate = HFEngine.generate

    def skewed(self, prompts, params):
        groups = generate(self, prompts, params)
        for g in groups:
            for lp in g.logprobs:
                lp[::3] = [x - 0.5 for x in lp[::3]]  # every third token 0.61x as likely
        return groups

    monkeypatch.setattr(HFEngine, "generate", skewed)
    cfg = config(random_tiny_model, tmp_path / "run", reward("odd_length"), "algorithm.is_cap=2")
    texts, summary, _ = run(cfg)
    m = [x for x in read_metrics(tmp_path / "run") if "rollout/logprob_ratio_outside" in x]
    assert m and all(0.25 < x["rollout/logprob_ratio_outside"] < 0.45 for x in m)
    assert all(x["rollout/logprob_ratio_p999"] > 1.5 for x in m)  # exp(0.5) = 1.65
    assert first_steps(summary)["engine_mismatch"] == 1
    assert any("rollout/logprob_ratio_outside" in t and "algorithm.is_cap" in t for t in texts)


def test_a_fatal_kind_stops_the_run_and_keeps_its_state(random_tiny_model, tmp_path):
    cut = ("rollout.max_completion_length=2", "algorithm.overlong_buffer=1", "preset=grpo")
    cfg = config(random_tiny_model, tmp_path / "run", *cut, "health.fatal=[truncation]")
    _, summary, exc = run(cfg, error=HealthError)
    assert "health.fatal includes 'truncation'" in str(exc) and "step_000001" in str(exc)
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
    assert summary["steps"] == 1 and first_steps(summary) == {"truncation": 1}
    assert read_metrics(tmp_path / "run")[0]["health/truncation"] == 1.0  # logged first


# --- the checks against hand-made metrics --------------------------------------------------


def monitor(*extra: str) -> HealthMonitor:
    return HealthMonitor(load_config(overrides=list(extra)))


def feed(m: HealthMonitor, steps: list[dict[str, float]]) -> list[str]:
    """The kinds warned, in order, over ``steps``."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, metrics in enumerate(steps, 1):
            m.observe(i, dict(metrics))
    return [str(w.message).split("(")[1].split(",")[0] for w in seen]


def test_the_kinds_are_the_configs_names():
    from typing import get_args

    from dapo.choices import HealthKind

    assert ("all", *KINDS) == get_args(HealthKind)


def test_entropy_blowup_needs_entropy_up_and_accuracy_down():
    base = {"actor/entropy": 1.0, "reward/acc": 0.5}
    up_flat = {"actor/entropy": 3.5, "reward/acc": 0.49}  # 3.5 > 3 x 1.0, acc within 0.05
    up_down = {"actor/entropy": 3.5, "reward/acc": 0.3}
    assert feed(monitor(), [base, base, up_flat]) == []
    assert feed(monitor(), [base, base, up_down]) == ["entropy_blowup"]
    assert feed(monitor(), [base, base, {**up_down, "actor/entropy": 2.9}]) == []


def test_length_racing_to_the_limit_with_a_flat_accuracy():
    limit = load_config().rollout.max_completion_length
    base = {"response_length/mean": 0.4 * limit, "reward/acc": 0.5}
    long = {"response_length/mean": 0.92 * limit, "reward/acc": 0.52}
    assert feed(monitor(), [base, base, long]) == ["length_to_limit"]
    # Long from the start (no race), or long and learning: no warning.
    assert feed(monitor(), [long, long, long]) == []
    assert feed(monitor(), [base, base, {**long, "reward/acc": 0.7}]) == []


def test_uniform_groups_name_a_reward_scale_that_never_crosses_correct():
    # Only where acc is asked for: "auto" (the default) keeps such a reward's groups by score.
    step = {
        "sampling/uniform_groups": 1.0,
        "sampling/all_correct_frac": 1.0,
        "sampling/all_wrong_frac": 0.0,
        "reward/score_min": 0.1,
        "reward/score_max": 1.0,
    }
    m = monitor("algorithm.dynamic_sampling_metric=acc")
    with pytest.warns(HealthWarning) as seen:
        m.observe(1, dict(step))
        m.observe(2, dict(step))
    (w,) = seen
    assert "(uniform_groups, rollout step 2)" in str(w.message)
    assert "ranged from 0.1 to 1" in str(w.message)
    assert "algorithm.dynamic_sampling_metric=reward" in str(w.message)


def test_each_kind_warns_once_and_health_metrics_mark_every_step():
    m = monitor()
    step = {"response_length/clip_ratio": 0.8, "response_length/mean": 100.0}
    with pytest.warns(HealthWarning):
        out = [m.observe(i, dict(step)) for i in (1, 2, 3)]
    assert [o["health/truncation"] for o in out] == [1.0, 1.0, 1.0]
    assert [f["step"] for f in m.findings] == [1]
    assert m.findings[0]["value"] == 0.8 and m.findings[0]["threshold"] == 0.5
    m2 = monitor()
    m2.load_state_dict(m.state_dict())  # resumed: not warned again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2.observe(4, dict(step))


def test_diagnose_groups_names_each_cause():
    from dapo.handover import ScoredGroup

    def group(rewards, truncated=False):
        n = len(rewards)
        return ScoredGroup(
            prompt_ids=[1],
            response_ids=[[2]] * n,
            sample_logprobs=[[0.0]] * n,
            truncated=[truncated] * n,
            rewards=list(rewards),
            correct=[r > 0 for r in rewards],
            penalty=[0.0] * n,
        )

    text = diagnose_groups([group([-1.0] * 4, True)], max_completion_length=8, temperature=1.0)
    assert "100% of the responses were cut off at rollout.max_completion_length=8" in text
    assert "the reward was -1 for every one of the 4 responses" in text
    text = diagnose_groups([group([-3.0, -0.5])], max_completion_length=8, temperature=1.0)
    assert "ranged from -3 to -0.5 but no response counts as correct" in text
    assert diagnose_groups([group([1.0, -1.0])], max_completion_length=8, temperature=1.0) == ""


def test_logprob_ratio_quantiles_match_a_direct_computation():
    from dapo.training.batch import Sample
    from dapo.training.token_weights import logprob_mismatch

    torch.manual_seed(0)
    trainer_lp = torch.randn(200).double() - 2
    gap = torch.randn(200).double() * 0.3
    s = Sample.__new__(Sample)
    s.sampling_logprobs = trainer_lp - gap  # engine
    s.sampled = lambda: torch.ones(200)
    out = logprob_mismatch([s], [trainer_lp])
    ratio = torch.exp(gap)  # pi_trainer / pi_engine
    ordered = sorted(ratio.tolist())

    # numpy's "linear" quantile, written out: position q * (n - 1).
    def quantile(q):
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        return ordered[lo] + (ordered[min(lo + 1, 199)] - ordered[lo]) * (pos - lo)

    assert out["rollout/logprob_ratio_p001"] == pytest.approx(quantile(0.001), rel=1e-9)
    assert out["rollout/logprob_ratio_p999"] == pytest.approx(quantile(0.999), rel=1e-9)
    outside = sum(1 for r in ratio.tolist() if r < 0.8 or r > 1.25) / 200
    assert out["rollout/logprob_ratio_outside"] == pytest.approx(outside)


# --- what a run that cannot learn leaves to read -------------------------------------------


def test_a_reward_spec_that_cannot_be_called_is_refused_before_the_model_loads(
    random_tiny_model, tmp_path
):
    import shutil

    # A model whose weights cannot load: the reward (and the data) are checked before them.
    missing = tmp_path / "broken-weights"
    shutil.copytree(random_tiny_model, missing)
    (missing / "model.safetensors").write_bytes(b"not weights")
    for name, why in (
        ("one_argument", "cannot be called in any form dapo knows"),
        ("swapped", "names its parameters in another order"),
    ):
        cfg = config(missing, tmp_path / name, reward(name))
        with pytest.raises(ConfigError, match=r"reward.functions\[0\].*" + re.escape(why)):
            Trainer(cfg, log=lambda _: None)
    bad_data = tmp_path / "no-such-file.jsonl"
    cfg = config(missing, tmp_path / "data", reward("odd_length"), f"data.train={bad_data}")
    with pytest.raises(Exception, match="no-such-file.jsonl"):  # the data, before the weights
        Trainer(cfg, log=lambda _: None)
    cfg = config(missing, tmp_path / "good", reward("odd_length"))
    with pytest.raises(Exception, match="safetensors|header|weights"):  # precondition
        Trainer(cfg, log=lambda _: None)


def test_every_reward_failing_is_not_an_accuracy_of_zero(random_tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = config(random_tiny_model, out, reward("raises"), "evaluate=true", "train.steps=1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(cfg, log=lambda _: None).run()  # one step of failures: under max_failed_steps
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None
    err = capsys.readouterr().err
    assert "held-out accuracy before training: not measured (every reward call failed" in err
    assert "this reward always fails" in err and "0.0%" not in err


def test_dapo_show_numbers_steps_as_the_console_and_shows_what_was_left_out(
    random_tiny_model, tmp_path
):
    out = tmp_path / "run"
    # Every group all wrong: both steps skip their update (3 such steps would stop the run).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(config(random_tiny_model, out, reward("always_wrong"), "train.steps=2"))
    show = [sys.executable, "-m", "dapo", "show", str(out), "--step", "2"]
    done = subprocess.run(show, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NOT TRAINED  step 2" in done.stdout
    assert "not trained: filtered out by dynamic sampling: all 4 responses wrong" in done.stdout
    assert "ground truth: '" in done.stdout and "answer: '" not in done.stdout
    steps = {r["step"] for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())}
    assert steps == {1, 2}  # as the console and metrics.jsonl count
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "rollouts.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "dapo", "show", str(empty)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "holds no rollouts" in done.stderr


def test_the_dashboard_draws_shares_near_1_from_0_and_marks_health_warnings():
    from dapo.metrics.dashboard import _build_figure, health_marks

    records = [
        {"step": s, "response_length/clip_ratio": 0.9955 + s / 1e4, "response_length/mean": 9.0}
        for s in (1, 2, 3)
    ]
    records[1]["health/truncation"] = 1.0
    records[2]["health/truncation"] = 1.0
    assert health_marks(records) == {"truncation": 2}
    fig = _build_figure(records, "t")
    length = fig.axes[1]  # Response length; its twin holds the truncated share
    twin = next(a for a in fig.axes if a is not length and a.bbox.bounds == length.bbox.bounds)
    assert twin.get_ylim() == pytest.approx((-0.03, 1.03))
    assert any("health warnings" in t.get_text() for t in fig.texts)
    assert any(line.get_xdata()[0] == 2 for line in length.lines if line.get_color() == "red")
