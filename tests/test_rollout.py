"""Tests for ``dapo.rollout``: the HF engine's sampling loop and ``process_logits``.

The model is the random-weight builtin tiny model (no download, no warm-up). References are
computed independently: log-probs by one plain forward pass over each unpadded
``prompt + response``, greedy decoding by re-running the full sequence at every step
(no KV cache, no batching, no padding).
"""

from __future__ import annotations

import math

import pytest
import torch

from dapo.models.tiny import build_model
from dapo.rollout import HFEngine, SamplingParams, process_logits

EOS, PAD = 1, 0

TEXTS = ["Add 1+2", "Hi", "abcdefghijkl", "x", "The quick brown", "42+17=", "zz top", "Answer: 5"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one thread


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def make_model(tok, seed: int, eos_scale: float = 1.0, eos_bias: float = 0.0):
    """The tiny random model in eval mode; the EOS logit becomes ``scale * logit + bias``.

    A random model almost never emits EOS; the hook makes some rows stop early (and, with a
    scale, at positions that depend on the content) so that finished rows get dropped.
    """
    model = build_model(len(tok), seed=seed).eval()
    if eos_scale != 1.0 or eos_bias != 0.0:

        def hook(_module, _inputs, out):
            out = out.clone()
            out[..., EOS] = out[..., EOS] * eos_scale + eos_bias
            return out

        model.lm_head.register_forward_hook(hook)
    return model


def engine(model, batch_size: int = 256) -> HFEngine:
    return HFEngine(model, eos_token_id=EOS, pad_token_id=PAD, batch_size=batch_size)


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float()
    p = len(prompt)
    scaled = logits[p - 1 : p - 1 + len(response)]
    if temperature > 0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


def check_truncation_flags(groups, max_tokens: int) -> None:
    for g in groups:
        for resp, trunc in zip(g.response_ids, g.truncated, strict=True):
            if EOS in resp:
                assert resp[-1] == EOS and resp.count(EOS) == 1
                assert not trunc
                assert len(resp) <= max_tokens
            else:
                assert trunc
                assert len(resp) == max_tokens


# --------------------------------------------------------------------------------------
# Log-probs and truncation
# --------------------------------------------------------------------------------------


def test_sampling_logprobs_match_full_forward_pass(tok, prompts):
    model = make_model(tok, seed=0, eos_bias=2.0)
    temperature, max_tokens = 0.8, 12
    chosen = [prompts[0], prompts[1], prompts[2]]  # lengths 7, 2, 12: left padding
    assert len({len(p) for p in chosen}) == 3
    groups = engine(model).generate(
        chosen, SamplingParams(n=4, temperature=temperature, max_tokens=max_tokens, seed=0)
    )

    lengths = [len(r) for g in groups for r in g.response_ids]
    finished = [
        len(r) for g in groups for r, t in zip(g.response_ids, g.truncated, strict=True) if not t
    ]
    # Preconditions: rows stop at different steps and some run to the limit.
    assert any(g.truncated[i] for g in groups for i in range(4)), lengths
    assert len(set(finished)) >= 3, lengths
    assert min(finished) < max_tokens // 2, lengths

    check_truncation_flags(groups, max_tokens)
    for g in groups:
        for resp, lp in zip(g.response_ids, g.logprobs, strict=True):
            assert len(lp) == len(resp)
            ref = reference_logprobs(model, g.prompt_ids, resp, temperature)
            torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-4, rtol=0)


def test_truncation_flag_when_eos_is_the_last_allowed_token(tok, prompts):
    # With a large bias every row ends at its first token, which is also the last allowed.
    model = make_model(tok, seed=0, eos_bias=50.0)
    groups = engine(model).generate(prompts[:3], SamplingParams(n=2, max_tokens=1, seed=0))
    assert all(r == [EOS] for g in groups for r in g.response_ids)
    assert not any(t for g in groups for t in g.truncated)
    # Without the bias, one token is never enough to finish.
    model = make_model(tok, seed=0, eos_bias=-50.0)
    groups = engine(model).generate(prompts[:3], SamplingParams(n=2, max_tokens=3, seed=0))
    assert all(len(r) == 3 and EOS not in r for g in groups for r in g.response_ids)
    assert all(t for g in groups for t in g.truncated)


