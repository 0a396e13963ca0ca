"""One optimizer step's gradient, exact under any micro-batch split.

The loss of a mini-batch is normalised by denominators of the *whole* mini-batch (for
``token-mean``, its number of loss tokens after overlong filtering), computed once before
any micro-batch runs. Each micro-batch then contributes ``sum(loss tokens) / global`` and
the accumulated gradient equals the one of a single pass over the whole mini-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dapo import algorithms as alg
from dapo.algorithms import LossSettings
from dapo.errors import TrainingError
from dapo.models.inputs import device_of
from dapo.models.precision import autocast
from dapo.parallel import sharding
from dapo.parallel.distributed import all_reduce_max, all_reduce_sum, current, token_share
from dapo.training.batch import Sample
from dapo.training.corrections import cov_selection
from dapo.training.forward import collate, micro_batches, pad_rows, response_logprobs

if TYPE_CHECKING:
    from dapo.config import Config, TrainConfig


def loss_settings(cfg: Config) -> LossSettings:
    """The loss knobs of a run: the ``algorithm`` fields of the same names, the sampling
    temperature and L_max (``rollout.max_completion_length``)."""
    shared = {
        f.name: getattr(cfg.algorithm, f.name)
        for f in dataclasses.fields(LossSettings)
        if hasattr(cfg.algorithm, f.name)
    }
    return LossSettings(
        **shared,
        temperature=cfg.rollout.temperature,
        max_len=cfg.rollout.max_completion_length,
    )


def lr_at(step: int, t: TrainConfig) -> float:
    """The learning rate of rollout step ``step``: linear warm-up, then constant or cosine."""
    warm = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
    if t.lr_schedule == "cosine" and t.steps > t.warmup_steps:
        progress = min(1.0, max(0.0, (step - t.warmup_steps) / (t.steps - t.warmup_steps)))
        floor = t.min_lr_ratio
        return t.lr * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return t.lr * warm


def plan_updates(
    n_samples: int, group_size: int, prompts_per_step: int, mini_batch_size: int, epochs: int,
    *, seed: int,
) -> list[tuple[int, list[int]]]:  # fmt: skip
    """``(epoch, sample indices)`` of every optimizer update of a rollout step: whole groups,
    shuffled per epoch (seeded), cut into mini-batches of ``mini_batch_size`` prompts.

    A full batch (``prompts_per_step`` groups) makes ``prompts_per_step / mini_batch_size``
    updates per epoch. A short batch of ``n`` groups (the round cap with
    ``algorithm.round_cap=train``) makes ``ceil(n / mini_batch_size)`` updates whose sizes
    differ by at most one group (29 groups with mini-batches of 16: 15 + 14, not 16 + 13),
    so no update is a sliver and no sample is used more often than in a full batch. Each
    update is still normalised by its own global token count.
    """
    n_groups, rest = divmod(n_samples, group_size)
    if rest:
        raise TrainingError(f"{n_samples} samples do not make groups of {group_size} responses")
    if n_groups > prompts_per_step:
        raise TrainingError(f"{n_groups} groups exceed train.prompts_per_step={prompts_per_step}")
    n_updates = -(-n_groups // mini_batch_size)  # = prompts_per_step // mini_batch_size if full
    base, extra = divmod(n_groups, max(n_updates, 1))
    sizes = [base + (m < extra) for m in range(n_updates)]
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for epoch in range(epochs):
        order = torch.randperm(n_groups, generator=gen).tolist()
        start = 0
        for size in sizes:
            gids = order[start : start + size]
            start += size
            plan.append((epoch, [g * group_size + j for g in gids for j in range(group_size)]))
    return plan


def make_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or LoRA's adapters), with weight
    decay on matrices only (not on biases, norms or other vectors).

    The fused kernel updates each parameter in one pass: the default single-tensor (CPU) and
    foreach (CUDA) paths allocate temporaries as large as the largest parameter or as all of
    them, which made a Qwen2.5-0.5B-shaped step peak ~1 GB higher (``bench_memory.py``).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        fused=_fused_supported([*decay, *no_decay]),
    )


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter: floating point, on CPU or CUDA."""
    supported = ("cpu", "cuda")
    return bool(params) and all(p.is_floating_point() and p.device.type in supported for p in params)


