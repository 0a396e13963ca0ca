"""What ``dapo eval`` loads: the policy with its tokenizer (and a vision-language model's
processor), and the problems' prompts as token ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dapo.data import PromptRecord, encode_prompts
from dapo.data.images import PixelCache
from dapo.errors import EvalError


def load_model(
    model: str, log: Callable[[str], None]
) -> tuple[Any, Any, int | None, tuple[Any, PixelCache] | None]:
    """The policy (in eval mode), its tokenizer, its context length (None: unknown) and, for
    a vision-language model, its ``(processor, pixel cache)`` (None for a text model)."""
    from dapo.models import context_length, load_policy, load_tokenizer, resolve_model_path
    from dapo.models.loading import is_vision_model
    from dapo.models.vision import load_processor, pixel_cache

    path = resolve_model_path(model, log=log)
    tokenizer = load_tokenizer(path)
    vision = None
    if is_vision_model(path):
        processor = load_processor(path)
        vision = (processor, pixel_cache(processor))
    policy = load_policy(path)
    policy.eval()
    return policy, tokenizer, context_length(policy), vision


def tokenize_prompts(
    records: list[PromptRecord],
    tokenizer: Any,
    max_prompt_length: int,
    log: Callable[[str], None],
    vision: tuple[Any, PixelCache] | None = None,
) -> tuple[list[PromptRecord], list[list[int]], int]:
    """Tokenize the prompts (their images through ``vision``); drop (never truncate) those
    too long: (records, ids, dropped)."""
    # No limit for encode_prompts: its errors name the trainer's data.max_prompt_length.
    records, all_ids, _ = encode_prompts(records, tokenizer, 10**12, vision=vision)
    kept = [i for i, ids in enumerate(all_ids) if len(ids) <= max_prompt_length]
    dropped = len(records) - len(kept)
    if not kept:
        shortest = min(map(len, all_ids))
        raise EvalError(
            f"all {len(records)} prompts are longer than --max-prompt-length "
            f"{max_prompt_length} tokens (shortest {shortest}); raise --max-prompt-length "
            "or lower --max-tokens"
        )
    if dropped:
        log(
            f"dropped {dropped} of {len(records)} problems whose prompts are longer than "
            f"{max_prompt_length} tokens (--max-prompt-length)"
        )
    return [records[i] for i in kept], [all_ids[i] for i in kept], dropped
