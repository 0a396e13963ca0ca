"""The decode step's forward for Llama-family decoders, written out as tensor operations.

A transformers decoder layer spends most of a small model's decode step in its own
machinery (mask and cache interfaces, rotary embeddings recomputed per layer, views and
dtype checks): ``builtin:tiny``'s forward for 128 rows ran ~45 operators per layer. For
one new token per row over :class:`~dapo.rollout.buffers.RowCache`, :class:`LlamaStep`
computes the same function in ~20: each layer is

    x = RMSNorm(h);  q, k, v = x W_qkv  (one product when the three are plain linear layers)
    q, k = q cos + rotate_half(q) sin, ...   (cos/sin looked up per row from one table)
    cache[row, :, slot] = k, v
    h = h + softmax(q K^T * scale + mask) V W_o
    h = h + down(act(x' W_gate) * x' W_up),  x' = RMSNorm(h)

and the logits are the model's own output layer on the final norm (its hooks and
replacements apply). A prefix that every row holds (a chat template's system prompt) is
attended through one copy (:meth:`LlamaStep.share_prefix`): its scores are one product per
head for all rows, joined to each row's own scores before the softmax. It serves Llama,
Mistral, Qwen2 and Qwen3 causal LMs (and the built-in models, GGUF-loaded ones and
LoRA-wrapped ones: an adapter's layers are called as modules) when nothing would change
their forward: no autocast, no module hooks but on the output layer. Elsewhere the step
calls the model (:func:`unsupported`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dapo.models.lora import causal_lm
from dapo.rollout.attention import SharedPrefix, cascade

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Vision-language models whose text model is a Llama (decoding is text decoding: the image
# features are in the prompt's keys and values).
VISION = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")

Linear = Callable[[torch.Tensor], torch.Tensor]


def text_model(lm: nn.Module) -> nn.Module:
    """The decoder (embeddings, layers, final norm) of a causal LM or a supported
    vision-language model."""
    return lm.model.text_model if type(lm).__name__ in VISION else lm.model


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def unsupported(model: nn.Module) -> str | None:
    """Why :class:`LlamaStep` cannot stand in for ``model``'s forward (None: it can)."""
    lm = causal_lm(model)
    name = type(lm).__name__
    if name not in SUPPORTED + VISION:
        return f"{name} is not one of {', '.join(SUPPORTED + VISION)}"
    if name in VISION and type(text_model(lm)).__name__ != "LlamaModel":
        return f"{name}'s text model is a {type(text_model(lm)).__name__}, not a LlamaModel"
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        return "autocast is on (bf16-mixed)"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "global module hooks are registered"
    head = lm.get_output_embeddings()
    for module in lm.modules():
        if module is not head and _hooked(module) and not _inside(module, head):
            return f"a {type(module).__name__} has forward hooks"
    for layer in text_model(lm).layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"{type(mlp).__name__} is not a gated MLP"
        if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"{type(attn).__name__} is not a q/k/v/o attention"
    return None


def _inside(module: nn.Module, parent: nn.Module | None) -> bool:
    return parent is not None and any(m is module for m in parent.modules())


