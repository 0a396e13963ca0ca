"""The transformers engine: sampling with the policy module itself, in the training process.

:class:`HFEngine` runs its own sampling loop, so that it can return log-probs cheaply, share
one prompt prefill across the group, and drop finished sequences from the batch. What made
it slow on a real model (SmolLM2-135M, 49k vocabulary, 3 key/value heads for 9 query heads,
on CPU; profiled with cProfile) and is done otherwise here: ``torch.multinomial`` (one
exponential random number per vocabulary entry; :func:`sample_next` inverts the CDF with
one uniform per row), transformers copying the grouped key/value heads for every masked
attention call (:func:`_grouped_kv_attention`), the prefill's logits for every prompt
position (only the last is kept) and a per-token transfer of the sampled tokens (they stay
on the device until the call ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dapo.models.inputs import device_of, left_pad
from dapo.models.precision import autocast, float32_logits
from dapo.parallel.sharding import full_params
from dapo.rollout.base import Group, SamplingParams


def process_logits(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering; removed entries are -inf."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its log-prob under the distribution it was
    drawn from (after temperature, top-k and top-p); greedy at temperature 0.

    Sampling inverts the cumulative distribution with one uniform number per row (in
    float64, so that no token of positive probability is rounded away). It draws from the
    same distribution as ``torch.multinomial``, whose one-sample path draws an exponential
    number for every vocabulary entry: with a 49k vocabulary that was a fifth of the
    decoding time of a 135M model on CPU.
    """
    if params.temperature == 0:
        tok = logits.argmax(-1)
        return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(
        process_logits(logits, params.temperature, params.top_p, params.top_k), -1
    )
    cdf = logp.exp().double().cumsum_(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=gen, device=cdf.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u < total
    # The first entry whose cumulative mass exceeds u: never one of probability 0.
    tok = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


_SDPA_GQA = "dapo_sdpa_gqa"  # transformers' sdpa attention, grouped key/value heads kept


def _sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA with ``enable_gqa``: the kernel reads each key/value head for its group of query
    heads. transformers' own sdpa attention copies them out first (``repeat_kv``) whenever a
    padding mask is given, which on CPU made attention 9x slower for SmolLM2 (3 key/value
    heads for 9 query heads). Anything else (a position bias, attention sinks) goes to
    transformers' function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _grouped_kv_attention(model: torch.nn.Module) -> Iterator[None]:
    """While generating on CPU, a model with grouped key/value heads on transformers' sdpa
    attention uses :func:`_sdpa_gqa_attention` (the same maths, the same masks)."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if (
        device_of(model).type != "cpu"  # CUDA's fast kernels take no mask with GQA
        or getattr(config, "_attn_implementation", None) != "sdpa"
        or not heads
        or kv_heads == heads
    ):
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_SDPA_GQA, _sdpa_gqa_attention)
    AttentionMaskInterface.register(_SDPA_GQA, sdpa_mask)
    config._attn_implementation = _SDPA_GQA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


class HFEngine:
    """Sampling with a transformers causal LM in the training process.

    The engine holds the policy module itself, so after an optimizer step it already
    samples from the new weights; ``load_weights`` copies tensors only when given ones
    that are not its own (e.g. from another process).
    """

    def __init__(
        self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, batch_size: int = 256
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights too
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"load_weights: the engine's model has no parameter {name!r}")
                if tensor is not params[name] and params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        """Sample ``params.n`` responses per prompt.

        An FSDP-sharded model is gathered once for the whole call, as each rank runs its
        own number of decoding steps: every rank must call this, with any number of prompts.
        """
        gen = torch.Generator(device=device_of(self.model)).manual_seed(params.seed)
        per_call = max(1, self.batch_size // max(1, params.n))
        groups: list[Group] = []
        was_training = self.model.training
        self.model.eval()
        try:
            # The trainer's precision: its autocast, and float32 logits from bf16 products.
            with (
                full_params(self.model),
                autocast(self.model),
                float32_logits(self.model),
                _grouped_kv_attention(self.model),
            ):
                for start in range(0, len(prompts), per_call):
                    groups.extend(self._generate(prompts[start : start + per_call], params, gen))
        finally:
            self.model.train(was_training)
        return groups

    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator
    ) -> list[Group]:
        from transformers import DynamicCache

        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = params.n
        ids, attn = left_pad(prompts, self.pad_token_id)
        device = device_of(self.model)
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # One prefill per prompt, shared by its n responses.
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        attn = attn.repeat_interleave(n, dim=0)
        next_pos = pos[:, -1].repeat_interleave(n, dim=0) + 1

        # The responses stay on the device until the end (no per-token transfer): row r's
        # token t is tokens[r, t]; lengths[r] tokens were generated, the last EOS if finished.
        total, steps = len(prompts) * n, params.max_tokens
        tokens = torch.zeros((total, steps), dtype=torch.long, device=device)
        logps = torch.zeros((total, steps), dtype=torch.float32, device=device)
        lengths = torch.zeros(total, dtype=torch.long, device=device)
        finished = torch.zeros(total, dtype=torch.bool, device=device)
        active = torch.arange(total, device=device)  # rows of the full batch still generating
        for step in range(steps):
            tok, logp = sample_next(logits, params, gen)
            tokens[active, step] = tok
            logps[active, step] = logp.float()
            lengths[active] = step + 1
            done_now = tok == self.eos_token_id
            finished[active] = done_now
            if step == steps - 1:
                break
            keep = (~done_now).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < active.numel():  # finished rows stop costing compute
                cache.batch_select_indices(keep)
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1].float()
            next_pos = next_pos + 1

        tokens_l, logps_l, lengths_l, finished_l = (
            x.tolist() for x in (tokens, logps, lengths, finished)
        )
        groups = []
        for i, p in enumerate(prompts):
            g = Group(prompt_ids=list(p))
            for row in range(i * n, (i + 1) * n):
                g.response_ids.append(tokens_l[row][: lengths_l[row]])
                g.logprobs.append(logps_l[row][: lengths_l[row]])
                g.truncated.append(not finished_l[row])
            groups.append(g)
        return groups
