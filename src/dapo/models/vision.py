"""Vision-language policies: which transformers families are supported, their processor, the
vision tower's freezing, and the image inputs of a batch of prompts.

Supported: the Idefics3 / SmolVLM family (a SigLIP vision tower, a pixel-shuffle connector and
a Llama text model, so the engine's direct Llama step decodes it). Its image tokens are
ordinary positions of the text model: a prompt's images enter only where its image tokens
stand (the prefill, the training forward's prompt pass), and decoding is text decoding.
Families with positions of their own for images (Qwen2-VL / Qwen2.5-VL's multi-axis rotary
positions) and every other image-text-to-text class are refused at start-up with the reason
(:func:`vision_refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dapo.data.images import ImagePrompt, PixelCache
from dapo.errors import ModelError

# transformers model_type -> what the family's image inputs look like.
FAMILIES = {"idefics3": "idefics3", "smolvlm": "idefics3"}
# Families known and refused, with why.
REFUSED = {
    "qwen2_vl": "its multi-axis rotary positions (M-RoPE) are not yet laid out by dapo's "
    "static-cache decoder and shared-prompt forward",
    "qwen2_5_vl": "its multi-axis rotary positions (M-RoPE) are not yet laid out by dapo's "
    "static-cache decoder and shared-prompt forward",
}
INPUT_KEYS = ("pixel_values", "pixel_attention_mask")  # what the model takes from a prompt


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is an image-text-to-text model's (it has a vision part)."""
    return getattr(config, "vision_config", None) is not None


def vision_refusal(config: Any) -> str | None:
    """Why dapo cannot train this vision-language model (None: it can)."""
    kind = getattr(config, "model_type", "?")
    if kind in FAMILIES:
        return None
    supported = ", ".join(sorted(FAMILIES))
    why = REFUSED.get(kind, "dapo does not know where its image inputs go")
    return f"model_type {kind!r} is not supported ({why}); supported: {supported}"


def load_processor(path: str, *, trust_remote_code: bool = False) -> Any:
    """The model directory's processor (its tokenizer and image processor)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{path!r} is a vision-language model but its processor could not be loaded "
            f"({type(exc).__name__}: {exc}). Fix: save the processor beside the weights "
            "(processor.save_pretrained(dir)): preprocessor_config.json, processor_config.json "
            "and the tokenizer files."
        ) from exc


def pixel_cache(processor: Any) -> PixelCache:
    """The pixel inputs of an image list through ``processor``'s image processor."""
    return PixelCache(_Pixels(processor.image_processor))


class _Pixels:
    """``images -> {pixel_values, pixel_attention_mask}`` for one prompt (picklable)."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor

    def __call__(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[list(images)], return_tensors="pt")
        return {k: out[k] for k in INPUT_KEYS if k in out}


def image_inputs(prompts: Sequence[Sequence[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """The image keyword arguments of a forward over ``prompts`` (one row each): each
    row's images, padded with all-zero images (which the Idefics3 family skips) to the most
    any row has and to the largest height and width; ``{}`` when no prompt has images."""
    parts = [p.pixel_inputs() if isinstance(p, ImagePrompt) else None for p in prompts]
    given = [x for x in parts if x is not None]
    if not given:
        return {}
    n = max(x["pixel_values"].shape[1] for x in given)
    h = max(x["pixel_values"].shape[3] for x in given)
    w = max(x["pixel_values"].shape[4] for x in given)
    c = given[0]["pixel_values"].shape[2]
    pixels = torch.zeros((len(prompts), n, c, h, w), dtype=given[0]["pixel_values"].dtype)
    mask = torch.zeros((len(prompts), n, h, w), dtype=torch.long)
    for i, x in enumerate(parts):
        if x is None:
            continue
        v = x["pixel_values"][0]
        pixels[i, : v.shape[0], :, : v.shape[2], : v.shape[3]] = v
        m = x.get("pixel_attention_mask")
        if m is None:
            mask[i, : v.shape[0], : v.shape[2], : v.shape[3]] = 1
        else:
            mask[i, : v.shape[0], : v.shape[2], : v.shape[3]] = m[0]
    return {"pixel_values": pixels.to(device), "pixel_attention_mask": mask.to(device)}


def image_token_id(model: torch.nn.Module) -> int | None:
    """The token id that stands for image features in ``model``'s prompts (None: a text model)."""
    config = getattr(model, "config", None)
    if config is None or not is_vision_config(config):
        return None
    return getattr(config, "image_token_id", None)


def text_prefix(prompts: Sequence[Sequence[int]], image_token: int | None) -> list[list[int]]:
    """Each prompt up to its first image token: what may be shared between prompts without
    comparing images (a shared prefix never holds an image)."""
    if image_token is None:
        return [list(p) for p in prompts]
    out = []
    for p in prompts:
        ids = list(p)
        out.append(ids[: ids.index(image_token)] if image_token in ids else ids)
    return out


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a supported vision-language model (None for a text model)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "vision_model", None) if inner is not None else None


def freeze_vision_tower(model: torch.nn.Module, train: bool) -> int:
    """Stop gradients into the vision encoder unless ``train`` (``model.train_vision``); the
    connector and the language model train. Returns the parameters frozen."""
    tower = vision_tower(model)
    if tower is None or train:
        return 0
    n = 0
    for p in tower.parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n
