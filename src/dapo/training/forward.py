"""Training forward passes: the model's states at the response positions, and the log-probs
and entropies of the sampled tokens from them.

:func:`response_states` is the one place that calls the model in training. With a shared
prompt (the responses of one group), each distinct prompt is forwarded once into a key/value
cache (:mod:`dapo.training.kv_cache`) and the responses on top of it; the output layer is
applied afterwards by :func:`token_logprobs`, chunk by chunk
(:func:`dapo.models.chunked_logprobs.chunked_logprobs`), so no ``[tokens x vocabulary]``
logits exist.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dapo import algorithms as alg
from dapo.data.images import images_of
from dapo.models.chunked_logprobs import chunked_logprobs
from dapo.models.head import head_replaced, output_head
from dapo.models.inputs import after_prefix, device_of, shared_prefix
from dapo.models.precision import autocast, compute_dtype
from dapo.models.vision import image_token_id, rope_positions, text_prefix, token_inputs
from dapo.parallel import sharding
from dapo.training.batch import Sample
from dapo.training.microbatch import MicroBatch, collate, micro_batches, response_widths
from dapo.training.packed import pack, packed_states

if TYPE_CHECKING:
    from dapo.training.kv_cache import SharedPromptCache


@dataclass(frozen=True)
class ForwardOptions:
    """How the training forward runs (``train.*`` and the sampling temperature)."""

    pad_id: int
    temperature: float = 1.0  # the logits are divided by it, as the sampler's were
    token_budget: int = 8192  # train.micro_batch_tokens: padded tokens per micro-batch
    logits_chunk_size: int = 1024  # train.logits_chunk_size: positions per output-layer chunk
    shared_prompt: bool = True  # train.shared_prompt_forward
    packed: bool = False  # train.packing, resolved for the model (dapo.models.packing.choose)


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


def response_states(
    model: torch.nn.Module,
    batch: MicroBatch,
    *,
    shared_prompt: bool = True,
    ddp: torch.nn.Module | None = None,
    hidden: bool = True,
    packed: bool = False,
) -> torch.Tensor:
    """The model's output at the positions that predict the response tokens, ``[b, R, .]``:
    the final hidden states (``hidden`` and a plain linear output layer, which is bypassed;
    :func:`token_logprobs` applies it) or the logits.

    ``packed`` (a model :func:`dapo.models.packing.install` prepared): the micro-batch is
    forwarded as one row without padding (:mod:`dapo.training.packed`) and the output is
    ``[N, .]``, one per response token (``batch.response_mask > 0``, row by row). A batch
    with images is forwarded unpacked (the image features go in the prompt pass).

    When some prompt of the batch has several responses (a group) and ``shared_prompt`` is
    on, each distinct prompt is forwarded once (left-padded, with a cache), the cache is
    expanded to its responses (an ``index_select``, so the gradient of every response flows
    back into the one prompt pass) and the responses are forwarded on top of it with their
    prompt's padding mask and positions. This is exact: a response token attends to the same
    keys and values at the same positions (causal attention makes a prompt's states
    independent of what follows it), only computed once per prompt instead of once per
    response. A prompt's images (``batch.prompts``, :class:`~dapo.data.images.ImagePrompt`)
    go into the pass that forwards its image tokens; a shared prefix stops before the first
    image token. A prefix that all the distinct prompts share (a chat template's system prompt,
    few-shot turns: :func:`~dapo.models.inputs.shared_prefix`) is forwarded once, on one
    row, and the rest of each prompt on top of it (left-padded after it), by the same
    argument. The responses go in groups of similar width (:func:`length_buckets`), each
    forwarded at its own longest width rather than all at the micro-batch's longest (but
    for an FSDP-sharded model, which gathers its weights at every call). Otherwise (no
    repeated prompt, the switch off, or a model that cannot continue from a cache, see
    :func:`prompt_cache`) every sample is forwarded as prompt + response.

    ``ddp`` (the DistributedDataParallel wrapper of ``model``) runs exactly one forward per
    call, the first (the shared prefix's, the prompts' or the full one), as DDP expects one
    forward per backward (each forward broadcasts buffers, a collective every rank must
    match). The later passes call ``model`` itself: their gradient reaches the same
    parameters in the same backward, which DDP (``find_unused_parameters`` off) reduces once.
    """
    first_pass = ddp if ddp is not None else model
    distinct = batch.distinct_prompts
    # A prompt's images go in a pass of its own (the vision encoder runs once per distinct
    # prompt); an episode with images in its later turns is forwarded whole, every image in
    # its place.
    visual = any(images_of(p) for p in batch.prompts)
    later = any(images_of(x) for x in batch.responses)
    shares = shared_prompt and len(distinct) < len(batch.owner)
    cache = prompt_cache(model) if (shares or visual) and not later else None
    device = device_of(model)
    r = batch.width
    head = output_head(model) if hidden else None
    with autocast(model), head_replaced(head, _identity):  # the "logits" are hidden states
        if packed and not (visual or later):
            return packed_states(model, pack(batch, shared_prompt=shared_prompt), ddp)
        if cache is None:
            attn = torch.cat([batch.prompt_mask, batch.response_mask], 1).to(device)
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            ids = torch.cat([batch.prompt_ids, batch.response_ids], 1).to(device)
            rows = whole_sequences(batch)
            out = first_pass(
                **token_inputs(
                    model, ids, rows, [ids.shape[1] - r - len(p) for p in batch.prompts]
                ),
                attention_mask=attn,
                position_ids=rope_positions(model, rows, pos),
                logits_to_keep=r + 1,
                use_cache=False,
            )
            return out.logits[:, :-1]
        prompt_ids, prompt_mask = batch.prompt_ids[distinct], batch.prompt_mask[distinct]
        tokens = [row[m > 0].tolist() for row, m in zip(prompt_ids, prompt_mask, strict=True)]
        c = shared_prefix(text_prefix(tokens, image_token_id(model)))  # never an image
        if c:  # a prefix every prompt shares (a system prompt): once, then the rest on top
            first_pass(
                input_ids=torch.tensor([tokens[0][:c]], device=device),
                position_ids=torch.arange(c, device=device)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = cache.continued(len(tokens))
            prompt_ids, prompt_mask, pos = after_prefix(tokens, c, pad_id=0)  # 0: masked
        else:
            pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        given = [batch.prompts[i] for i in distinct] if batch.prompts else []
        ids = prompt_ids.to(device)
        out = (model if c else first_pass)(
            **token_inputs(model, ids, given, [ids.shape[1] - len(p) for p in given]),
            attention_mask=prompt_mask.to(device),
            position_ids=rope_positions(model, given, pos.to(device)),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        owner = torch.tensor(batch.owner)  # each row's prompt among the distinct ones
        rows = owner.to(device)
        first = out.logits[:, -1:].index_select(0, rows)  # predicts response token 0
        if r == 1:
            return first
        # Tokens 1..w-1 of each response, from its positions 0..w-2 (its last token is no
        # input), in groups of similar width w, each forwarded at its own longest width.
        widths = response_widths(batch.response_mask)
        groups = [list(range(len(widths)))]
        if not sharding.is_fsdp(model):  # a sharded model gathers its weights at every call
            groups = length_buckets(widths)
        parts = []
        for group in groups:
            sub = torch.tensor(group)
            w = max(widths[i] for i in group)
            if w <= 1:  # nothing but the first token, which the prompt pass predicts
                parts.append(first.new_zeros((len(group), r - 1, first.shape[-1])))
                continue
            mask = prompt_mask[owner[sub]]  # as the prompts lie in the cache
            attn = torch.cat([mask, batch.response_mask[sub, : w - 1]], 1).to(device)
            pos = mask.sum(-1)[:, None].to(device) + torch.arange(w - 1, device=device)
            rows_of = [batch.prompts[i] for i in sub.tolist()] if batch.prompts else []
            states = model(
                input_ids=batch.response_ids[sub, : w - 1].to(device),
                attention_mask=attn,
                position_ids=rope_positions(model, rows_of, pos),
                past_key_values=cache.expand(rows[sub.to(device)]),
                use_cache=True,
            ).logits
            parts.append(torch.nn.functional.pad(states, (0, 0, 0, r - w)))  # to R-1 columns
        rest = parts[0]
        if len(groups) > 1:  # back to the batch's row order
            order = torch.tensor([i for group in groups for i in group])
            rest = torch.cat(parts).index_select(0, torch.argsort(order).to(device))
        return torch.cat([first, rest], 1)


def whole_sequences(batch: MicroBatch) -> list[Sequence[int]]:
    """Each row's prompt, or its prompt and response where the response holds images (an
    episode's later turns): what its images and positions are read from."""
    if not batch.responses:
        return list(batch.prompts)
    return [
        p + x if images_of(x) else p for p, x in zip(batch.prompts, batch.responses, strict=True)
    ]


