"""The rollout-engine interface: what the trainer and the evaluator need from a generator.

Engines ``generate`` a group of ``n`` responses per prompt (token ids, the sampling
log-probs, truncation flags) and ``load_weights`` of the updated policy. They do not score,
filter or train. :func:`make_engine` builds one by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dapo.choices import ENGINES  # the names, shared with dapo.config


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

    def decode(self, tokenizer: Any) -> list[str]:
        """The responses as text (special tokens such as EOS dropped)."""
        return [tokenizer.decode(r, skip_special_tokens=True) for r in self.response_ids]


class RolloutEngine(Protocol):
    """What the trainer needs from a generation backend."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def make_engine(
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    batch_size: int,
    max_model_len: int,
    seed: int = 0,
    gpu_memory_utilization: float = 0.3,
    sleep: bool = True,
    server_url: str | None = None,
    server_timeout_s: float = 600.0,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> RolloutEngine:
    """The engine ``name`` (``hf``, ``vllm`` or ``vllm-server``) sampling from ``model``.

    ``batch_size`` sequences are generated together; ``max_model_len`` (prompt + response
    tokens) sizes vLLM's context. ``gpu_memory_utilization`` and ``sleep`` apply to vLLM on
    a GPU. ``state_dict``: the weights a separate engine (vLLM) starts from, in the base
    model's names, instead of ``model``'s own (a LoRA policy's merged weights).
    ``vllm-server`` generates on the rollout server at ``server_url`` (which must hold
    ``max_model_len``) and starts with the server's weights: push the policy's (merged, for
    LoRA). Raises :class:`~dapo.errors.VLLMUnavailableError` / ``VLLMEngineError`` when vLLM
    is missing or cannot start, :class:`~dapo.errors.RolloutServerError` when the server
    does not answer or does not fit.
    """
    if name == "hf":
        from dapo.rollout.hf_engine import HFEngine

        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, batch_size)
    if name == "vllm":
        from dapo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            max_model_len=max_model_len,
            max_num_seqs=batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=None if sleep else False,  # None: on a GPU only
            seed=seed,
            state_dict=state_dict,
        )
    if name == "vllm-server":
        from dapo.rollout.server_client import ServerEngine

        return ServerEngine(
            server_url or "",
            max_model_len=max_model_len,
            eos_token_id=tokenizer.eos_token_id,
            timeout_s=server_timeout_s,
        )
    raise ValueError(f"unknown rollout engine {name!r}; choose one of: {', '.join(ENGINES)}")


def close_engine(engine: Any) -> None:
    """Release an engine's resources (vLLM's memory and process group); a no-op for ``hf``."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()
