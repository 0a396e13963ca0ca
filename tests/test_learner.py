"""The learner's update: what it logs, how deep it calls, and resuming a run."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import pytest
import torch
from test_trainer import small_config

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.config import TrainConfig
from dapo.models.tiny import build_model, build_tokenizer
from dapo.training.batch import Sample
from dapo.training.checkpoint import load_state_file
from dapo.training.forward import ForwardOptions, response_logprobs
from dapo.training.learner import Learner
from dapo.training.microbatch import collate
from dapo.training.optim import make_optimizer
from dapo.training.trainer import Trainer, TrainingError

pytestmark = pytest.mark.usefixtures("one_thread")
FIXTURES = Path(__file__).parent / "fixtures"


def groups_of_samples(n_groups: int = 4, size: int = 4, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_groups):
        prompt = [rng.randrange(3, 99) for _ in range(rng.randrange(3, 9))]
        for _ in range(size):
            resp = [rng.randrange(3, 99) for _ in range(rng.randrange(2, 12))]
            out.append(Sample(prompt, resp, rng.choice([-1.0, -0.3, 0.4, 1.2]), [1.0] * len(resp)))
    return out


def make_learner(settings: LossSettings, **train: object) -> Learner:
    model = build_model(len(build_tokenizer()), seed=3)
    model.train()
    t = TrainConfig(**{"prompts_per_step": 4, "mini_batch_size": 4, "lr": 1e-2, **train})
    return Learner(
        model, make_optimizer(model, t), settings, ForwardOptions(0, token_budget=60), train=t
    )


def test_entropy_is_the_mean_over_the_tokens_that_measured_it_whatever_the_epochs() -> None:
    """actor/entropy is measured in the first epoch only; with 2 epochs it used to be divided
    by the tokens of both (half the entropy). It is the loss-token mean of the initial
    policy's entropy (the first update forwards the initial weights)."""
    samples = groups_of_samples()
    learner = make_learner(LossSettings(), epochs=2)
    with torch.no_grad():
        batch = collate(samples, 0)
        _, entropy = response_logprobs(learner.model, batch, learner.forward)
    expected = float(alg.masked_mean(entropy, batch.loss_mask))
    metrics = learner.update(samples, step=0, group_size=4)
    assert metrics["actor/updates"] == 2.0
    assert metrics["actor/entropy"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("epochs", [1, 2])
def test_the_first_updates_samples_take_their_old_logprobs_from_its_own_forward(
    monkeypatch: pytest.MonkeyPatch, epochs: int
) -> None:
    """With several updates per rollout step, the ratio's old log-probs come from a pass
    before the update, but for the first update's samples: its forward runs at the same
    weights. The pass skips them (4 of 16 samples here), and the weights after the step are
    those of a learner that computes all 16 first; with 2 epochs the first mini-batch is
    trained again against the log-probs its first forward gave."""
    from dapo.training import learner as learner_module

    passed: list[int] = []
    real = learner_module.compute_logprobs

    def counting(model, samples, options):  # noqa: ANN001, ANN202
        passed.append(len(samples))
        return real(model, samples, options)

    monkeypatch.setattr(learner_module, "compute_logprobs", counting)
    fast, full = (make_learner(LossSettings(), mini_batch_size=1, epochs=epochs) for _ in "ab")
    full.needs_old_logprobs = True  # every sample's old log-probs before the first update
    fast.update(groups_of_samples(seed=2), step=0, group_size=4)
    assert passed == [12]
    full.update(groups_of_samples(seed=2), step=0, group_size=4)
    assert passed == [12, 16]
    moved = 0.0
    for a, b, start in zip(
        fast.model.parameters(),
        full.model.parameters(),
        make_learner(LossSettings()).model.parameters(),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((a - start).abs().max()))
    assert moved > 1e-3  # the updates changed the weights (so stale old log-probs would show)


def test_the_engine_comparison_covers_every_sample_with_several_updates() -> None:
    """rollout/logprob_mismatch is the mean |engine - trainer| over every sampled token, the
    first update's samples (whose trainer log-probs its own forward gave) among them."""
    samples = groups_of_samples(seed=3)
    learner = make_learner(LossSettings(), mini_batch_size=1)
    learner.compare_engine = True
    with torch.no_grad():
        logp, _ = response_logprobs(learner.model, collate(samples, 0), learner.forward)
    gap = tokens = 0.0
    for j, s in enumerate(samples):
        offset = 0.05 * (j + 1)
        s.sampling_logprobs = logp[j, : len(s.response_ids)] + offset
        gap += offset * len(s.response_ids)
        tokens += len(s.response_ids)
    metrics = learner.update(samples, step=0, group_size=4)
    assert metrics["actor/updates"] == 4.0
    assert metrics["rollout/logprob_mismatch"] == pytest.approx(gap / tokens, rel=1e-5)


def test_whatever_the_loss_reports_is_logged() -> None:
    """No name list between compute_loss and the metrics: dual clip's share (which the old
    hand-kept lists dropped) is logged, and equals the share of tokens with A < 0 whose
    ratio exceeds c, computed here from the same old log-probs."""
    samples = groups_of_samples(seed=1)
    gen = torch.Generator().manual_seed(0)
    for s in samples:  # old log-probs far below the policy's: ratios far above c = 3
        s.old_logprobs = -9.0 + torch.randn(len(s.response_ids), generator=gen)
    learner = make_learner(LossSettings(clip_c=3.0))
    with torch.no_grad():
        logp, _ = response_logprobs(learner.model, collate(samples, 0), learner.forward)
    dual = total = 0.0
    for j, s in enumerate(samples):
        ratio = torch.exp(logp[j, : len(s.response_ids)] - s.old_logprobs)
        total += len(s.response_ids)
        if s.advantage < 0:
            dual += float((ratio > 3.0).sum())
    metrics = learner.update(samples, step=0, group_size=4)
    assert dual > 0
    assert metrics["actor/clip_frac_dual"] == pytest.approx(dual / total, rel=1e-6)
    assert {"actor/clip_frac_low", "actor/clip_frac_high", "actor/pg_loss"} <= metrics.keys()


@pytest.mark.slow
def test_the_update_reaches_the_model_in_four_frames(random_tiny_model, tmp_path) -> None:
    """train_step -> Learner.optimize -> Learner.optimizer_step -> response_states -> model,
    and train_step -> Learner.prepare -> compute_logprobs -> response_states for the old
    log-probs: no frame of dapo's between train_step and the model's forward beyond these
    four, for the gradient passes and the prepare stage (two updates per step here)."""
    cfg = small_config(random_tiny_model, tmp_path / "run", "algorithm.dynamic_sampling=false")
    trainer = Trainer(cfg, log=lambda _: None)
    stacks: list[list[str]] = []

    def hook(module, args, kwargs):
        names = [f.function for f in inspect.stack() if "/src/dapo/" in f.filename]
        if "train_step" in names and {"optimize", "prepare"} & set(names):  # not generation
            stacks.append(names[: names.index("train_step") + 1])

    handle = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        trainer.train_step()
    finally:
        handle.remove()
        trainer.close()
    assert stacks  # the hook saw the update's forwards
    deepest = max(stacks, key=len)
    assert max(len(s) for s in stacks) <= 4, deepest
    assert ["response_states", "optimizer_step", "optimize", "train_step"] in stacks
    assert ["response_states", "compute_logprobs", "prepare", "train_step"] in stacks


@pytest.mark.slow
def test_resuming_with_another_model_is_refused_in_one_line(random_tiny_model, tmp_path) -> None:
    out = tmp_path / "run"
    Trainer(small_config(random_tiny_model, out, "train.steps=1"), log=lambda _: None).run()
    other = tmp_path / "other_model"
    tok = build_tokenizer()
    model = build_model(len(tok), seed=1)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(TrainingError) as info:  # before the other model loads
        Trainer(small_config(other, out, "train.steps=2", "resume=true"), log=lambda _: None)
    message = str(info.value)
    assert "\n" not in message
    assert f"model.name_or_path {str(random_tiny_model)!r} there, {str(other)!r} now" in message
    assert f"Resume with model.name_or_path={random_tiny_model}" in message
    assert "new output_dir" in message
    assert "size mismatch" not in message


@pytest.mark.slow
def test_resuming_with_changed_keys_lists_them(random_tiny_model, tmp_path) -> None:
    out = tmp_path / "run"
    Trainer(small_config(random_tiny_model, out, "train.steps=1"), log=lambda _: None).run()
    with pytest.warns(UserWarning) as caught:  # said before anything loads
        resumed = Trainer(
            small_config(
                random_tiny_model,
                out,
                "train.steps=2",
                "resume=true",
                "train.prompts_per_step=2",
                "preset=grpo",
            ),
            log=lambda _: None,
        )
    summary = resumed.run()
    text = " ".join(str(w.message) for w in caught)
    assert "resuming with" in text
    assert "train.prompts_per_step 4 -> 2" in text and "preset dapo -> grpo" in text
    assert "train.steps 1 -> 2" in text
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 1


@pytest.mark.slow
def test_a_checkpoint_of_release_a5216fc_resumes_with_its_carry_over(tmp_path) -> None:
    """tests/fixtures/trainer_state_a5216fc.pt is the trainer state a5216fc wrote at step 2 of
    this very config (its carry-over pickled as ScoredGroup objects). Put in place of the
    current release's, the run resumes with those 2 groups and trains them first."""
    args = [
        "seed=2",
        "train.prompts_per_step=4",
        "train.mini_batch_size=4",
        "rollout.num_generations=4",
        "evaluate=false",
        "checkpoint.save_every=1",
        "logging.tensorboard=false",
        "logging.dashboard=false",
        "logging.console=false",
        f"output_dir={tmp_path}",
    ]
    from dapo.config import load_config

    Trainer(load_config(overrides=[*args, "train.steps=2"]), log=lambda _: None).run()
    ckpt = tmp_path / "checkpoints" / "step_000002"
    (ckpt / "trainer_state.pt").write_bytes((FIXTURES / "trainer_state_a5216fc.pt").read_bytes())
    (ckpt / "dapo-manifest.json").unlink()  # that release wrote none: loaded unverified
    legacy = load_state_file(FIXTURES / "trainer_state_a5216fc.pt")
    carried = [(g.prompt_ids, g.response_ids) for g in legacy["sampler"]["carry"]]
    with pytest.warns(UserWarning, match="resuming with"):  # output_dir and train.steps
        trainer = Trainer(
            load_config(overrides=[*args, "train.steps=3", "resume=true"]), log=lambda _: None
        )
    trained = []
    build = trainer.build_samples
    trainer.build_samples = lambda groups: trained.append(groups) or build(groups)
    summary = trainer.run()
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    assert [(g.prompt_ids, g.response_ids) for g in trained[0][:2]] == carried
