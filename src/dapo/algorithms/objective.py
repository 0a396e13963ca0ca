"""The whole loss of a micro-batch from per-token log-probs: the one seam between the
forward pass (which produces log-probs and entropies) and the algorithm.

``L = PG + beta * KL - entropy_coef * H``, every term reduced by
:func:`~dapo.algorithms.aggregation.aggregate_loss` with the same mode and the same
global denominator of the optimizer-step batch, so the sum of the micro-batch losses is
the mini-batch loss whatever the split. PG is one of the policy losses
(:mod:`dapo.algorithms.policy_loss`), or Clip-Cov / KL-Cov
(:mod:`dapo.algorithms.entropy`), its per-token terms weighted by the engine-vs-trainer
importance weights (:mod:`dapo.algorithms.corrections`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo.algorithms.aggregation import aggregate_loss, masked_mean
from dapo.algorithms.entropy import clip_cov_token_loss, kl_cov_token_loss
from dapo.algorithms.kl import kl_penalty
from dapo.algorithms.policy_loss import REGISTRY, Stats
from dapo.choices import (
    EntropyControl,
    ISLevel,
    ISMode,
    KLKind,
    LossAgg,
    PolicyLoss,
    ProximalLogprobs,
)
from dapo.config.algorithm import AlgorithmConfig

_ALGO = AlgorithmConfig()  # the defaults, written once, in the config


@dataclass
class LossSettings:
    """The algorithm knobs the loss needs: the ``algorithm`` config fields of the same names
    (their defaults read from :class:`~dapo.config.AlgorithmConfig`), the sampling
    temperature and L_max."""

    policy_loss: PolicyLoss = _ALGO.policy_loss
    clip_low: float = _ALGO.clip_low
    clip_high: float = _ALGO.clip_high
    clip_c: float | None = _ALGO.clip_c
    loss_agg: LossAgg = _ALGO.loss_agg
    beta: float = _ALGO.beta
    kl_estimator: KLKind = _ALGO.kl_estimator
    temperature: float = 1.0  # rollout.temperature
    max_len: int = 1  # L_max (rollout.max_completion_length), for seq-mean-token-sum-norm
    is_level: ISLevel = _ALGO.is_level  # engine-vs-trainer importance weights (corrections.py)
    is_mode: ISMode = _ALGO.is_mode
    is_cap: float | None = _ALGO.is_cap  # None: no correction
    proximal_logprobs: ProximalLogprobs = _ALGO.proximal_logprobs  # streaming's proximal policy
    entropy_coef: float = _ALGO.entropy_coef
    entropy_control: EntropyControl = _ALGO.entropy_control
    clip_cov_ratio: float = _ALGO.clip_cov_ratio
    clip_cov_low: float = _ALGO.clip_cov_low
    clip_cov_high: float = _ALGO.clip_cov_high
    kl_cov_ratio: float = _ALGO.kl_cov_ratio
    kl_cov_coef: float = _ALGO.kl_cov_coef


# The entries of compute_loss's stats that are parts of the loss itself, aggregated with the
# global denominator (they add up over micro-batches); every other entry is a per-token mean.
LOSS_PARTS = ("pg_loss", "entropy_bonus")


def compute_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    *,
    denominator: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The loss to backpropagate for ``[b, R]`` response tokens, and detached stats.

    - ``logprobs`` (with gradient), ``old_logprobs`` (the ratio's denominator policy),
      ``advantages`` ``[b]`` or ``[b, R]``, ``mask`` the tokens that count (overlong- and
      IS-masked tokens are 0);
    - ``denominator``: the global normaliser of the mini-batch for ``settings.loss_agg``
      (``dapo.training.microbatch.loss_denominator`` summed over ranks); None: this batch's own;
    - ``is_weights``: engine-vs-trainer importance weights, multiply the policy term;
    - ``selected``: the Clip-Cov / KL-Cov token selection (with ``entropy_control``);
    - ``ref_logprobs``: the reference policy's, for ``beta > 0``;
    - ``entropy``: differentiable per-token entropy, for ``entropy_coef > 0``.

    Stats: the policy loss's (clip fractions, ``ratio_mean``, ``ppo_kl``), ``pg_loss``
    (the aggregated policy term), ``kl_ref`` (mean per-token KL, beta > 0) and
    ``entropy_bonus`` (``entropy_coef * aggregated H``, subtracted from the loss).
    """
    s = settings
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    agg = {"agg": s.loss_agg, "num_tokens": denominator, "max_len": s.max_len}
    if s.entropy_control != "none":
        chosen = torch.zeros_like(mask, dtype=torch.bool) if selected is None else selected
        if s.entropy_control == "clip_cov":
            per_token, stats = clip_cov_token_loss(
                logprobs,
                old_logprobs,
                adv,
                mask,
                chosen,
                clip_low=s.clip_low,
                clip_high=s.clip_high,
                clip_c=s.clip_c,
            )
        else:
            per_token, stats = kl_cov_token_loss(
                logprobs, old_logprobs, adv, mask, chosen, coef=s.kl_cov_coef
            )
    else:
        per_token, stats = REGISTRY[s.policy_loss](
            logprobs,
            old_logprobs,
            adv,
            mask,
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            clip_c=s.clip_c,
        )
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = aggregate_loss(per_token, mask, **agg)
    stats = {**stats, "pg_loss": loss.detach()}
    if s.beta > 0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference policy's log-probs (ref_logprobs)")
        kl = kl_penalty(logprobs, ref_logprobs, s.kl_estimator)
        loss = loss + s.beta * aggregate_loss(kl, mask, **agg)
        stats["kl_ref"] = masked_mean(kl.detach(), mask.to(kl.dtype))
    if s.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the differentiable per-token entropy")
        bonus = s.entropy_coef * aggregate_loss(entropy, mask, **agg)
        loss = loss - bonus
        stats["entropy_bonus"] = bonus.detach()
    return loss, stats
