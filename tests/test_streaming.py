"""Streaming rollouts with bounded staleness and partial rollouts (rollout.max_staleness,
rollout.partial_rollouts): no trained token is older than N versions, however long its batch
waited; a partial rollout keeps each token's behaviour log-prob and version and continues
exactly as a fresh generation under the new weights would (no stale cache); the decoupled
objective is the one AReaL defines; a resume trains on the queued batches; the config's
defaults and the former name."""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import pytest
import torch
from vllm_check import needs_vllm

from dapo.algorithms import LossSettings, compute_loss
from dapo.config import load_config
from dapo.rollout import HFEngine, SamplingParams
from dapo.rollout.versioned import VersionedEngine
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs
from dapo.training.token_weights import attach_is_weights
from dapo.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    "train.prompts_per_step=4",
    "train.mini_batch_size=2",
    "rollout.num_generations=4",
    "rollout.max_completion_length=24",
    "algorithm.overlong_buffer=4",
    "evaluate=false",
    "logging.tensorboard=false",
    "logging.dashboard=false",
    "logging.console=false",
    "checkpoint.save_every=0",
    "checkpoint.save_final_model=false",
    "reward.num_workers=0",
]


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    from dapo.models import resolve_model_path

    return Path(resolve_model_path("builtin:tiny", log=lambda _: None))


def small_config(model: Path, out: Path, *extra: str):
    return load_config(
        overrides=[f"model.name_or_path={model}", f"output_dir={out}", *SMALL, *extra]
    )


def run_steps(cfg, steps: int, fill_queue: bool = False) -> list[tuple[int, list]]:
    """``steps`` rollout steps; each step's trained groups. ``fill_queue``: before each step,
    wait until the producer has filled the queue as far as the bound allows, so that every
    batch waits there (the staleness is then N, whatever the machine's speed)."""
    trainer = Trainer(cfg, log=lambda _: None)
    n, end = cfg.rollout.max_staleness, cfg.train.steps
    out = []
    try:
        for _ in range(steps):
            step = trainer.step
            if fill_queue:
                if not trainer.stream.running:
                    trainer.stream.start(step)
                deadline = time.monotonic() + 300
                while min(step + n, end - 1) not in trainer.stream.ready:
                    assert time.monotonic() < deadline, "the producer did not fill the queue"
                    time.sleep(0.05)
            _, groups = trainer.train_step()
            out.append((step, groups))
    finally:
        trainer.close()
    return out


def oldest(step: int, groups: list) -> int:
    """The staleness of the oldest trained token of a step."""
    return max(step - v for g in groups for versions in g.versions for v in versions)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.slow
def test_no_trained_token_is_older_than_n_versions_hf(tiny_path, tmp_path, n, partial):
    """hf (a copy of the policy samples): the producer fills the queue up to the bound and
    every batch waits there; still no trained token is more than N versions older than the
    weights it updates, and the bound is reached."""
    cfg = small_config(
        tiny_path,
        tmp_path,
        f"rollout.max_staleness={n}",
        f"rollout.partial_rollouts={str(partial).lower()}",
        "rollout.partial_chunk_tokens=8",
        "train.steps=6",
    )
    steps = run_steps(cfg, 6, fill_queue=True)
    ages = [oldest(step, groups) for step, groups in steps]
    # Batch k was filled as soon as the bound allowed: with version k - N (0 for k < N).
    assert ages == [min(step, n) for step, _ in steps], ages


@needs_vllm
@pytest.mark.slow
def test_no_trained_token_is_older_than_n_versions_vllm(tiny_path, tmp_path):
    """The same bound with the vLLM engine in this process, partial rollouts on."""
    cfg = small_config(
        tiny_path,
        tmp_path,
        "rollout.engine=vllm",
        "rollout.max_staleness=2",
        "rollout.partial_rollouts=true",
        "rollout.partial_chunk_tokens=8",
        "train.steps=5",
    )
    steps = run_steps(cfg, 5, fill_queue=True)
    ages = [oldest(step, groups) for step, groups in steps]
    assert ages == [min(step, 2) for step, _ in steps], ages


