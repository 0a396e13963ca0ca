"""Tests for ``dapo.rollout.decode``: the static cache, the decode step, continuous batching
and packing, bf16 generation weights, the CUDA-graph and model-support decisions.

References are independent of the loop: log-probs from one plain forward pass over each
unpadded ``prompt + response`` (``test_rollout.reference_logprobs``), token distributions from
the softmax of that forward.
"""

from __future__ import annotations

import pytest
import torch
from test_rollout import EOS, PAD, make_model, reference_greedy, reference_logprobs

from dapo.models.precision import set_precision
from dapo.rollout import HFEngine, SamplingParams
from dapo.rollout.buffers import RowCache, bucket_for, buckets
from dapo.rollout.hf_engine import graphs_fallback, unsupported_reason

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["Add 1+2", "Hi", "abcdefghijkl", "x", "The quick brown", "42+17="]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def batch_sizes_seen(monkeypatch) -> list[int]:
    """The batch size of every decode step (one new token per row), whichever forward it
    takes."""
    from dapo.rollout import decode

    seen: list[int] = []
    real = decode.decode_step

    def recorded(model, s, *a, **k):
        seen.append(s.done.shape[0])
        real(model, s, *a, **k)

    monkeypatch.setattr(decode, "decode_step", recorded)
    return seen


