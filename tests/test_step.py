"""Exactness of one optimizer step's gradient under any micro-batch split."""

from __future__ import annotations

import math
import random

import pytest
import torch
from learner_utils import backward  # tests/learner_utils.py

from dapo.algorithms import LossSettings
from dapo.errors import TrainingError
from dapo.models.tiny import build_model, build_tokenizer
from dapo.training.batch import Sample
from dapo.training.forward import ForwardOptions, compute_logprobs, prompt_cache, response_logits
from dapo.training.microbatch import collate, loss_denominator, micro_batches, plan_updates
from dapo.training.token_weights import attach_is_weights

PAD = 0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    tok = build_tokenizer()
    m = build_model(len(tok), seed=3).double()
    m.train()
    return m


def make_samples(seed: int = 0, system: int = 0) -> list[Sample]:
    """Prompts and responses of very different lengths, some prompts with several responses
    (groups, as in training: one prompt pass shared by the group); three responses masked as
    truncated. ``system``: every prompt starts with the same ``system`` tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 99) for _ in range(system)]
    layout = [
        (5, [40]),
        (12, [1]),
        (3, [17]),
        (9, [60]),
        (7, [2]),
        (4, [33]),
        (6, [1, 25, 55, 8]),
        (11, [3, 3, 44]),
    ]  # (prompt length, its response lengths)
    truncated = {3, 4, 8}
    samples = []
    for lp, lrs in layout:
        prompt = head + [rng.randrange(3, 99) for _ in range(lp)]
        for lr in lrs:
            i = len(samples)
            resp = [rng.randrange(3, 99) for _ in range(lr)]
            mask = [0.0 if i in truncated else 1.0] * lr
            adv = rng.choice([-1.3, -0.4, 0.7, 1.1])
            samples.append(Sample(prompt, resp, adv, mask))
    return samples


def with_old_logprobs(samples: list[Sample], seed: int) -> list[Sample]:
    """Old log-probs that differ from the policy's, so that ratios leave [0.8, 1.28]."""
    gen = torch.Generator().manual_seed(seed)
    for s in samples:
        s.old_logprobs = -4.6 + 0.5 * torch.randn(
            len(s.response_ids), generator=gen, dtype=torch.float64
        )
    return samples


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def reference_gradient(
    model: torch.nn.Module, samples: list[Sample], settings: LossSettings
) -> torch.Tensor:
    """The paper's token-level loss transcribed directly, one unpadded sequence at a time.

    J = 1/sum_i |o_i| * sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i),
    counting only the tokens that are not filtered out. With ``settings.is_cap`` (token
    level, truncate) each term is weighted by min(exp(old_it - sampling_it), is_cap).
    """
    model.zero_grad(set_to_none=True)
    total = sum(sum(s.loss_mask) for s in samples)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        objective = 0.0
        for t in range(len(s.response_ids)):
            if s.loss_mask[t] == 0:
                continue
            ratio = torch.exp(logp[t] - s.old_logprobs[t])
            clipped = torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high)
            weight = 1.0
            if settings.is_cap is not None:
                weight = min(math.exp(s.old_logprobs[t] - s.sampling_logprobs[t]), settings.is_cap)
            objective = objective + weight * torch.minimum(
                ratio * s.advantage, clipped * s.advantage
            )
        if torch.is_tensor(objective):
            (-objective / total).backward()
    return grads(model)


def step_gradient(model, samples, settings, budget, shared_prompt: bool = True) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    backward(model, samples, settings, token_budget=budget, pad_id=PAD, shared_prompt=shared_prompt)
    return grads(model)


def test_micro_batches_cover_every_sample_once_within_budget() -> None:
    samples = make_samples()
    chunks = micro_batches(samples, token_budget=120)
    assert sorted(i for c in chunks for i in c) == list(range(len(samples)))
    assert len(chunks) > 2
    for c in chunks:
        width = max(samples[i].length for i in c)
        assert len(c) == 1 or width * len(c) <= 120


