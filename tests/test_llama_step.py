"""Tests for ``dapo.rollout.llama_step``: the decode step's forward written out for
Llama-family models, against the model's own forward.

The reference is transformers' forward over each row's whole unpadded sequence (no cache):
for a random cache state (rows at different lengths, written through the same step), the
next-token logits must agree to 1e-5 (float32), for every supported architecture and
variant (grouped heads, biases, per-head norms, tied or untied output layer, a LoRA adapter).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dapo.rollout.buffers import RowCache
from dapo.rollout.llama_step import LlamaStep, unsupported

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(
    vocab_size=61,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def llama(**kw):
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "tie_word_embeddings": True, **kw}))


MODELS = {
    "llama": llama,
    "llama-mha-untied-bias": lambda: llama(
        num_key_value_heads=6, tie_word_embeddings=False, attention_bias=True, mlp_bias=True
    ),
    "llama-rope-scaled": lambda: llama(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),  # q/k/v biases
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),  # q/k norms
}


def step_against_full_forward(model, fuse: bool = True, keys_last: bool = False) -> None:
    """Three rows of different lengths decode 5 tokens through LlamaStep; after each, its
    logits equal the model's forward over the row's whole sequence. ``keys_last``: the keys
    are stored ``[rows, heads, head_dim, length]`` (the engine's layout for LlamaStep)."""
    torch.manual_seed(0)
    cfg = model.config
    rows, length, steps = 3, 24, 5
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head_dim = lm.model.layers[0].self_attn.head_dim
    starts = [7, 3, 11]  # each row's sequence so far
    seqs = [torch.randint(2, cfg.vocab_size, (n,)).tolist() for n in starts]
    shape = (rows, cfg.num_key_value_heads, length, head_dim)
    if keys_last:
        stored = (rows, cfg.num_key_value_heads, head_dim, length)
        keys = [torch.zeros(stored).transpose(2, 3) for _ in range(cfg.num_hidden_layers)]
    else:
        keys = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    values = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
    slot = torch.zeros(rows, dtype=torch.long)
    valid = torch.zeros(rows, length, dtype=torch.bool)
    valid[:, 0] = True
    cache = RowCache(keys, values, slot)
    step = LlamaStep(model, length, fuse=fuse)
    with torch.no_grad():
        # Fill each row's cache token by token (row r's slots 0..n-1), then check 5 more.
        for t in range(max(starts) + steps):
            tok = torch.tensor([s[min(t, len(s) - 1)] for s in seqs])
            pos = torch.tensor([min(t, len(s) - 1) for s in seqs])
            slot.copy_(pos)
            valid[torch.arange(rows), slot] = True
            logits = step(tok, pos, valid, cache)
            for r, s in enumerate(seqs):
                if t == len(s) - 1:  # the row's last token: compare, then extend the row
                    want = model(input_ids=torch.tensor([s])).logits[0, -1]
                    torch.testing.assert_close(logits[r], want, atol=1e-5, rtol=0)
                    if len(s) < starts[r] + steps:
                        s.append(int(logits[r].argmax()))


@pytest.mark.parametrize("keys_last", [False, True], ids=["slots-major", "keys-last"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_step_gives_the_models_logits(name, keys_last):
    model = MODELS[name]().eval()
    assert unsupported(model) is None
    step_against_full_forward(model, keys_last=keys_last)


def test_unfused_and_lora_wrapped_policies_give_the_same_logits():
    from peft import LoraConfig, get_peft_model

    model = llama().eval()
    step_against_full_forward(model, fuse=False)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    wrapped = get_peft_model(llama(), cfg).eval()
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:  # a non-zero adapter, so that it changes the logits
            torch.nn.init.normal_(p, std=0.5)
    assert unsupported(wrapped) is None
    step_against_full_forward(wrapped)


def test_models_it_cannot_stand_in_for_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50))
    assert "GPT2LMHeadModel is not one of" in unsupported(gpt2)
    model = llama()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert unsupported(model) == "a LlamaMLP has forward hooks"
    handle.remove()
    model.lm_head.register_forward_hook(lambda *a: None)  # the output layer is still called
    assert unsupported(model) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert unsupported(model) == "autocast is on (bf16-mixed)"


@pytest.mark.parametrize("name", ["llama", "llama-mha-untied-bias", "qwen3"])
def test_a_shared_prefix_is_attended_through_its_one_copy(name, monkeypatch):
    """Five rows that share their first 6 tokens, then run on with their own: once the
    prefix's keys and values are handed over (as a prefill's cache holds them), the rows'
    own copies of those slots are wiped and every row's logits still equal the model's
    forward over its whole sequence, to 1e-5; below ``CASCADE_MIN_ROW_SLOTS`` the step reads
    the rows' copies again."""
    from transformers import DynamicCache

    from dapo.rollout import attention, llama_step

    torch.manual_seed(0)
    model = MODELS[name]().eval()
    cfg = model.config
    c, rows, length = 6, 5, 20
    d = model.model.layers[0].self_attn.head_dim
    prefix = torch.randint(2, cfg.vocab_size, (c,)).tolist()
    seqs = [prefix + torch.randint(2, cfg.vocab_size, (1 + r,)).tolist() for r in range(rows)]
    layers = cfg.num_hidden_layers
    stored = (rows, cfg.num_key_value_heads, d, length)
    keys = [torch.zeros(stored).transpose(2, 3) for _ in range(layers)]
    values = [torch.zeros(rows, cfg.num_key_value_heads, length, d) for _ in range(layers)]
    slot = torch.zeros(rows, dtype=torch.long)
    valid = torch.zeros(rows, length, dtype=torch.bool)
    cache = RowCache(keys, values, slot)
    step = LlamaStep(model, length)
    monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", rows * c)
    cascades = []
    real = llama_step.cascade
    monkeypatch.setattr(llama_step, "cascade", lambda *a: cascades.append(1) or real(*a))
    with torch.no_grad():
        head = DynamicCache()
        model(input_ids=torch.tensor([prefix]), past_key_values=head, use_cache=True)
        for i, layer in enumerate(head.layers):  # every row's slots 0..c-1: the prefix
            keys[i][:, :, :c] = layer.keys
            values[i][:, :, :c] = layer.values
        valid[:, :c] = True
        kv = [(layer.keys, layer.values) for layer in head.layers]
        step.share_prefix(attention.SharedPrefix.from_cache(kv))
        for i in range(layers):  # the rows' copies: never read from here on
            keys[i][:, :, :c] = float("nan")
            values[i][:, :, :c] = float("nan")
        for t in range(c, c + 4):
            tok = torch.tensor([s[t] for s in seqs])
            slot.fill_(t)
            valid[:, t] = True
            logits = step(tok, torch.full((rows,), t), valid, cache)
            assert cascades, "the step did not take the shared copy"
            for r, s in enumerate(seqs):
                want = model(input_ids=torch.tensor([s[: t + 1]])).logits[0, -1]
                torch.testing.assert_close(logits[r], want, atol=1e-5, rtol=0)
            for r, s in enumerate(seqs):
                if len(s) == t + 1:  # the row's given tokens are used up: greedy from here
                    s.append(int(logits[r].argmax()))
        monkeypatch.setattr(attention, "CASCADE_MIN_ROW_SLOTS", rows * c + 1)
        assert torch.isnan(step(tok, torch.full((rows,), t), valid, cache)).all()
