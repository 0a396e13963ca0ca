"""Rewards: answer scorers, overlong shaping, user reward functions and the timed scoring pool.

- ``math``: extract and normalise final answers; the built-in scorers ``dapo_math`` (the
  DAPO reference's rules), ``dapo_math_lenient``, ``math_verify`` and ``gsm8k``.
- ``shaping``: the soft overlong punishment and the overlong filter mask.
- ``user``: reward functions given as ``module:function`` specs or Python callables, and
  running them on one sample.
- ``scorer``: :class:`RewardScorer`, the weighted reward of a batch, never failing the run.
- ``pool`` and ``worker``: the persistent worker processes that run the functions, each call
  timed; ``inprocess``: the helper thread for callables that cannot be pickled.

The package imports neither torch nor the trainer: scoring workers import only it (and
:mod:`dapo.workers`).
"""

from dapo.errors import RewardFunctionWarning
from dapo.rewards.math import (
    SCORERS,
    dapo_math_lenient_score,
    dapo_math_score,
    extract_answer,
    math_verify_score,
    normalize_final_answer,
    scorer_for_source,
)
from dapo.rewards.scorer import RewardScorer, ScoreRequest, ScoreResult
from dapo.rewards.shaping import overlong_filter_mask, soft_overlong_punishment
from dapo.rewards.user import load_reward_function

__all__ = [
    "SCORERS",
    "RewardFunctionWarning",
    "RewardScorer",
    "ScoreRequest",
    "ScoreResult",
    "dapo_math_lenient_score",
    "dapo_math_score",
    "extract_answer",
    "load_reward_function",
    "math_verify_score",
    "normalize_final_answer",
    "overlong_filter_mask",
    "scorer_for_source",
    "soft_overlong_punishment",
]