def test_token_mean_gradient_is_exact_under_any_micro_batch_split(model) -> None:
    settings = LossSettings(clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    samples = with_old_logprobs(make_samples(), seed=1)
    whole = step_gradient(model, samples, settings, budget=10**6)
    ref = reference_gradient(model, samples, settings)
    assert whole.abs().max() > 1e-4
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    for budget in (70, 130, 250):
        split = step_gradient(model, samples, settings, budget=budget)
        assert len(micro_batches(samples, budget)) > 1
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_per_micro_batch_normaliser_would_be_wrong(model) -> None:
    """Dividing each micro-batch by its own token count (a known peer bug) changes the step."""
    settings = LossSettings(loss_agg="token-mean")
    samples = with_old_logprobs(make_samples(), seed=2)
    exact = step_gradient(model, samples, settings, budget=10**6)
    model.zero_grad(set_to_none=True)
    for idx in micro_batches(samples, 130):
        chunk = [samples[i] for i in idx]  # normalised by its own token count
        backward(model, chunk, settings, token_budget=10**6, pad_id=PAD)
    assert not torch.allclose(grads(model), exact, atol=1e-5)


def test_truncated_responses_do_not_count(model) -> None:
    """Overlong filtering: a masked response changes neither the loss nor its denominator."""
    settings = LossSettings(loss_agg="token-mean")
    samples = with_old_logprobs(make_samples(), seed=3)
    with_masked = step_gradient(model, samples, settings, budget=10**6)
    kept = [s for s in samples if sum(s.loss_mask) > 0]
    without = step_gradient(model, kept, settings, budget=10**6)
    torch.testing.assert_close(with_masked, without, atol=1e-9, rtol=1e-7)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sequence_modes_are_exact_under_micro_batching(model, agg) -> None:
    settings = LossSettings(loss_agg=agg, max_len=64)
    samples = with_old_logprobs(make_samples(), seed=4)
    whole = step_gradient(model, samples, settings, budget=10**6)
    split = step_gradient(model, samples, settings, budget=90)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_ratio_one_when_no_old_logprobs(model) -> None:
    """Without old log-probs the step is on-policy: the ratio is exactly 1, nothing clips."""
    settings = LossSettings(loss_agg="token-mean")
    samples = make_samples()
    model.zero_grad(set_to_none=True)
    means = backward(model, samples, settings, token_budget=10**6, pad_id=PAD).stats.means()
    assert means["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-9)
    assert means["actor/clip_frac_high"] == 0.0 and means["actor/clip_frac_low"] == 0.0
    assert 0 < means["actor/entropy"] <= torch.log(torch.tensor(99.0)).item() + 1e-6


def test_truncated_importance_sampling_weights_each_token(model) -> None:
    """is_cap (token, truncate): each token's clipped surrogate is weighted by
    min(pi_old / pi_engine, C)."""
    cap = 1.5
    samples = with_old_logprobs(make_samples(), seed=5)
    gen = torch.Generator().manual_seed(6)
    for s in samples:
        noise = 0.5 * torch.randn(len(s.response_ids), generator=gen, dtype=torch.float64)
        s.sampling_logprobs = s.old_logprobs + noise
    weights = torch.cat([torch.exp(s.old_logprobs - s.sampling_logprobs) for s in samples])
    assert (weights > cap).any() and (weights < 0.8).any()  # precondition: capped and small
    settings = LossSettings(loss_agg="token-mean", is_cap=cap)
    attach_is_weights(samples, settings)
    ref = reference_gradient(model, samples, settings)
    plain = reference_gradient(model, samples, LossSettings(loss_agg="token-mean"))
    assert not torch.allclose(ref, plain, atol=1e-5)
    for budget in (10**6, 130):
        torch.testing.assert_close(
            step_gradient(model, samples, settings, budget), ref, atol=1e-5, rtol=1e-5
        )
    # Engine log-probs equal to the trainer's: weight 1, the plain step.
    for s in samples:
        s.sampling_logprobs = s.old_logprobs.clone()
    attach_is_weights(samples, settings)
    torch.testing.assert_close(
        step_gradient(model, samples, settings, 10**6), plain, atol=1e-5, rtol=1e-5
    )


def test_micro_batches_keep_groups_together() -> None:
    """The responses of one prompt share a micro-batch unless the group alone exceeds the budget."""
    samples = make_samples()
    group_of = [tuple(s.prompt_ids) for s in samples]
    for budget in (70, 130, 250, 10**6):
        for chunk in micro_batches(samples, budget):
            for i in chunk:
                members = [j for j in range(len(samples)) if group_of[j] == group_of[i]]
                if max(samples[j].length for j in members) * len(members) <= budget:
                    assert set(members) <= set(chunk)
    # Budget 130: the 4-response group (244 padded tokens) is split, the 3-response one
    # (longest 55 + 11 = 66, 198 tokens) too; at 250 both stay whole.
    split = micro_batches(samples, 130)
    assert sum(any(i in c for i in range(6, 10)) for c in split) > 1
    whole = micro_batches(samples, 250)
    assert sum(any(i in c for i in range(6, 10)) for c in whole) == 1


def _count_prompt_passes(model: torch.nn.Module) -> tuple[list[int], object]:
    """Batch sizes of the forwards run with a fresh cache (the shared prompt passes)."""
    seen: list[int] = []

    def hook(_module, _args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() == 0:
            seen.append(kwargs["input_ids"].shape[0])

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def same_as_whole_sequences(model, samples, settings, budget, full, shared) -> torch.Tensor:
    """Asserts that the log-probs ``shared`` (the shared-prompt forward's) are ``full`` (every
    sample forwarded as prompt + response) and that so are the step's gradients; returns the
    latter gradient."""
    for a, b in zip(full, shared, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    g_full = step_gradient(model, samples, settings, budget, shared_prompt=False)
    g_shared = step_gradient(model, samples, settings, budget)
    assert g_full.abs().max() > 1e-4
    torch.testing.assert_close(g_shared, g_full, atol=1e-5, rtol=1e-5)
    return g_full


def test_shared_prompt_forward_equals_full_sequences(model) -> None:
    """One prompt pass per distinct prompt gives the log-probs and gradients of forwarding
    every sample as prompt + response: prompts of different lengths in one micro-batch,
    groups split across micro-batches, responses of length 1."""
    samples = with_old_logprobs(make_samples(), seed=7)
    settings = LossSettings(loss_agg="token-mean", temperature=0.7)
    seen, handle = _count_prompt_passes(model)
    try:
        for budget in (10**6, 250, 130, 70):
            chunks = micro_batches(samples, budget)
            seen.clear()
            full = compute_logprobs(
                model, samples, ForwardOptions(PAD, 0.7, budget, shared_prompt=False)
            )
            assert not seen
            shared = compute_logprobs(model, samples, ForwardOptions(PAD, 0.7, budget))
            repeated = [
                c for c in chunks if len({tuple(samples[i].prompt_ids) for i in c}) < len(c)
            ]
            assert len(seen) == len(repeated) > 0  # the shared path did run
            same_as_whole_sequences(model, samples, settings, budget, full, shared)
    finally:
        handle.remove()
    # A micro-batch of length-1 responses: response token 0 is predicted by the prompt pass
    # alone, and two prompt lengths share it.
    ones = [s for s in make_samples() if len(s.response_ids) <= 3]
    assert (
        len({len(s.prompt_ids) for s in ones}) > 1 and min(len(s.response_ids) for s in ones) == 1
    )
    for group in (ones, [s for s in ones if len(s.response_ids) == 1] * 2):
        a = response_logits(model, collate(group, PAD), temperature=1.0, shared_prompt=False)
        b = response_logits(model, collate(group, PAD), temperature=1.0)
        assert a.shape == b.shape
        for j, s in enumerate(group):  # padding positions predict nothing
            r = len(s.response_ids)
            torch.testing.assert_close(b[j, :r], a[j, :r], atol=1e-5, rtol=1e-5)


def test_a_prefix_every_prompt_shares_is_forwarded_once_with_the_same_results(
    model, monkeypatch
) -> None:
    """Prompts that start with the same 20 tokens (a system prompt): each micro-batch forwards
    them once, on one row, and the rest of every prompt on top (left-padded after them); the
    log-probs and the gradient are those of forwarding every sample as prompt + response, in
    float64 (with and without layer checkpointing) and in float32."""
    from dapo.models import inputs

    monkeypatch.setattr(inputs, "PASS_COST", 0)  # shared whenever two prompts share a token
    samples = with_old_logprobs(make_samples(seed=2, system=20), seed=5)
    settings = LossSettings(loss_agg="token-mean", temperature=0.7)
    seen, handle = _count_prompt_passes(model)
    try:
        for budget in (10**6, 250):
            seen.clear()
            shared = compute_logprobs(model, samples, ForwardOptions(PAD, 0.7, budget))
            # Every fresh pass is one row: the shared tokens where a micro-batch has several
            # prompts (then the prompts' rest on top of them), else the group's one prompt.
            chunks = micro_batches(samples, budget)
            prompts = [{tuple(samples[i].prompt_ids) for i in c} for c in chunks]
            repeated = [p for p, c in zip(prompts, chunks, strict=True) if len(p) < len(c)]
            assert seen == [1] * len(repeated), seen
            assert budget != 10**6 or len(repeated[0]) == 8  # one micro-batch, 8 prompts
            full = compute_logprobs(
                model, samples, ForwardOptions(PAD, 0.7, budget, shared_prompt=False)
            )
            g_full = same_as_whole_sequences(model, samples, settings, budget, full, shared)
    finally:
        handle.remove()
    # Under dapo's layer checkpointing every layer runs again in backward: the same gradient.
    import copy

    from dapo.models.activation_checkpointing import checkpoint_layers

    checkpointed = copy.deepcopy(model)
    assert checkpoint_layers(checkpointed) == 4
    g_ckpt = step_gradient(checkpointed, samples, settings, 10**6)
    torch.testing.assert_close(g_ckpt, g_full, atol=1e-5, rtol=1e-5)
    m32 = build_model(len(build_tokenizer()), seed=5)
    m32.train()
    a = compute_logprobs(m32, samples, ForwardOptions(PAD, 1.0, 10**6, shared_prompt=False))
    b = compute_logprobs(m32, samples, ForwardOptions(PAD, 1.0, 10**6))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def _forwarded(widths: list[int], groups: list[list[int]], cost: int) -> int:
    return sum(len(g) * max(widths[i] for i in g) + cost for g in groups)


def test_length_buckets_find_the_cheapest_cut_by_width() -> None:
    """The groups partition the rows (each in batch order), and their positions forwarded plus
    ``cost`` per group is the minimum over every cut of the rows sorted by width (brute force
    here)."""
    from itertools import combinations

    from dapo.training.forward import length_buckets

    rng = random.Random(0)
    for _ in range(200):
        widths = [rng.choice([1, 2, 5, 9, 30, 31, 64]) for _ in range(rng.randint(1, 7))]
        cost = rng.choice([0, 3, 20, 100])
        groups = length_buckets(widths, cost)
        assert sorted(i for g in groups for i in g) == list(range(len(widths)))
        assert all(g == sorted(g) for g in groups)
        order = sorted(range(len(widths)), key=lambda i: widths[i])
        n = len(order)
        brute = min(
            _forwarded(
                widths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, n), strict=True)], cost
            )
            for k in range(n)
            for cuts in combinations(range(1, n), k)
        )
        assert _forwarded(widths, groups, cost) == brute, (widths, cost, groups)
    assert length_buckets([5, 5, 5, 50, 50], cost=10) == [[0, 1, 2], [3, 4]]
    assert length_buckets([5, 5, 5, 50, 50], cost=10**6) == [[0, 1, 2, 3, 4]]
    assert length_buckets([7] * 4, cost=0) == [[0, 1, 2, 3]]


def test_responses_forwarded_by_width_give_one_passs_logprobs_and_gradients(
    model, monkeypatch
) -> None:
    """Responses of one micro-batch forwarded in several passes by width (each at its own
    longest width, on its prompts' shared pass): the log-probs and the gradient of forwarding
    every sample as prompt + response, and of one pass at the batch's longest width."""
    from dapo.training import forward

    samples = with_old_logprobs(make_samples(), seed=3)
    settings = LossSettings(loss_agg="token-mean", temperature=0.7)
    passes: list[list[list[int]]] = []
    real = forward.length_buckets

    def recorded(widths, cost=None):
        passes.append(real(widths, cost))
        return passes[-1]

    monkeypatch.setattr(forward, "length_buckets", recorded)
    monkeypatch.setattr(forward, "BUCKET_COST", 0)  # a pass per distinct width
    budget = 10**6
    full = compute_logprobs(model, samples, ForwardOptions(PAD, 0.7, budget, shared_prompt=False))
    by_width = compute_logprobs(model, samples, ForwardOptions(PAD, 0.7, budget))
    assert passes and max(len(p) for p in passes) >= 4, passes  # several passes ran
    for a, b in zip(full, by_width, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    g_by_width = step_gradient(model, samples, settings, budget)
    g_full = step_gradient(model, samples, settings, budget, shared_prompt=False)
    monkeypatch.setattr(forward, "BUCKET_COST", 10**9)  # one pass at the longest width
    passes.clear()
    g_one = step_gradient(model, samples, settings, budget)
    assert passes and all(len(p) == 1 for p in passes)
    assert g_full.abs().max() > 1e-4
    torch.testing.assert_close(g_by_width, g_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_by_width, g_one, atol=1e-5, rtol=1e-5)


def test_shared_prompt_forward_in_float32() -> None:
    """In float32 the two paths differ only by summation order."""
    m = build_model(len(build_tokenizer()), seed=5)
    m.train()
    samples = make_samples(seed=8)
    a = compute_logprobs(m, samples, ForwardOptions(PAD, 1.0, 250, shared_prompt=False))
    b = compute_logprobs(m, samples, ForwardOptions(PAD, 1.0, 250))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


def test_checkpointed_layers_with_the_shared_prompt_equal_the_plain_forward(model) -> None:
    """dapo's layer checkpointing keeps the shared-prompt forward: each layer runs again in
    backward (its cache update gives the same keys again) and the log-probs and gradients
    are those of the plain forward of whole sequences."""
    import copy

    from dapo.models.activation_checkpointing import checkpoint_layers, is_checkpointed

    checkpointed = copy.deepcopy(model)
    assert checkpoint_layers(checkpointed) == 4 and is_checkpointed(checkpointed)
    assert not is_checkpointed(model) and prompt_cache(checkpointed) is not None
    assert checkpointed.state_dict().keys() == model.state_dict().keys()
    settings = LossSettings(loss_agg="token-mean", temperature=0.8)
    samples = with_old_logprobs(make_samples(), seed=11)
    calls = {"plain": 0, "checkpointed": 0}
    handles = [
        m.model.layers[0].self_attn.register_forward_pre_hook(
            lambda *_, k=k: calls.__setitem__(k, calls[k] + 1)
        )
        for k, m in (("plain", model), ("checkpointed", checkpointed))
    ]
    seen, hook = _count_prompt_passes(checkpointed)
    try:
        plain = step_gradient(model, samples, settings, 130, shared_prompt=False)
        shared = step_gradient(checkpointed, samples, settings, 130)
    finally:
        hook.remove()
        for h in handles:
            h.remove()
    assert len(seen) > 0  # the prompts were forwarded once per group...
    passes = len(micro_batches(samples, 130))
    # one more pass (the responses) per shared prompt pass, and every pass ran again in backward
    assert calls["plain"] == passes and calls["checkpointed"] == 2 * (passes + len(seen))
    assert plain.abs().max() > 1e-4
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    a = compute_logprobs(model, samples, ForwardOptions(PAD, 0.8, 130, shared_prompt=False))
    b = compute_logprobs(checkpointed, samples, ForwardOptions(PAD, 0.8, 130))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-6)


def test_prompt_cache_only_where_the_cache_is_exact(model) -> None:
    """transformers' own gradient checkpointing (its layers drop the cache in training) and
    sliding-window attention (the cache keeps only part of the past) fall back to full
    sequences, exactly."""
    import copy

    from transformers import MistralConfig, MistralForCausalLM

    assert prompt_cache(model) is not None
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    assert prompt_cache(checkpointed) is None
    assert prompt_cache(checkpointed.eval()) is not None
    checkpointed.train()
    settings = LossSettings(loss_agg="token-mean")
    samples = with_old_logprobs(make_samples(), seed=9)
    torch.testing.assert_close(
        step_gradient(checkpointed, samples, settings, 250),
        step_gradient(model, samples, settings, 250, shared_prompt=False),
        atol=1e-5,
        rtol=1e-5,
    )
    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=8,
        )
    )
    assert prompt_cache(sliding) is None


