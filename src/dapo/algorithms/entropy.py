"""Policy entropy."""

from __future__ import annotations

import torch


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
