"""Seeds: the global RNGs of a run, derived seeds for each generation call, and seeded
coins for decisions every rank must take alike."""

from __future__ import annotations

import enum
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


class Stream(enum.Enum):
    """The salts that give each use of the run seed its own random stream: the mini-batch
    order of a rollout step, Clip-Cov's token draw of an update, held-out sampling. Their
    values are fixed: changing one changes every run's numbers."""

    UPDATE_PLAN = (99991,)  # plan_updates: the groups' order in each epoch
    COV_DRAW = (7919,)  # cov_selection: Clip-Cov's random choice among candidate tokens
    EVALUATION = (7, 7)  # held-out sampling (the same prompts and seeds before and after)


def stream_seed(seed: int, stream: Stream, *parts: int) -> int:
    """The seed of ``stream`` for ``parts`` (a step, an update, ...) of the run ``seed``."""
    return mix_seed(seed, *parts, *stream.value)


def unit_hash(*parts: int | str) -> float:
    """A number in [0, 1) that is a pure function of ``parts`` (BLAKE2b of their text): the
    same on every rank, in every process and after a resume, unlike a global RNG's draw."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
