"""Vision-language policies: which transformers families are supported, their processor, the
vision tower's freezing, and the image inputs and positions of a batch of prompts.

Supported:

- the Idefics3 / SmolVLM family (a SigLIP vision tower, a pixel-shuffle connector and a Llama
  text model, so the engine's direct Llama step decodes it). Its image tokens are ordinary
  positions of the text model.
- the Qwen2-VL / Qwen2.5-VL family, whose rotary positions have three axes (M-RoPE): an
  image's tokens take (time, row, column) positions from its grid and the text after it
  continues from the largest, so a prompt's positions are not its token indices. They are
  computed once per prompt with the model's own ``get_rope_index`` and laid out wherever the
  prefill, the decode step and the training forward give positions
  (:func:`rope_positions`).

In both, a prompt's images enter only where its image tokens stand (the prefill, the
training forward's prompt pass), and decoding is text decoding. Every other
image-text-to-text class is refused at start-up with the reason (:func:`vision_refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dapo.data.images import ImagePrompt, PixelCache, spans_of
from dapo.errors import ModelError
from dapo.models.lora import causal_lm

# transformers model_type -> how the family takes images: padded per prompt (Idefics3) or
# as one sequence of patches with a grid per image and three-axis positions (M-RoPE).
FAMILIES = {"idefics3": "padded", "smolvlm": "padded", "qwen2_vl": "mrope", "qwen2_5_vl": "mrope"}
# Families known and refused, with why.
REFUSED = {
    "llava": "its image features replace its image tokens only at a prompt's first forward "
    "in some versions, and dapo has no tested layout for it",
}
# The forward keyword that carries a batch's image rows to images_in_forward's pre-hook.
IMAGE_ROWS = "dapo_image_rows"
# What the model takes from a prompt's image processor output.
INPUT_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw")


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is an image-text-to-text model's (it has a vision part)."""
    return getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config: a vision-language model's text part, a text model's
    own (or whatever ``config`` is, when it is no transformers config)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


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
    parts = [p.pixel_inputs() if isinstance(p, ImagePrompt) and p.images else None for p in prompts]
    given = [x for x in parts if x is not None]
    if not given:
        return {}
    if "image_grid_thw" in given[0]:  # one sequence of patches, a (t, h, w) grid per image
        return {
            "pixel_values": torch.cat([x["pixel_values"] for x in given]).to(device),
            "image_grid_thw": torch.cat([x["image_grid_thw"] for x in given]).to(device),
        }
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


