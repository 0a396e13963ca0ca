"""A prompt with images as vLLM takes it, and the checks that vLLM ran dapo's prompt.

vLLM expands each image placeholder of a token prompt itself (its multi-modal processor
replaces the placeholder with the image's tokens), so a prompt that dapo already expanded
would be expanded twice. An :class:`~dapo.data.images.ImagePrompt` therefore goes to vLLM
as its unexpanded form (``raw``: one placeholder per image) with the images as vLLM's
multi-modal data, and the prompt vLLM reports having run must equal dapo's expansion token
for token: that is what the training forward sees.
"""

from __future__ import annotations

from typing import Any

from dapo.data.images import images_of
from dapo.errors import VLLMEngineError


def request(prompt: list[int]) -> Any:
    """vLLM's input for a prompt: its token ids, or for a prompt with images its
    unexpanded ids and the images."""
    from vllm.inputs import TokensPrompt

    images = images_of(prompt)
    if not images:
        return TokensPrompt(prompt_token_ids=list(prompt))
    raw = prompt.raw  # type: ignore[attr-defined]
    return TokensPrompt(prompt_token_ids=list(raw), multi_modal_data={"image": list(images)})


def refusal(prompt: list[int]) -> str | None:
    """Why a prompt's images cannot be given to an engine that expands them itself (None:
    they can): no unexpanded form, or an image placeholder the policy sampled as text, on
    which vLLM would put an image (the placeholder is the token the prompt's image spans
    hold)."""
    images = images_of(prompt)
    if not images:
        return None
    raw, spans = prompt.raw, prompt.spans  # type: ignore[attr-defined]
    if raw is None:
        return (
            "a prompt with images has no unexpanded form for vLLM (it was built without "
            "dapo.data.images.encode_with_images)"
        )
    if spans:
        placeholders = raw.count(prompt[spans[0][0]])
        if placeholders != len(images):
            return (
                f"a prompt holds {placeholders} image placeholder tokens for {len(images)} "
                "image(s): the policy sampled the placeholder as text, and vLLM would put an "
                "image there; rollout.engine=hf keeps such tokens as text"
            )
    return None


def check_images(prompt: list[int], model: str, vision: bool) -> None:
    """Raise ``ValueError`` where a prompt's images cannot be given to vLLM (a text model,
    or :func:`refusal`'s reasons)."""
    if images_of(prompt) and not vision:
        raise ValueError(
            f"a prompt has {len(images_of(prompt))} image(s) but {model} is a text model"
        )
    why = refusal(prompt)
    if why is not None:
        raise ValueError(why)


def check_expansion(prompt: list[int], seen: list[int] | None, model: str) -> None:
    """Raise :class:`~dapo.errors.VLLMEngineError` unless the prompt vLLM ran (``seen``) is
    dapo's: the images it expanded stand where the training forward puts them."""
    if not images_of(prompt) or seen is None or list(seen) == list(prompt):
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(seen, prompt, strict=False)) if a != b),
        min(len(seen), len(prompt)),
    )
    raise VLLMEngineError(
        f"vLLM expanded a prompt's {len(images_of(prompt))} image(s) of {model} into "
        f"{len(seen)} tokens where dapo's processor gives {len(prompt)} (first difference at "
        f"token {at}): its rollouts would not see what the trainer sees. The processor saved "
        "with the model and vLLM's processing of this model disagree; use rollout.engine=hf"
    )
