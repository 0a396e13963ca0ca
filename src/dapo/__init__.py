"""dapo: DAPO reinforcement learning from verifiable rewards.

``dapo.train(...)`` trains from Python (``dapo.make_trainer`` for step-by-step use,
``dapo.make_config`` for the config alone); see :mod:`dapo.api`. They are imported on first
use, so that ``import dapo`` (the reward workers do it) stays free of torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["make_config", "make_trainer", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dapo import api

        return getattr(api, name)
    raise AttributeError(f"module 'dapo' has no attribute {name!r}")
