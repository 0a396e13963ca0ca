"""Randomly initialised Llama models for the benchmarks (shared by the bench_* scripts).

The default shape is the ``100m`` model of ``bench_engines.py``: the architecture of
``builtin:tiny`` (Llama, tied embeddings, PAD 0 and EOS 1 of the builtin character
tokenizer) at hidden 768, 12 layers, 12 heads, MLP 2048, vocabulary 32000 (~110M
parameters). Random weights rarely emit EOS, so its responses run to the length limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PAD, EOS = 0, 1  # the builtin character tokenizer's ids


def llama_config(
    *,
    vocab_size: int = 32000,
    hidden_size: int = 768,
    intermediate_size: int = 2048,
    num_hidden_layers: int = 12,
    num_attention_heads: int = 12,
    num_key_value_heads: int | None = None,
    max_position_embeddings: int = 1024,
) -> Any:
    """A ``LlamaConfig`` of the builtin family (tied embeddings, builtin PAD/EOS ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )


def random_llama(seed: int = 0, **shape: Any) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` with random weights (fp32); ``shape`` as in :func:`llama_config`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**shape)).float()


def save_random_llama(out_dir: Path, seed: int = 0, **shape: Any) -> torch.nn.Module:
    """Save a random Llama and the builtin character tokenizer to ``out_dir`` (a model
    directory ``dapo train model.name_or_path=...`` can load); returns the model."""
    from dapo.models.tiny import build_tokenizer

    model = random_llama(seed, **shape)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return model