@pytest.fixture(params=[True, False], ids=["llama-step", "model-forward"])
def direct(request, monkeypatch):
    """Both decode-step forwards: LlamaStep (the default for these Llama models) and the
    model's own forward; each test checks the path it asked for is the one taken."""
    from dapo.rollout import decode

    calls = {"n": 0}
    real = decode.LlamaStep.__call__

    def counted(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(decode.LlamaStep, "__call__", counted)
    yield request.param
    assert (calls["n"] > 0) == request.param, calls


def test_buckets_are_powers_of_two_and_halfway_sizes_up_to_the_batch():
    assert buckets(1) == [1]
    assert buckets(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert buckets(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert [bucket_for(n, buckets(256)) for n in (1, 5, 7, 13, 200, 256)] == [1, 6, 8, 16, 256, 256]


def test_the_row_cache_writes_each_rows_key_at_its_own_slot():
    keys = [torch.zeros(3, 2, 5, 4)]
    values = [torch.zeros(3, 2, 5, 4)]
    slot = torch.tensor([0, 3, 4])
    cache = RowCache(keys, values, slot)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 1, 4) + 1
    out_k, out_v = cache.update(k, -k, 0)
    assert out_k is keys[0] and out_v is values[0]  # the buffers themselves: nothing grows
    for row, s in enumerate(slot.tolist()):
        assert torch.equal(keys[0][row, :, s], k[row, :, 0])
        assert torch.equal(values[0][row, :, s], -k[row, :, 0])
        others = [i for i in range(5) if i != s]
        assert keys[0][row, :, others].abs().sum() == 0


def test_bf16_mixed_keeps_its_cache_in_bf16_with_the_same_results(tok, prompts, monkeypatch):
    """Under bf16-mixed the attention products read the cache in bf16: stored in bf16 (not
    float32, rounded again at every step), the call samples the same tokens with the same
    log-probs as with a float32 cache."""
    from dapo.rollout import decode

    model = set_precision(make_model(tok, seed=0), "bf16-mixed")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3)
    dtypes: list[torch.dtype] = []
    real = decode.decode_step

    def recorded(m, s, cache, *a, **k):
        dtypes.extend(x.dtype for x in (*cache.keys, *cache.values))
        real(m, s, cache, *a, **k)

    monkeypatch.setattr(decode, "decode_step", recorded)
    bf16 = HFEngine(model, EOS, PAD).generate(prompts, params)
    assert dtypes and set(dtypes) == {torch.bfloat16}
    dtypes.clear()
    monkeypatch.setattr(decode.Decoder, "_cache_dtype", lambda self, x: x.dtype)
    fp32 = HFEngine(model, EOS, PAD).generate(prompts, params)
    assert torch.float32 in dtypes  # the keys leave the rotary embedding in float32
    assert [g.response_ids for g in bf16] == [g.response_ids for g in fp32]
    assert [g.logprobs for g in bf16] == [g.logprobs for g in fp32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_attention_is_softmax_of_scaled_scores_times_values(dtype):
    """One new token per row over a cache window (a strided view, as the engine passes it),
    grouped-query heads and a boolean slot mask: the engine's attention against the
    formula written out in float64 from the same (rounded) inputs, to the precision of the
    dtype's products."""
    from dapo.rollout.attention import decode_attention

    g = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, dim, window = 5, 6, 2, 16, 9
    query = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    cache = torch.randn(2, rows, kv_heads, 20, dim, generator=g).to(dtype)
    key, value = cache[0, :, :, :window], cache[1, :, :, :window]
    mask = torch.rand(rows, 1, 1, window, generator=g) > 0.3
    mask[..., 0] = True
    out, _ = decode_attention(None, query, key, value, mask, scaling=0.25)

    q = query.double().reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = (q @ key.double().transpose(-1, -2)) * 0.25
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    expected = (probs @ value.double()).reshape(rows, 1, heads, dim)
    assert out.shape == (rows, 1, heads, dim) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: scores, probs and output rounded
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_attention_reads_a_shared_prefix_through_its_one_copy(dtype, monkeypatch):
    """Rows whose first 7 slots hold the same prefix: inside ``sharing``, the attention of a
    layer reads the prefix from its one copy (the rows' copies wiped with NaN are never read)
    and equals the formula written out in float64 over the rows' whole windows; under the
    threshold, or for a module without a layer index, it reads the rows' copies again."""
    from types import SimpleNamespace

    from dapo.rollout import attention

    g = torch.Generator().manual_seed(1)
    rows, heads, kv_heads, dim, c, window, layers = 5, 6, 2, 16, 7, 12, 3
    query = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    prefix = torch.randn(layers, 2, 1, kv_heads, c, dim, generator=g).to(dtype)
    cache = torch.randn(layers, 2, rows, kv_heads, 20, dim, generator=g).to(dtype)
    cache[:, :, :, :, :c] = prefix  # every row's slots 0..c-1
    mask = torch.rand(rows, 1, 1, window, generator=g) > 0.3
    mask[..., :c] = True
    mask[..., -1] = True
    shared = attention.SharedPrefix.from_cache([(p[0], p[1]) for p in prefix])
    assert shared.length == c
    calls: list[int] = []
    real = attention.cascade
    monkeypatch.setattr(attention, "cascade", lambda q, *a: calls.append(len(q)) or real(q, *a))
    monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", rows * c)
    wiped = cache.clone()
    wiped[:, :, :, :, :c] = float("nan")
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for layer in range(layers):
        key, value = cache[layer, 0, :, :, :window], cache[layer, 1, :, :, :window]
        q = query.double().reshape(rows, kv_heads, heads // kv_heads, dim)
        scores = (q @ key.double().transpose(-1, -2)) * 0.25
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        expected = (probs @ value.double()).reshape(rows, 1, heads, dim)
        module = SimpleNamespace(layer_idx=layer)
        k, v = wiped[layer, 0, :, :, :window], wiped[layer, 1, :, :, :window]
        with attention.sharing(shared):
            out, _ = attention.decode_attention(module, query, k, v, mask, scaling=0.25)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    assert calls == [rows * kv_heads] * layers
    with attention.sharing(shared):
        out, _ = attention.decode_attention(SimpleNamespace(), query, k, v, mask, scaling=0.25)
        assert torch.isnan(out).all() and len(calls) == layers  # no layer index: the rows'
        monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", rows * c + 1)
        out, _ = attention.decode_attention(module, query, k, v, mask, scaling=0.25)
        assert torch.isnan(out).all() and len(calls) == layers  # under the threshold
    out, _ = attention.decode_attention(module, query, k, v, mask, scaling=0.25)
    assert torch.isnan(out).all() and attention.shared() is None  # outside: the rows'


def test_refilled_and_packed_rows_give_the_forwards_logprobs_to_1e5(
    tok, prompts, direct, monkeypatch
):
    """A batch of 4 rows for 12 responses of very different lengths: rows are refilled from
    the queue and packed as they finish; every response's tokens and log-probs are those of a
    plain forward over it."""
    model = make_model(tok, seed=0, eos_scale=8.0)
    seen = batch_sizes_seen(monkeypatch)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=14, seed=5)
    groups = HFEngine(model, EOS, PAD, batch_size=4, direct=direct).generate(prompts, params)
    lengths = [len(r) for g in groups for r in g.response_ids]
    assert len(set(lengths)) >= 4, lengths  # precondition: a spread of lengths
    assert max(seen) == 4 and min(seen) < 4, seen  # rows refilled, then packed
    for g in groups:
        for resp, lp, trunc in zip(g.response_ids, g.logprobs, g.truncated, strict=True):
            assert len(lp) == len(resp) and (EOS in resp) != trunc
            ref = reference_logprobs(model, g.prompt_ids, resp, temperature=1.0)
            torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=0)


def test_a_small_cache_is_kept_between_calls_without_changing_results(tok, prompts, monkeypatch):
    """A cache under ``KEEP_BYTES`` is allocated once and reused by the next calls of the same
    shape, its stale slots from other prompts masked: every call returns what a fresh engine
    returns. A workspace still in use (another thread's call) is not handed out again, and a
    cache over the limit is not kept."""
    from dapo.rollout import buffers

    model = make_model(tok, seed=2, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3)
    others = [list(reversed(p)) for p in prompts]  # the same widths, other keys and values

    def fresh(ps):
        return HFEngine(model, EOS, PAD, batch_size=4).generate(ps, params)

    engine = HFEngine(model, EOS, PAD, batch_size=4)
    engine.generate(others, params)
    (ws,) = engine.workspaces.entries.values()
    address = ws.cache.keys[0].data_ptr()
    # LlamaStep's keys are stored [rows, heads, head_dim, slots]: slots innermost.
    assert ws.cache.keys[0].stride(2) == 1 and ws.cache.values[0].stride(3) == 1
    again = engine.generate(prompts, params)
    assert [(g.response_ids, g.logprobs) for g in again] == [
        (g.response_ids, g.logprobs) for g in fresh(prompts)
    ]
    (kept,) = engine.workspaces.entries.values()
    assert kept is ws and ws.cache.keys[0].data_ptr() == address and not ws.busy

    ws.busy = True  # as while another call decodes on it
    before = ws.cache.keys[0].clone()
    assert [g.response_ids for g in engine.generate(others, params)] == [
        g.response_ids for g in fresh(others)
    ]
    assert torch.equal(ws.cache.keys[0], before) and list(engine.workspaces.entries.values()) == [
        ws
    ]

    monkeypatch.setattr(buffers, "KEEP_BYTES", 0)
    big = HFEngine(model, EOS, PAD, batch_size=4)
    big.generate(prompts, params)
    assert not big.workspaces.entries


def assert_same_groups(got, want) -> None:
    """The same tokens, and log-probs equal to 1e-5."""
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def row_estimates(monkeypatch) -> list[int]:
    """The most one row may take, as each call's sizing estimated it."""
    from dapo.rollout import decode

    seen: list[int] = []
    real = decode.Decoder._fit

    def recorded(self, key, per_row):
        seen.append(per_row)
        return real(self, key, per_row)

    monkeypatch.setattr(decode.Decoder, "_fit", recorded)
    return seen


def cache_bytes(ws) -> int:
    return sum(b.untyped_storage().nbytes() for b in [*ws.cache.keys, *ws.cache.values])


def test_a_cache_that_does_not_fit_decodes_on_fewer_rows_with_the_same_results(
    tok, prompts, monkeypatch
):
    """When the cache of the rows asked for would take more than ``CACHE_SHARE`` of the
    device's available memory, the call decodes on the most rows that fit (said once), the
    other responses waiting for a free row: the same greedy tokens and log-probs as on all
    rows; the next call reuses the kept smaller workspace. When not one row fits, the error
    names the field to change."""
    from dapo.errors import ConfigError
    from dapo.memory import Memory
    from dapo.rollout import decode

    model = make_model(tok, seed=2, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    per_row = row_estimates(monkeypatch)
    roomy = HFEngine(model, EOS, PAD, batch_size=8)
    want = roomy.generate(prompts, params)
    (ws,) = roomy.workspaces.entries.values()
    assert ws.state.done.shape[0] == 8
    row = per_row[-1]  # the most one row may take: at least what its workspace holds
    assert row >= ws.nbytes() / 8

    # Room for 3 rows; what the engine keeps is taken from it, as on a device.
    budget = {"bytes": int(3.4 * row / decode.CACHE_SHARE)}
    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, batch_size=8, log=lines.append)

    def memory(device):
        kept = sum(w.nbytes() for w in engine.workspaces.entries.values())
        return Memory(budget["bytes"] - kept, 2**40)

    monkeypatch.setattr(decode, "device_memory", memory)
    seen = batch_sizes_seen(monkeypatch)
    addresses = set()
    for _ in range(2):
        got = engine.generate(prompts, params)
        assert_same_groups(got, want)
        (ws,) = engine.workspaces.entries.values()
        addresses.add(ws.cache.keys[0].data_ptr())
    assert max(seen) == 3, seen
    assert len(addresses) == 1  # the second call reused the first one's 3 rows
    assert cache_bytes(ws) <= decode.CACHE_SHARE * budget["bytes"]
    assert len(lines) == 1 and "decoding 3 rows at a time" in lines[0], lines
    assert "8 rows" in lines[0] and "rollout.generation_batch_size" in lines[0]

    engine = HFEngine(model, EOS, PAD, batch_size=8)
    budget["bytes"] = int(0.5 * row / decode.CACHE_SHARE)
    with pytest.raises(ConfigError, match=r"rollout.max_completion_length=10: one response") as e:
        engine.generate(prompts, params)
    assert "more than 80% of the" in str(e.value) and "MiB available on cpu" in str(e.value)
    assert e.value.key == "rollout.max_completion_length"


SYSTEM = "You add numbers. Write the sum, then a line: Answer: the sum. Be brief and exact. "


@pytest.fixture(scope="module")
def chat_prompts(tok):
    """Prompts that share a long prefix (as a chat template's system prompt), then differ in
    length and content: 84 shared characters, then 1 to 9 of their own."""
    rest = ["2+2", "40+2=", "1", "77+123=?", "9+9 is", "x+y", "35+46=81?"]
    return [tok(SYSTEM + r, add_special_tokens=False)["input_ids"] for r in rest]


def prefix_passes(monkeypatch) -> list[int]:
    """The length of every prefix pass a call makes (one row of the shared tokens)."""
    from dapo.rollout import decode

    seen: list[int] = []
    real = decode.Decoder._share_prefix

    def recorded(self):
        out = real(self)
        if self.prefix:
            seen.append(self.prefix)
        return out

    monkeypatch.setattr(decode.Decoder, "_share_prefix", recorded)
    return seen


def test_a_shared_prefix_is_forwarded_once_per_call_with_the_same_results(
    tok, chat_prompts, direct, monkeypatch
):
    """Prompts sharing a system prompt: its keys and values are computed once per call and
    each prefill forwards only the rest (refills included, on 5 rows for 14 responses); with
    either decode step attends to it through that one copy (here on 4 rows or more). Every
    response's log-probs are those of a plain forward over it, and greedy tokens are those of
    a cache-free decode."""
    from dapo.rollout import attention, llama_step

    shared = len(tok(SYSTEM, add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", 4 * shared)
    model = make_model(tok, seed=0, eos_scale=8.0)
    passes = prefix_passes(monkeypatch)
    seen = batch_sizes_seen(monkeypatch)
    cascades: list[int] = []
    real = attention.cascade
    for where in (attention, llama_step):  # the model's own attention, LlamaStep
        monkeypatch.setattr(where, "cascade", lambda q, *a: cascades.append(len(q)) or real(q, *a))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5)
    groups = HFEngine(model, EOS, PAD, batch_size=5, direct=direct).generate(chat_prompts, params)
    assert passes == [shared]
    assert max(seen) == 5 and len(seen) > 12  # refills: more than one prefill used it
    wide = [r for r in seen if r >= 4]
    assert wide and len(wide) < len(seen)  # both: the shared copy, then (packed) the rows
    assert len(cascades) == len(wide) * model.config.num_hidden_layers
    for g in groups:
        for resp, lp in zip(g.response_ids, g.logprobs, strict=True):
            ref = reference_logprobs(model, g.prompt_ids, resp, temperature=1.0)
            torch.testing.assert_close(torch.tensor(lp), ref, atol=1e-5, rtol=0)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=10)
    for batch in (2, 7):
        groups = HFEngine(model, EOS, PAD, batch_size=batch, direct=direct).generate(
            chat_prompts, greedy
        )
        assert [g.response_ids[0] for g in groups] == [
            reference_greedy(model, p, 10) for p in chat_prompts
        ]
    assert len(passes) == 3  # once per call


def test_greedy_tokens_equal_a_cache_free_decode_whatever_the_batch(tok, prompts, direct):
    model = make_model(tok, seed=1, eos_scale=8.0)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12)
    for batch in (2, 5, 256):
        engine = HFEngine(model, EOS, PAD, batch_size=batch, direct=direct)
        groups = engine.generate(prompts, params)
        for p, g in zip(prompts, groups, strict=True):
            want = reference_greedy(model, p, 12)
            assert g.response_ids == [want] * 3, batch


