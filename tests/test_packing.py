"""Packed training forwards: the same log-probs, entropies and gradients as unpacked, and the
two negative controls (no position resets, no per-sequence attention) that must fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from learner_utils import backward  # tests/learner_utils.py

from dapo.algorithms import LossSettings
from dapo.errors import ConfigError
from dapo.models import packing
from dapo.models.activation_checkpointing import checkpoint_layers
from dapo.training import forward
from dapo.training.batch import Sample
from dapo.training.forward import response_logits, response_states, token_logprobs
from dapo.training.microbatch import collate, micro_batches
from dapo.training.packed import pack, packed_states

VOCAB = 97


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    """A random two-layer Llama or Qwen2 (grouped-query attention, Qwen2's q/k/v biases)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, config = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[family]
    torch.manual_seed(seed)
    cfg = config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # sharper attention than the default 0.02: positions matter
        attn_implementation="sdpa",
    )
    return cls(cfg).float().eval()


def samples(seed: int = 1) -> list[Sample]:
    """Three prompts of different lengths with four responses each, among them a one-token
    response (only the prompt pass predicts it) and lengths from 1 to 11; plus one prompt
    with a single response."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    out = []
    for p, lengths in ((5, (1, 4, 11, 2)), (9, (7, 3, 3, 9)), (7, (2, 11, 5, 1)), (4, (6,))):
        prompt = rnd(p)
        for r in lengths:
            response = rnd(r)
            out.append(Sample(prompt, response, float(torch.randn(1, generator=gen)), [1.0] * r))
    return out


def logprobs(model, batch, *, packed: bool, shared_prompt: bool = True, chunk: int = 1024):
    states = response_states(model, batch, shared_prompt=shared_prompt, packed=packed)
    return token_logprobs(model, states, batch, temperature=0.7, chunk_size=chunk)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shared_prompt", [True, False])
def test_packed_logprobs_and_entropies_equal_the_unpacked_ones(family, shared_prompt) -> None:
    model = tiny(family)
    assert packing.choose("auto", model, whole_rows=True)[0]
    batch = collate(samples(), 0)
    with torch.no_grad():
        ref_lp, ref_ent = logprobs(model, batch, packed=False)
        lp, ent = logprobs(model, batch, packed=True, shared_prompt=shared_prompt, chunk=5)
    valid = batch.response_mask > 0
    assert float((lp - ref_lp).abs().max()) <= 1e-5
    assert float((ent - ref_ent).abs().max()) <= 1e-5
    assert float(ref_lp[valid].std()) > 0.1 and (lp[~valid] == 0).all()
    # The whole-logits reference agrees too (scattered back to [b, R, V]).
    full = response_logits(model, batch, temperature=0.7, packed=True)
    unpacked = response_logits(model, batch, temperature=0.7)
    assert full.shape == unpacked.shape
    assert float((full[valid] - unpacked[valid]).abs().max()) <= 1e-5


def test_the_packed_row_holds_each_prompt_once_and_no_padding() -> None:
    batch = collate(samples(), 0)
    row = pack(batch)
    prompts = 5 + 9 + 7 + 4
    inputs = sum(max(len(r) - 1, 0) for r in (s.response_ids for s in samples()))
    assert row.input_ids.shape == (1, prompts + inputs)
    assert row.gather.numel() == int((batch.response_mask > 0).sum())
    # positions restart at every prompt and continue from its length for its responses
    pos = row.position_ids[0].tolist()
    assert pos.count(0) == 4 and pos[:5] == [0, 1, 2, 3, 4]
    unshared = pack(batch, shared_prompt=False)
    assert unshared.input_ids.shape[1] == prompts + 3 * 5 + 3 * 9 + 3 * 7 + inputs


def _gap(model, batch, row) -> float:
    ref, _ = logprobs(model, batch, packed=False)
    with torch.no_grad():
        logits = packed_states(model, row).float() / 0.7  # [N, V] at the response tokens
    valid = batch.response_mask > 0
    lp = logits.log_softmax(-1).gather(-1, batch.response_ids[valid][:, None])[:, 0]
    return float((lp - ref[valid]).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packing_without_position_resets_or_without_per_sequence_attention_fails(family) -> None:
    """The negative controls: each separation removed alone changes the log-probs."""
    model = tiny(family)
    packing.install(model)
    batch = collate(samples(), 0)
    row = pack(batch)
    assert _gap(model, batch, row) <= 1e-5
    no_resets = dataclasses.replace(row, position_ids=torch.arange(row.input_ids.shape[1])[None])
    assert _gap(model, batch, no_resets) > 1e-2
    one_sequence = dataclasses.replace(row, layout=packing.whole_row(row.input_ids.shape[1]))
    assert _gap(model, batch, one_sequence) > 1e-2


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("budget", [10_000, 25])
def test_a_packed_optimizer_step_has_the_unpacked_gradient(budget: int, monkeypatch) -> None:
    """The exact token-mean over micro-batches: packed micro-batches of a token budget (25:
    several, groups split) give the gradient of one unpacked pass, with activation
    checkpointing on the packed side."""
    settings = LossSettings(loss_agg="token-mean", temperature=0.7)
    batch = samples()
    chunks = micro_batches(batch, budget, packed=True)
    assert sorted(i for c in chunks for i in c) == list(range(len(batch)))
    if budget == 25:
        assert len(chunks) > 3
    reference = tiny("llama").train()
    backward(reference, batch, settings, token_budget=10_000)
    model = tiny("llama").train()
    assert checkpoint_layers(model) == 2
    rows, real = [], forward.packed_states
    monkeypatch.setattr(forward, "packed_states", lambda m, r, *a: rows.append(r) or real(m, r, *a))
    result = backward(model, batch, settings, token_budget=budget, packed=True)
    assert result.applied and len(rows) == len(chunks)
    want, got = _grads(reference), _grads(model)
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3


def test_packed_micro_batches_respect_the_token_budget_and_keep_groups() -> None:
    batch = samples()
    for budget in (12, 30, 60, 10_000):
        chunks = micro_batches(batch, budget, packed=True)
        assert sorted(i for c in chunks for i in c) == list(range(len(batch)))
        for c in chunks:
            prompts = {tuple(batch[i].prompt_ids) for i in c}
            tokens = sum(len(p) for p in prompts) + sum(len(batch[i].response_ids) for i in c)
            assert tokens <= budget or len(c) == 1
    whole = micro_batches(batch, 10_000, packed=True)
    assert len(whole) == 1


def test_packed_lora_logprobs_equal_the_unpacked_ones() -> None:
    from dapo.config import LoraConfig
    from dapo.models.lora import apply_lora

    model = tiny("qwen2")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    assert packing.choose(True, model, whole_rows=False)[0]
    batch = collate(samples(), 0)
    ref, _ = logprobs(model, batch, packed=False)
    lp, _ = logprobs(model, batch, packed=True)
    assert float((lp - ref).abs().max()) <= 1e-5


def _from_config(kind: str, **kw) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, **kw)
    return transformers.AutoModelForCausalLM.from_config(config)


def gated_delta_net() -> torch.nn.Module:
    return _from_config(
        "qwen3_next",
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=1,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
    )


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (gated_delta_net, "GatedDeltaNet"),
        (lambda: _from_config("mamba", num_hidden_layers=2, state_size=4), "state-space"),
        (
            lambda: _from_config(
                "lfm2",
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                layer_types=["conv", "full_attention"],
            ),
            "ShortConv",
        ),
    ],
    ids=["qwen3-next", "mamba", "lfm2"],
)
def test_models_that_mix_positions_outside_attention_are_not_packed(build, reason) -> None:
    model = build()
    packed, line = packing.choose("auto", model, whole_rows=True)
    assert not packed and "unpacked" in line and reason in line
    assert model.config._attn_implementation != packing.NAME  # left as it was
    with pytest.raises(ConfigError, match=rf"train.packing=true.*{reason}.*Fix: train.packing"):
        packing.choose(True, model, whole_rows=True)


def test_sliding_windows_and_other_attention_are_not_packed() -> None:
    model = tiny("qwen2")
    model.config.use_sliding_window, model.config.sliding_window = True, 8
    assert "sliding-window" in packing.choose("auto", model, whole_rows=True)[1]
    eager = tiny("llama")
    eager.config._attn_implementation = "eager"
    assert "'eager'" in packing.choose("auto", eager, whole_rows=True)[1]
    assert packing.choose(False, tiny("llama"), whole_rows=True) == (
        False,
        "train.packing=false: micro-batches padded per group of similar length",
    )


def test_auto_packs_where_the_unpacked_forward_would_pad_whole_rows() -> None:
    """FSDP, train.shared_prompt_forward=false or no prompt cache pad every row to the
    micro-batch's longest: auto packs there; elsewhere the length buckets stay."""
    model = tiny("llama")
    packed, line = packing.choose("auto", model, whole_rows=False)
    assert not packed and "length buckets" in line
    assert model.config._attn_implementation == "sdpa"  # not installed
    assert packing.choose(True, model, whole_rows=False)[0]  # true packs anyway
    assert model.config._attn_implementation == packing.NAME


