"""Rollout engines: sample groups of responses with their log-probs.

``base`` holds the types every engine implements; ``factory`` builds one by name
(``rollout.engine``); ``hf_engine`` the transformers engine; ``vllm_engine`` the vLLM engine
(an optional extra, imported lazily); ``server`` / ``server_client`` the rollout server
(``dapo vllm-serve``) and the trainer's side of it.
"""

from dapo.rollout.base import Group, RolloutEngine, SamplingParams, close_engine
from dapo.rollout.factory import ENGINES, make_engine
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