def test_sampling_draws_from_the_models_distribution(tok, prompts, direct):
    """1,536 responses of 2 tokens to one prompt on 256 rows (refills), at temperature 0.4
    (a peaked distribution): the first token's
    frequencies and the second token's, after the most frequent first one, are within 5 sigma
    of the softmax of a plain forward."""
    model = make_model(tok, seed=2)
    prompt = prompts[0]
    n = 1536
    groups = HFEngine(model, EOS, PAD, batch_size=256, direct=direct).generate(
        [prompt], SamplingParams(n=n, temperature=0.4, max_tokens=2, seed=11)
    )
    responses = groups[0].response_ids
    vocab = len(tok)

    def check(counts: torch.Tensor, probs: torch.Tensor, total: int) -> None:
        freq = counts.double() / total
        sigma = (probs * (1 - probs) / total).sqrt()
        assert ((freq - probs).abs() <= 5 * sigma + 2e-3).all()

    with torch.no_grad():
        first = torch.softmax(
            model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / 0.4, -1
        )
    counts = torch.bincount(torch.tensor([r[0] for r in responses]), minlength=vocab)
    check(counts, first, n)
    top = int(counts.argmax())
    after = [r[1] for r in responses if r[0] == top and len(r) > 1]
    assert len(after) > 50  # precondition
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + [top]])).logits[0, -1].double() / 0.4
    check(
        torch.bincount(torch.tensor(after), minlength=vocab), torch.softmax(logits, -1), len(after)
    )