# --------------------------------------------------------------------------------------
# The update plan: full and short batches
# --------------------------------------------------------------------------------------


def test_a_full_batch_is_cut_into_equal_mini_batches() -> None:
    g, n, mbs, epochs, seed = 3, 12, 4, 2, 17
    plan = plan_updates(n * g, g, n, mbs, epochs, seed=seed)
    # Transcription of the rule: per epoch one seeded permutation of the groups, cut into
    # prompts_per_step / mini_batch_size slices of mini_batch_size groups.
    gen = torch.Generator().manual_seed(seed)
    expected = []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for m in range(n // mbs):
            expected.append(
                (epoch, [k * g + j for k in order[m * mbs : (m + 1) * mbs] for j in range(g)])
            )
    assert plan == expected


@pytest.mark.parametrize(
    ("groups", "prompts_per_step", "mbs", "sizes"),
    [
        (29, 32, 16, [15, 14]),
        (17, 32, 16, [9, 8]),
        (3, 32, 8, [3]),
        (10, 16, 4, [4, 3, 3]),
        (1, 4, 4, [1]),
    ],
)
def test_a_short_batch_gets_ceil_n_over_mini_batch_updates_of_near_equal_size(
    groups: int, prompts_per_step: int, mbs: int, sizes: list[int]
) -> None:
    g, epochs = 2, 2
    plan = plan_updates(groups * g, g, prompts_per_step, mbs, epochs, seed=5)
    assert len(plan) == epochs * math.ceil(groups / mbs)
    for epoch in range(epochs):
        updates = [idx for e, idx in plan if e == epoch]
        assert [len(idx) // g for idx in updates] == sizes
        rows = [i for idx in updates for i in idx]
        assert sorted(rows) == list(range(groups * g))  # every response once per epoch
        for idx in updates:  # whole groups, each response of a group in order
            gids = [i // g for i in idx[::g]]
            assert idx == [k * g + j for k in gids for j in range(g)]


def test_more_groups_than_the_batch_is_an_error() -> None:
    with pytest.raises(TrainingError, match="exceed train.prompts_per_step=4"):
        plan_updates(5 * 2, 2, 4, 2, 1, seed=0)


# ======================================================================================
# The loss variants, importance-sampling corrections and entropy controls: each is exact
# under any micro-batch split (and, tests/test_distributed.py, any number of ranks).
# ======================================================================================

VARIANTS = {
    "gspo": LossSettings(
        policy_loss="gspo", clip_low=0.05, clip_high=0.08, loss_agg="seq-mean-token-mean"
    ),
    "cispo": LossSettings(policy_loss="cispo", clip_low=1.0, clip_high=0.3),
    "is-token-truncate": LossSettings(is_cap=1.5, is_level="token", is_mode="truncate"),
    "is-token-mask": LossSettings(is_cap=1.5, is_level="token", is_mode="mask"),
    "is-sequence-truncate": LossSettings(is_cap=1.5, is_level="sequence", is_mode="truncate"),
    "is-sequence-mask": LossSettings(is_cap=1.5, is_level="sequence", is_mode="mask"),
    "gspo+is-sequence-mask": LossSettings(
        policy_loss="gspo",
        clip_low=0.05,
        clip_high=0.08,
        loss_agg="seq-mean-token-mean",
        is_cap=1.5,
        is_level="sequence",
        is_mode="mask",
    ),
    "clip_cov": LossSettings(
        entropy_control="clip_cov",
        clip_low=1.0,
        clip_high=1.0,
        clip_cov_ratio=0.1,
        clip_cov_low=0.05,
        clip_cov_high=5.0,
    ),
    "kl_cov": LossSettings(entropy_control="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=1.0),
    "entropy-token-mean": LossSettings(entropy_coef=0.05),
    "entropy-seq-mean": LossSettings(entropy_coef=0.05, loss_agg="seq-mean-token-mean"),
    "entropy-sum-norm": LossSettings(
        entropy_coef=0.05, loss_agg="seq-mean-token-sum-norm", max_len=64
    ),
}


def variant_samples(seed: int) -> list[Sample]:
    """make_samples with old log-probs and engine log-probs that differ from them (some
    token ratios and some response products beyond the IS cap 1.5)."""
    samples = with_old_logprobs(make_samples(), seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    for s in samples:
        s.sampling_logprobs = s.old_logprobs + 0.25 * torch.randn(
            len(s.response_ids), generator=gen, dtype=torch.float64
        )
    return samples


def variant_gradient(model, samples, settings, budget, *, seed: int = 0) -> torch.Tensor:
    """One step's gradient as optimizer_step computes it on one process: IS weights, the
    covariance selection and the denominator first, then the micro-batches."""
    attach_is_weights(samples, settings)
    model.zero_grad(set_to_none=True)
    backward(model, samples, settings, token_budget=budget, pad_id=PAD, seed=seed)
    return grads(model)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_is_exact_under_any_micro_batch_split(model, name) -> None:
    settings = VARIANTS[name]
    samples = variant_samples(seed=11)
    whole = variant_gradient(model, samples, settings, 10**6)
    plain = step_gradient(model, with_old_logprobs(make_samples(), seed=11), LossSettings(), 10**6)
    assert whole.abs().max() > 1e-4
    assert not torch.allclose(whole, plain, atol=1e-6)  # the variant changes the step
    for budget in (70, 130, 250):
        assert len(micro_batches(samples, budget)) > 1
        torch.testing.assert_close(
            variant_gradient(model, samples, settings, budget), whole, atol=1e-5, rtol=1e-5
        )


def _sequence_logprobs(model, s: Sample) -> torch.Tensor:
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]


def test_gspo_and_sequence_masked_is_match_a_transcription(model) -> None:
    """GSPO, J = 1/G sum_i min(s_i A_i, clip(s_i) A_i) with s_i the length-normalised sequence
    ratio over the loss tokens, and sequence-level masked IS: a response whose engine ratio
    prod_t pi_old / pi_engine exceeds C is dropped, the others weighted by it. One unpadded
    forward per response; G counts every response (as for overlong-filtered ones)."""
    settings = VARIANTS["gspo+is-sequence-mask"]
    samples = variant_samples(seed=12)
    attach_is_weights(samples, settings)
    rhos = [math.exp(float((s.old_logprobs - s.sampling_logprobs).sum())) for s in samples]
    assert any(r > 1.5 for r in rhos) and any(
        r <= 1.5 and sum(s.loss_mask) for r, s in zip(rhos, samples, strict=True)
    )
    model.zero_grad(set_to_none=True)
    G = len(samples)
    for s, rho in zip(samples, rhos, strict=True):
        if rho > 1.5 or sum(s.loss_mask) == 0:
            continue
        logp = _sequence_logprobs(model, s)
        log_ratio = sum(logp[t] - s.old_logprobs[t] for t in range(len(logp)))
        ratio = torch.exp(log_ratio / len(logp))
        clipped = torch.clamp(ratio, 1 - 0.05, 1 + 0.08)
        (-rho * torch.minimum(ratio * s.advantage, clipped * s.advantage) / G).backward()
    ref = grads(model)
    torch.testing.assert_close(
        variant_gradient(model, samples, settings, 130), ref, atol=1e-5, rtol=1e-5
    )


def test_cispo_and_token_masked_is_match_a_transcription(model) -> None:
    """CISPO with token-level masked IS: J = 1/N sum sg(clip(r)) rho A log pi over the loss
    tokens with rho = pi_old / pi_engine <= C; N counts only those tokens."""
    settings = LossSettings(
        policy_loss="cispo",
        clip_low=1.0,
        clip_high=0.3,
        is_cap=1.5,
        is_level="token",
        is_mode="mask",
    )
    samples = variant_samples(seed=13)  # ratios pi / pi_old far from 1, some above 1.3
    attach_is_weights(samples, settings)
    kept = [
        (i, t)
        for i, s in enumerate(samples)
        for t in range(len(s.response_ids))
        if s.loss_mask[t] and math.exp(s.old_logprobs[t] - s.sampling_logprobs[t]) <= 1.5
    ]
    n = len(kept)
    assert 0 < n < sum(sum(s.loss_mask) for s in samples)
    model.zero_grad(set_to_none=True)
    logps = {i: _sequence_logprobs(model, s) for i, s in enumerate(samples)}
    objective, clipped = 0.0, 0
    for i, t in kept:
        s = samples[i]
        rho = math.exp(s.old_logprobs[t] - s.sampling_logprobs[t])
        r = math.exp(logps[i][t].item() - s.old_logprobs[t])
        clipped += r > 1.3
        objective = objective + min(max(r, 0.0), 1.3) * rho * s.advantage * logps[i][t] / n
    assert clipped > 0
    (-objective).backward()
    ref = grads(model)
    assert loss_denominator(samples, settings) == n
    torch.testing.assert_close(
        variant_gradient(model, samples, settings, 70), ref, atol=1e-5, rtol=1e-5
    )


def test_masked_responses_leave_the_loss_and_its_denominator(model) -> None:
    """Sequence-level masking drops a response exactly as overlong filtering does: the step
    equals the step on the batch without it (token-mean)."""
    settings = LossSettings(is_cap=2.0, is_level="sequence", is_mode="mask")
    samples = with_old_logprobs(make_samples(), seed=14)
    for j, s in enumerate(samples):
        s.sampling_logprobs = s.old_logprobs - (1.0 if j in (0, 5) else 0.0)  # rho e^|y| or 1
    without = [s for j, s in enumerate(samples) if j not in (0, 5)]
    expected = step_gradient(model, [s for s in without if sum(s.loss_mask)], LossSettings(), 10**6)
    metrics = attach_is_weights(samples, settings)
    assert metrics["rollout/is_masked_frac"] == pytest.approx(2 / 10)  # of the 10 with loss tokens
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.0)
    torch.testing.assert_close(
        variant_gradient(model, samples, settings, 130), expected, atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_cov_selection_equals_the_single_batch_algorithm(name) -> None:
    """The mini-batch selection (global means, global top-k) equals the pure algorithm run
    on the whole batch at once, with the same random draws."""
    from dapo import algorithms as alg
    from dapo.seeding import mix_seed
    from dapo.training.token_weights import cov_selection

    def pad(rows):
        return torch.nn.utils.rnn.pad_sequence(
            [torch.as_tensor(x, dtype=torch.float64) for x in rows], batch_first=True
        )

    settings = VARIANTS[name]
    samples = variant_samples(seed=15)
    selected, metrics = cov_selection(samples, list(range(len(samples))), settings, seed=3)
    lp = pad([s.old_logprobs for s in samples])
    mask = pad([s.loss_mask for s in samples])
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    if name == "clip_cov":
        priority = pad(
            [
                torch.rand(
                    len(s.response_ids),
                    dtype=torch.float64,
                    generator=torch.Generator().manual_seed(mix_seed(3, i)),
                )
                for i, s in enumerate(samples)
            ]
        )
        want = alg.clip_cov_select(lp, adv, mask, priority, ratio=0.1, low=0.05, high=5.0)
    else:
        want = alg.kl_cov_select(lp, adv, mask, ratio=0.1)
    got = pad(selected) > 0
    assert want.sum() == int(0.1 * mask.sum()) > 3
    assert torch.equal(got, want)
    assert metrics["actor/cov_selected_frac"] == pytest.approx(float(want.sum() / mask.sum()))


class FakeRanks:
    """``all_gather_objects`` across threads, one per simulated rank."""

    def __init__(self, n: int) -> None:
        import threading

        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.local = threading.local()

    def all_gather_objects(self, obj):
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("world", [2, 3])
def test_cov_selection_is_the_same_on_any_number_of_ranks(monkeypatch, name, world) -> None:
    import threading

    from dapo.training import token_weights

    settings = VARIANTS[name]
    samples = variant_samples(seed=16)
    single, single_metrics = token_weights.cov_selection(
        samples, list(range(len(samples))), settings, seed=5
    )
    fake = FakeRanks(world)
    monkeypatch.setattr(token_weights, "all_gather_objects", fake.all_gather_objects)
    order = list(range(len(samples)))
    random.Random(world).shuffle(order)
    parts = [order[r::world] for r in range(world)]
    results: dict[int, tuple] = {}

    def run(rank: int) -> None:
        fake.local.rank = rank
        ids = parts[rank]
        results[rank] = token_weights.cov_selection(
            [samples[i] for i in ids], ids, settings, seed=5
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for rank, ids in enumerate(parts):
        sel, metrics = results[rank]
        for i, x in zip(ids, sel, strict=True):
            assert torch.equal(x, single[i]), (rank, i)
        assert metrics == single_metrics
    assert sum(int(x.sum()) for x in single) > 3
