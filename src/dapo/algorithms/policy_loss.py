"""Policy-gradient losses behind one typed contract: ``ppo``, ``gspo`` and ``cispo``.

Each variant is a :class:`TokenLossFn`: it maps the log-probs of the sampled tokens under
the current policy (with gradient) and the old policy, the advantages and the loss mask to
a per-token loss ``[B, T]`` (to minimise) and detached statistics. One function,
:func:`~dapo.algorithms.aggregation.aggregate_loss`, then reduces every variant with the
configured mode and the global denominator, so each is exact under any micro-batch split
(a response is never split across micro-batches, so per-response quantities such as
GSPO's sequence ratio are split-invariant too).

``REGISTRY`` maps ``algorithm.policy_loss`` to the function; :func:`policy_loss` is the
aggregated loss of one of them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dapo.algorithms.aggregation import aggregate_loss, masked_mean
from dapo.choices import LOSS_AGG_MODES, POLICY_LOSSES, LossAgg, PolicyLoss

Stats = dict[str, torch.Tensor]


class TokenLossFn(Protocol):
    """``(logp, old_logp, advantages, mask, *, clip_low, clip_high, clip_c) -> (per-token
    loss [B, T], stats)``. ``advantages`` is ``[B, 1]`` (one per response) or ``[B, T]``."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        clip_low: float,
        clip_high: float,
        clip_c: float | None,
    ) -> tuple[torch.Tensor, Stats]: ...


def _clip_stats(
    ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip_low: float, clip_high: float
) -> Stats:
    """Shares of tokens where the clipped term is the one selected, low and high side."""
    adv = adv.expand_as(ratio)
    return {
        "clip_frac_low": masked_mean(((ratio < 1.0 - clip_low) & (adv < 0)).to(mask), mask),
        "clip_frac_high": masked_mean(((ratio > 1.0 + clip_high) & (adv > 0)).to(mask), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO's clipped surrogate with decoupled bounds (DAPO's Clip-Higher), per token.

    ``r_t = pi_theta(o_t) / pi_old(o_t) = exp(logp_t - logp_old_t)``,
    ``s_t = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)``; with dual clip
    (``clip_c = c > 1``, Ye et al. 2020) tokens with ``A < 0`` use ``max(s_t, c A)``.
    Returns ``-s_t``. DAPO: eps_low 0.2, eps_high 0.28 (arXiv 2503.14476).
    """
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
    with torch.no_grad():
        stats = _clip_stats(ratio, advantages, mask, clip_low, clip_high)
        stats["ppo_kl"] = masked_mean(-log_ratio, mask)
        if clip_c is not None:
            adv = advantages.expand_as(ratio)
            dual = ((adv < 0) & (ratio * adv < clip_c * adv)).to(mask)
            stats["clip_frac_dual"] = masked_mean(dual, mask)
    return -surrogate, stats


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GSPO (Group Sequence Policy Optimization, Qwen, arXiv 2507.18071): one ratio per
    response, the length-normalised sequence likelihood ratio, clipped as a whole.

    ``s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|)
    = exp(1/|y_i| sum_t (logp_it - logp_old_it))`` over the response's loss tokens, and
    ``J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.

    Per token this returns the paper's GSPO-token form, ``-min(s_it A, clip(s_it) A)`` with
    ``s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]``: its value is ``s_i`` and its
    gradient is ``s_i / |y_i| * sum_t grad log pi(y_it)``, i.e. ``grad s_i``. Reduced with
    ``seq-mean-token-mean`` (the paper's 1/G sum_i, which config validation requires) it
    is exactly the sequence objective above. The paper clips far tighter than PPO:
    eps_low 3e-4, eps_high 4e-4 (v2, section 5.1); ``clip_c`` does not apply.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    length = mask.sum(-1, keepdim=True).clamp(min=1)
    log_seq_ratio = (log_ratio * mask).sum(-1, keepdim=True) / length  # log s_i, [B, 1]
    ratio = torch.exp(log_seq_ratio.detach() + logprobs - logprobs.detach())  # s_it
    surrogate = torch.minimum(
        ratio * advantages, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    )
    with torch.no_grad():
        stats = _clip_stats(ratio, advantages, mask, clip_low, clip_high)
        stats["ppo_kl"] = masked_mean(-log_ratio, mask)
    return -surrogate, stats


def cispo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """CISPO (Clipped IS-weight Policy Optimization, MiniMax-M1, arXiv 2506.13585): clip the
    importance weight, not the update, and use it as a stop-gradient coefficient.

    ``J = 1/sum_i |o_i| sum_i sum_t sg(r^_it) A_it log pi_theta(o_it)`` with
    ``r^_it = clip(r_it, 1 - eps_low, 1 + eps_high)``: every token keeps a gradient
    (``r^ A grad log pi``), only its weight is bounded, so the rare "fork" tokens that PPO's
    clip drops still learn. The paper normalises over all tokens (``token-mean``) and sets
    no lower bound (a large eps_low; ``clip_low = 1`` makes the bound 0); it does not
    publish eps_high. ScaleRL (arXiv 2510.13786) caps the weight at 5 (``clip_high = 4``,
    the ``cispo`` preset); verl's example uses 0.2. The loss value is ``-r^ A log pi``, not
    about 0 as PPO's is at ratio 1. ``clip_c`` does not apply.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    per_token = -weight * advantages * logprobs
    with torch.no_grad():
        stats = {
            "clip_frac_low": masked_mean((ratio < 1.0 - clip_low).to(mask), mask),
            "clip_frac_high": masked_mean((ratio > 1.0 + clip_high).to(mask), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return per_token, stats


REGISTRY: dict[str, TokenLossFn] = {
    "ppo": ppo_token_loss,
    "gspo": gspo_token_loss,
    "cispo": cispo_token_loss,
}
assert tuple(REGISTRY) == POLICY_LOSSES, "dapo.choices.PolicyLoss and REGISTRY must agree"


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: PolicyLoss = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    agg: LossAgg = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The aggregated policy loss of variant ``kind`` (see ``REGISTRY``), negated to minimise.

    The default, ``ppo``, is the clipped surrogate with decoupled bounds:
    per token ``r = exp(logp - logp_old)``,
    ``s = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``; with dual clip
    (``clip_c > 1``) tokens with ``A < 0`` use ``max(s, clip_c * A)``. ``weights`` (no
    gradient, e.g. importance weights of the rollout engine) multiply the per-token loss.
    The per-token loss is reduced by :func:`~dapo.algorithms.aggregation.aggregate_loss`
    (``agg``, ``num_tokens``, ``max_len``: see there).

    Returns the scalar loss and detached stats: ``clip_frac_low``/``clip_frac_high`` (share
    of tokens where the low/high bound is active), ``ratio_mean`` and ``ppo_kl``
    (mean of ``logp_old - logp``, the approximate KL to the sampling policy).
    """
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {LOSS_AGG_MODES}")
    if kind not in REGISTRY:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {POLICY_LOSSES}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    per_token, stats = REGISTRY[kind](
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
    )
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, max_len=max_len)
    return loss, stats