def test_a_long_tail_runs_on_a_shrinking_batch(tok, prompts, monkeypatch):
    """Most responses short, two at the limit: once the queue is empty the decode step runs
    on fewer rows (never on the whole batch for the stragglers)."""
    model = make_model(tok, seed=0, eos_bias=3.0)
    state = {"calls": 0}

    def hook(_m, _i, out):  # rows 0-1 of the first decode batch never end (EOS forbidden)
        out = out.clone()
        if out.shape[1] == 1 and state["calls"] < 10_000:
            out[:2, :, EOS] = -1e9
        return out

    model.lm_head.register_forward_hook(hook)
    seen = batch_sizes_seen(monkeypatch)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=48, seed=0)
    groups = HFEngine(model, EOS, PAD, batch_size=16).generate(prompts[:2], params)
    lengths = sorted(len(r) for g in groups for r in g.response_ids)
    assert lengths[-1] == 48 and lengths[len(lengths) // 2] < 8, lengths  # a long tail
    assert seen[0] == 16 and seen[-1] <= 3, seen
    row_steps = sum(seen)
    assert row_steps < 0.3 * 16 * len(seen), (row_steps, len(seen))


def test_the_copies_memory_leaves_out_an_output_layer_the_model_holds_in_bf16(tok, monkeypatch):
    """Under pure bf16 on CUDA the output layer's "copy" is the model's own bf16 weight (its
    operand is not upcast there): it is no memory of the engine's, so it neither counts
    towards what the engine frees nor is freed."""
    from dapo.models import chunked_logprobs
    from dapo.models.precision import GenerationWeights

    model = set_precision(make_model(tok, seed=0), "bf16")
    weights = GenerationWeights()
    with weights.applied(model):  # on a CPU the operand is a float32 copy: the engine's
        pass
    head = model.lm_head.weight
    assert weights.nbytes() == head.numel() * 4

    monkeypatch.setattr(chunked_logprobs, "_operand", lambda x, dtype: x.to(dtype))  # as CUDA
    weights = GenerationWeights()
    with weights.applied(model):
        pass
    assert weights._head[1].weight.data_ptr() == head.data_ptr() and weights.nbytes() == 0


def test_bf16_mixed_generation_reads_bf16_weights_cast_once_and_restores_them(tok, prompts):
    model = set_precision(make_model(tok, seed=0), "bf16-mixed")
    layer = model.model.layers[0].mlp.down_proj
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params_before = {n: p for n, p in model.named_parameters()}
    seen: list[torch.dtype] = []
    layer.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    engine = HFEngine(model, EOS, PAD)
    groups = engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=6, seed=0))
    assert seen and set(seen) == {torch.bfloat16}  # inside: the bf16 copy, no per-token cast
    for n, p in model.named_parameters():  # outside: the float32 parameters, unchanged
        assert p is params_before[n] and p.dtype == torch.float32
        assert torch.equal(p.detach(), before[n])
    copies = dict(engine.weights._copies)
    with torch.no_grad():
        layer.weight.add_(1.0)  # an update
    engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=2, seed=0))
    fresh = engine.weights._copies[id(layer.weight)]
    assert fresh is copies[id(layer.weight)]  # refreshed in place: the same address
    assert torch.equal(fresh, layer.weight.detach().to(torch.bfloat16))
    assert len(groups) == 2


