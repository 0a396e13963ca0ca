"""What a run loads before its prompts and its policy: the multi-turn episode spec and the
tokenizer, checked against each other, so that a bad environment, tool or parser spec, or a
model without the chat template episodes and agents need, is refused before weights load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dapo.config import Config
from dapo.environments import EnvironmentSpec, load_environment, load_parser, no_template_error
from dapo.errors import ConfigError, ModelError
from dapo.models import load_tokenizer, resolve_model_path
from dapo.models.loading import builtin_chat_template, is_vision_model
from dapo.models.vision import is_vision_config, load_processor, vision_refusal
from dapo.run_inputs import RunInputs


def load_spec_and_tokenizer(
    cfg: Config, inputs: RunInputs, log: Callable[[str], None]
) -> tuple[EnvironmentSpec | None, Any, str, Any]:
    """``(spec, tokenizer, model_path, processor)``: the episode spec (None for single-turn
    runs), the tokenizer (``inputs``' or loaded), the resolved model path ("" when
    ``inputs`` holds both the model and the tokenizer) and a vision-language model's
    processor (None for a text model)."""
    r = cfg.rollout
    spec = load_environment(
        inputs.environment or r.environment, [*r.tools, *inputs.tools], r.tool_parser
    )
    tokenizer_name = cfg.model.tokenizer or cfg.model.name_or_path
    agent = r.agent is not None or inputs.agent is not None
    if agent:
        load_parser(r.tool_parser)  # the endpoint parses the agents' tool calls with it
    chat = spec is not None or agent
    # A built-in model known to have no template is refused before it is built.
    if chat and inputs.tokenizer is None and builtin_chat_template(tokenizer_name) is False:
        raise no_template_error(tokenizer_name)
    model_path = ""
    if inputs.model is None or inputs.tokenizer is None:
        model_path = resolve_model_path(cfg.model.name_or_path, log=log)
    trust = cfg.model.trust_remote_code
    processor = inputs.processor
    if processor is None and model_path and is_vision_model(model_path, trust_remote_code=trust):
        processor = load_processor(model_path, trust_remote_code=trust)
    check_vision_object(inputs.model, processor)
    if processor is not None:
        check_vision_run(cfg, agent)
    tokenizer = inputs.tokenizer or load_tokenizer(
        cfg.model.tokenizer or model_path, trust_remote_code=trust
    )
    template = getattr(tokenizer, "chat_template", None) or getattr(
        processor, "chat_template", None
    )
    if chat and not template:
        raise no_template_error(tokenizer_name)
    return spec, tokenizer, model_path, processor


def check_vision_run(cfg: Config, agent: bool) -> None:
    """Refuse, before any weights load, what a vision-language policy cannot do yet: agents
    (whose OpenAI-client requests reach the policy as text). Every rollout engine takes
    images, and environments and tools may return them
    (:mod:`dapo.environments.rendering`)."""
    name = cfg.model.name_or_path
    if agent:
        raise ConfigError(
            f"{name!r} is a vision-language model; agents (rollout.agent) reach the policy "
            "through an OpenAI-compatible endpoint that dapo serves as text, so their "
            "requests' images would not reach it. Fix: give the episodes as an environment "
            "(rollout.environment: reset and step may return images) or tools",
            key="rollout.agent",
        )


def check_vision_object(model: Any, processor: Any) -> None:
    """A loaded vision-language model (``dapo.train(model=...)``) must be of a supported
    family and come with its processor: without it, its prompts' images cannot be read."""
    config = getattr(model, "config", None)
    if model is None or not is_vision_config(config):
        return
    kind = type(model).__name__
    reason = vision_refusal(config)
    if reason is not None:
        raise ModelError(f"model = a {kind} object: {reason}")
    if processor is None:
        raise ConfigError(
            f"model = a {kind} object, a vision-language model, was given without its "
            "processor (which turns images into the model's inputs). Fix: pass "
            "processor=AutoProcessor.from_pretrained(path) with model= and tokenizer= "
            "(transformers' AutoProcessor, from the model's directory), or give the "
            "directory as model.name_or_path",
            key="model",
        )
