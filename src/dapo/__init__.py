"""dapo: DAPO reinforcement learning from verifiable rewards.

``dapo.train(...)`` trains from Python (``dapo.make_trainer`` for step-by-step use,
``dapo.make_config`` for the config alone); see :mod:`dapo.api`. They are imported on first
use, so that ``import dapo`` (the reward workers do it) stays free of torch; so are the
sub-packages reached as attributes (``dapo.environments.Environment``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["make_config", "make_trainer", "train"]


# Sub-packages reached as attributes (``dapo.environments.Environment``), imported on first use.
_SUBPACKAGES = frozenset(
    {
        "algorithms",
        "config",
        "data",
        "environments",
        "evaluation",
        "metrics",
        "models",
        "parallel",
        "rewards",
        "rollout",
        "training",
    }
)


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dapo import api

        return getattr(api, name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dapo.{name}")
    raise AttributeError(f"module 'dapo' has no attribute {name!r}")
