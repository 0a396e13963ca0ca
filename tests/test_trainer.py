"""The training loop with dynamic sampling, on a random tiny model (fast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapo.config import load_config
from dapo.errors import DynamicSamplingWarning
from dapo.metrics.logger import read_metrics
from dapo.producer.dynamic_sampling import DynamicSamplingError, is_uniform
from dapo.training.trainer import Trainer, TrainingError

REWARDS = Path(__file__).with_name("trainer_rewards.py")


def small_config(model: Path, out: Path, *extra: str):
    return load_config(
        overrides=[
            f"model.name_or_path={model}",
            f"output_dir={out}",
            "train.steps=4",
            "train.prompts_per_step=4",
            "train.mini_batch_size=2",
            "rollout.num_generations=4",
            "rollout.max_completion_length=12",
            "algorithm.overlong_buffer=4",
            "data.max_eval_prompts=8",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.dashboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            "reward.num_workers=1",
            *extra,
        ]
    )


@pytest.mark.slow
def test_dynamic_sampling_trains_only_mixed_groups_and_reuses_surplus(random_tiny_model, tmp_path):
    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class', weight: 1.0}}]",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    trained: list[list] = []
    carried_after: list[list] = []
    original_build, original_fill = trainer.build_samples, trainer.rollouts.sampler.fill

    def record_build(groups):
        trained.append(list(groups))
        return original_build(groups)

    def record_fill(produce, *rest):
        out = original_fill(produce, *rest)
        carried_after.append(list(trainer.rollouts.sampler.carry))
        return out

    trainer.build_samples = record_build
    trainer.rollouts.sampler.fill = record_fill
    trainer.run()

    assert len(trained) == 4
    uniform_seen = False
    for batch in trained:
        assert len(batch) == 4
        assert not any(is_uniform(g) for g in batch)
    # Uniform groups were generated (and dropped): the reward makes a third all-correct.
    rows = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows
    import json

    metrics = [json.loads(r) for r in rows]
    uniform_seen = any(m.get("sampling/all_correct_frac", 0) > 0 for m in metrics)
    assert uniform_seen
    assert all(
        m["sampling/all_wrong_frac"] > 0 or m["sampling/all_correct_frac"] > 0 for m in metrics[:1]
    )
    # Surplus kept after step k is trained first at step k+1, the very same objects.
    reused = 0
    for k in range(len(trained) - 1):
        carry = carried_after[k]
        head = trained[k + 1][: len(carry)]
        assert [id(g) for g in head] == [id(g) for g in carry[: len(head)]]
        reused += len(head)
        assert all(g.step == k for g in head)
    assert reused > 0, "no surplus was carried over in 4 steps; the test needs a surplus"
    assert any(m["train/stale_groups"] > 0 for m in metrics)


@pytest.mark.slow
def test_a_step_trained_on_the_surplus_alone_reports_no_rollout_figures(
    random_tiny_model, tmp_path
):
    """A step whose batch comes whole from the previous step's surplus generates nothing: its
    metrics leave out the rewards, accuracy, lengths, rates and group shares (which would read
    as zeros on the console, the dashboard and the health checks) and keep the counts."""
    from dapo.metrics.console import signals

    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        f"reward.functions=[{{name: '{REWARDS}:by_answer_class', weight: 1.0}}]",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        first = trainer.rollouts.fill_batch(0)
        generated = {"reward/mean", "reward/acc", "response_length/mean", "sampling/uniform_groups"}
        assert generated <= first.metrics.keys()
        assert "acc " in signals(first.metrics) and "len " in signals(first.metrics)
        sampler = trainer.rollouts.sampler
        carry = list(first.groups)  # a surplus as large as a batch: nothing to generate
        sampler.load_state_dict({**sampler.state_dict(), "carry": carry})
        second = trainer.rollouts.fill_batch(1)
    finally:
        trainer.close()
    assert [id(g) for g in second.groups] == [id(g) for g in carry]
    m = second.metrics
    assert m["sampling/generated_groups"] == 0 and m["sampling/carried_in"] == len(carry)
    assert m["perf/gen_s"] == 0 and m["sampling/trained_groups"] == len(carry)
    reported = {k for k in m if k.startswith(("reward/", "response_length/"))}
    counts = {"reward/failures", "reward/failures_total", "reward/unscorable"}
    assert reported <= counts | {"reward/output_dropped_bytes"}  # counts, not rollout figures
    assert not {
        "perf/rollout_tokens_per_s",
        "sampling/uniform_groups",
        "sampling/wasted_frac",
    } & set(m)
    assert "acc " not in signals(m) and "len " not in signals(m) and "uniform" not in signals(m)


@pytest.mark.slow
def test_round_cap_gives_the_documented_error(random_tiny_model, tmp_path):
    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        f"reward.functions=[{{name: '{REWARDS}:always_wrong'}}]",
        "algorithm.max_gen_rounds=3",
        "algorithm.round_cap=stop",
    )
    with pytest.raises(DynamicSamplingError) as info:
        Trainer(cfg, log=lambda _: None).run()
    msg = str(info.value)
    assert "after 3 generation rounds (algorithm.max_gen_rounds=3, algorithm.round_cap=stop)" in msg
    assert "100% were all wrong" in msg and "0% were all correct" in msg
    assert "algorithm.max_gen_rounds" in msg and "rollout.num_generations" in msg


@pytest.mark.slow
def test_round_cap_train_trains_short_batches_exactly_planned(random_tiny_model, tmp_path):
    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        f"reward.functions=[{{name: '{REWARDS}:rarely_mixed'}}]",
        "algorithm.max_gen_rounds=1",
        "train.steps=3",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    trained: list[int] = []
    original = trainer.build_samples
    trainer.build_samples = lambda groups: trained.append(len(groups)) or original(groups)
    with pytest.warns(DynamicSamplingWarning) as caught:
        trainer.run()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 3
    short = [m for m in metrics if 0 < m["sampling/trained_groups"] < 4]
    assert short, "no step trained a short batch: the test needs the round cap to bite"
    sizes = iter(trained)
    for m in metrics:
        n = int(m["sampling/trained_groups"])
        assert (m["sampling/short_batch"] == 1.0) == (n < 4)
        if n:
            assert next(sizes) == n
            # A short batch of n groups: ceil(n / mini_batch_size=2) updates.
            assert m["actor/updates"] == -(-n // 2)
        else:
            assert m["actor/updates"] == 0.0
    notes = [str(w.message) for w in caught if "short batch" in str(w.message)]
    assert len(notes) == sum(0 < m["sampling/trained_groups"] < 4 for m in metrics)
    assert all("algorithm.round_cap=train" in x and "algorithm.round_cap=stop" in x for x in notes)


@pytest.mark.slow
def test_steps_without_signal_skip_the_update_then_stop_also_after_resume(
    random_tiny_model, tmp_path
):
    out = tmp_path / "run"
    extra = (
        f"reward.functions=[{{name: '{REWARDS}:always_wrong'}}]",
        "algorithm.max_gen_rounds=2",
        "checkpoint.save_every=1",
    )
    trainer = Trainer(
        small_config(random_tiny_model, out, *extra, "train.steps=1"), log=lambda _: None
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.warns(DynamicSamplingWarning, match="update is skipped"):
        trainer.run()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update was made
    assert trainer.learner.optimizer.state == {}
    (m,) = read_metrics(out)
    assert m["actor/updates"] == 0.0 and m["sampling/trained_groups"] == 0.0
    assert m["sampling/short_batch"] == 1.0

    # The count of empty steps in a row is checkpointed: with the default
    # algorithm.max_empty_steps=3 the resumed run skips step 1 and stops at step 2.
    resumed = Trainer(
        small_config(random_tiny_model, out, *extra, "train.steps=5", "resume=true"),
        log=lambda _: None,
    )
    with pytest.warns(DynamicSamplingWarning), pytest.raises(DynamicSamplingError) as info:
        resumed.run()
    assert resumed.step == 2
    msg = str(info.value)
    assert "no group with a learning signal in 3 rollout steps in a row" in msg
    assert "algorithm.max_empty_steps=3" in msg and "Raise algorithm.max_gen_rounds" in msg


@pytest.mark.slow
def test_existing_checkpoints_are_not_overwritten_without_resume(random_tiny_model, tmp_path):
    out = tmp_path / "run"
    cfg = small_config(random_tiny_model, out, "algorithm.dynamic_sampling=false", "train.steps=1")
    Trainer(cfg, log=lambda _: None).run()
    ckpt = next((out / "checkpoints").iterdir())
    before = (ckpt / "model.safetensors").read_bytes()
    with pytest.raises(TrainingError, match="resume=true"):
        Trainer(cfg, log=lambda _: None).run()
    assert (ckpt / "model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_every_file_of_a_run_has_the_permissions_of_a_new_file(random_tiny_model, tmp_path):
    """safetensors writes its files 0600; the weights of the checkpoints and final_model get
    what every other file of the run gets: 0o666 less the umask."""
    import os

    out = tmp_path / "run"
    cfg = small_config(
        random_tiny_model,
        out,
        "algorithm.dynamic_sampling=false",
        "train.steps=1",
        "checkpoint.save_final_model=true",
    )
    umask = os.umask(0o027)  # not the usual 022: the mode follows the umask
    try:
        Trainer(cfg, log=lambda _: None).run()
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(out)): os.stat(p).st_mode & 0o777 for p in out.rglob("*")}
    files = [name for name in modes if (out / name).is_file()]
    weights = [name for name in files if name.endswith(".safetensors")]
    assert any(n.startswith("checkpoints/") for n in weights)
    assert any(n.startswith("final_model/") for n in weights)
    assert {name: oct(modes[name]) for name in files} == {name: "0o640" for name in files}


@pytest.mark.slow
def test_same_seed_same_metrics(random_tiny_model, tmp_path):
    """Two runs of one seed log the same metrics; logging.dashboard changes only whether
    dashboard.png is drawn at the end."""
    import json

    def run(out: Path, dashboard: bool) -> list[dict]:
        cfg = small_config(
            random_tiny_model,
            out,
            "algorithm.dynamic_sampling=false",
            "train.steps=2",
            f"logging.dashboard={str(dashboard).lower()}",
        )
        Trainer(cfg, log=lambda _: None).run()
        assert (out / "dashboard.png").is_file() == dashboard
        assert (out / "summary.json").is_file()
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if not k.startswith("perf/") and k != "time"} for r in rows
        ]

    assert run(tmp_path / "a", True) == run(tmp_path / "b", False)


@pytest.mark.slow
def test_beta_loads_reference_model_only_when_needed(random_tiny_model, tmp_path):
    no_kl = Trainer(small_config(random_tiny_model, tmp_path / "a"), log=lambda _: None)
    assert no_kl.learner.ref_model is None
    with_kl = Trainer(
        small_config(
            random_tiny_model,
            tmp_path / "b",
            "algorithm.beta=0.1",
            "algorithm.dynamic_sampling=false",
            "train.steps=1",
        ),
        log=lambda _: None,
    )
    assert with_kl.learner.ref_model is not None
    with_kl.run()
    import json

    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert "actor/kl_ref" in rows[0]


@pytest.mark.slow
def test_trains_a_transformers_model_on_reference_parquet(tmp_path):
    """Any causal LM directory + a parquet file in the DAPO reference format."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dapo.models.tiny import build_model, build_tokenizer

    model_dir = tmp_path / "model"
    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    build_model(len(tok), seed=1).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"What is {i}+{i}? End with Answer: N"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i in range(12)
    ]
    rows.append(dict(rows[0]))  # a duplicate prompt, dropped by the loader
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "run"
    cfg = small_config(
        model_dir,
        out,
        f"data.train={data}",
        f"data.eval={data}",
        "evaluate=true",
        "algorithm.dynamic_sampling=false",
        "train.steps=2",
        "checkpoint.save_final_model=true",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    assert len(trainer.rollouts.train_records) == 12
    assert trainer.tokenizer.decode(trainer.rollouts.train_ids[0]).startswith("user: What is")
    summary = trainer.run()
    assert summary["steps"] == 2 and "accuracy_after" in summary
    rows_out = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows_out[0] == {
        "step": 0,
        "val/acc": summary["accuracy_before"],
        "time": rows_out[0]["time"],
    }
    assert rows_out[1]["actor/grad_norm"] > 0
    assert (out / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_sample_budget_stops_after_that_many_generated_responses(random_tiny_model, tmp_path):
    """train.sample_budget counts every response generated, dropped groups included, and
    the count survives a resume."""
    import json

    reward = f"reward.functions=[{{name: '{REWARDS}:by_answer_class', weight: 1.0}}]"
    out = tmp_path / "run"
    # 4 prompts x 4 responses per round; uniform groups force extra rounds.
    budget = 40
    cfg = small_config(
        random_tiny_model,
        out,
        reward,
        "train.steps=50",
        f"train.sample_budget={budget}",
        "checkpoint.save_every=1",
    )
    summary = Trainer(cfg, log=lambda _: None).run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sampling/generated_groups" in r]
    totals = [r["sampling/generated_samples_total"] for r in steps]
    per_step = [4 * r["sampling/generated_groups"] for r in steps]
    # The running total is the sum of what each step generated ...
    assert totals == [sum(per_step[: i + 1]) for i in range(len(per_step))]
    # ... and the run stopped at the first step that reached the budget.
    assert totals[-1] >= budget and all(t < budget for t in totals[:-1])
    assert summary["samples_generated"] == totals[-1] and summary["steps"] == len(steps) < 50
    assert any(n > 16 for n in per_step)  # some step needed more than one round

    # A resumed run with a larger budget continues the count instead of restarting it.
    more = small_config(
        random_tiny_model,
        out,
        reward,
        "train.steps=50",
        "resume=true",
        f"train.sample_budget={totals[-1] + 1}",
    )
    resumed = Trainer(more, log=lambda _: None).run()
    assert resumed["steps"] == len(steps) + 1
    assert resumed["samples_generated"] > totals[-1]


# --- metric regressions ---------------------------------------------------------------------


def _punishment(length: int, l_max: int, buffer: int) -> float:
    """The paper's soft overlong punishment, transcribed (eq. 13)."""
    if length <= l_max - buffer:
        return 0.0
    if length <= l_max:
        return ((l_max - buffer) - length) / buffer
    return -1.0


@pytest.mark.parametrize("penalty, factor", [(True, 0.5), (False, 1.0)])
def test_overlong_penalty_metric_is_the_penalty_applied(
    random_tiny_model, tmp_path, penalty, factor
):
    """reward/overlong_penalty_mean is the mean shaping actually added to the rewards: with
    its factor, and 0 when the shaping is off (it used to be computed regardless, unscaled)."""
    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        "algorithm.dynamic_sampling=false",
        f"algorithm.overlong_penalty={str(penalty).lower()}",
        f"algorithm.overlong_penalty_factor={factor}",
        "algorithm.overlong_buffer=8",
    )
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        groups, metrics, _ = trainer.rollouts.fill_batch(
            0
        )  # dynamic sampling off: every group kept
    finally:
        trainer.close()
    lengths = [len(r) for g in groups for r in g.response_ids]
    shaped = [factor * _punishment(n, 12, 8) for n in lengths] if penalty else [0.0] * len(lengths)
    assert any(n > 4 for n in lengths)  # the ramp (lengths 5..12) is reached
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(sum(shaped) / len(shaped))
    if not penalty:
        assert metrics["reward/overlong_penalty_mean"] == 0.0


def test_only_rank_zero_prints_start_up_lines(random_tiny_model, tmp_path, monkeypatch):
    """Set-up messages (here: prompts dropped by the length filter) come from rank 0 only."""
    import dapo.training.learner as learner_mod
    from dapo.parallel import distributed as D

    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(
            f'{{"prompt": "{i}{"x" * (5 if i % 2 else 60)}", "reward_model": {{"ground_truth": "1"}}}}'
            for i in range(8)
        )
    )
    monkeypatch.setattr(learner_mod, "wrap_data_parallel", lambda *a, **k: ("ddp", None))
    heard: dict[int, list[str]] = {}
    for rank in (0, 1):
        monkeypatch.setattr(
            D, "init_distributed", lambda rank=rank: D.DistInfo(rank=rank, world_size=2)
        )
        heard[rank] = []
        cfg = small_config(
            random_tiny_model,
            tmp_path / f"run{rank}",
            f"data.train={data}",
            "data.max_prompt_length=20",
        )
        Trainer(cfg, log=heard[rank].append).close()
    assert any("dropped 4 training prompts" in m for m in heard[0])
    assert heard[1] == []