def loss_denominator(samples: Sequence[Sample], settings: LossSettings) -> float:
    """The global normaliser of a mini-batch for the configured aggregation.

    ``token-mean``: loss tokens (masked ones do not count: truncated responses under
    overlong filtering, tokens or responses dropped by masked importance sampling);
    ``seq-mean-token-mean``: responses; ``seq-mean-token-sum-norm``: responses x L_max.
    In data-parallel training the caller sums this over ranks.
    """
    if settings.loss_agg == "token-mean":
        return float(sum(float(s.train_mask().sum()) for s in samples))
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
)


@dataclass
class GradStats:
    """Token-weighted sums of per-token statistics over the micro-batches of a step."""

    sums: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    loss: float = 0.0  # the mini-batch loss (sum of the micro-batch losses)
    pg_loss: float = 0.0  # its policy-gradient part
    entropy_bonus: float = 0.0  # entropy_coef x aggregated entropy, subtracted from the loss

    def add(self, name: str, value: float, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value * weight

    def merge(self, other: GradStats) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.tokens += other.tokens
        self.loss += other.loss
        self.pg_loss += other.pg_loss
        self.entropy_bonus += other.entropy_bonus

    def all_reduce(self) -> None:
        """Sum over data-parallel ranks; a rank that trained nothing may lack keys."""
        keys = STAT_KEYS
        values = [self.sums.get(k, 0.0) for k in keys] + [float(k in self.sums) for k in keys]
        totals = all_reduce_sum(
            values + [self.tokens, self.loss, self.pg_loss, self.entropy_bonus]
        )
        n = len(keys)
        self.sums = {k: totals[i] for i, k in enumerate(keys) if totals[n + i] > 0}
        self.tokens, self.loss, self.pg_loss, self.entropy_bonus = totals[2 * n :]

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
    logits_chunk_size: int = 1024,
    with_entropy: bool = True,
    scale: float = 1.0,
    ddp: torch.nn.Module | None = None,
    shared_prompt: bool = True,
    selected: Sequence[torch.Tensor | None] | None = None,
) -> GradStats:
    """Backpropagate the mini-batch loss through ``model`` in micro-batches.

    ``denominator`` is :func:`loss_denominator` of the whole mini-batch (over all ranks),
    so the gradient does not depend on how ``samples`` are split. ``scale`` multiplies the
    loss (the world size, when the gradient reduction averages over ranks). Samples
    without ``old_logprobs`` use the current policy's (detached), i.e. ratio 1, and keep them
    as their ``old_logprobs`` (the trainer compares them with the engine's).
    ``selected``: the Clip-Cov / KL-Cov token selection of each sample
    (:func:`dapo.training.corrections.cov_selection`), when ``entropy_control`` is on.

    With ``ddp`` (the DistributedDataParallel wrapper of ``model``) each micro-batch runs one
    forward through it (see :func:`~dapo.training.forward.response_logits`) and only the last micro-batch's
    backward synchronises gradients, so each rank all-reduces exactly once whatever its
    number of micro-batches; a rank with no samples contributes a zero gradient.
    ``shared_prompt``: see :func:`~dapo.training.forward.response_logits`.

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
                                      logits_chunk_size=logits_chunk_size,
                                      with_entropy=with_entropy, ddp=ddp,
                                      shared_prompt=shared_prompt,
                                      selected=None if selected is None else [selected[i] for i in idx])
        stats.merge(stats_chunk)
    return stats


def _zero_backward(model: torch.nn.Module, pad_id: int) -> None:
    """Forward and backward with a zero loss: the collectives of a pass, a zero gradient.

    A rank with nothing (more) to train joins DDP's all-reduce or FSDP's all-gathers and
    reduce-scatters this way.
    """
    with autocast(model):
        out = model(input_ids=torch.tensor([[pad_id]], device=device_of(model)), use_cache=False)
    (out.logits.float().sum() * 0.0).backward()


def _micro_step(
    model: torch.nn.Module,
    chunk: Sequence[Sample],
    settings: LossSettings,
    *,
    pad_id: int,
    denominator: float,
    scale: float,
    logits_chunk_size: int,
    with_entropy: bool,
    ddp: torch.nn.Module | None,
    shared_prompt: bool,
    selected: Sequence[torch.Tensor | None] | None = None,
) -> GradStats:
    """Forward and backward of one micro-batch; its share of the mini-batch loss."""
    stats = GradStats()
    batch = collate(chunk, pad_id).to(device_of(model))
    # (a) per-token log-probs (with grad) and entropies [b, R] of the responses, float32
    logp, entropy = response_logprobs(model, chunk, pad_id=pad_id, temperature=settings.temperature,
                                      chunk_size=logits_chunk_size, shared_prompt=shared_prompt,
                                      ddp=ddp)
    # (b) the loss from them
    r = batch.response_len
    device = logp.device
    old = logp.detach().clone()
    for j, s in enumerate(chunk):
        if s.old_logprobs is not None:
            old[j, : s.old_logprobs.numel()] = s.old_logprobs
        else:  # ratio 1: this forward is the old policy (kept to compare with the engine's)
            s.old_logprobs = old[j, : len(s.response_ids)].clone()
    mask = pad_rows([s.train_mask() for s in chunk], r).to(device=device, dtype=logp.dtype)
    adv = torch.tensor([s.advantage for s in chunk], dtype=logp.dtype, device=device)
    is_w = None
    if any(s.is_weight is not None for s in chunk):
        rows = [s.is_weight if s.is_weight is not None else torch.ones(len(s.response_ids))
                for s in chunk]  # fmt: skip
        is_w = pad_rows(rows, r).to(device=device, dtype=logp.dtype)
    chosen = None
    if selected is not None and any(x is not None for x in selected):
        rows = [x if x is not None else torch.zeros(len(s.response_ids), dtype=torch.bool)
                for x, s in zip(selected, chunk, strict=True)]  # fmt: skip
        chosen = pad_rows([x.float() for x in rows], r).to(device) > 0
    ref = None
    if settings.beta > 0:
        ref = pad_rows([s.ref_logprobs for s in chunk], r).to(device)
    loss, terms = alg.compute_loss(
        logp, old, adv, mask, settings, denominator=denominator, is_weights=is_w,
        selected=chosen, ref_logprobs=ref,
        entropy=entropy if settings.entropy_coef > 0 else None,
    )  # fmt: skip
    (loss * scale).backward()
    n_tok = mask.sum().item()
    stats.tokens += n_tok
    stats.loss += loss.item()
    stats.pg_loss += terms["pg_loss"].item()
    stats.entropy_bonus += terms["entropy_bonus"].item() if "entropy_bonus" in terms else 0.0
    for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "ppo_kl", "kl_ref"):
        if key in terms:
            stats.add(f"actor/{key}", float(terms[key]), n_tok)
    stats.add("actor/gen_prob", alg.gen_prob(logp.detach(), mask).item(), n_tok)
    if with_entropy:
        stats.add("actor/entropy", alg.masked_mean(entropy.detach(), mask).item(), n_tok)
    return stats


@dataclass
class StepResult:
    """One optimizer step: its statistics (summed over ranks) and whether it was applied."""

    stats: GradStats
    grad_norm: float
    applied: bool
    selection: dict[str, float] = field(default_factory=dict)  # actor/cov_selected_frac


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Sample],
    settings: LossSettings,
    *,
    pad_id: int,
    token_budget: int,
    max_grad_norm: float = 1.0,
    logits_chunk_size: int = 1024,
    with_entropy: bool = True,
    ddp: torch.nn.Module | None = None,
    shared_prompt: bool = True,
    seed: int = 0,
) -> StepResult:
    """One exact optimizer step on a mini-batch, on one process or across data-parallel ranks.

    Every rank passes the whole mini-batch; each trains the share that balances token
    counts across ranks. The loss denominator is the all-reduced global count, and the
    loss is scaled by the world size because DDP and FSDP average gradients over ranks:
    the summed gradient is the one a single process computes on the whole mini-batch.
    ``model`` may be sharded with FSDP (``dapo.parallel.sharding``); then the gradient norm is
    the global one over all shards. Non-finite gradients are not applied
    (``applied=False``); the caller decides what to do. ``seed`` draws Clip-Cov's random
    token choice (:func:`dapo.training.corrections.cov_selection`).
    """
    info = current()
    ids = token_share([s.length for s in samples], info)
    mine = [samples[i] for i in ids]
    selected, selection = cov_selection(mine, ids, settings, seed=seed)
    (denominator,) = all_reduce_sum([loss_denominator(mine, settings)])
    stats = accumulate_gradients(
        model, mine, settings, pad_id=pad_id, token_budget=token_budget,
        denominator=denominator, logits_chunk_size=logits_chunk_size,
        with_entropy=with_entropy, scale=float(info.world_size), ddp=ddp if info.enabled else None,
        shared_prompt=shared_prompt, selected=selected,
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
    return StepResult(stats, float(norm), applied, selection)
