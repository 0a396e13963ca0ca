"""One optimizer step's gradient, exact under any micro-batch split.

The loss of a mini-batch is normalised by denominators of the *whole* mini-batch (for
``token-mean``, its number of loss tokens after overlong filtering), computed once before
any micro-batch runs. Each micro-batch then contributes ``sum(loss tokens) / global`` and
the accumulated gradient equals the one of a single pass over the whole mini-batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dapo import algorithms as alg
from dapo import sharding
from dapo.distributed import all_reduce_max, all_reduce_sum, balance_by_tokens, current

if TYPE_CHECKING:
    from transformers import Cache


@dataclass
class Sample:
    """One response ready for training."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    loss_mask: list[float]  # per response token; all 0 for a filtered (truncated) response
    old_logprobs: torch.Tensor | None = None  # [len(response_ids)], trainer's, no grad
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None  # the rollout engine's, for tis_cap

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class LossSettings:
    """The algorithm knobs the loss needs."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    loss_agg: str = "token-mean"
    beta: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    max_len: int = 1  # L_max, for seq-mean-token-sum-norm
    tis_cap: float | None = None  # truncated importance sampling cap C; None disables


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


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def collate(samples: Sequence[Sample], pad_id: int) -> Collated:
    r = max(len(s.response_ids) for s in samples)
    resp = torch.full((len(samples), r), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), r))
    for i, s in enumerate(samples):
        resp[i, : len(s.response_ids)] = torch.tensor(s.response_ids)
        mask[i, : len(s.response_ids)] = torch.tensor(s.loss_mask)
    return Collated(resp, mask, r)


def _left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[n, P]`` left-padded to the longest row, and their attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    return ids, mask


def _right_padded(
    rows: Sequence[Sequence[int]], width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[n, width]`` right-padded (rows cut at ``width``), and their attention mask."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        k = min(len(row), width)
        if k:
            ids[i, :k] = torch.tensor(row[:k])
            mask[i, :k] = 1
    return ids, mask


def prompt_cache(model: torch.nn.Module) -> Cache | None:
    """An empty key/value cache to forward ``model``'s prompts into, or None if the model cannot
    continue exactly from one (then every sample is forwarded as prompt + response).

    The condition: a decoder-only transformers model that takes a ``DynamicCache`` whose layers
    all keep every past key and value (full attention; not sliding-window, chunked or linear
    attention layers, which keep only part of the past), and no gradient checkpointing while
    training (checkpointed layers drop the cache).
    """
    config = getattr(model, "config", None)
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not callable(supports):
        return None
    if not supports() or (model.training and getattr(model, "is_gradient_checkpointing", False)):
        return None
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", [])
    depth = getattr(config.get_text_config(decoder=True), "num_hidden_layers", len(layers))
    if len(layers) != depth or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return cache


def response_logits(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    pad_id: int,
    temperature: float,
    shared_prompt: bool = True,
    ddp: torch.nn.Module | None = None,
) -> torch.Tensor:
    """Logits ``[b, R, V]`` that predict each response token (scaled by 1/temperature).

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
    first_pass = ddp if ddp is not None else model
    owner: dict[tuple[int, ...], int] = {}
    index = [owner.setdefault(tuple(s.prompt_ids), len(owner)) for s in samples]
    cache = prompt_cache(model) if shared_prompt and len(owner) < len(samples) else None
    device = device_of(model)
    r = max(len(s.response_ids) for s in samples)
    if cache is None:
        prompt_ids, prompt_mask = _left_padded([s.prompt_ids for s in samples], pad_id)
        resp_ids, resp_mask = _right_padded([s.response_ids for s in samples], r, pad_id)
        attn = torch.cat([prompt_mask, resp_mask], 1)
        out = first_pass(
            input_ids=torch.cat([prompt_ids, resp_ids], 1).to(device),
            attention_mask=attn.to(device),
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0).to(device),
            logits_to_keep=r + 1,
            use_cache=False,
        )
        logits = out.logits[:, :-1]
    else:
        prompt_ids, prompt_mask = _left_padded(list(owner), pad_id)
        prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        out = first_pass(
            input_ids=prompt_ids.to(device),
            attention_mask=prompt_mask.to(device),
            position_ids=prompt_pos.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        rows = torch.tensor(index, device=device)
        logits = out.logits[:, -1:].index_select(0, rows)  # predicts response token 0
        if r > 1:  # tokens 1..R-1, from response positions 0..R-2 (the last is no input)
            cache = out.past_key_values
            cache.reorder_cache(rows)  # index_select of each layer's keys and values
            resp_ids, resp_mask = _right_padded([s.response_ids for s in samples], r - 1, pad_id)
            attn = torch.cat([prompt_mask[index], resp_mask], 1)
            pos = prompt_mask.sum(-1)[index, None] + torch.arange(r - 1)
            rest = model(
                input_ids=resp_ids.to(device),
                attention_mask=attn.to(device),
                position_ids=pos.to(device),
                past_key_values=cache,
                use_cache=True,
            )
            logits = torch.cat([logits, rest.logits], 1)
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


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
) -> list[torch.Tensor]:
    """Per-response log-probs of the sampled tokens under ``model`` (no grad).

    An FSDP model is gathered once for all micro-batches (every rank must call this, with
    any number of samples, even none).
    """
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    device = device_of(model)
    with sharding.full_params(model):
        for idx in micro_batches(samples, token_budget):
            chunk = [samples[i] for i in idx]
            logits = response_logits(model, chunk, pad_id=pad_id, temperature=temperature,
                                     shared_prompt=shared_prompt)
            logp = alg.token_logprobs(logits, collate(chunk, pad_id).to(device).response_ids)
            for j, i in enumerate(idx):
                out[i] = logp[j, : len(samples[i].response_ids)].clone()
    return out


