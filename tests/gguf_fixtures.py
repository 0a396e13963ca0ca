"""A small GGUF file written by the tests themselves (the ``gguf`` package's GGUFWriter).

:func:`write_tiny_gguf` writes what llama.cpp's converter writes for a Llama: the
``llama.*`` hyper-parameters, a byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``)
with ChatML special tokens and a chat template, pad == EOS like SmolLM2, and the weights
under GGUF tensor names, with q/k rows permuted the llama.cpp way and the matrices
quantised to Q4_1. It returns the transformers model whose dequantised weights the file
holds, so a test can check a conversion against it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
EOS_ID = 2
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "a n", "o n", "Ġ s", "e n"]
N_HEAD, N_KV_HEAD, HIDDEN, N_LAYER, FFN = 4, 2, 64, 2, 128


def byte_level_vocab() -> list[str]:
    """The specials, GPT-2's 256 byte symbols, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers undoes it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(path: Path, *, seed: int = 0, architecture: str = "llama") -> torch.nn.Module:
    """Write the file; return the LlamaForCausalLM holding exactly the weights it decodes to."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = byte_level_vocab()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV_HEAD,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    model = LlamaForCausalLM(config).float().eval()
    q4 = gguf.GGMLQuantizationType.Q4_1

    w = gguf.GGUFWriter(path, architecture)
    w.add_name("tiny test llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_dimension_count(HIDDEN // N_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(0)
    w.add_pad_token_id(EOS_ID)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    state = model.state_dict()
    tensors = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for i in range(N_LAYER):
        for hf, gg in names.items():
            tensors[f"blk.{i}.{gg}.weight"] = f"model.layers.{i}.{hf}.weight"
    with torch.no_grad():
        for gg_name, hf_name in tensors.items():
            t = state[hf_name].numpy()
            if t.ndim == 1 or gg_name == "token_embd.weight":  # norms and embeddings stay F32
                w.add_tensor(gg_name, t.astype(np.float32))
                continue
            heads = N_HEAD if ".attn_q." in gg_name else N_KV_HEAD if ".attn_k." in gg_name else 0
            if heads:
                t = _permute(t, heads)
            packed = gguf.quants.quantize(t, q4)
            w.add_tensor(gg_name, packed, raw_dtype=q4)
            # The model keeps the values the file decodes to, in transformers' row order.
            decoded = gguf.quants.dequantize(packed, q4)
            state[hf_name].copy_(torch.from_numpy(_unpermute(decoded, heads) if heads else decoded))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