def test_cuda_graphs_decision_and_unsupported_models(tok, monkeypatch):
    model = make_model(tok, seed=0)
    assert graphs_fallback(model, "auto") is None  # CPU + auto: nothing to say, no graphs
    assert "not CUDA" in graphs_fallback(model, "on")
    assert graphs_fallback(model, "off") == "rollout.cuda_graphs=off"
    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, cuda_graphs="on", log=lines.append)
    assert not engine.uses_graphs() and not engine.uses_graphs()
    assert lines == [
        "rollout.cuda_graphs: decoding without CUDA graphs: the model is on cpu, not CUDA"
    ]
    with pytest.raises(ValueError, match="cuda_graphs='yes'"):
        HFEngine(model, EOS, PAD, cuda_graphs="yes")
    # On CUDA under auto: a sharded policy decodes without graphs and says so, once.
    from dapo.rollout import hf_engine

    monkeypatch.setattr(hf_engine, "device_of", lambda m: torch.device("cuda", 0))
    monkeypatch.setattr(hf_engine, "is_fsdp", lambda m: True)
    lines.clear()
    auto = HFEngine(model, EOS, PAD, log=lines.append)
    assert not auto.uses_graphs() and not auto.uses_graphs()
    assert lines == [
        "rollout.cuda_graphs: decoding without CUDA graphs: the policy is FSDP-sharded (its "
        "gathered weights move at every call)"
    ]
    lines.clear()
    assert not HFEngine(model, EOS, PAD, cuda_graphs="off", log=lines.append).uses_graphs()
    assert lines == []  # off: nothing to say
    monkeypatch.undo()

    assert unsupported_reason(model, 4096) is None
    model.config.sliding_window = 16
    model.config.layer_types = ["sliding_attention"] * 4
    assert unsupported_reason(model, 8) is None  # the window covers the whole sequence
    assert "sliding window (16)" in unsupported_reason(model, 40)
    with pytest.raises(ValueError, match="rollout.engine=vllm"):
        HFEngine(model, EOS, PAD).generate([[5] * 30], SamplingParams(max_tokens=20))