def loss_denominator(samples: Sequence[Sample], settings: LossSettings) -> float:
    """The global normaliser of a mini-batch for the configured aggregation.

    ``token-mean``: loss tokens (masked, e.g. truncated, responses do not count);
    ``seq-mean-token-mean``: responses; ``seq-mean-token-sum-norm``: responses x L_max.
    In data-parallel training the caller sums this over ranks.
    """
    if settings.loss_agg == "token-mean":
        return float(sum(sum(s.loss_mask) for s in samples))
    if settings.loss_agg == "seq-mean-token-mean":
        return float(len(samples))
    return float(len(samples) * settings.max_len)


STAT_KEYS = (
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/ratio_mean",
    "actor/ppo_kl",
    "actor/gen_prob",
    "actor/entropy",
    "actor/kl_ref",
    "actor/tis_weight",
)


@dataclass
class GradStats:
    """Token-weighted sums of per-token statistics over the micro-batches of a step."""

    sums: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    loss: float = 0.0  # the mini-batch loss (sum of the micro-batch losses)
    pg_loss: float = 0.0  # its policy-gradient part

    def add(self, name: str, value: float, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value * weight

    def merge(self, other: GradStats) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.tokens += other.tokens
        self.loss += other.loss
        self.pg_loss += other.pg_loss

    def all_reduce(self) -> None:
        """Sum over data-parallel ranks; a rank that trained nothing may lack keys."""
        keys = STAT_KEYS
        values = [self.sums.get(k, 0.0) for k in keys] + [float(k in self.sums) for k in keys]
        totals = all_reduce_sum(values + [self.tokens, self.loss, self.pg_loss])
        n = len(keys)
        self.sums = {k: totals[i] for i, k in enumerate(keys) if totals[n + i] > 0}
        self.tokens, self.loss, self.pg_loss = totals[2 * n :]

    def means(self) -> dict[str, float]:
        return {k: v / max(self.tokens, 1.0) for k, v in self.sums.items()}


def accumulate_gradients(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    settings: LossSettings,
    *,
    pad_id: int,
    token_budget: int,
    denominator: float,
    entropy_chunk_size: int = 1024,
    with_entropy: bool = True,
    scale: float = 1.0,
    on_micro_batch: Callable[[], None] | None = None,
    ddp: torch.nn.Module | None = None,
    shared_prompt: bool = True,
) -> GradStats:
    """Backpropagate the mini-batch loss through ``model`` in micro-batches.

    ``denominator`` is :func:`loss_denominator` of the whole mini-batch (over all ranks),
    so the gradient does not depend on how ``samples`` are split. ``scale`` multiplies the
    loss (the world size, when the gradient reduction averages over ranks). Samples
    without ``old_logprobs`` use the current policy's (detached), i.e. ratio 1.

    With ``ddp`` (the DistributedDataParallel wrapper of ``model``) each micro-batch runs one
    forward through it (see :func:`response_logits`) and only the last micro-batch's
    backward synchronises gradients, so each rank all-reduces exactly once whatever its
    number of micro-batches; a rank with no samples contributes a zero gradient.
    ``shared_prompt``: see :func:`response_logits`.

    An FSDP-sharded ``model`` gathers parameters in every forward and backward, so every
    rank runs as many passes as the rank with the most micro-batches: the missing ones are
    zero-loss passes that add nothing to the gradient. Gradients are reduce-scattered after
    each pass and accumulate sharded (keeping a full-size gradient until the last pass
    would give up FSDP's memory saving). Each pass is then one whole-sequence forward
    (no shared prompt), so that all ranks run the same collectives.
    """
    stats = GradStats()
    chunks = micro_batches(samples, token_budget)
    fsdp = sharding.is_fsdp(model) and current().enabled
    if ddp is not None and not chunks:
        _zero_backward(ddp, pad_id)
        return stats
    passes = all_reduce_max(len(chunks)) if fsdp else len(chunks)
    if fsdp:  # a shared prompt adds a forward on some ranks only: keep the counts equal
        shared_prompt = False
    for n in range(passes):
        if n >= len(chunks):
            _zero_backward(model, pad_id)
            continue
        idx = chunks[n]
        sync = ddp is None or n == len(chunks) - 1
        with contextlib.nullcontext() if sync else ddp.no_sync():
            stats_chunk = _micro_step(model, [samples[i] for i in idx], settings, pad_id=pad_id,
                                      denominator=denominator, scale=scale,
                                      entropy_chunk_size=entropy_chunk_size,
                                      with_entropy=with_entropy, ddp=ddp,
                                      shared_prompt=shared_prompt)
        stats.merge(stats_chunk)
        if on_micro_batch is not None:
            on_micro_batch()
    return stats


def _zero_backward(model: torch.nn.Module, pad_id: int) -> None:
    """Forward and backward with a zero loss: the collectives of a pass, a zero gradient.

    A rank with nothing (more) to train joins DDP's all-reduce or FSDP's all-gathers and
    reduce-scatters this way.
    """
    out = model(input_ids=torch.tensor([[pad_id]], device=device_of(model)), use_cache=False)
    (out.logits.sum() * 0.0).backward()


def _micro_step(
    model: torch.nn.Module,
    chunk: Sequence[Sample],
    settings: LossSettings,
    *,
    pad_id: int,
    denominator: float,
    scale: float,
    entropy_chunk_size: int,
    with_entropy: bool,
    ddp: torch.nn.Module | None,
    shared_prompt: bool,
) -> GradStats:
    """Forward and backward of one micro-batch; its share of the mini-batch loss."""
    stats = GradStats()
    batch = collate(chunk, pad_id).to(device_of(model))
    logits = response_logits(model, chunk, pad_id=pad_id, temperature=settings.temperature,
                             shared_prompt=shared_prompt, ddp=ddp)
    logp = alg.token_logprobs(logits, batch.response_ids)
    r = batch.response_len
    old = logp.detach().clone()
    for j, s in enumerate(chunk):
        if s.old_logprobs is not None:
            old[j, : s.old_logprobs.numel()] = s.old_logprobs
    adv = torch.tensor([s.advantage for s in chunk], dtype=logp.dtype, device=logp.device)
    tis = None
    if settings.tis_cap is not None:
        # Truncated importance sampling: the responses come from the rollout engine, whose
        # distribution differs from the trainer's old policy (numerics, weights synced every
        # k updates). Each token's loss is weighted by w = min(pi_old / pi_engine, C). w is
        # positive and carries no gradient, so weighting the per-token advantage weights
        # the clipped (and dual-clipped) surrogate itself: min(r A w, clip(r) A w) = w s.
        tis = tis_weights(old, chunk, settings.tis_cap)
        adv = adv[:, None] * tis
    loss, pstats = alg.policy_loss(
        logp,
        old,
        adv,
        batch.loss_mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        clip_c=settings.clip_c,
        agg=settings.loss_agg,
        num_tokens=denominator,
        max_len=settings.max_len,
    )
    pg_loss = loss.detach()
    if settings.beta > 0:
        ref = pad_rows([s.ref_logprobs for s in chunk], r).to(logp.device)
        kl = alg.kl_penalty(logp, ref, settings.kl_estimator)
        kl_loss = alg.aggregate_loss(
            kl, batch.loss_mask, settings.loss_agg, num_tokens=denominator, max_len=settings.max_len
        )
        loss = loss + settings.beta * kl_loss
        stats.add("actor/kl_ref", alg.masked_mean(kl.detach(), batch.loss_mask).item(), batch.loss_mask.sum().item())
    (loss * scale).backward()
    n_tok = batch.loss_mask.sum().item()
    stats.tokens += n_tok
    stats.loss += loss.item()
    stats.pg_loss += pg_loss.item()
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ppo_kl"):
        stats.add(f"actor/{key}", float(pstats[key]), n_tok)
    stats.add("actor/gen_prob", alg.gen_prob(logp.detach(), batch.loss_mask).item(), n_tok)
    if tis is not None:
        stats.add("actor/tis_weight", alg.masked_mean(tis, batch.loss_mask).item(), n_tok)
    if with_entropy:
        ent = alg.entropy_from_logits(logits.detach(), entropy_chunk_size)
        stats.add("actor/entropy", alg.masked_mean(ent, batch.loss_mask).item(), n_tok)
    return stats


def tis_weights(old: torch.Tensor, chunk: Sequence[Sample], cap: float) -> torch.Tensor:
    """``min(exp(old - sampling), cap)`` per response token ``[b, R]``; 1 where a sample has
    no engine log-probs (or on padding)."""
    w = torch.ones_like(old)
    for j, s in enumerate(chunk):
        if s.sampling_logprobs is not None:
            k = s.sampling_logprobs.numel()
            w[j, :k] = torch.exp(old[j, :k] - s.sampling_logprobs.to(old)).clamp(max=cap)
    return w


@dataclass
class StepResult:
    """One optimizer step: its statistics (summed over ranks) and whether it was applied."""

    stats: GradStats
    grad_norm: float
    applied: bool


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    settings: LossSettings,
    *,
    pad_id: int,
    token_budget: int,
    max_grad_norm: float = 1.0,
    entropy_chunk_size: int = 1024,
    with_entropy: bool = True,
    ddp: torch.nn.Module | None = None,
    shared_prompt: bool = True,
) -> StepResult:
    """One exact optimizer step on a mini-batch, on one process or across data-parallel ranks.

    Every rank passes the whole mini-batch; each trains the share that balances token
    counts across ranks. The loss denominator is the all-reduced global count, and the
    loss is scaled by the world size because DDP and FSDP average gradients over ranks:
    the summed gradient is the one a single process computes on the whole mini-batch.
    ``model`` may be sharded with FSDP (``dapo.sharding``); then the gradient norm is
    the global one over all shards. Non-finite gradients are not applied
    (``applied=False``); the caller decides what to do.
    """
    info = current()
    mine: Sequence[Sample] = samples
    if info.enabled:
        parts = balance_by_tokens([s.length for s in samples], info.world_size)
        mine = [samples[i] for i in parts[info.rank]]
    (denominator,) = all_reduce_sum([loss_denominator(mine, settings)])
    stats = accumulate_gradients(
        model, mine, settings, pad_id=pad_id, token_budget=token_budget,
        denominator=denominator, entropy_chunk_size=entropy_chunk_size,
        with_entropy=with_entropy, scale=float(info.world_size), ddp=ddp if info.enabled else None,
        shared_prompt=shared_prompt,
    )
    params = [p for p in model.parameters() if p.grad is not None]
    norm = sharding.grad_norm(params, max_grad_norm)
    if info.enabled:
        stats.all_reduce()
    applied = bool(torch.isfinite(norm)) and math.isfinite(stats.loss)
    if applied:
        sharding.reshard(model)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(stats, float(norm), applied)
