"""The clipped policy-gradient loss (PPO-style, with DAPO's decoupled bounds)."""

from __future__ import annotations

import torch

from dapo.algorithms.aggregation import aggregate_loss, masked_mean
from dapo.choices import LOSS_AGG_MODES, LossAgg


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss with decoupled bounds (Clip-Higher), negated to minimise.

    Per token: ``r = exp(logp - logp_old)``,
    ``s = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``; with dual clip
    (``clip_c > 1``) tokens with ``A < 0`` use ``max(s, clip_c * A)``. The per-token
    ``-s`` is reduced by :func:`~dapo.algorithms.aggregation.aggregate_loss` (``agg``,
    ``num_tokens``, ``max_len``: see there).

    Returns the scalar loss and detached stats: ``clip_frac_low``/``clip_frac_high`` (share
    of tokens where the low/high bound is active), ``ratio_mean`` and ``ppo_kl``
    (mean of ``logp_old - logp``, the approximate KL to the sampling policy).
    """
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {LOSS_AGG_MODES}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if clip_c is not None:
        surrogate = torch.where(
            advantages < 0, torch.maximum(surrogate, clip_c * advantages), surrogate
        )
    per_token = -surrogate
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, max_len=max_len)

    with torch.no_grad():
        adv = advantages.expand_as(ratio)
        low = ((ratio < 1.0 - clip_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1.0 + clip_high) & (adv > 0)).to(mask.dtype)
        stats = {
            "clip_frac_low": masked_mean(low, mask),
            "clip_frac_high": masked_mean(high, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
        if clip_c is not None:
            dual = ((adv < 0) & (ratio * adv < clip_c * adv)).to(mask.dtype)
            stats["clip_frac_dual"] = masked_mean(dual, mask)
    return loss, stats