BUCKET_COST = 128  # a response pass's fixed work, in positions (see length_buckets)


def length_buckets(widths: Sequence[int], cost: int | None = None) -> list[list[int]]:
    """Row indices cut into groups of similar width, each to be forwarded at its own longest
    width instead of every row at the batch's longest: the cut of the rows sorted by width
    that minimises the positions forwarded (rows x longest width, summed over groups) plus
    ``cost`` per group (a forward and backward call's fixed work; :data:`BUCKET_COST`).

    A response shorter than its group's longest is otherwise padded to it: with DAPO's long
    tails (most responses short, a few at the limit) that is most of the work.
    """
    cost = BUCKET_COST if cost is None else cost
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    ordered = [widths[i] for i in order]
    distinct = sorted(set(widths))
    ends = [bisect.bisect_right(ordered, d) for d in distinct]  # rows up to each width
    best = [0.0] + [float("inf")] * len(distinct)  # best[j]: the first ends[j-1] rows
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        for i in range(j):
            start = ends[i - 1] if i else 0
            total = best[i] + (ends[j - 1] - start) * distinct[j - 1] + cost
            if total < best[j]:
                best[j], cut[j] = total, i
    bounds, j = [], len(distinct)
    while j:
        bounds.append((ends[cut[j] - 1] if cut[j] else 0, ends[j - 1]))
        j = cut[j]
    return [sorted(order[a:b]) for a, b in reversed(bounds)]


