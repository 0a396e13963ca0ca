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


def after_prefix(
    prompts: Sequence[Sequence[int]], prefix: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a pass over ``prompts`` after their first ``prefix`` tokens, which are
    already in the cache (0: none): the rest's ids ``[n, w]`` left-padded, the attention mask
    over prefix and rest ``[n, prefix + w]`` (``[prefix | padding | rest]``), and the rest's
    positions ``[n, w]``, continuing from the prefix. Generation and the training forward
    both lay prompts out this way, so their keys and positions agree."""
    ids, rest = left_pad([p[prefix:] for p in prompts], pad_id)
    mask = torch.cat([rest.new_ones(len(prompts), prefix), rest], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, prefix:]
    return ids, mask, pos


PASS_COST = 128  # a forward call's fixed work, in token positions (see shared_prefix)


def shared_prefix(prompts: Sequence[Sequence[int]], pass_cost: int | None = None) -> int:
    """How many leading tokens to forward once for all ``prompts`` (0: none): their longest
    common prefix, leaving every prompt at least one token of its own (the one whose output
    predicts the first response token).

    A chat template's system prompt, few-shot turns or an instruction shared by every problem
    are often most of a prompt (``builtin:chat_addition``: 139 of 152 tokens). Forwarding
    them once saves ``(n - 1) x length`` token positions for an extra pass; only worth it
    when that saves more than the pass's fixed work (``pass_cost``, :data:`PASS_COST`).
    """
    cost = PASS_COST if pass_cost is None else pass_cost
    if len(prompts) < 2:
        return 0
    first, shortest = prompts[0], min(len(p) for p in prompts)
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n if (len(prompts) - 1) * n > cost else 0


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