def test_a_failed_capture_falls_back_to_eager_steps_once(tok, prompts, monkeypatch):
    """The capture path itself runs on CUDA only; here its failure handling: the engine says
    why in one line and decodes eagerly, with the same results."""
    model = make_model(tok, seed=0, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    want = HFEngine(model, EOS, PAD).generate(prompts[:3], params)

    def no_stream(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, log=lines.append)
    # As on CUDA: graphs asked for (bucketed rows, a rounded cache length), capture fails.
    monkeypatch.setattr(HFEngine, "uses_graphs", lambda self: not self.workspaces.capture_failed)
    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    got = engine.generate(prompts[:3], params)
    again = engine.generate(prompts[:3], params)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    assert [g.response_ids for g in again] == [g.response_ids for g in want]
    assert len(lines) == 1 and lines[0].startswith(
        "rollout.cuda_graphs: the decode step could not be captured as a CUDA graph "
        "(RuntimeError: operation not permitted"
    ), lines
    assert lines[0].endswith("decoding without CUDA graphs")


def graph_stand_in(monkeypatch) -> tuple[list[tuple], type]:
    """torch.cuda's graph API replaced by a stand-in whose "graph" re-runs the step it
    captured; ``HFEngine`` told to use graphs. Returns the steps run (decoder, rows, slots),
    and the stand-in graph class (counting replays)."""
    import contextlib

    from dapo.rollout.decode import Decoder

    steps: list[tuple] = []
    real_step = Decoder._step

    def recorded(self, rows, length):
        steps.append((self, rows, length))
        real_step(self, rows, length)

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1
            real_step(*self.step)

    @contextlib.contextmanager
    def capture(graph, pool=None):
        first = len(steps)
        yield
        graph.step = steps[first]  # the step run inside the capture (undone after it)

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(Decoder, "_step", recorded)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)

    monkeypatch.setattr(HFEngine, "uses_graphs", lambda self: True)
    return steps, Graph


def test_the_graph_path_captures_each_bucket_once_and_replays_it(tok, prompts, monkeypatch):
    """The CUDA-graph bookkeeping on a CPU, with torch.cuda's graph API replaced by a stand-in
    whose "graph" re-runs the step it captured: bucketed rows, the whole cache length, warm-up
    steps undone, each bucket captured once and reused by the next call; the sampled tokens
    and log-probs are those of eager steps on the same schedule."""
    steps, Graph = graph_stand_in(monkeypatch)
    model = make_model(tok, seed=0, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=3)
    # The reference: the same shapes and schedule, every step run eagerly (as after a failed
    # capture), so that the same uniform numbers meet the same rows.
    eager = HFEngine(model, EOS, PAD, batch_size=8)
    eager.workspaces.capture_failed = True
    want = eager.generate(prompts, params)
    steps.clear()  # from here: the graph path's
    lines: list[str] = []
    engine = HFEngine(model, EOS, PAD, batch_size=8, log=lines.append)
    for _ in range(2):
        got = engine.generate(prompts, params)
        assert_same_groups(got, want)
    (ws,) = engine.workspaces.entries.values()
    captured = sorted(key[0] for key in ws.graphs)
    assert captured[-1] == 8 and len(captured) >= 2, captured  # the batch, then smaller
    assert len(steps) == 3 * len(captured)  # 2 warm-up steps and the captured one, once each
    assert all(length == ws.state.valid.shape[1] for _, _, length in steps)  # whole cache
    assert ws.state.valid.shape[1] == 32 + 40  # prompt width rounded up to 32
    assert Graph.replays > 2 * len(captured) and not lines