@pytest.fixture
def two_policies(random_tiny_model):
    """The random model and a perturbed copy (weights A and B), and an hf engine on a third
    copy that starts with A."""
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(random_tiny_model).eval()
    b = copy.deepcopy(a)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    engine = HFEngine(copy.deepcopy(a), eos_token_id=1, pad_token_id=0)
    return a, b, engine


def test_partial_rollouts_keep_each_tokens_behaviour_logprob_and_version(two_policies):
    """Weights change after the first chunk: the tokens of that chunk keep version 0 and
    A's log-probs, the continued tokens get version 1 and B's, and a response continued under
    B is exactly what a fresh generation from the same prefix under B gives (so no key or
    value computed with A served it)."""
    a, b, inner = two_policies
    versioned = VersionedEngine(inner, version=0, chunk_tokens=6)
    real = inner.generate
    calls = []

    def generate(prompts, params):
        out = real(prompts, params)
        calls.append((prompts, params))
        if len(calls) == 1:  # an update lands after the first chunk
            versioned.load_weights(b.named_parameters(), version=1)
        return out

    inner.generate = generate
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=7)
    groups = versioned.generate(prompts, params)
    assert versioned.continued > 0
    opts = ForwardOptions(pad_id=0)
    for g in groups:
        for ids, lps, versions in zip(g.response_ids, g.logprobs, g.versions, strict=True):
            first = min(6, len(ids))
            assert versions == [0] * first + [1] * (len(ids) - first)
            sample = Sample(g.prompt_ids, ids, 0.0, [1.0] * len(ids))
            under_a = compute_logprobs(a, [sample], opts)[0]
            under_b = compute_logprobs(b, [sample], opts)[0]
            got = torch.tensor(lps)
            torch.testing.assert_close(got[:first], under_a[:first], atol=1e-5, rtol=0)
            torch.testing.assert_close(got[first:], under_b[first:], atol=1e-5, rtol=0)
    # The second call continued the unfinished responses under B: the same call on a fresh
    # engine holding B gives the same tokens and log-probs.
    prefixes, cont_params = calls[1]
    fresh = HFEngine(copy.deepcopy(b), eos_token_id=1, pad_token_id=0)
    again = fresh.generate(prefixes, cont_params)
    continued = real(prefixes, cont_params)  # the engine that saw A first, now B
    for x, y in zip(again, continued, strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs))


@needs_vllm
@pytest.mark.slow
def test_vllm_continuation_after_an_update_uses_no_stale_cache(tiny_path):
    """vLLM's prefix cache holds the prompt's keys under A after the first chunk; after the
    update, the continued tokens' log-probs are B's (teacher-forced by the trainer), which
    they would not be if the cached keys of A were served."""
    from transformers import AutoModelForCausalLM

    from dapo.rollout.vllm_engine import VLLMEngine

    a = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    b = copy.deepcopy(a)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    inner = VLLMEngine(a, eos_token_id=1, pad_token_id=0, max_model_len=128, seed=0)
    try:
        versioned = VersionedEngine(inner, version=0, chunk_tokens=6)
        real = inner.generate
        calls = []

        def generate(prompts, params):
            out = real(prompts, params)
            calls.append(1)
            if len(calls) == 1:
                versioned.load_weights(b.named_parameters(), version=1)
            return out

        inner.generate = generate
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        groups = versioned.generate([prompt], SamplingParams(n=2, max_tokens=24, seed=1))
    finally:
        inner.close()
    opts = ForwardOptions(pad_id=0)
    checked = 0
    for ids, lps, versions in zip(
        groups[0].response_ids, groups[0].logprobs, groups[0].versions, strict=True
    ):
        if len(ids) <= 6:
            continue
        sample = Sample(prompt, ids, 0.0, [1.0] * len(ids))
        under_b = compute_logprobs(b, [sample], opts)[0]
        torch.testing.assert_close(torch.tensor(lps[6:]), under_b[6:], atol=1e-4, rtol=0)
        assert versions[6:] == [1] * (len(ids) - 6)
        checked += 1
    assert checked


