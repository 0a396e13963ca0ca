"""Per-token KL estimators against the reference policy (the ``beta`` term)."""

from __future__ import annotations

import torch

from dapo.choices import KL_KINDS, KLKind


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
