"""Seeds: the global RNGs of a run, and derived seeds for each generation call."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (if installed) numpy's global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def mix_seed(*parts: int) -> int:
    """A well-mixed seed in [0, 2**61) from integer parts (FNV-1a over their low 32 bits).

    Deterministic across processes and runs (unlike ``hash``), so every rank derives the
    same seed for the same (run seed, step, round, ...).
    """
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFF)) * 1099511628211) % 2**61
    return h
