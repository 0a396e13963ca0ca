"""The rollout-engine interface: what the trainer and the evaluator need from a generator.

Engines ``generate`` a group of ``n`` responses per prompt (token ids, the sampling
log-probs, truncation flags) and ``load_weights`` of the updated policy. They do not score,
filter or train. :func:`dapo.rollout.factory.make_engine` builds one by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int = 0


@dataclass
class Group:
    """One prompt's ``n`` responses: token ids, sampling log-probs, truncation flags."""

    prompt_ids: list[int]
    response_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    # Multi-turn episodes (dapo.rollout.episodes.run_episodes); None for single-turn groups.
    # response_ids then hold every token after the prompt, the environment's too.
    model_mask: list[list[int]] | None = None  # 1 on sampled tokens, 0 on environment tokens
    env_rewards: list[float | None] | None = None  # the environment's reward; None: score text
    final_texts: list[str] | None = None  # each episode's last assistant turn (what is scored)
    episode_stats: list[dict[str, Any]] | None = None  # turns, tool calls, end reason, ...
    # The policy version that sampled each response token (rollout.max_staleness; None: the
    # engine did not say). A partial rollout mixes versions; environment tokens repeat the
    # version of the turn before them.
    versions: list[list[int]] | None = None

    def decode(self, tokenizer: Any) -> list[str]:
        """The texts to score: the responses (special tokens such as EOS dropped), or each
        episode's final assistant turn."""
        if self.final_texts is not None:
            return list(self.final_texts)
        return [tokenizer.decode(r, skip_special_tokens=True) for r in self.response_ids]


class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def close_engine(engine: Any) -> None:
    """Release an engine's resources (vLLM's memory and process group); a no-op for ``hf``."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