# --------------------------------------------------------------------------------------
# Greedy decoding: dropping finished rows, batching
# --------------------------------------------------------------------------------------


def test_batched_greedy_equals_one_prompt_at_a_time(tok, prompts):
    model = make_model(tok, seed=0, eos_scale=8.0)
    max_tokens = 16
    params = SamplingParams(n=2, temperature=0.0, max_tokens=max_tokens)
    eng = engine(model)
    batch = eng.generate(prompts, params)

    lengths = [len(g.response_ids[0]) for g in batch]
    finished = [len(g.response_ids[0]) for g in batch if not g.truncated[0]]
    # Preconditions: rows finish at different steps while others keep going.
    assert any(g.truncated[0] for g in batch), lengths
    assert len(set(finished)) >= 2 and min(finished) < max_tokens, lengths

    check_truncation_flags(batch, max_tokens)
    for p, g in zip(prompts, batch, strict=True):
        alone = eng.generate([p], params)[0]
        assert g.response_ids == alone.response_ids
        assert g.truncated == alone.truncated
        for a, b in zip(g.logprobs, alone.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        # Greedy: both responses of a group are the same and match a cache-free decode.
        assert g.response_ids[0] == g.response_ids[1]
        assert g.response_ids[0] == reference_greedy(model, p, max_tokens)
        ref = reference_logprobs(model, p, g.response_ids[0], temperature=0.0)
        torch.testing.assert_close(torch.tensor(g.logprobs[0]), ref, atol=1e-4, rtol=0)


def test_generation_batch_size_does_not_change_greedy_outputs(tok, prompts):
    model = make_model(tok, seed=0, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    chosen = prompts[:5]

    seen: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    small = engine(model, batch_size=4).generate(chosen, params)
    handle.remove()
    assert seen and max(seen) <= 4  # precondition: the work really was split (10 rows)

    big = engine(model, batch_size=256).generate(chosen, params)
    assert len(small) == len(big) == 5
    for s, b, p in zip(small, big, chosen, strict=True):
        assert s.prompt_ids == b.prompt_ids == p
        assert s.response_ids == b.response_ids
        assert s.truncated == b.truncated
        for x, y in zip(s.logprobs, b.logprobs, strict=True):
            assert x == pytest.approx(y, abs=1e-4)


# --------------------------------------------------------------------------------------
# Seeds and grouping
# --------------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(tok, prompts):
    model = make_model(tok, seed=0)
    eng = engine(model)

    def run(seed: int):
        return eng.generate(prompts[:3], SamplingParams(n=3, max_tokens=6, seed=seed))

    a, b, c = run(7), run(7), run(8)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


def test_n_responses_per_prompt_come_back_grouped(tok, prompts):
    model = make_model(tok, seed=0)
    chosen = prompts[:4]
    n, max_tokens = 3, 5
    groups = engine(model).generate(chosen, SamplingParams(n=n, max_tokens=max_tokens, seed=3))
    assert len(groups) == len(chosen)
    for p, g in zip(chosen, groups, strict=True):
        assert g.prompt_ids == p
        assert len(g.response_ids) == len(g.logprobs) == len(g.truncated) == n
        assert all(len(lp) == len(r) for r, lp in zip(g.response_ids, g.logprobs, strict=True))
        # Independent samples, not one sample repeated (near-uniform random model).
        assert len({tuple(r) for r in g.response_ids}) == n
        # Each response continues its own prompt.
        for r, lp in zip(g.response_ids, g.logprobs, strict=True):
            ref = reference_logprobs(model, p, r, temperature=1.0)
            torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-4, rtol=0)


def test_engine_restores_training_mode(tok, prompts):
    model = make_model(tok, seed=0).train()
    engine(model).generate(prompts[:1], SamplingParams(n=2, max_tokens=2))
    assert model.training


def test_empty_prompt_is_rejected(tok, prompts):
    with pytest.raises(ValueError, match="at least one token"):
        engine(make_model(tok, seed=0)).generate([prompts[0], []], SamplingParams(max_tokens=2))


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def _greedy(eng, prompts):
    groups = eng.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=8))
    return [g.response_ids[0] for g in groups]


