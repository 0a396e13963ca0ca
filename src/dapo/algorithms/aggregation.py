"""Masked reductions and the loss aggregation modes, one normalisation for every loss term.

Every per-token term (policy loss, KL penalty, entropy bonus) is reduced by
:func:`aggregate_loss` with the same mode and the same global denominator, so that the sum
of the micro-batch losses is the loss of the whole optimizer-step batch.
"""

from __future__ import annotations

import torch

from dapo.choices import LOSS_AGG_MODES, LossAgg


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask)``."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    agg: LossAgg = "token-mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss ``l`` to a scalar by one of the aggregation modes.

    - ``"token-mean"`` (DAPO): ``sum_i sum_t l_it / num_tokens``. ``num_tokens`` defaults
      to ``mask.sum()``; pass the token count of the whole optimizer-step batch when this
      call sees one micro-batch of it, so that the summed micro-batch losses are exact.
    - ``"seq-mean-token-mean"`` (GRPO): ``1/B sum_i 1/|o_i| sum_t l_it``.
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): ``sum_i sum_t l_it / (B * max_len)``.

    For the two sequence modes B is the number of rows passed; when a batch is split,
    pass ``num_tokens`` as the total number of responses (``seq-mean-token-mean``) or the
    total ``B * max_len`` (``seq-mean-token-sum-norm``) to keep the split exact.
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