def test_the_decoupled_objective_is_areals_token_by_token():
    """Responses of mixed versions: the loss dapo computes (ratio against the proximal
    policy, behaviour weight pi_prox / pi_behave masked above the cap, token mean over the
    kept tokens) equals a direct transcription of AReaL's decoupled PPO objective, value and
    gradient."""
    torch.manual_seed(0)
    lengths = [5, 3, 6]
    settings = LossSettings(clip_low=0.2, clip_high=0.28, is_cap=2.0, is_mode="mask")
    samples, behave, prox = [], [], []
    for i, n in enumerate(lengths):
        b = -torch.rand(n) * 2 - 0.1  # behaviour log-probs (versions mixed along the response)
        p = b + torch.randn(n) * 0.6  # proximal: the weights at the start of the update
        s = Sample(
            [1, 2], list(range(3, 3 + n)), advantage=[1.0, -0.5, 2.0][i], loss_mask=[1.0] * n
        )
        s.sampling_logprobs, s.old_logprobs = b.clone(), p.clone()
        samples.append(s)
        behave.append(b)
        prox.append(p)
    attach_is_weights(samples, settings)
    width = max(lengths)
    pad = lambda xs: torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in xs])  # noqa: E731
    theta = (pad(prox) + torch.randn(len(lengths), width) * 0.1).requires_grad_()
    mask = pad([torch.ones(n) for n in lengths])
    keep = pad([s.is_keep for s in samples])
    weights = pad([s.is_weight for s in samples])
    adv = torch.tensor([s.advantage for s in samples])
    kept = mask * keep
    loss, _ = compute_loss(
        theta, pad(prox), adv, kept, settings, denominator=float(kept.sum()), is_weights=weights
    )
    loss.backward()
    ours = theta.grad.clone()

    # The transcription: J = 1/|T| sum_{t in T} w_t min(r_t A, clip(r_t, 1-e_l, 1+e_h) A),
    # r_t = pi_theta / pi_prox, w_t = pi_prox / pi_behave, T = tokens with w_t <= cap.
    theta2 = theta.detach().clone().requires_grad_()
    total, count = 0.0, 0
    for i, n in enumerate(lengths):
        for t in range(n):
            w = math.exp(float(prox[i][t] - behave[i][t]))
            if w > settings.is_cap:
                continue
            r = torch.exp(theta2[i, t] - prox[i][t])
            a = float(adv[i])
            surrogate = torch.minimum(r * a, torch.clamp(r, 1 - 0.2, 1 + 0.28) * a)
            total = total + w * surrogate
            count += 1
    reference = -total / count
    reference.backward()
    assert 0 < count < sum(lengths)  # some tokens were over the cap
    torch.testing.assert_close(loss, reference.to(loss.dtype), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, theta2.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_a_resume_trains_on_the_queued_batches(tiny_path, tmp_path):
    """The checkpoint holds the batches filled ahead (with their versions); a trainer resumed
    from it trains on exactly those groups before it generates anything new."""
    out = tmp_path / "run"
    cfg = small_config(tiny_path, out, "rollout.max_staleness=2", "train.steps=6")
    trainer = Trainer(cfg, log=lambda _: None)
    try:
        trainer._resume_or_start()
        for _ in range(2):
            trainer.train_step()
        time.sleep(1.0)  # the producer fills the queue up to the bound meanwhile
        trainer.save()
        queued = {k: [g.response_ids for g in b.groups] for k, b in trainer.stream.ready.items()}
    finally:
        trainer.close()
    assert 2 in queued and len(queued) >= 1
    cfg = small_config(tiny_path, out, "rollout.max_staleness=2", "train.steps=6", "resume=true")
    resumed = Trainer(cfg, log=lambda _: None)
    try:
        resumed._resume_or_start()
        assert resumed.step == 2
        generate = resumed.rollouts.engine.generate
        calls = []
        resumed.rollouts.engine.generate = lambda *a: calls.append(1) or generate(*a)
        for step in sorted(queued):
            _, groups = resumed.train_step()
            assert [g.response_ids for g in groups] == queued[step]
    finally:
        resumed.close()


def test_streaming_config_defaults_and_the_former_name():
    """max_staleness > 0 turns the capped correction on (AReaL's cap 5, masked) unless
    algorithm.is_cap is given; rollout.async_steps is read as rollout.max_staleness."""
    cfg = load_config(overrides=["rollout.max_staleness=2"])
    assert (cfg.algorithm.is_cap, cfg.algorithm.is_mode) == (5.0, "mask")
    cfg = load_config(overrides=["rollout.max_staleness=2", "algorithm.is_cap=null"])
    assert cfg.algorithm.is_cap is None
    cfg = load_config(
        overrides=["rollout.max_staleness=1", "algorithm.is_cap=2", "algorithm.is_mode=truncate"]
    )
    assert (cfg.algorithm.is_cap, cfg.algorithm.is_mode) == (2.0, "truncate")
    assert load_config(overrides=[]).algorithm.is_cap is None  # synchronous: unchanged
    cfg = load_config({"rollout": {"async_steps": 1, "engine": "vllm"}})
    assert cfg.rollout.max_staleness == 1 and cfg.algorithm.is_cap == 5.0


def test_loglinear_proximal_logprobs_by_hand():
    """AReaL's interpolation: alpha = (v_prox - v_behave) / (v_theta - v_behave)."""
    from dapo.algorithms import loglinear_proximal

    behave = torch.tensor([[-1.0, -2.0, -0.5]])
    current = torch.tensor([[-1.5, -1.0, -0.5]])
    versions = torch.tensor([[3.0, 5.0, 4.0]])  # sampled 2, 0 and 1 versions before step 5
    # At the step's first update the weights are the proximal policy: alpha = 1.
    torch.testing.assert_close(loglinear_proximal(behave, current, versions, 5, 0.0), current)
    # Half-way through: alpha = 2/2.5, 0 (sampled this step), 1/1.5.
    got = loglinear_proximal(behave, current, versions, 5, 0.5)
    alpha = torch.tensor([[2 / 2.5, 0.0, 1 / 1.5]])
    torch.testing.assert_close(got, behave + alpha * (current - behave))
    assert float(got[0, 1]) == -2.0  # a token of this step: its behaviour policy is proximal


def test_loglinear_equals_recompute_at_a_steps_first_update(random_tiny_model):
    """At the first update of a step the log-linear proximal log-probs are the weights' own,
    so the loss and gradient equal the recomputed decoupled objective's (truncate, token)."""
    from learner_utils import learner
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(random_tiny_model)
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(4):
        ids = torch.randint(2, 60, (6 + i,), generator=gen).tolist()
        s = Sample([5, 6, 7], ids, advantage=[1.0, -1.0, 0.5, 2.0][i], loss_mask=[1.0] * len(ids))
        s.versions = torch.full((len(ids),), float(2 + i % 2))  # 1 or 2 versions behind step 4
        samples.append(s)
    exact = compute_logprobs(model, samples, ForwardOptions(pad_id=0))
    for s, lp in zip(samples, exact, strict=True):
        s.sampling_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=gen)  # older policy
    grads = {}
    for mode in ("recompute", "loglinear"):
        settings = LossSettings(is_cap=2.0, is_mode="truncate", proximal_logprobs=mode)
        batch = [copy.copy(s) for s in samples]
        if mode == "recompute":
            for s, lp in zip(batch, exact, strict=True):
                s.old_logprobs = lp
            attach_is_weights(batch, settings)
        model.zero_grad()
        lrn = learner(model, settings, token_budget=4096)
        result = lrn.optimizer_step(batch, version=4, progress=0.0)
        grads[mode] = (result.stats.parts["loss"], [p.grad.clone() for p in model.parameters()])
    assert grads["recompute"][0] == pytest.approx(grads["loglinear"][0], rel=1e-5, abs=1e-7)
    for a, b in zip(grads["recompute"][1], grads["loglinear"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
