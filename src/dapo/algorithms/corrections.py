"""Importance weights that correct for the rollout engine sampling from another distribution
than the trainer's old policy (vLLM kernels, bf16, weights synced every k updates).

The responses come from ``pi_engine``; the loss's ratio is taken against the trainer's
``pi_old`` (the same weights, recomputed). The gap is corrected with the importance ratio
``rho = pi_old / pi_engine`` of the sampled tokens, per token or per response (their
product, or their geometric mean), and large ratios are either truncated (TIS, a biased,
low-variance weight) or the token or response is dropped from the loss (masked IS,
rejection). Papers and peers: "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (Yao et al., 2025, token-level TIS, cap 2); verl's ``rollout_corr`` (token,
sequence or geometric, truncate or reject) and SkyRL's off-policy correction; TRL's
``vllm_importance_sampling_mode`` (default ``sequence_mask``, cap 3.0).
"""

from __future__ import annotations

import torch

from dapo.choices import IS_LEVELS, IS_MODES, ISLevel, ISMode

SAFETY_BOUND = 20.0  # |log rho| beyond this is clamped before exp (as verl): no inf * 0


def is_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    level: ISLevel = "token",
    mode: ISMode = "truncate",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Engine-vs-trainer importance weights of ``[B, T]`` sampled tokens (no gradient).

    ``level="token"``: ``rho_t = pi_old(o_t) / pi_engine(o_t) = exp(logp_old_t - logp_engine_t)``.
    ``level="sequence"``: one ratio per response, the likelihood ratio of the whole response,
    ``rho_i = prod_t rho_it = exp(sum_t (logp_old_it - logp_engine_it))`` over the tokens
    where ``mask`` is 1 (the response tokens), applied to all of them. The product: it is
    the importance weight of the response as a sample (unbiased), as in verl and TRL; its
    spread grows with the length (a per-token gap of 0.01 nats is a factor e^10 over 1000
    tokens), so on long responses most of them cross any cap.
    ``level="geometric"``: one ratio per response, the geometric mean of its token ratios,
    ``rho_i = exp(mean_t (logp_old_it - logp_engine_it))`` over the tokens where ``mask`` is
    1 (1 for a response without any), applied to all of them: the ``geo`` mode of verl's
    ``rollout_corr`` and of SkyRL (the form of the GSPO ratio). It is not the response's
    likelihood ratio (biased, as truncation is), but it does not grow with the length: a
    cap means the same for short and long responses.

    ``mode="truncate"``: ``w = min(rho, cap)``, every token kept. ``mode="mask"``:
    ``w = rho`` where ``rho <= cap``; a token (or response) above the cap is dropped: weight
    0 and ``keep`` 0, so that it leaves the loss and, under ``token-mean``, the token count
    that divides it, like a response removed by overlong filtering (the ``seq-mean-*``
    denominators count responses, and still count a dropped one, as they count a filtered one).

    Returns ``(weights, keep, over_cap)``: weights, the 0/1 keep mask, and where ``rho``
    exceeded the cap (truncated or dropped), each ``[B, T]`` and 0 where ``mask`` is 0.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose one of {IS_LEVELS}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose one of {IS_MODES}")
    with torch.no_grad():
        mask = mask.to(old_logprobs.dtype)
        log_rho = (old_logprobs - sampling_logprobs.to(old_logprobs)) * mask
        if level == "sequence":
            log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)
        elif level == "geometric":
            tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
            log_rho = (log_rho.sum(-1, keepdim=True) / tokens).expand_as(mask)
        rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        over = (rho > cap).to(mask) * mask
        if mode == "truncate":
            return rho.clamp(max=cap) * mask, mask.clone(), over
        keep = mask * (1.0 - over)
        return rho * keep, keep, over


def loglinear_proximal(
    behaviour: torch.Tensor,
    current: torch.Tensor,
    versions: torch.Tensor,
    version: int,
    progress: float,
) -> torch.Tensor:
    """AReaL's log-linear approximation of the proximal policy's log-probs (decoupled PPO
    without the proximal forward pass).

    The proximal policy is the one at the start of the update (rollout step ``version``);
    a token was sampled by ``versions`` (the behaviour policy, ``behaviour`` its log-prob);
    the weights being trained are ``progress`` in [0, 1) of the way through this step's
    updates (``current`` their log-prob, detached). Interpolating in log space along the
    versions::

        alpha = (v_prox - v_behave) / (v_theta - v_behave)
        log pi_prox ~= log pi_behave + alpha * (log pi_theta - log pi_behave)

    with v_prox = version, v_theta = version + progress. It is exact where it can be: at the
    first update (progress 0) alpha = 1 and pi_prox = pi_theta; a token sampled this step
    (v_behave = v_prox) gets alpha = 0 and pi_prox = pi_behave.
    """
    ahead = (float(version) - versions).clamp(min=0).to(current.dtype)
    span = ahead + float(progress)
    alpha = torch.where(span > 0, ahead / span.clamp(min=1e-12), torch.ones_like(span))
    return behaviour + alpha * (current - behaviour)
