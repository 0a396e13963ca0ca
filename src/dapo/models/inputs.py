"""Padded model inputs, shared by generation and the training forward passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[n, P]`` left-padded to the longest row (every row ends at column P-1), and
    their attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
    return ids, mask


def right_pad(
    rows: Sequence[Sequence[int]], width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[n, width]`` right-padded (rows cut at ``width``), and their attention mask."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        k = min(len(row), width)
        if k:
            ids[i, :k] = torch.tensor(row[:k])
            mask[i, :k] = 1
    return ids, mask


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of the model's (first) parameters."""
    return next(model.parameters()).device