def token_logprobs(
    model: torch.nn.Module,
    states: torch.Tensor,
    batch: MicroBatch,
    *,
    temperature: float,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the sampled response tokens and the entropies of the distributions they
    were drawn from (softmax of logits / temperature), from :func:`response_states`: two
    float32 ``[b, R]`` tensors, 0 on padding, both differentiable. ``states`` may also be
    the packed forward's ``[N, .]``, one per response token.

    The output layer, log-softmax and entropy are applied ``chunk_size`` positions at a time
    and recomputed in backward (:func:`~dapo.models.chunked_logprobs.chunked_logprobs`).
    Models whose head is not a plain linear layer (:func:`~dapo.models.head.output_head`)
    give whole logits, used as they are.
    """
    head = output_head(model)
    device = states.device
    valid = batch.response_mask.to(device) > 0
    targets = batch.response_ids.to(device)[valid]
    flat = states if states.dim() == 2 else states[valid]
    if head is not None:
        logp, entropy = chunked_logprobs(
            flat,
            head.weight,
            targets,
            bias=head.bias,
            temperature=temperature,
            chunk_size=chunk_size,
            compute_dtype=compute_dtype(model),
        )
    else:
        logits = flat.float()
        logits = logits / temperature if temperature != 1.0 else logits
        logp, entropy = alg.token_logprobs(logits, targets), alg.token_entropy(logits)
    full = torch.zeros(valid.shape, dtype=torch.float32, device=device)
    return full.masked_scatter(valid, logp), full.masked_scatter(valid, entropy)


def response_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    options: ForwardOptions,
    ddp: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`response_states` then :func:`token_logprobs`: ``(logp, entropy)``, ``[b, R]``."""
    states = response_states(
        model, batch, shared_prompt=options.shared_prompt, ddp=ddp, packed=options.packed
    )
    return token_logprobs(
        model, states, batch, temperature=options.temperature, chunk_size=options.logits_chunk_size
    )


def response_logits(
    model: torch.nn.Module,
    batch: MicroBatch,
    *,
    temperature: float,
    shared_prompt: bool = True,
    packed: bool = False,
) -> torch.Tensor:
    """Logits ``[b, R, V]`` that predict each response token (scaled by 1/temperature), in
    float32: the whole-logits reference that :func:`token_logprobs` avoids."""
    logits = response_states(
        model, batch, shared_prompt=shared_prompt, hidden=False, packed=packed
    ).float()
    if logits.dim() == 2:  # packed: one per response token
        valid = (batch.response_mask > 0).to(logits.device)
        full = logits.new_zeros((*valid.shape, logits.shape[-1]))
        full[valid] = logits
        logits = full
    return logits / temperature if temperature != 1.0 else logits


def zero_backward(model: torch.nn.Module, pad_id: int) -> None:
    """Forward and backward with a zero loss: the collectives of a pass, a zero gradient.

    A rank with nothing (more) to train joins DDP's all-reduce or FSDP's all-gathers and
    reduce-scatters this way.
    """
    with autocast(model):
        out = model(input_ids=torch.tensor([[pad_id]], device=device_of(model)), use_cache=False)
    (out.logits.float().sum() * 0.0).backward()


@torch.no_grad()
def compute_logprobs(
    model: torch.nn.Module, samples: Sequence[Sample], options: ForwardOptions
) -> list[torch.Tensor]:
    """Per-response log-probs of the sampled tokens under ``model`` (no grad).

    An FSDP model is gathered once for all micro-batches (every rank must call this, with
    any number of samples, even none).
    """
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    with sharding.full_params(model):
        for idx in micro_batches(samples, options.token_budget, packed=options.packed):
            batch = collate([samples[i] for i in idx], options.pad_id)
            states = response_states(
                model, batch, shared_prompt=options.shared_prompt, packed=options.packed
            )
            logp, _ = token_logprobs(
                model,
                states,
                batch,
                temperature=options.temperature,
                chunk_size=options.logits_chunk_size,
            )
            for j, i in enumerate(idx):
                out[i] = logp[j, : len(samples[i].response_ids)].clone()
    return out
