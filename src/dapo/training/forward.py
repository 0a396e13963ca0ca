"""Forward passes for training: collate samples, shared-prompt caches, response log-probs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dapo import algorithms as alg
from dapo.logprobs import chunked_logprobs
from dapo.models.head import head_replaced, output_head
from dapo.models.inputs import device_of, left_pad, right_pad
from dapo.models.precision import autocast, compute_dtype
from dapo.parallel import sharding
from dapo.parallel.distributed import all_reduce_sum
from dapo.training.batch import Sample

if TYPE_CHECKING:
    from dapo.training.kv_cache import SharedPromptCache


@dataclass
class Collated:
    """The targets of a micro-batch: responses right-padded to R."""

    response_ids: torch.Tensor  # [b, R]
    loss_mask: torch.Tensor  # [b, R]
    response_len: int  # R

    def to(self, device: torch.device) -> Collated:
        if device.type == "cpu":
            return self
        return Collated(self.response_ids.to(device), self.loss_mask.to(device), self.response_len)


def collate(samples: Sequence[Sample], pad_id: int) -> Collated:
    r = max(len(s.response_ids) for s in samples)
    resp = torch.full((len(samples), r), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), r))
    for i, s in enumerate(samples):
        resp[i, : len(s.response_ids)] = torch.tensor(s.response_ids)
        mask[i, : len(s.response_ids)] = torch.tensor(s.loss_mask)
    return Collated(resp, mask, r)


def prompt_cache(model: torch.nn.Module) -> SharedPromptCache | None:
    """An empty key/value cache to forward ``model``'s prompts into, or None if the model cannot
    continue exactly from one (then every sample is forwarded as prompt + response).

    The condition: a decoder-only transformers model that takes a ``DynamicCache`` whose layers
    all keep every past key and value (full attention; not sliding-window, chunked or linear
    attention layers, which keep only part of the past), and not transformers' own gradient
    checkpointing while training (its layers drop the cache; dapo's,
    ``model.gradient_checkpointing``, keeps it: see :mod:`dapo.training.kv_cache`).
    """
    config = getattr(model, "config", None)
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not callable(supports):
        return None
    if not supports() or (model.training and getattr(model, "is_gradient_checkpointing", False)):
        return None
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from dapo.training.kv_cache import SharedPromptCache

    layers = getattr(DynamicCache(config=config), "layers", [])
    depth = getattr(config.get_text_config(decoder=True), "num_hidden_layers", len(layers))
    if len(layers) != depth or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return SharedPromptCache.empty(depth)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def response_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_id: int,
    temperature: float,
    chunk_size: int = 1024,
    shared_prompt: bool = True,
    ddp: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the sampled response tokens and the entropies of the distributions they
    were drawn from (softmax of logits / temperature): two float32 ``[b, R]`` tensors, 0 on
    padding, both differentiable.

    The model runs up to its final hidden states (its output layer bypassed); the output
    layer, log-softmax and entropy are applied ``chunk_size`` positions at a time and
    recomputed in backward (:func:`dapo.logprobs.chunked_logprobs`), so no ``[tokens x
    vocabulary]`` logits exist. Models whose head is not a plain linear layer
    (:func:`~dapo.models.head.output_head`) take the whole logits. The forward passes: see
    :func:`response_logits`.
    """
    head = output_head(model)
    with autocast(model), head_replaced(head, _identity):  # the "logits" are hidden states
        out = _response_outputs(model, samples, pad_id=pad_id, shared_prompt=shared_prompt,
                                ddp=ddp)  # [b, R, H] hidden states, or [b, R, V] logits
    device = out.device
    lengths = torch.tensor([len(s.response_ids) for s in samples], device=device)
    valid = torch.arange(out.shape[1], device=device)[None, :] < lengths[:, None]
    targets = collate(samples, pad_id).response_ids.to(device)[valid]
    if head is not None:
        logp, entropy = chunked_logprobs(
            out[valid], head.weight, targets, bias=head.bias, temperature=temperature,
            chunk_size=chunk_size, compute_dtype=compute_dtype(model),
        )  # fmt: skip
    else:
        logits = out[valid].float()
        logits = logits / temperature if temperature != 1.0 else logits
        logp, entropy = alg.token_logprobs(logits, targets), alg.token_entropy(logits)
    full = torch.zeros(valid.shape, dtype=torch.float32, device=device)
    return full.masked_scatter(valid, logp), full.masked_scatter(valid, entropy)