@pytest.mark.parametrize(
    ("extra", "logged"),
    [
        (["preset=gspo"], []),
        (
            [
                "preset=cispo",
                "algorithm.is_cap=1.0",
                "algorithm.is_level=token",
                "algorithm.is_mode=mask",
            ],
            ["rollout/is_weight_mean", "rollout/is_masked_frac"],
        ),
        (
            ["preset=clip_cov", "algorithm.clip_cov_ratio=0.05", "algorithm.clip_cov_low=-5"],
            ["actor/cov_selected_frac"],
        ),
        (
            [
                "preset=kl_cov",
                "algorithm.entropy_coef=0.01",
                "algorithm.is_cap=2.0",
                "algorithm.is_level=sequence",
            ],
            ["actor/cov_selected_frac", "actor/entropy_bonus", "rollout/is_truncated_frac"],
        ),
    ],
)
@pytest.mark.slow
def test_loss_variants_train_and_log_their_metrics(random_tiny_model, tmp_path, extra, logged):
    import json

    # No overlong filtering: the random model's responses are mostly truncated.
    cfg = small_config(
        random_tiny_model,
        tmp_path / "run",
        "train.steps=2",
        "algorithm.dynamic_sampling=false",
        "algorithm.overlong_filter=false",
        *extra,
    )
    Trainer(cfg, log=lambda _: None).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "actor/loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["actor/updates"] == 2 and r["actor/skipped_updates"] == 0
        for key in logged:
            assert key in r, key
        assert 0 <= r.get("rollout/is_masked_frac", 0) <= 1
        assert 0 <= r.get("rollout/is_truncated_frac", 0) <= 1
        if "actor/cov_selected_frac" in logged:  # int(r N) of N ~ 8 x 12 loss tokens
            assert 0 < r["actor/cov_selected_frac"] <= 0.06
        if "actor/entropy_bonus" in logged:  # coef x the entropy, subtracted from the loss
            assert r["actor/entropy_bonus"] == pytest.approx(0.01 * r["actor/entropy"], rel=0.3)
            assert r["actor/loss"] == pytest.approx(r["actor/pg_loss"] - r["actor/entropy_bonus"])
        else:
            assert "actor/entropy_bonus" not in r


def test_a_training_file_without_data_eval_is_not_evaluated_on_another_task(
    random_tiny_model, tmp_path
):
    """data.eval left unset with a file in data.train: no evaluation, and the run says so
    (the default task's held-out split would measure a task that is not trained)."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "\n".join(
            f'{{"prompt": "{i}+1", "reward_model": {{"ground_truth": "{i + 1}"}}}}'
            for i in range(8)
        )
    )
    heard: list[str] = []
    cfg = small_config(random_tiny_model, tmp_path / "run", f"data.train={data}", "evaluate=true")
    assert cfg.data.eval is None
    trainer = Trainer(cfg, log=heard.append)
    try:
        assert trainer.rollouts.eval_records == [] and len(trainer.rollouts.train_records) == 8
    finally:
        trainer.close()
    assert any("no held-out evaluation" in m and "data.eval=FILE" in m for m in heard)
