"""The first training prompt exactly as the model will see it (``dapo train --print-prompt``),
without building or loading the model.

Single-turn runs render the prompt as the data pipeline does
(:func:`~dapo.data.prompts.encode_prompts`: the chat template when the prompt is chat
messages); multi-turn runs (``rollout.environment`` / ``rollout.tools``) as an episode
opens (:class:`~dapo.environments.ChatRenderer`: the environment's ``reset`` messages, the
tool schemas and the chat template). The ids are decoded with their special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo.config import Config
from dapo.data.prompts import encode_prompts, load_prompt_set
from dapo.environments import ChatRenderer, load_environment
from dapo.environments.base import check_messages
from dapo.errors import DataError
from dapo.models import load_tokenizer, resolve_model_path
from dapo.models.cache import BUILTIN_MODELS


@dataclass
class PromptPreview:
    """The first training prompt: its text as the model sees it, and its length."""

    text: str
    tokens: int
    multi_turn: bool
    uid: str


def preview_tokenizer(cfg: Config, log: Any = print) -> Any:
    """The run's tokenizer, alone: a built-in model's is built from its recipe (its
    weights are not built), another's loaded from ``model.tokenizer`` or the model's path."""
    m = cfg.model
    if m.tokenizer is None and m.name_or_path in BUILTIN_MODELS:
        from dapo.models.tiny import RECIPES, build_tokenizer

        return build_tokenizer(RECIPES[m.name_or_path].chat_template)
    source = m.tokenizer or resolve_model_path(m.name_or_path, log=log)
    return load_tokenizer(source, trust_remote_code=m.trust_remote_code)


def first_prompt(cfg: Config, tokenizer: Any = None, train_dataset: Any = None) -> PromptPreview:
    """The first prompt of the training data as rendered for the model (see the module)."""
    tokenizer = tokenizer if tokenizer is not None else preview_tokenizer(cfg)
    records = load_prompt_set(cfg.data, "train", train_dataset)
    if not records:
        raise DataError("the training data has no prompts; check data.train")
    record = records[0]
    r = cfg.rollout
    spec = load_environment(r.environment, r.tools, r.tool_parser)
    if spec is None:
        (_, (ids,), _) = encode_prompts([record], tokenizer, 1 << 30)
    else:
        env = spec.make()
        messages = check_messages(env.reset(record), "the environment's reset", allow_empty=False)
        ids = ChatRenderer(tokenizer, spec.schemas).opening(messages)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return PromptPreview(text, len(ids), spec is not None, record.uid)