def response_logits(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_id: int,
    temperature: float,
    shared_prompt: bool = True,
    ddp: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Logits ``[b, R, V]`` that predict each response token (scaled by 1/temperature), in
    float32: the whole-logits path (:func:`response_logprobs` avoids it).

    When some prompt of ``samples`` has several responses (a group) and ``shared_prompt`` is
    on, each distinct prompt is forwarded once (left-padded, with a cache), the cache is
    expanded to its responses (an ``index_select``, so the gradient of every response flows
    back into the one prompt pass) and the responses are forwarded on top of it with their
    prompt's padding mask and positions. This is exact: a response token attends to the same
    keys and values at the same positions (causal attention makes a prompt's states
    independent of what follows it), only computed once per prompt instead of once per
    response. Otherwise (no repeated prompt, the switch off, or a model that cannot continue
    from a cache, see :func:`prompt_cache`) every sample is forwarded as prompt + response.

    ``ddp`` (the DistributedDataParallel wrapper of ``model``) runs exactly one forward per
    call, the prompt pass or the full one, as DDP expects one forward per backward (each
    forward broadcasts buffers, a collective every rank must match). The response pass calls
    ``model`` itself: its gradient reaches the same parameters in the same backward, which
    DDP (``find_unused_parameters`` off) reduces once.
    """
    with autocast(model):
        logits = _response_outputs(model, samples, pad_id=pad_id, shared_prompt=shared_prompt,
                                   ddp=ddp)
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _response_outputs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_id: int,
    shared_prompt: bool,
    ddp: torch.nn.Module | None,
) -> torch.Tensor:
    """The model's output (``logits``) at the positions that predict the response tokens."""
    first_pass = ddp if ddp is not None else model
    owner: dict[tuple[int, ...], int] = {}
    index = [owner.setdefault(tuple(s.prompt_ids), len(owner)) for s in samples]
    cache = prompt_cache(model) if shared_prompt and len(owner) < len(samples) else None
    device = device_of(model)
    r = max(len(s.response_ids) for s in samples)
    if cache is None:
        prompt_ids, prompt_mask = left_pad([s.prompt_ids for s in samples], pad_id)
        resp_ids, resp_mask = right_pad([s.response_ids for s in samples], r, pad_id)
        attn = torch.cat([prompt_mask, resp_mask], 1)
        ids = torch.cat([prompt_ids, resp_ids], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = _forward(first_pass, device, ids, attn, pos, logits_to_keep=r + 1, use_cache=False)
        logits = out.logits[:, :-1]
    else:
        prompt_ids, prompt_mask = left_pad(list(owner), pad_id)
        prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        out = _forward(
            first_pass, device, prompt_ids, prompt_mask, prompt_pos,
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        rows = torch.tensor(index, device=device)
        logits = out.logits[:, -1:].index_select(0, rows)  # predicts response token 0
        if r > 1:  # tokens 1..R-1, from response positions 0..R-2 (the last is no input)
            cache = cache.expand(rows)  # index_select of each layer's keys and values
            resp_ids, resp_mask = right_pad([s.response_ids for s in samples], r - 1, pad_id)
            attn = torch.cat([prompt_mask[index], resp_mask], 1)
            pos = prompt_mask.sum(-1)[index, None] + torch.arange(r - 1)
            rest = _forward(model, device, resp_ids, attn, pos, past_key_values=cache, use_cache=True)
            logits = torch.cat([logits, rest.logits], 1)
    return logits


def _forward(
    module: torch.nn.Module,
    device: torch.device,
    ids: torch.Tensor,
    attn: torch.Tensor,
    pos: torch.Tensor,
    **kw: Any,
) -> Any:
    """``module``'s forward on token ids, attention mask and positions moved to ``device``."""
    return module(
        input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device), **kw
    )


def pad_rows(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[int]]:
    """Indices of samples split into micro-batches of at most ``token_budget`` padded tokens.

    Samples are kept in groups (the responses of one prompt), so that a micro-batch
    forwards each of its prompts once (:func:`response_logits`): groups sorted by their
    longest sample fill the micro-batches one after the other, and a group is split only
    when it alone exceeds the budget. Sorting by length keeps padding small. The split does
    not change the result, only the memory and time it takes.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_ids), []).append(i)
    members = [sorted(g, key=lambda i: samples[i].length) for g in groups.values()]
    members.sort(key=lambda g: samples[g[-1]].length)
    chunks: list[list[int]] = []
    current: list[int] = []
    widest = 0
    for group in members:
        longest = samples[group[-1]].length
        together = max(widest, longest) * (len(current) + len(group))
        if current and longest * len(group) <= token_budget < together:
            chunks.append(current)
            current, widest = [], 0
        for i in group:  # all at once unless the group alone exceeds the budget
            w = max(widest, samples[i].length)
            if current and w * (len(current) + 1) > token_budget:
                chunks.append(current)
                current, w = [], samples[i].length
            current.append(i)
            widest = w
    if current:
        chunks.append(current)
    return chunks


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_id: int,
    temperature: float,
    token_budget: int,
    shared_prompt: bool = True,
    logits_chunk_size: int = 1024,
) -> list[torch.Tensor]:
    """Per-response log-probs of the sampled tokens under ``model`` (no grad).

    An FSDP model is gathered once for all micro-batches (every rank must call this, with
    any number of samples, even none).
    """
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    with sharding.full_params(model):
        for idx in micro_batches(samples, token_budget):
            chunk = [samples[i] for i in idx]
            logp, _ = response_logprobs(model, chunk, pad_id=pad_id, temperature=temperature,
                                        chunk_size=logits_chunk_size, shared_prompt=shared_prompt)
            for j, i in enumerate(idx):
                out[i] = logp[j, : len(samples[i].response_ids)].clone()
    return out


def logprob_mismatch(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean |engine log-prob - trainer log-prob| over the response tokens (all ranks):
    ``rollout/logprob_mismatch``, or nothing when no sample has both."""
    total, count = 0.0, 0
    for s in samples:
        if s.sampling_logprobs is None or s.old_logprobs is None:
            continue
        total += float((s.sampling_logprobs.to(s.old_logprobs) - s.old_logprobs).abs().sum())
        count += len(s.response_ids)
    total, n = all_reduce_sum([total, float(count)])
    return {"rollout/logprob_mismatch": total / n} if n else {}
