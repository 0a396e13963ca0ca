"""Packed sequences: many sequences in one row without padding, each attending only to itself.

A packed row holds the sequences of a micro-batch one after the other. Two things keep them
apart, and both are needed (a test removes each and sees the log-probs change):

- **positions** restart at each sequence (the caller's ``position_ids``), so rotary
  embeddings see each sequence from 0 (a response after its shared prompt continues from the
  prompt's length);
- **attention** is computed per :class:`Segment`: a segment's queries see its own keys
  causally and, for a response whose prompt sits earlier in the row, that prompt's keys
  (the prompt is forwarded once for all its responses, as in the unpacked shared-prompt path).

The attention is :func:`packed_attention`, installed in a transformers model by
:func:`install` under the name :data:`NAME`; the segments travel as a keyword argument of the
model's forward (``packed_layout=``), which transformers passes to every attention call and
activation checkpointing passes again when it recomputes a layer. Calls without it are
transformers' SDPA attention, unchanged. On a CPU each segment is one
``scaled_dot_product_attention`` (memory linear in the segment's length, no ``[T x T]`` mask);
on CUDA in bf16/fp16 all segments are one ``varlen_attn`` call.

Layers that mix positions outside attention (linear attention, gated delta nets, causal
convolutions, state-space layers) would carry one sequence into the next through their
recurrent state: :func:`unpackable` names them, and such models are not packed.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo.errors import ConfigError

NAME = "dapo_packed"
LAYOUT_KEY = "packed_layout"

# Modules (by class name) whose output at a position depends on earlier positions other than
# through attention: a packed row would carry one sequence's state into the next.
_MIXING = (
    "GatedDeltaNet",
    "LinearAttention",
    "Mamba",
    "ShortConv",
    "CausalConv",
    "RecurrentBlock",
    "RG_LRU",
    "Rwkv",
    "SSM",
)
# Model types whose attention or mask is not plain causal full attention over a row.
_MODEL_TYPES_REFUSED = {
    "mamba": "state-space layers",
    "mamba2": "state-space layers",
    "falcon_mamba": "state-space layers",
    "rwkv": "recurrent (RWKV) layers",
    "recurrent_gemma": "recurrent (RG-LRU) layers",
}


@dataclass(frozen=True)
class Segment:
    """Queries ``[start, end)`` of the row, attending causally to themselves and, in full, to
    the keys ``prefix`` (``(a, b)``: a prompt placed earlier in the row) if given."""

    start: int
    end: int
    prefix: tuple[int, int] | None = None

    @property
    def keys(self) -> int:
        own = self.end - self.start
        return own + (self.prefix[1] - self.prefix[0] if self.prefix else 0)


@dataclass(frozen=True)
class Layout:
    """The segments of one packed row, in order, covering it exactly."""

    segments: tuple[Segment, ...]
    # what every layer of one forward reads: the masks, varlen_attn's indices (built once)
    _cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @functools.cached_property
    def cuts(self) -> list[int]:
        """Every boundary of a segment or a prefix, sorted: the row is split there once, so
        that backward joins the pieces' gradients in one ``cat`` (slicing each segment out
        would add a zero-filled row-sized gradient per segment)."""
        bounds = {0, self.length}
        for s in self.segments:
            bounds |= {s.start, s.end, *(s.prefix or ())}
        return sorted(bounds)

    def pieces(self, start: int, end: int) -> list[int]:
        """The indices of the pieces between :attr:`cuts` that make up ``[start, end)``."""
        return list(range(self._cut_index[start], self._cut_index[end]))

    @functools.cached_property
    def _cut_index(self) -> dict[int, int]:
        return {c: i for i, c in enumerate(self.cuts)}

    def mask(self, i: int, device: torch.device) -> torch.Tensor:
        """Segment ``i``'s boolean mask ``[own, prefix + own]``: all of the prefix, causal on
        itself (built once per forward and shared by the layers)."""
        seg = self.segments[i]
        if i not in self._cache:
            assert seg.prefix is not None
            own, pre = seg.end - seg.start, seg.prefix[1] - seg.prefix[0]
            m = torch.ones(own, pre + own, dtype=torch.bool, device=device)
            m[:, pre:] = torch.ones(own, own, dtype=torch.bool, device=device).tril()
            self._cache[i] = m
        return self._cache[i]

    def varlen_inputs(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """``varlen_attn``'s view of the row: the key positions of each segment (its prefix,
        then itself) in one index, the cumulative query and key lengths, and their maxima
        (built once per forward and shared by the layers)."""
        if "varlen" not in self._cache:
            empty = torch.empty(0, dtype=torch.long, device=device)
            key_index = torch.cat(
                [
                    torch.cat(
                        [
                            torch.arange(*s.prefix, device=device) if s.prefix else empty,
                            torch.arange(s.start, s.end, device=device),
                        ]
                    )
                    for s in self.segments
                ]
            )
            lengths_q = [s.end - s.start for s in self.segments]
            lengths_k = [s.keys for s in self.segments]
            self._cache["varlen"] = (
                key_index,
                _cumulative(lengths_q, device),
                _cumulative(lengths_k, device),
                max(lengths_q),
                max(lengths_k),
            )
        return self._cache["varlen"]


def whole_row(length: int) -> Layout:
    """One causal segment over the whole row: no separation (the negative control's layout)."""
    return Layout((Segment(0, length),))


def unpackable(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be packed exactly, or None: layers that mix positions outside
    attention, attention that is not full causal attention over a row (sliding windows,
    attention sinks, soft-capped scores), or an attention implementation other than SDPA."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return "not a transformers model (its attention cannot be replaced)"
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model (its image features go in an unpacked prompt pass)"
    text = config.get_text_config(decoder=True)
    kind = getattr(text, "model_type", "")
    if kind in _MODEL_TYPES_REFUSED:
        return f"model type {kind!r} has {_MODEL_TYPES_REFUSED[kind]}"
    mixing = sorted(
        {type(m).__name__ for m in model.modules() if any(n in type(m).__name__ for n in _MIXING)}
    )
    if mixing:
        return (
            f"{', '.join(mixing)} layers mix positions outside attention (their state would run "
            "from one packed sequence into the next; dapo does not pass sequence boundaries to "
            "their kernels)"
        )
    layer_types = set(getattr(text, "layer_types", None) or [])
    if layer_types - {"full_attention"}:
        return f"layer types {sorted(layer_types - {'full_attention'})} are not full attention"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return f"sliding-window attention (window {text.sliding_window})"
    if getattr(text, "attn_logit_softcapping", None):
        return "soft-capped attention scores"
    if any(hasattr(m, "sinks") for m in model.modules()):
        return "attention sinks"
    impl = config._attn_implementation
    if impl not in ("sdpa", NAME):
        return f"attention implementation {impl!r} (packing replaces sdpa)"
    return None


def install(model: torch.nn.Module) -> None:
    """Make ``model`` attend with :func:`packed_attention` (transformers' SDPA for calls without
    a layout, so generation and unpacked forwards are unchanged)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = NAME


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed row (``query`` ``[1, heads, T, dim]``) segment by segment when the
    forward carries a :class:`Layout`; transformers' SDPA attention otherwise."""
    layout: Layout | None = kwargs.pop(LAYOUT_KEY, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or query.shape[2] != layout.length:
        raise ValueError(
            f"a packed layout of {layout.length} positions for queries of shape "
            f"{tuple(query.shape)}: a packed forward is one row of exactly its layout"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention does not apply sliding windows (see unpackable)")
    gqa = key.shape[1] != query.shape[1]
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen() is not None:
        return _varlen_attention(query, key, value, layout, scaling, gqa), None
    cuts = layout.cuts
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    qs, ks, vs = (t.split(sizes, 2) for t in (query, key, value))

    def joined(parts: Sequence[torch.Tensor], index: list[int]) -> torch.Tensor:
        return parts[index[0]] if len(index) == 1 else torch.cat([parts[j] for j in index], 2)

    outs = []
    for i, seg in enumerate(layout.segments):
        own = layout.pieces(seg.start, seg.end)
        keys = own if seg.prefix is None else layout.pieces(*seg.prefix) + own
        q, k, v = joined(qs, own), joined(ks, keys), joined(vs, keys)
        mask = None if seg.prefix is None else layout.mask(i, query.device)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                is_causal=mask is None,
                enable_gqa=gqa,
            )
        )
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


def _varlen() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _varlen_params(fn: Any) -> frozenset[str]:
    """The keyword arguments this torch's ``varlen_attn`` takes (its signature changed
    between releases: ``is_causal`` before ``window_size``)."""
    return frozenset(inspect.signature(fn).parameters)


def _varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Every segment in one ``varlen_attn`` call (CUDA, flash attention): each segment's keys
    (its prefix, then itself) gathered into one sequence, causal bottom-right aligned."""
    varlen_attn = _varlen()
    key_index, cu_q, cu_k, max_q, max_k = layout.varlen_inputs(query.device)
    q = query[0].transpose(0, 1)  # [T, heads, dim]
    k = key[0].index_select(1, key_index).transpose(0, 1)
    v = value[0].index_select(1, key_index).transpose(0, 1)
    params = _varlen_params(varlen_attn)
    extra: dict[str, Any] = {"scale": scaling}
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    if "enable_gqa" in params:
        extra["enable_gqa"] = gqa
    elif gqa:
        groups = query.shape[1] // key.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
    return out[None]  # [1, T, heads, dim]


def _cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.tensor(lengths, device=device).cumsum(0)
    return out


def choose(
    setting: bool | str,
    model: torch.nn.Module,
    *,
    whole_rows: bool,
    key: str = "train.packing",
) -> tuple[bool, str]:
    """Whether to pack ``model``'s training forwards under ``setting`` (``train.packing``),
    and the start-up line that says so and why; a model that will be packed is prepared
    (:func:`install`).

    ``true`` packs, and refuses with the reason a model that cannot be packed exactly.
    ``auto`` packs an exact model where the unpacked forward pads whole rows
    (``whole_rows``: an FSDP-sharded model, ``train.shared_prompt_forward=false``, a model
    without a prompt cache): there packing forwards a fraction of the positions (measured
    2.2x faster on a long-tailed step). Elsewhere the unpacked forward's shared prompt and
    length buckets leave little padding, and on a CPU they measured as fast as packing.
    """
    if setting is False:
        return False, f"{key}=false: micro-batches padded per group of similar length"
    why = unpackable(model)
    if why is not None:
        if setting is True:
            raise ConfigError(
                f"{key}=true: this model cannot be packed exactly: {why}. Fix: {key}=auto "
                "(it is then forwarded unpacked) or false",
                key=key,
            )
        return False, f"{key}=auto: unpacked, because of {why}"
    if setting == "auto" and not whole_rows:
        return False, (
            f"{key}=auto: unpacked (each prompt once, its responses in length buckets: little "
            f"padding; {key}=true packs)"
        )
    install(model)
    return True, (
        f"{key}={str(setting).lower()}: packed (each micro-batch one row without padding, "
        "attention per sequence)"
    )
