"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dapo.config import TrainConfig


def make_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (all of them, or LoRA's adapters), with weight
    decay on matrices only (not on biases, norms or other vectors).

    The fused kernel updates each parameter in one pass: the default single-tensor (CPU) and
    foreach (CUDA) paths allocate temporaries as large as the largest parameter or as all of
    them, which made a Qwen2.5-0.5B-shaped step peak ~1 GB higher (``bench_memory.py``).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        fused=_fused_supported([*decay, *no_decay]),
    )


def _fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter: floating point, on CPU or CUDA."""
    supported = ("cpu", "cuda")
    return bool(params) and all(
        p.is_floating_point() and p.device.type in supported for p in params
    )


def lr_at(step: int, t: TrainConfig) -> float:
    """The learning rate of rollout step ``step``: linear warm-up, then constant or cosine."""
    warm = min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0
    if t.lr_schedule == "cosine" and t.steps > t.warmup_steps:
        progress = min(1.0, max(0.0, (step - t.warmup_steps) / (t.steps - t.warmup_steps)))
        floor = t.min_lr_ratio
        return t.lr * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
    return t.lr * warm