def test_under_cuda_graphs_a_step_attends_over_the_smallest_window_that_holds_its_rows(
    tok, prompts, monkeypatch
):
    """A captured step reads a fixed window of cache slots, so it is captured per window
    (bucket sizes from ``GRAPH_MIN_WINDOW``, here 16, up to the whole cache): every step runs
    on the smallest window that holds each row's slots until the next look, the window
    growing with the responses, each (rows, window) captured once. The greedy tokens are the
    engine's without graphs (log-probs to 1e-5); at temperature 1, the draws of eager steps
    on the same schedule."""
    from dapo.rollout import decode

    monkeypatch.setattr(decode, "GRAPH_MIN_WINDOW", 16)
    model = make_model(tok, seed=0, eos_scale=2.0)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=40)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=5)
    plain = HFEngine(model, EOS, PAD, batch_size=8).generate(prompts, greedy)

    captures, _ = graph_stand_in(monkeypatch)
    eager = HFEngine(model, EOS, PAD, batch_size=8)
    eager.workspaces.capture_failed = True  # graphs' schedule (buckets, windows), eager steps
    eager_sampled = eager.generate(prompts, sampled)
    captures.clear()
    seen: list[tuple[int, int]] = []  # per decode step: its window, the furthest row's slot
    real_step = decode.decode_step

    def recorded(model, s, cache, *args):
        seen.append((s.valid.shape[1], int(s.slot.max())))
        real_step(model, s, cache, *args)

    monkeypatch.setattr(decode, "decode_step", recorded)
    engine = HFEngine(model, EOS, PAD, batch_size=8)
    assert_same_groups(engine.generate(prompts, greedy), plain)
    assert_same_groups(engine.generate(prompts, sampled), eager_sampled)

    (ws,) = engine.workspaces.entries.values()
    length = ws.state.valid.shape[1]
    windows = [w for w in buckets(length) if w >= 16]
    assert length == 32 + 40 and windows == [16, 24, 32, 48, 64, 72]
    used = sorted({w for w, _ in seen})
    # From the widest prompt's 15 slots + 9 on (the whole cache is 72), growing with the rows.
    assert max(map(len, prompts)) == 15 and used[0] == 24 and len(used) >= 3, used
    for window, furthest in seen:
        assert furthest < window  # the slot written is inside the window
        smaller = windows[windows.index(window) - 1]
        # The next smaller window would not hold the steps until the next look.
        assert furthest + decode.SYNC_EVERY + 1 > smaller, (window, furthest)
    assert len(captures) == 3 * len(ws.graphs)  # each (rows, window) captured once
    assert {key[1] for key in ws.graphs} == set(used)


def test_with_cuda_graphs_a_cache_over_the_keep_limit_is_freed_and_captured_anew(
    tok, prompts, monkeypatch
):
    """Under CUDA graphs a workspace is kept between calls (its graphs replay on its
    addresses) only while its cache is under ``KEEP_BYTES``: a larger one is freed with the
    call, for training's use, and the next call captures anew, with the same results."""
    from dapo.rollout import buffers

    steps, _ = graph_stand_in(monkeypatch)
    model = make_model(tok, seed=0, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=40)
    kept = HFEngine(model, EOS, PAD, batch_size=8)
    want = kept.generate(prompts, params)
    captures = len(steps)
    assert captures >= 6  # 3 steps per bucket: 2 warm-up, 1 captured
    assert [g.response_ids for g in kept.generate(prompts, params)] == [
        g.response_ids for g in want
    ]
    assert len(steps) == captures  # replayed: nothing captured again
    (ws,) = kept.workspaces.entries.values()

    monkeypatch.setattr(buffers, "KEEP_BYTES", cache_bytes(ws) - 1)
    engine = HFEngine(model, EOS, PAD, batch_size=8)
    steps.clear()
    for _ in range(2):
        got = engine.generate(prompts, params)
        assert [g.response_ids for g in got] == [g.response_ids for g in want]
        assert not engine.workspaces.entries
    assert len(steps) == 2 * captures