def test_the_learner_decides_at_start_up_and_says_why(tmp_path) -> None:
    from dapo.config import load_config
    from dapo.training.learner import Learner

    def start(*overrides: str) -> tuple[Learner, list[str]]:
        lines: list[str] = []
        cfg = load_config(None, overrides=["model.name_or_path=x", *overrides])
        return Learner.from_config(cfg, "x", 0, lines.append, model=tiny("qwen2")), lines

    learner, lines = start()
    assert not learner.forward.packed and any("train.packing=auto: unpacked" in x for x in lines)
    learner, lines = start("train.shared_prompt_forward=false")
    assert learner.forward.packed and any("train.packing=auto: packed" in x for x in lines)
    learner, lines = start("train.packing=true", "algorithm.beta=0.1")
    assert learner.forward.packed and learner.ref_model is not None
    assert learner.ref_model.config._attn_implementation == packing.NAME  # the reference too
    with pytest.raises(ConfigError, match="train.packing=true"):
        lines.clear()
        cfg = load_config(None, overrides=["model.name_or_path=x", "train.packing=true"])
        Learner.from_config(cfg, "x", 0, lines.append, model=gated_delta_net())


def test_an_installed_model_attends_as_before_without_a_layout() -> None:
    """Generation and unpacked passes are transformers' SDPA: the same logits."""
    model, plain = tiny("llama"), tiny("llama")
    packing.install(model)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = plain(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)


