"""Policy entropy, and the entropy controls of "The Entropy Mechanism of Reinforcement
Learning for Reasoning Language Models" (Cui et al., arXiv 2505.22617).

That paper shows that the entropy change of a softmax policy under policy gradient is
driven by the covariance between a token's log-probability and its advantage: confident
tokens (high ``log pi``) with positive advantage lower the entropy, and in RL for reasoning
this covariance stays positive, so the entropy collapses. Its two fixes act on the few
tokens with the largest covariance,
``Cov_t = (log pi(y_t) - mean log pi) * (A_t - mean A)`` (means over the batch's tokens):

- **Clip-Cov**: pick ``max(int(r N), 1)`` tokens at random among those with
  ``omega_low < Cov_t < omega_high`` and drop their gradient (their loss term is 0).
  Paper / authors' scripts: ``r = 2e-4``, ``(omega_low, omega_high) = (1, 5)``, PPO clip
  range 1 (i.e. practically no ratio clipping).
- **KL-Cov**: on the ``max(int(k N), 1)`` tokens with the largest covariance, add the
  penalty ``beta * |log pi_theta(y_t) - log pi_old(y_t)|`` (the authors' per-token KL) to
  the *unclipped* surrogate ``-r_t A_t``; elsewhere ``-r_t A_t``. Paper / scripts:
  ``k = 2e-3`` (Qwen2.5-7B), ``2e-4`` (32B), ``beta = 1``.

The selection here is made over the whole mini-batch (all ranks), from covariances the
caller computes with global means (:func:`token_covariance` takes them as arguments); the
selection functions take the token keys and return a mask.
"""

from __future__ import annotations

import torch

from dapo.algorithms.aggregation import masked_mean
from dapo.algorithms.policy_loss import Stats, ppo_token_loss


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


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Differentiable entropy ``H_t = -sum_v p_v log p_v`` at every position, for the
    entropy bonus (``algorithm.entropy_coef``): ``[..., V] -> [...]``.

    Its gradient with respect to the logits is ``-p_v (log p_v + H_t)``. It keeps the
    ``[..., V]`` log-softmax for backward, so it is computed only when the bonus is on.
    """
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_covariance(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    mean_logprob: float | torch.Tensor | None = None,
    mean_advantage: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``Cov_t = (logp_t - mean logp) * (A_t - mean A)`` per token ``[B, T]``, 0 where
    ``mask`` is 0. The means are over the mask's tokens; pass the means of the whole
    (multi-rank) batch when this call sees a part of it. No gradient."""
    with torch.no_grad():
        mask = mask.to(logprobs.dtype)
        adv = advantages.to(logprobs.dtype)
        adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(logprobs)
        if mean_logprob is None:
            mean_logprob = masked_mean(logprobs, mask)
        if mean_advantage is None:
            mean_advantage = masked_mean(adv, mask)
        return (logprobs - mean_logprob) * (adv - mean_advantage) * mask


def selection_count(num_tokens: float, ratio: float) -> int:
    """How many tokens Clip-Cov / KL-Cov act on: ``max(int(ratio * N), 1)``, 0 for N = 0."""
    return max(int(ratio * num_tokens), 1) if num_tokens > 0 else 0


def clip_cov_keys(
    cov: torch.Tensor, mask: torch.Tensor, priority: torch.Tensor, *, low: float, high: float
) -> torch.Tensor:
    """Clip-Cov's selection keys: ``-priority`` on the candidates (loss tokens with
    ``low < Cov_t < high``), ``-inf`` elsewhere. With ``priority`` i.i.d. uniform, the ``n``
    largest keys are ``n`` candidates drawn uniformly at random without replacement."""
    candidate = (cov > low) & (cov < high) & (mask > 0)
    return torch.where(candidate, -priority.to(cov), torch.full_like(cov, -torch.inf))


def kl_cov_keys(cov: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL-Cov's selection keys: the covariance on loss tokens, ``-inf`` elsewhere."""
    return torch.where(mask > 0, cov, torch.full_like(cov, -torch.inf))


def top_k_mask(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest finite ``keys`` (fewer if fewer are finite) as a bool mask; ties go
    to the earlier position in row-major order."""
    flat = keys.reshape(-1)
    order = torch.sort(-flat, stable=True).indices[:k]
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order] = True
    return (chosen & torch.isfinite(flat)).reshape(keys.shape)


def clip_cov_select(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    priority: torch.Tensor,
    *,
    ratio: float = 2e-4,
    low: float = 1.0,
    high: float = 5.0,
) -> torch.Tensor:
    """Clip-Cov's token selection on one batch: ``max(int(r N), 1)`` tokens among those with
    ``low < Cov_t < high`` (N loss tokens), chosen by ``priority`` (random draws)."""
    cov = token_covariance(logprobs, advantages, mask)
    keys = clip_cov_keys(cov, mask, priority, low=low, high=high)
    return top_k_mask(keys, selection_count(float(mask.sum()), ratio))


def kl_cov_select(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, ratio: float = 2e-3
) -> torch.Tensor:
    """KL-Cov's token selection on one batch: the ``max(int(k N), 1)`` loss tokens with the
    largest covariance."""
    cov = token_covariance(logprobs, advantages, mask)
    return top_k_mask(kl_cov_keys(cov, mask), selection_count(float(mask.sum()), ratio))


def clip_cov_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    selected: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clip-Cov per token: PPO's clipped surrogate ``-min(r A, clip(r) A)`` (authors' code;
    the paper's formula is the unclipped ``-r A``, which a clip range of 1 nearly is), with
    dual clip at ``clip_c`` when set, and ``0`` on the selected tokens, whose gradient is so
    dropped."""
    per_token, stats = ppo_token_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_c=clip_c,
    )
    return per_token * (~selected.bool()).to(per_token), stats


def kl_cov_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    selected: torch.Tensor,
    *,
    coef: float = 1.0,
) -> tuple[torch.Tensor, Stats]:
    """KL-Cov per token: ``-r_t A_t + beta * |logp_t - logp_old_t|`` on the selected tokens,
    ``-r_t A_t`` elsewhere (no ratio clipping: the paper's objective has none)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    per_token = -ratio * advantages + coef * log_ratio.abs() * selected.to(logprobs)
    with torch.no_grad():
        stats = {"ratio_mean": masked_mean(ratio, mask), "ppo_kl": masked_mean(-log_ratio, mask)}
    return per_token, stats
