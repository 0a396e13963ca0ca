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

from dapo.data.images import ImagePrompt, images_of
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


def check_images(prompt: ImagePrompt, model: str, vision: bool, image_token: int | None) -> None:
    """Raise ``ValueError`` where a prompt's images cannot be given to vLLM: a text model,
    no unexpanded form, or an image placeholder the policy sampled as text (vLLM would put
    an image where it stands)."""
    if not vision:
        raise ValueError(f"a prompt has {len(prompt.images)} image(s) but {model} is a text model")
    if prompt.raw is None:
        raise ValueError(
            "a prompt with images has no unexpanded form for vLLM (it was built without "
            "dapo.data.images.encode_with_images)"
        )
    placeholders = prompt.raw.count(image_token) if image_token is not None else None
    if placeholders is not None and placeholders != len(prompt.images):
        raise ValueError(
            f"a prompt holds {placeholders} image placeholder tokens for {len(prompt.images)} "
            "image(s): the policy sampled the placeholder as text, and vLLM would put an "
            "image there; rollout.engine=hf keeps such tokens as text"
        )


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
