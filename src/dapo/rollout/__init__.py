"""Rollout engines: sample groups of responses with their log-probs.

``base`` holds the interface every engine implements and the factory; ``hf_engine`` the
transformers engine; ``vllm_engine`` the vLLM engine (an optional extra, imported lazily).
"""

from dapo.rollout.base import (
    ENGINES,
    Group,
    RolloutEngine,
    SamplingParams,
    close_engine,
    make_engine,
)
from dapo.rollout.hf_engine import HFEngine, process_logits

__all__ = [
    "ENGINES",
    "Group",
    "HFEngine",
    "RolloutEngine",
    "SamplingParams",
    "close_engine",
    "make_engine",
    "process_logits",
]
