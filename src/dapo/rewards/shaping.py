"""Overlong reward shaping (DAPO section 3.4): the soft length penalty and the filter mask."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------------------
# Overlong reward shaping
# ---------------------------------------------------------------------------


def soft_overlong_punishment(length: int, max_length: int, cache_length: int) -> float:
    """DAPO soft overlong punishment: 0 up to ``max_length - cache_length``, then a linear
    ramp down to -1 at ``max_length``, and -1 beyond it.

    ``cache_length == 0`` disables the ramp (0 up to ``max_length``, -1 beyond).
    """
    if max_length <= 0:
        raise ValueError(
            f"max_length must be positive, got {max_length}; pass the generation cap in tokens"
        )
    if not 0 <= cache_length <= max_length:
        raise ValueError(
            f"cache_length must be between 0 and max_length={max_length}, got {cache_length}; "
            "use a buffer shorter than the generation cap (e.g. max_length // 5)"
        )
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}; pass the response length in tokens")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def overlong_filter_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Copy of the ``[B, T]`` loss mask with the rows of truncated responses zeroed."""
    import torch

    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if truncated.shape != (mask.shape[0],):
        raise ValueError(
            f"truncated must be [B] = [{mask.shape[0]}] to match mask {tuple(mask.shape)}, "
            f"got shape {tuple(truncated.shape)}"
        )
    rows = truncated.to(device=mask.device, dtype=torch.bool)
    return mask.masked_fill(rows[:, None], 0)
