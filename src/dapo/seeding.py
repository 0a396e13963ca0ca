"""Seeds: the global RNGs of a run, derived seeds for each generation call, and seeded
coins for decisions every rank must take alike."""

from __future__ import annotations

import hashlib
import random


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's and (if installed) numpy's global generators."""
    import torch  # here, so that the torch-free data modules can use the rest

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


def unit_hash(*parts: int | str) -> float:
    """A number in [0, 1) that is a pure function of ``parts`` (BLAKE2b of their text): the
    same on every rank, in every process and after a resume, unlike a global RNG's draw."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