def test_load_weights_from_another_model(tok, prompts):
    target = make_model(tok, seed=0)
    source = make_model(tok, seed=2)
    eng, src_eng = engine(target), engine(source)
    chosen = prompts[:4]
    assert _greedy(eng, chosen) != _greedy(src_eng, chosen)  # precondition

    eng.load_weights(source.named_parameters())

    assert _greedy(eng, chosen) == _greedy(src_eng, chosen)
    for (name, p), (_, q) in zip(target.named_parameters(), source.named_parameters(), strict=True):
        assert torch.equal(p, q), name
        assert p.data_ptr() != q.data_ptr(), name  # copied, not aliased


def test_load_weights_from_a_state_dict(tok, prompts):
    """A state_dict of a tied-embedding model also names lm_head.weight; it must load."""
    target = make_model(tok, seed=0)
    source = make_model(tok, seed=2)
    eng = engine(target)
    eng.load_weights(source.state_dict().items())
    assert _greedy(eng, prompts[:4]) == _greedy(engine(source), prompts[:4])


def test_load_weights_unknown_name_raises_key_error(tok):
    eng = engine(make_model(tok, seed=0))
    with pytest.raises(KeyError, match="no_such_layer"):
        eng.load_weights([("no_such_layer.weight", torch.zeros(3))])


# --------------------------------------------------------------------------------------
# process_logits
# --------------------------------------------------------------------------------------

# A 5-token distribution in shuffled order: sorted it is 0.4 (id 1), 0.3 (id 3),
# 0.15 (id 4), 0.1 (id 0), 0.05 (id 2).
PROBS = [0.1, 0.4, 0.05, 0.3, 0.15]


def _kept(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if x != -math.inf}


def test_process_logits_temperature():
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    torch.testing.assert_close(process_logits(logits, 2.0), logits / 2.0)
    torch.testing.assert_close(process_logits(logits, 0.5), logits * 2.0)
    torch.testing.assert_close(process_logits(logits, 1.0), logits)


def test_process_logits_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0], [0.0, -1.0, -2.0, -3.0, -4.0]])
    out = process_logits(logits, 1.0, top_k=2)
    assert _kept(out[0]) == {3, 4}
    assert _kept(out[1]) == {0, 1}
    kept = out != -math.inf
    torch.testing.assert_close(out[kept], logits[kept])  # survivors are unchanged
    assert _kept(process_logits(logits, 1.0, top_k=1)[0]) == {3}
    assert _kept(process_logits(logits, 1.0, top_k=0)[0]) == {0, 1, 2, 3, 4}  # 0 disables


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.2, {1}),  # 0.4 alone already reaches 0.2
        (0.65, {1, 3}),  # 0.4 + 0.3 = 0.7 >= 0.65
        (0.8, {1, 3, 4}),  # 0.85 >= 0.8
        (0.9, {1, 3, 4, 0}),  # 0.95 >= 0.9
        (0.99, {0, 1, 2, 3, 4}),
        (1e-9, {1}),  # the top token is always kept
    ],
)
def test_process_logits_top_p_smallest_set_reaching_p(top_p, expected):
    logits = torch.log(torch.tensor([PROBS]))
    out = process_logits(logits, 1.0, top_p=top_p)
    assert _kept(out[0]) == expected
    kept = out != -math.inf
    torch.testing.assert_close(out[kept], logits[kept])


def test_process_logits_top_p_applies_after_temperature_and_top_k():
    logits = torch.log(torch.tensor([PROBS]))
    # After top-k=2 the survivors renormalise to 0.4/0.7 = 0.571 and 0.3/0.7 = 0.429, so
    # p = 0.5 keeps only the top token (without renormalising it would keep two).
    assert _kept(process_logits(logits, 1.0, top_p=0.5, top_k=2)[0]) == {1}
    # Temperature 0.5 squares and renormalises: 0.16, 0.09, 0.0225, ... / 0.285 -> the top
    # token alone has 0.561 >= 0.55, while at temperature 1 it has only 0.4.
    assert _kept(process_logits(logits, 0.5, top_p=0.55)[0]) == {1}
    assert _kept(process_logits(logits, 1.0, top_p=0.55)[0]) == {1, 3}


