"""Building a rollout engine by name (``rollout.engine``): ``hf``, ``vllm`` or ``vllm-server``.

Apart from :mod:`dapo.rollout.base` (the types every engine imports), so that the engines
and their factory do not import each other.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from dapo.choices import ENGINES  # the names, shared with dapo.config
from dapo.rollout.base import RolloutEngine

if TYPE_CHECKING:
    from dapo.config import RolloutConfig


def make_engine(
    r: RolloutConfig,
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    max_model_len: int,
    seed: int = 0,
    state_dict: dict[str, torch.Tensor] | None = None,
    processor: Any = None,
) -> RolloutEngine:
    """The engine ``r.engine`` sampling from ``model``, set up by the ``rollout`` section.

    ``r.generation_batch_size`` sequences are generated together; ``max_model_len`` (prompt +
    response tokens) sizes vLLM's context. ``r.vllm_gpu_memory_utilization``, ``r.vllm_sleep``
    and ``r.vllm_quantization`` apply to vLLM on a GPU. ``state_dict``: the weights a separate
    engine (vLLM) starts from, in the base model's names, instead of ``model``'s own (a LoRA
    policy's merged weights). ``processor``: a vision-language policy's, which vLLM needs to
    read the prompts' images. ``vllm-server`` generates on the rollout server at
    ``r.server_url`` (which must hold ``max_model_len`` and serve a model of ``model``'s
    vocabulary and parameter shapes) with the key ``r.server_api_key`` (default: the
    ``DAPO_SERVER_API_KEY`` environment variable), and starts with the server's weights: push
    the policy's (merged, for LoRA). Raises :class:`~dapo.errors.VLLMUnavailableError` /
    ``VLLMEngineError`` when vLLM is missing or cannot start,
    :class:`~dapo.errors.RolloutServerError` when the server does not answer or does not fit.
    """
    name = r.engine
    if name == "hf":
        from dapo.rollout.hf_engine import HFEngine

        return HFEngine(
            model,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            r.generation_batch_size,
            cuda_graphs=r.cuda_graphs,
        )
    if name == "vllm":
        from dapo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            max_model_len=max_model_len,
            max_num_seqs=r.generation_batch_size,
            gpu_memory_utilization=r.vllm_gpu_memory_utilization,
            enable_sleep_mode=None if r.vllm_sleep else False,  # None: on a GPU only
            seed=seed,
            state_dict=state_dict,
            quantization=None if r.vllm_quantization == "none" else r.vllm_quantization,
            processor=processor,
        )
    if name == "vllm-server":
        from dapo.rollout.fingerprint import of_module
        from dapo.rollout.protocol import API_KEY_ENV
        from dapo.rollout.server_client import ServerEngine

        return ServerEngine(
            r.server_url or "",
            max_model_len=max_model_len,
            eos_token_id=tokenizer.eos_token_id,
            policy=of_module(model, tokenizer.eos_token_id),
            api_key=r.server_api_key or os.environ.get(API_KEY_ENV) or None,
            timeout_s=r.server_timeout_s,
        )
    raise ValueError(f"unknown rollout engine {name!r}; choose one of: {', '.join(ENGINES)}")