def test_large_bf16_copies_on_cuda_are_freed_after_each_call_with_the_graphs_reading_them(
    tok, prompts, monkeypatch
):
    """Under bf16-mixed the engine reads bf16 copies of the weights. On CUDA, copies over
    ``KEEP_BYTES`` are freed after each call (training gets the memory back), and with them
    the kept workspaces, whose captured graphs read the copies: the next call makes new
    copies, captures anew and samples the same tokens. Small copies, and any on a CPU, are
    kept, and their graphs replayed."""
    from dapo.rollout import buffers, hf_engine

    limit = buffers.KEEP_BYTES
    assert hf_engine.keeps_copies(torch.device("cpu"), 100 * limit)
    assert hf_engine.keeps_copies(torch.device("cuda"), limit)
    assert not hf_engine.keeps_copies(torch.device("cuda"), limit + 1)

    steps, _ = graph_stand_in(monkeypatch)
    model = set_precision(make_model(tok, seed=0, eos_scale=8.0), "bf16-mixed")
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    keeping = HFEngine(model, EOS, PAD, batch_size=8)
    want = keeping.generate(prompts, params)
    captures = len(steps)
    keeping.generate(prompts, params)
    assert len(steps) == captures and keeping.weights.nbytes() > 0

    monkeypatch.setattr(hf_engine, "keeps_copies", lambda device, nbytes: False)  # a large model
    engine = HFEngine(model, EOS, PAD, batch_size=8)
    steps.clear()
    for _ in range(2):
        got = engine.generate(prompts, params)
        assert [g.response_ids for g in got] == [g.response_ids for g in want]
        assert engine.weights.nbytes() == 0 and not engine.workspaces.entries
    assert len(steps) == 2 * captures


def test_under_cuda_graphs_the_rows_that_fit_are_a_bucket(tok, prompts, monkeypatch):
    """With CUDA graphs (one capture per batch-size bucket) a call whose cache does not fit
    decodes on the largest bucket that does: room for 5 rows of 8 gives 4 (buckets 1, 2, 3,
    4, 6, 8), with the greedy tokens of all 8 rows."""
    from dapo.memory import Memory
    from dapo.rollout import decode

    graph_stand_in(monkeypatch)
    model = make_model(tok, seed=2, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    per_row = row_estimates(monkeypatch)
    want = HFEngine(model, EOS, PAD, batch_size=8).generate(prompts, params)
    budget = int(5.4 * per_row[-1] / decode.CACHE_SHARE)
    monkeypatch.setattr(decode, "device_memory", lambda device: Memory(budget, 2**40))
    seen = batch_sizes_seen(monkeypatch)
    engine = HFEngine(model, EOS, PAD, batch_size=8)
    assert [g.response_ids for g in engine.generate(prompts, params)] == [
        g.response_ids for g in want
    ]
    (ws,) = engine.workspaces.entries.values()
    assert ws.state.done.shape[0] == 4 and max(seen) == 4, seen
    assert sorted(key[0] for key in ws.graphs)[-1] == 4


def test_a_refill_prefills_its_prompts_in_chunks_of_bounded_tokens(tok, prompts, monkeypatch):
    """The prompts of a refill are prefilled in forwards of at most ``PREFILL_TOKENS`` padded
    tokens (a longer prompt alone), with the responses of one large prefill: the same greedy
    tokens, log-probs equal to 1e-5."""
    from dapo.rollout import decode

    model = make_model(tok, seed=2, eos_scale=8.0)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    want = HFEngine(model, EOS, PAD, batch_size=12).generate(prompts, params)

    forwards: list[tuple[int, int]] = []  # (prompts, padded width) of each prefill

    def prefills(module, args, kwargs):  # not the decode steps, which run on the RowCache
        if not isinstance(kwargs.get("past_key_values"), RowCache):
            forwards.append(tuple(kwargs["input_ids"].shape))

    model.register_forward_pre_hook(prefills, with_kwargs=True)
    monkeypatch.setattr(decode, "PREFILL_TOKENS", 24)
    got = HFEngine(model, EOS, PAD, batch_size=12).generate(prompts, params)
    assert_same_groups(got, want)
    widths = sorted(len(p) for p in prompts)
    assert len(forwards) >= 3 and sum(n for n, _ in forwards) == len(prompts), forwards
    assert all(n * w <= 24 or n == 1 for n, w in forwards), forwards
    assert max(w for _, w in forwards) == widths[-1]