# --------------------------------------------------------------------------------------
# The token sampler
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.5, 1.0, 0), (1.0, 0.8, 0), (1.0, 1.0, 2)]
)
def test_sample_next_draws_from_the_processed_distribution(temperature, top_p, top_k):
    from dapo.rollout.hf_engine import sample_next

    # Probabilities of a 6-token vocabulary; token 5 has probability 0 (logit -inf).
    logits = torch.log(torch.tensor(PROBS + [0.0]))
    # The distribution, transcribed: p^(1/T) renormalised, then the top-k / top-p set.
    p = torch.tensor(PROBS + [0.0]) ** (1 / temperature)
    p = p / p.sum()
    order = sorted(range(6), key=lambda i: -p[i])
    keep = set(order[:top_k]) if top_k else set(range(6))
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += float(p[i])
        keep &= nucleus
    want = torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(6)])
    want = want / want.sum()

    rows = 200_000
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    tok, logp = sample_next(logits.expand(rows, 6), params, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=6).double() / rows
    assert all(freq[i] == 0 for i in range(6) if want[i] == 0)  # never a removed token
    sigma = (want * (1 - want) / rows).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-12).all(), (freq, want)
    torch.testing.assert_close(logp, want.log().float()[tok])  # the log-prob it was drawn with
    again, _ = sample_next(logits.expand(rows, 6), params, torch.Generator().manual_seed(0))
    assert torch.equal(tok, again)  # seeded


def test_sample_next_is_greedy_at_temperature_zero():
    from dapo.rollout.hf_engine import sample_next

    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 2.0, 1.0]])
    tok, logp = sample_next(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert tok.tolist() == [1, 0]
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_a_large_vocabulary_is_drawn_two_level_as_the_inverse_cdf_of_the_whole_row():
    from dapo.rollout.sampling import BLOCK, _draw

    # Three whole blocks and a partial one; integer masses, so that every partial sum is
    # exact in float32 and float64 and the inverse CDF is known exactly. Zero-mass entries
    # at block edges, a whole zero block and zeros before the last entry are never drawn.
    vocab = 3 * BLOCK + 77
    g = torch.Generator().manual_seed(0)
    mass = torch.randint(0, 8, (vocab,), generator=g).float()
    mass[BLOCK : 2 * BLOCK] = 0  # a block of no mass
    mass[[0, BLOCK - 1, 2 * BLOCK, 3 * BLOCK - 1]] = 0
    mass[-20:] = 0
    mass[-1] = 3  # the last entry, past zeros, in the partial block
    cum = mass.double().cumsum(0)
    total = float(cum[-1])
    # u on a grid of midpoints between the breakpoints, and next to 0 and 1.
    breaks = sorted({float(c) / total for c in cum})
    u = [(a + b) / 2 for a, b in zip([0.0] + breaks, breaks, strict=False) if b > a]
    u += [0.0, 1e-12, 1 - 2**-53]
    u = torch.tensor(u, dtype=torch.float64)
    want = torch.tensor([int((cum > x * total).nonzero()[0]) if x * total < total
                         else int(mass.nonzero()[-1]) for x in u.tolist()])  # fmt: skip
    got = _draw(mass.expand(len(u), vocab), u)
    assert torch.equal(got, want)
    assert (mass[got] > 0).all()
    # Every entry of positive mass is reachable.
    assert set(got.tolist()) == set(mass.nonzero().flatten().tolist())


def test_the_two_level_draw_keeps_top_k_and_the_log_prob_on_a_large_vocabulary():
    from dapo.rollout.sampling import BLOCK, sample_with

    vocab, rows = 5 * BLOCK + 3, 4000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    top = set(torch.topk(logits, 7).indices.tolist())
    params = SamplingParams(temperature=0.7, top_k=7)
    u = torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    tok, logp = sample_with(logits.expand(rows, vocab), params, u)
    assert set(tok.tolist()) == top  # only the top 7, each of them drawn
    want = torch.log_softmax(process_logits(logits[None], 0.7, top_k=7)[0], -1)[tok]
    torch.testing.assert_close(logp, want)
    # The frequencies of the 7 (a 5-sigma band around the transcribed distribution).
    p = torch.softmax(logits / 0.7, -1)
    p = torch.where(torch.isin(torch.arange(vocab), torch.tensor(sorted(top))), p, 0)
    p = (p / p.sum()).double()
    freq = torch.bincount(tok, minlength=vocab).double() / rows
    sigma = (p * (1 - p) / rows).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-12).all()