def token_inputs(
    model: torch.nn.Module, ids: torch.Tensor, rows: Sequence[Sequence[int]], offsets: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The token keyword argument of a forward over ``ids`` ``[b, w]``, whose row ``i`` holds
    token ``k`` of ``rows[i]`` at column ``offsets[i] + k``: ``input_ids``, or, when a row has
    images, ``inputs_embeds``: the token embeddings with the images' features (the model's
    own ``get_image_features``) in place of exactly the tokens of their spans
    (:class:`~dapo.data.images.ImagePrompt`), in order. An image token outside them (one the
    model sampled, in an earlier turn of an episode) stays text, which the model's forward
    given the pixels would not do: it puts features on every image token."""
    token = image_token_id(model)
    spans = [spans_of(r, token) for r in rows]
    if not any(spans):
        return {"input_ids": ids}
    if getattr(model, "_dapo_images_in_forward", False):  # the forward's own pre-hook does it
        return {"input_ids": ids, IMAGE_ROWS: (rows, offsets, spans)}
    return _embedded(model, ids, rows, offsets, spans)


def _embedded(
    model: torch.nn.Module,
    ids: torch.Tensor,
    rows: Sequence[Sequence[int]],
    offsets: Sequence[int],
    spans: Sequence[tuple[tuple[int, int], ...]],
) -> dict[str, torch.Tensor]:
    lm = causal_lm(model)
    embeds = lm.get_input_embeddings()(ids)
    given = [r if s else [] for r, s in zip(rows, spans, strict=True)]
    features = image_features(lm, given, ids.device)
    mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for i, (offset, row_spans) in enumerate(zip(offsets, spans, strict=True)):
        for a, b in row_spans:
            mask[i, offset + a : offset + b] = True
    if int(mask.sum()) != features.shape[0]:
        raise ValueError(
            f"{int(mask.sum())} image positions for {features.shape[0]} image features: the "
            "image tokens do not match the images (a sequence's spans are wrong)"
        )
    return {"inputs_embeds": embeds.masked_scatter(mask[..., None], features.to(embeds.dtype))}


def images_in_forward(model: torch.nn.Module) -> None:
    """Make ``model`` merge its images into its input embeddings inside its own forward:
    :func:`token_inputs` then passes the rows, their offsets and spans (``dapo_image_rows=``)
    and a forward pre-hook embeds them. Needed where the parameters are whole only during the forward: a root
    sharded with FSDP2 holds its embeddings, connector and vision tower as shards outside
    it, and gradients of work done outside it would miss its gradient reduction. FSDP's
    own pre-hook (registered first) has gathered them when this one runs."""

    def embed(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        given = kwargs.pop(IMAGE_ROWS, None)
        if given is None:
            return None
        kwargs.update(_embedded(module, kwargs.pop("input_ids"), *given))
        return args, kwargs

    if not getattr(model, "_dapo_images_in_forward", False):
        model.register_forward_pre_hook(embed, with_kwargs=True)
        model._dapo_images_in_forward = True  # type: ignore[assignment]


def image_features(
    model: torch.nn.Module, rows: Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """The features of the images of ``rows`` (rows without images give none), one per image
    token, ``[tokens, hidden]``, in row and image order: the vision encoder and connector."""
    x = image_inputs(rows, device)
    if "image_grid_thw" in x:  # a tuple of each image's tokens
        out = model.get_image_features(x["pixel_values"], x["image_grid_thw"], return_dict=True)
        return torch.cat(list(out.pooler_output))
    out = model.get_image_features(
        x["pixel_values"], x.get("pixel_attention_mask"), return_dict=True
    )
    return out.pooler_output.flatten(0, 1)


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
    inner = getattr(causal_lm(model), "model", None)
    if inner is None:
        return None
    return getattr(inner, "vision_model", None) or getattr(inner, "visual", None)


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
    merger = getattr(tower, "merger", None)  # Qwen2-VL's connector lives in its tower
    for p in merger.parameters() if merger is not None else ():
        p.requires_grad_(True)
        n -= p.numel()
    return n


def uses_mrope(model: torch.nn.Module) -> bool:
    """Whether ``model``'s positions have three axes (the Qwen2-VL family)."""
    config = getattr(causal_lm(model), "config", None)
    return FAMILIES.get(getattr(config, "model_type", ""), "") == "mrope"


def prompt_rope(model: torch.nn.Module, prompt: Sequence[int]) -> tuple[torch.Tensor, int]:
    """An M-RoPE model's positions of ``prompt``'s tokens ``[3, len]`` and the offset of the
    text that follows it (position of token index ``k >= len`` is ``k + delta`` on every
    axis), from the model's own ``get_rope_index``; kept on an :class:`ImagePrompt`."""
    kept = getattr(prompt, "_rope", None)
    if kept is not None:
        return kept
    ids = torch.tensor([list(prompt)])
    if not isinstance(prompt, ImagePrompt) or not prompt.images:
        out = (torch.arange(ids.shape[1]).expand(3, -1), 0)
    else:
        inner = causal_lm(model).model
        kinds = torch.zeros_like(ids, dtype=torch.int)
        for a, b in spans_of(prompt, causal_lm(model).config.image_token_id):
            kinds[0, a:b] = 1  # the image tokens the model sampled stay text
        grid = prompt.pixel_inputs()["image_grid_thw"]
        pos, delta = inner.get_rope_index(ids, kinds, image_grid_thw=grid)
        out = (pos[:, 0].cpu(), int(delta.reshape(-1)[0]))
    if isinstance(prompt, ImagePrompt):
        prompt._rope = out
    return out


def rope_positions(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], index: torch.Tensor
) -> torch.Tensor:
    """The position ids to give ``model`` for rows whose tokens are at ``index`` ``[b, w]``
    of their prompt-and-response sequence (``prompts[i]`` is row ``i``'s prompt): ``index``
    itself for a one-axis model, else ``[3, b, w]``, each prompt token's three-axis position
    and ``index + delta`` after the prompt."""
    if not uses_mrope(model):
        return index
    out = index.new_zeros((3, *index.shape))
    for i, prompt in enumerate(prompts):
        pos, delta = prompt_rope(model, prompt)
        row = index[i]
        inside = row < pos.shape[1]
        out[:, i] = torch.where(
            inside, pos.to(row.device)[:, row.clamp(max=pos.shape[1] - 1)], row + delta
        )
    return out


def rope_delta(model: torch.nn.Module, prompt: Sequence[int]) -> int:
    """How far the text after ``prompt`` is shifted from its token index (0 but for M-RoPE)."""
    return prompt_rope(model, prompt)[1] if uses_mrope(model) else 0
