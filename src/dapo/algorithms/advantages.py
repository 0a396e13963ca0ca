"""Group-relative advantages: one scalar per response, shared by all of its tokens."""

from __future__ import annotations

import torch

from dapo.choices import ADVANTAGE_SCALES, AdvantageScale

EPS = 1e-6  # added to the std before dividing (GRPO, DAPO)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: AdvantageScale = "group"
) -> torch.Tensor:
    """One advantage per response, shared by all of its tokens.

    ``"group"`` (GRPO, DAPO): ``A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6)``
    with the unbiased std; a group of one response uses mean 0 and std 1.
    ``"batch"``: group mean, std over the whole batch. ``"none"`` (Dr. GRPO): ``R_i - mean``.
    A group whose rewards are all equal gets exactly zero advantages.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the {rewards.numel()} rewards; "
            "lay rewards out group after group with the same number of responses each"
        )
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {ADVANTAGE_SCALES}")
    grouped = rewards.reshape(-1, group_size)
    if group_size == 1:
        mean = torch.zeros_like(grouped)
        std = torch.ones_like(grouped)
    else:
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, keepdim=True)
    # An all-equal group must give exactly 0; its float mean can be off by one rounding step,
    # which the division by a near-zero std would then blow up.
    same = (grouped == grouped[:, :1]).all(dim=1, keepdim=True) & (group_size > 1)
    centred = torch.where(same, torch.zeros_like(grouped), grouped - mean)
    if scale == "none":
        return centred.reshape(-1)
    if scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else torch.ones((), dtype=rewards.dtype)
    return (centred / (std + EPS)).reshape(-1)
