"""Attention while generating: one new token per row against the rows' cache, and a prefix
every row holds attended through its one copy.

With a chat template, every row of the decode cache starts with the same prefix (a system
prompt, few-shot turns: 139 of ~160 slots in ``make train-real``). Split the keys into the
shared prefix ``P`` (``c`` slots, one copy) and the row's own slots ``R``; the attention of a
row's query ``q`` is the same function computed over both parts with one softmax,

    s = [q P_k^T, q R_k^T] * scale + mask,   p = softmax(s),
    out = p[:c] P_v + p[c:] R_v,

where the prefix scores of all rows are one product per key/value head (every row's queries
against the one copy) instead of one small product per row over its own copy. Used by both
decode steps: :class:`~dapo.rollout.llama_step.LlamaStep` and, for the models' own forward,
:func:`decode_attention`, once rows x prefix reaches :data:`CASCADE_MIN_ROW_SLOTS`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CASCADE_MIN_ROW_SLOTS",
    "SharedPrefix",
    "cascade",
    "decode_attention",
    "generation_attention",
    "sharing",
]

# The prefix every row holds is attended through its one copy when rows x prefix length
# reaches this; below, each row reads its own copy (a few operators a layer fewer). Measured
# on 2 AMD EPYC cores at a 139-token prefix in float32: the break-even is at ~28 rows for
# builtin:tiny, ~12 for SmolLM2-135M; at 128 rows a step is 1.32x and 1.10x faster.
CASCADE_MIN_ROW_SLOTS = 4096


@dataclass(frozen=True)
class SharedPrefix:
    """The keys ``[kv_heads, head_dim, c]`` and values ``[kv_heads, c, head_dim]`` of each
    layer for a prefix that every row holds in its slots ``0..c-1``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def from_cache(
        cls, kv: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> SharedPrefix:
        """From a one-row prefill's cache (per layer ``[1, kv_heads, c, head_dim]`` keys and
        values), stored in ``dtype`` (that of the rows' cache) where given."""
        keys = [k[0].transpose(1, 2).to(dtype or k.dtype).contiguous() for k, _ in kv]
        values = [v[0].to(dtype or v.dtype).contiguous() for _, v in kv]
        return cls(keys, values)

    @property
    def length(self) -> int:
        return self.keys[0].shape[-1] if self.keys else 0

    def width(self, rows: int) -> int:
        """The slots a step over ``rows`` rows reads from the one copy (0: the rows' own)."""
        c = self.length
        return c if rows * c >= CASCADE_MIN_ROW_SLOTS else 0


def cascade(
    q: torch.Tensor,
    own: torch.Tensor,
    values: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over a shared prefix's one copy and each row's own slots, one softmax over
    both: ``q [rows * kv_heads, group, d]``; ``own [rows * kv_heads, group, n]`` the float32
    scores against the row's own slots, scaled and masked; ``values [rows * kv_heads, n, d]``
    those slots' values; ``prefix_keys [kv_heads, d, c]`` and ``prefix_values [kv_heads, c,
    d]``. Returns ``[rows, kv_heads, group, d]`` in ``values``' dtype."""
    hkv, d, c = prefix_keys.shape
    rows, g = q.shape[0] // hkv, q.shape[1]
    # Per head, every row's queries against the prefix in one product.
    by_head = q.view(rows, hkv, g, d).transpose(0, 1).reshape(hkv, rows * g, d)
    pre = torch.bmm(by_head.to(prefix_keys.dtype), prefix_keys).float().mul_(scale)
    pre = pre.view(hkv, rows, g, c).transpose(0, 1).reshape(rows * hkv, g, c)
    probs = torch.softmax(torch.cat([pre, own], -1), -1)
    out = torch.bmm(probs[..., c:].to(values.dtype), values)
    p = probs[..., :c].reshape(rows, hkv, g, c).transpose(0, 1).reshape(hkv, rows * g, c)
    out_pre = torch.bmm(p.to(prefix_values.dtype), prefix_values)
    out = out.view(rows, hkv, g, d) + out_pre.view(hkv, rows, g, d).transpose(0, 1)
    return out.to(values.dtype)


# The prefix the model's own decode attention may read through its one copy: set by the
# decoder for the call it runs (per thread: a streaming producer decodes in its own).
_SHARED: ContextVar[SharedPrefix | None] = ContextVar("dapo_shared_prefix", default=None)


@contextlib.contextmanager
def sharing(prefix: SharedPrefix | None) -> Iterator[None]:
    """Inside, :func:`decode_attention` attends to ``prefix`` (held in slots ``0..c-1`` of
    every row of the cache it is given) through its one copy."""
    token = _SHARED.set(prefix)
    try:
        yield
    finally:
        _SHARED.reset(token)


def shared() -> SharedPrefix | None:
    """The prefix set by :func:`sharing` (None outside)."""
    return _SHARED.get()


_ATTENTION = "dapo_generate"


def decode_attention(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention while generating; ``query [B, Hq, Q, D]``, ``key``/``value [B, Hkv, L, D]``.

    Decoding (``Q == 1`` with a boolean mask over the cache's slots): ``softmax(q k^T * scale)
    v`` with the query heads grouped by their key/value head (``[B, Hkv, Hq/Hkv, D]``), the
    scores in float32; inside :func:`sharing`, the shared prefix through its one copy
    (:func:`cascade`). Prompts: SDPA with ``enable_gqa``. Anything else (a position bias,
    attention sinks) goes to transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    if q_len == 1 and attention_mask is not None and attention_mask.dtype == torch.bool:
        prefix, layer = shared(), getattr(module, "layer_idx", None)
        c = prefix.width(batch) if prefix is not None and layer is not None else 0
        if c:
            key, value, attention_mask = key[:, :, c:], value[:, :, c:], attention_mask[..., c:]
        q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        if key.device.type == "cpu" and key.dtype != torch.float32:
            # A CPU bf16 product copies a transposed operand: the keys go in as stored, the
            # query transposed (SmolLM2's score product 2.3x faster, the same numbers).
            scores = torch.matmul(key, q.transpose(-1, -2)).transpose(-1, -2)
        else:
            scores = torch.matmul(q, key.transpose(-1, -2))
        scores = scores.float() * scale  # [B, Hkv, G, L]
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        if c:
            n, g = key.shape[2], heads // kv_heads
            out = cascade(
                q.reshape(batch * kv_heads, g, dim),
                scores.view(batch * kv_heads, g, n),
                value.reshape(batch * kv_heads, n, dim),
                prefix.keys[layer],
                prefix.values[layer],
                scale,
            )
        else:
            probs = torch.softmax(scores, -1).to(value.dtype)
            out = torch.matmul(probs, value)  # [B, Hkv, G, D]
        return out.reshape(batch, 1, heads, dim), None
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(q_len > 1 and attention_mask is None and causal),
        enable_gqa=kv_heads != heads,
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def generation_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ``model`` (a transformers model) attends with :func:`decode_attention` and
    builds boolean masks for its prompts, whatever attention it trains with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if config is None or before is None:
        yield
        return
    AttentionInterface.register(_ATTENTION, decode_attention)
    AttentionMaskInterface.register(_ATTENTION, sdpa_mask)
    config._attn_implementation = _ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