def _rms(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Llama's RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))`` computed in float32."""
    eps = norm.variance_epsilon
    w = norm.weight

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    return apply


def _linear(*modules: nn.Module, fuse: bool) -> Linear:
    """``x -> cat([m(x) for m in modules], -1)``, as one product when every module is a
    plain ``nn.Linear`` (the weights concatenated once, here) and ``fuse``."""
    plain = all(type(m) is nn.Linear and not _hooked(m) for m in modules)
    if plain and len(modules) == 1:
        w, b = modules[0].weight, modules[0].bias
        return lambda x: F.linear(x, w, b)
    biased = {m.bias is not None for m in modules}
    if plain and fuse and len(biased) == 1:
        w = torch.cat([m.weight for m in modules])
        b = torch.cat([m.bias for m in modules]) if biased == {True} else None
        return lambda x: F.linear(x, w, b)
    return lambda x: torch.cat([m(x) for m in modules], -1)


@dataclass
class _Layer:
    norm1: Callable[[torch.Tensor], torch.Tensor]
    qkv: Linear
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    o: Linear
    norm2: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    down: Linear


class LlamaStep:
    """``model``'s logits for one new token per row, its keys and values written into a
    :class:`~dapo.rollout.buffers.RowCache`; Built once per
    engine call (``fuse``: concatenate the q/k/v and gate/up weights for that call; a
    captured CUDA graph outlives the call, so it is built with ``fuse=False`` there).
    Positions run up to ``length`` (prompt width + response limit)."""

    def __init__(self, model: nn.Module, length: int, fuse: bool = True) -> None:
        lm = causal_lm(model)
        inner = text_model(lm)
        attn = inner.layers[0].self_attn
        self.lm, self.inner = lm, inner
        self.heads = inner.config.num_attention_heads
        self.kv_heads = inner.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.group = self.heads // self.kv_heads
        self.embed = inner.embed_tokens
        emb = self.embed.weight
        dummy = torch.zeros(1, dtype=emb.dtype, device=emb.device)
        # A finished row keeps stepping (discarded) one position past its last token.
        positions = torch.arange(length + 1, device=emb.device)[None]
        cos, sin = inner.rotary_emb(dummy, positions)
        cos, sin = cos[0], sin[0]  # [length, head_dim]
        if cos.shape[-1] != self.head_dim:
            raise ValueError("partial rotary embeddings are not supported by LlamaStep")
        half = self.head_dim // 2
        self.cos = cos
        # rotate_half(x) * sin == x.roll(half) * [-sin_1, sin_2]: one roll, no cat or neg.
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)
        self.half = half
        self.layers = [
            _Layer(
                norm1=_rms(layer.input_layernorm),
                qkv=_linear(layer.self_attn.q_proj, layer.self_attn.k_proj,
                            layer.self_attn.v_proj, fuse=fuse),
                q_norm=_rms(layer.self_attn.q_norm) if hasattr(layer.self_attn, "q_norm") else None,
                k_norm=_rms(layer.self_attn.k_norm) if hasattr(layer.self_attn, "k_norm") else None,
                o=_linear(layer.self_attn.o_proj, fuse=fuse),
                norm2=_rms(layer.post_attention_layernorm),
                gate_up=_linear(layer.mlp.gate_proj, layer.mlp.up_proj, fuse=fuse),
                act=layer.mlp.act_fn,
                down=_linear(layer.mlp.down_proj, fuse=fuse),
            )
            for layer in inner.layers
        ]  # fmt: skip
        self.final_norm = _rms(inner.norm)
        self.head = lm.get_output_embeddings()
        self.prefix: SharedPrefix | None = None

    def share_prefix(self, prefix: SharedPrefix | None) -> None:
        """Attend to a prefix every row holds (slots ``0..c-1`` of every row: a chat
        template's system prompt) through its one copy (:func:`~dapo.rollout.attention.cascade`):
        from :data:`~dapo.rollout.attention.CASCADE_MIN_ROW_SLOTS` on, the rows' copies of
        it are not read. None: every row reads its own."""
        self.prefix = prefix

    def __call__(
        self, tok: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, cache: object
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for tokens ``tok`` at positions ``pos``; ``valid [rows,
        window]`` says which slots each row attends to (the cache's views are ``window``
        long and hold each row's new key at ``cache.slot``)."""
        rows, window = valid.shape
        hq, hkv, d, g = self.heads, self.kv_heads, self.head_dim, self.group
        c = self.prefix.width(rows) if self.prefix is not None else 0
        h = self.embed(tok)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        bias = torch.zeros((rows, window - c), dtype=torch.float32, device=valid.device)
        bias.masked_fill_(~valid[:, c:], -math.inf)
        bias = bias[:, None, None].expand(rows, hkv, g, window - c).reshape(rows * hkv, g, -1)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.norm1(h)).view(rows, hq + 2 * hkv, d)
            v = qkv[:, hq + hkv :]
            if layer.q_norm is None:
                qk = qkv[:, : hq + hkv]
            else:
                qk = torch.cat([layer.q_norm(qkv[:, :hq]), layer.k_norm(qkv[:, hq : hq + hkv])], 1)
            qk = torch.addcmul(qk * cos, qk.roll(self.half, -1), sin)
            keys, values = cache.update(qk[:, hq:, None], v[:, :, None], i)
            # [rows * kv_heads, head_dim, window - c]: a view when the cache stores the keys
            # slots-last (the product's fast operand layout, ~2x on a CPU), else strided.
            keys_t = keys[:, :, c:].transpose(2, 3).reshape(rows * hkv, d, window - c)
            values = values[:, :, c:].reshape(rows * hkv, window - c, d)
            q = qk[:, :hq].reshape(rows * hkv, g, d)
            if q.dtype == torch.float32 and keys.dtype == torch.float32:
                scores = torch.baddbmm(bias, q, keys_t, alpha=self.scale)
            else:  # scores in float32, as the transformers path computes them
                scores = torch.bmm(q, keys_t.to(q.dtype)).float()
                scores = scores.mul_(self.scale).add_(bias)
            if c:
                pk, pv = self.prefix.keys[i], self.prefix.values[i]
                out = cascade(q, scores, values, pk, pv, self.scale)
            else:
                probs = torch.softmax(scores, -1).to(values.dtype)
                out = torch.bmm(probs, values)
            h = h + layer.o(out.view(rows, hq * d).to(h.dtype))
            gate, up = layer.gate_up(layer.norm2(h)).chunk(2, -1)
            h = h + layer.down(layer.act(gate) * up)
        # [rows, 1, hidden] as the model gives it, for hooks on the output layer.
        return self.head(self.final_norm(h)[:, None])[:, 0]
