"""The algorithm core: pure functions on tensors, no I/O, no globals.

Notation follows the DAPO paper (arXiv 2503.14476). A batch holds B responses laid out
group after group (rows ``k*G .. k*G+G-1`` are prompt k's G responses); per-token tensors
are ``[B, T]`` with a ``mask`` that is 1 on the response tokens that count in the loss.
"""

from __future__ import annotations

import torch

from dapo.choices import (  # the names of the variants below (one source, shared with config)
    ADVANTAGE_SCALES,
    KL_KINDS,
    LOSS_AGG_MODES,
    AdvantageScale,
    KLKind,
    LossAgg,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "EPS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "entropy_from_logits",
    "gen_prob",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "token_logprobs",
]

EPS = 1e-6


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: AdvantageScale = "group"
) -> torch.Tensor:
    """One advantage per response, shared by all of its tokens.

    ``"group"`` (GRPO, DAPO): ``A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6)``
    with the unbiased std; a group of one response uses mean 0 and std 1.
    ``"batch"``: group mean, std over the whole batch. ``"none"`` (Dr. GRPO): ``R_i - mean``.
    A group whose rewards are all equal gets exactly zero advantages.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the {rewards.numel()} rewards; "
            "lay rewards out group after group with the same number of responses each"
        )
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {ADVANTAGE_SCALES}")
    grouped = rewards.reshape(-1, group_size)
    if group_size == 1:
        mean = torch.zeros_like(grouped)
        std = torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, keepdim=True)
    # An all-equal group must give exactly 0; its float mean can be off by one rounding step,
    # which the division by a near-zero std would then blow up.
    same = (grouped == grouped[:, :1]).all(dim=1, keepdim=True) & (group_size > 1)
    centred = torch.where(same, torch.zeros_like(grouped), grouped - mean)
    if scale == "none":
        return centred.reshape(-1)
    if scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else torch.ones((), dtype=rewards.dtype)
    return (centred / (std + EPS)).reshape(-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)``."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


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
    (``clip_c > 1``) tokens with ``A < 0`` use ``max(s, clip_c * A)``. Aggregation:

    - ``"token-mean"`` (DAPO): ``-sum_i sum_t s_it / num_tokens``. ``num_tokens`` defaults
      to ``mask.sum()``; pass the token count of the whole optimizer-step batch when this
      call sees one micro-batch of it, so that the summed micro-batch losses are exact.
    - ``"seq-mean-token-mean"`` (GRPO): ``-1/B sum_i 1/|o_i| sum_t s_it``.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): ``-sum_i sum_t s_it / (B * max_len)``.

    For the two sequence modes B is the number of rows passed; when a batch is split,
    pass ``num_tokens`` as the total number of responses (``seq-mean-token-mean``) or the
    total ``B * max_len`` (``seq-mean-token-sum-norm``) to keep the split exact.

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


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    agg: LossAgg = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar by one of the aggregation modes.

    See :func:`policy_loss` for the modes and the meaning of ``num_tokens``; the KL
    penalty uses the same reduction so both terms share one normalisation.
    """
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {LOSS_AGG_MODES}")
    mask = mask.to(per_token.dtype)
    if agg == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return masked_sum(per_token, mask) / _positive(denom)
    if agg == "seq-mean-token-mean":
        seq_mean = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        denom = mask.shape[0] if num_tokens is None else num_tokens
        return seq_mean.sum() / _positive(denom)
    width = mask.shape[-1] if max_len is None else max_len
    denom = mask.shape[0] * width if num_tokens is None else num_tokens
    return masked_sum(per_token, mask) / _positive(denom)


def _positive(denom: float | torch.Tensor) -> float | torch.Tensor:
    """Guard a loss denominator against 0 (an all-masked batch has a zero loss, not NaN)."""
    if isinstance(denom, torch.Tensor):
        return denom.clamp(min=1e-8)
    return max(float(denom), 1e-8)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token estimator of ``KL(pi_theta || pi_ref)`` from log-probs of sampled tokens.

    ``k1 = log pi - log pi_ref``; ``k2 = 0.5 (log pi - log pi_ref)^2``;
    ``k3 = pi_ref/pi - log(pi_ref/pi) - 1`` (GRPO's, unbiased and non-negative).
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        # Clamp as a guard against overflow when the policies are far apart.
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., token]`` for each position: ``[B, T, V], [B, T] -> [B, T]``.

    Uses ``logsumexp`` so that no second ``[B, T, V]`` tensor is kept for backward.
    """
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` of ``softmax(logits)`` at every position.

    Works on ``chunk_size`` positions at a time, so that the full-vocabulary probability
    tensor exists for one chunk only. Returns ``logits.shape[:-1]``; no gradient.
    """
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=logits.dtype, device=logits.device)
        for start in range(0, flat.shape[0], chunk_size):
            chunk = flat[start : start + chunk_size]
            logp = torch.log_softmax(chunk, dim=-1)
            out[start : start + chunk_size] = -(logp.exp() * logp).sum(-1)
        return out.reshape(logits.shape[:-1])


def gen_prob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean probability of the sampled tokens, ``mean(exp(log pi(o_t)))`` over the mask."""
    return masked_mean(torch.exp(logprobs), mask.to(logprobs.dtype))