def test_config_accepts_auto_true_and_false() -> None:
    from dapo.config import load_config

    assert load_config(None).train.packing == "auto"
    assert load_config(None, overrides=["train.packing=true"]).train.packing is True
    assert load_config(None, overrides=["train.packing=false"]).train.packing is False
    with pytest.raises(ConfigError, match="train.packing"):
        load_config(None, overrides=["train.packing=sometimes"])


def test_varlen_inputs_list_each_segment_s_prefix_then_itself() -> None:
    """What the CUDA path hands ``varlen_attn`` (built on the CPU here): per segment its keys
    (the prompt's, then its own), cumulative lengths, and one build per forward."""
    layout = pack(collate(samples(), 0)).layout
    index, cu_q, cu_k, max_q, max_k = layout.varlen_inputs(torch.device("cpu"))
    want: list[int] = []
    for s in layout.segments:
        want += [*range(*s.prefix)] if s.prefix else []
        want += range(s.start, s.end)
    assert index.tolist() == want
    assert cu_q.tolist()[-1] == layout.length and cu_k.tolist()[-1] == len(want)
    assert max_q == max(s.end - s.start for s in layout.segments)
    assert max_k == max(s.keys for s in layout.segments) > max_q  # a prefix was counted
    assert layout.varlen_inputs(torch.device("cpu"))[0] is index
