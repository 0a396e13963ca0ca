"""Held-out evaluation: the metrics (``stats``: avg@k, pass@k, maj@k) and ``dapo eval`` (``run``)."""

from dapo.evaluation.run import engine_accuracy, run_evaluation
from dapo.evaluation.stats import majority_answer, majority_correct, pass_at_k, summarize

__all__ = [
    "engine_accuracy",
    "majority_answer",
    "majority_correct",
    "pass_at_k",
    "run_evaluation",
    "summarize",
]
