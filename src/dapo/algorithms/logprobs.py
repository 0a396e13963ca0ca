"""Log-probabilities of the sampled tokens and their mean probability."""

from __future__ import annotations

import torch

from dapo.algorithms.aggregation import masked_mean


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., token]`` for each position: ``[B, T, V], [B, T] -> [B, T]``.

    Uses ``logsumexp`` so that no second ``[B, T, V]`` tensor is kept for backward.
    """
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def gen_prob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean probability of the sampled tokens, ``mean(exp(log pi(o_t)))`` over the mask."""
    return masked_mean(torch.exp(logprobs), mask.to(logprobs.dtype))
