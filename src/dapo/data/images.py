"""Images in prompts: reading them from rows, checking them against the prompt's placeholders,
and the token ids of a prompt that carry its images (:class:`ImagePrompt`).

The data forms read are TRL's (a conversational prompt whose messages have content parts
``{"type": "image"}`` / ``{"type": "text", "text": ...}``, with an ``images`` or ``image``
column) and verl's (``<image>`` placeholders in the text, with an ``images`` column). An
image is a PIL image, a file path, raw bytes, or the ``{"bytes": ..., "path": ...}`` dict a
``datasets`` ``Image`` feature or a parquet file holds. Every problem is a
:class:`~dapo.errors.DataError` naming the row, before any training.

A prompt with images travels through generation and training as an :class:`ImagePrompt`:
its token ids (image tokens expanded by the model's processor) with the images and a digest
of them, so that the training forward sees exactly the pixels the rollout saw, and two
prompts count as one only when both their tokens and their images are identical.
"""

from __future__ import annotations

import hashlib
import io
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dapo.errors import DataError

PLACEHOLDER = "<image>"  # verl's placeholder in a prompt's text
IMAGE_COLUMNS = ("images", "image")  # TRL's and verl's column names


def _row_error(where: str, index: int, key: str, problem: str, fix: str) -> DataError:
    return DataError(f"{where}: row {index}: field '{key}': {problem}. Fix: {fix}")


def open_image(value: Any, where: str, index: int, key: str) -> Any:
    """``value`` (PIL image, path, bytes, or ``{"bytes", "path"}``) as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    fix = "give a PIL image, an image file's path, its bytes, or {'bytes': ..., 'path': ...}"
    if isinstance(value, Image.Image):
        image = value
    else:
        data: bytes | None = None
        path: str | None = None
        if isinstance(value, dict):
            raw = value.get("bytes")
            data = bytes(raw) if raw is not None else None
            path = value.get("path") if data is None else None
        elif isinstance(value, bytes | bytearray | memoryview):
            data = bytes(value)
        elif isinstance(value, str | Path):
            path = str(value)
        else:
            raise _row_error(where, index, key, f"an image is a {type(value).__name__}", fix)
        if data is None and not path:
            raise _row_error(
                where, index, key, f"an image has neither bytes nor a path ({value!r})", fix
            )
        if data is None:
            file = Path(path).expanduser()
            if not file.is_file():
                raise _row_error(
                    where, index, key, f"the image file {path!r} does not exist", "fix the path"
                )
            data = file.read_bytes()
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            what = f"the image {path!r}" if path else f"an image of {len(data)} bytes"
            raise _row_error(
                where,
                index,
                key,
                f"{what} cannot be read ({exc})",
                "give a PNG, JPEG or WebP image",
            ) from None
    return image if image.mode == "RGB" else image.convert("RGB")


def content_parts(content: Any) -> list[dict[str, Any]] | None:
    """A message's content as TRL-style parts, or None when it is plain text."""
    if isinstance(content, str):
        return None
    return [dict(p) for p in content]


def count_images(prompt: str | list[dict[str, Any]]) -> int:
    """The images a prompt asks for: its ``{"type": "image"}`` parts and its ``<image>``
    placeholders."""
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    n = 0
    for message in prompt:
        content = message["content"]
        if isinstance(content, str):
            n += content.count(PLACEHOLDER)
            continue
        for part in content:
            if part.get("type") == "image":
                n += 1
            elif part.get("type") == "text":
                n += str(part.get("text", "")).count(PLACEHOLDER)
    return n


def with_image_parts(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages whose images are content parts: verl's ``<image>`` placeholders in the
    text become ``{"type": "image"}`` parts where they stand (a plain-text prompt becomes
    one user message); TRL-style parts stay as they are."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = []
    for m in messages:
        content = m["content"]
        texts = [content] if isinstance(content, str) else None
        parts: list[dict[str, Any]] = []
        for part in [{"type": "text", "text": t} for t in texts] if texts else content:
            if part.get("type") != "text" or PLACEHOLDER not in str(part.get("text", "")):
                parts.append(dict(part))
                continue
            pieces = str(part["text"]).split(PLACEHOLDER)
            for j, piece in enumerate(pieces):
                if j:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts})
    return out


def read_images(
    row: Any, prompt: str | list[dict[str, Any]], where: str, index: int, key: str | None
) -> list[Any]:
    """The row's images (the ``key`` column, else ``images`` or ``image``), opened, checked
    against the prompt's placeholders; ``[]`` for a text-only row."""
    keys = [key] if key else [k for k in IMAGE_COLUMNS if k in row]
    column = keys[0] if keys else IMAGE_COLUMNS[0]
    raw = row.get(column) if keys else None
    if hasattr(raw, "tolist") and not isinstance(raw, bytes | str):
        raw = raw.tolist()
    values = [] if raw is None else list(raw) if isinstance(raw, list | tuple) else [raw]
    wanted = count_images(prompt)
    if wanted != len(values):
        placeholders = "{'type': 'image'} parts or <image> placeholders"
        raise _row_error(
            where,
            index,
            column,
            f"the prompt has {wanted} image placeholder{'s' * (wanted != 1)} ({placeholders}) "
            f"but the row has {len(values)} image{'s' * (len(values) != 1)}",
            "give one image per placeholder, in order",
        )
    return [open_image(v, where, index, column) for v in values]


def image_digest(images: Sequence[Any]) -> str:
    """A digest of images' pixels (and sizes): equal exactly when the images are."""
    h = hashlib.sha1()
    for image in images:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.hexdigest()[:16]


class PixelCache:
    """The processor's pixel inputs of image lists, computed on demand and kept for the most
    recent :attr:`size` digests (a rollout step's prompts are forwarded several times: the
    prefill, the old log-probs, every update)."""

    def __init__(self, compute: Callable[[Sequence[Any]], dict[str, Any]], size: int = 512) -> None:
        self.compute, self.size = compute, size
        self._kept: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def get(self, digest: str, images: Sequence[Any]) -> dict[str, Any]:
        hit = self._kept.get(digest)
        if hit is None:
            hit = self._kept[digest] = self.compute(images)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(digest)
        return hit

    def __getstate__(self) -> dict[str, Any]:  # pickled without what it keeps
        return {"compute": self.compute, "size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.compute, self.size, self._kept = state["compute"], state["size"], OrderedDict()


class ImagePrompt(list):
    """Token ids (image tokens expanded) carrying their images.

    ``images``: RGB PIL images in order; ``digest``: an identity of them (:func:`image_digest`,
    or a digest of digests for a joined sequence); ``pixels``: where their pixel inputs come
    from; ``spans``: the ``(start, stop)`` token ranges that hold the images' features, in
    order (None: every image token, as a prompt encoded by an older release). An
    image token outside the spans is text: one the model sampled. ``raw``: the same sequence
    with each image as its one unexpanded placeholder, as an engine that expands images
    itself (vLLM) takes it (None: not known). Continued with plain ids (``prompt + ids``, as
    an episode grows) it keeps its images; joined with another ``ImagePrompt`` (either side)
    it holds both's images, the second's spans shifted. ``key`` identifies the sequence by
    its tokens, images and spans together.
    """

    def __init__(
        self,
        ids: Sequence[int],
        images: Sequence[Any],
        pixels: PixelCache,
        digest: str = "",
        spans: Sequence[tuple[int, int]] | None = None,
        raw: Sequence[int] | None = None,
    ) -> None:
        super().__init__(ids)
        self.images = tuple(images)
        self.pixels = pixels
        self.digest = digest or image_digest(self.images)
        self.spans = None if spans is None else tuple((int(a), int(b)) for a, b in spans)
        self.raw = None if raw is None else tuple(int(t) for t in raw)

    def __add__(self, other: Sequence[int]) -> ImagePrompt:  # type: ignore[override]
        if not images_of(other):
            raw = None if self.raw is None else [*self.raw, *other]
            return ImagePrompt(
                [*self, *other], self.images, self.pixels, self.digest, self.spans, raw
            )
        return _joined(self, other)  # type: ignore[arg-type]

    def __radd__(self, other: Sequence[int]) -> ImagePrompt:
        return _joined(other, self)

    def pixel_inputs(self) -> dict[str, Any]:
        """The model's image inputs for this sequence's images (the processor's tensors)."""
        return self.pixels.get(self.digest, self.images)

    def key(self) -> tuple[Any, ...]:
        return (*self, self.digest, self.spans)

    def __reduce__(self) -> tuple[Any, ...]:
        args = (list(self), self.images, self.pixels, self.digest, self.spans, self.raw)
        return (ImagePrompt, args)


def _joined(first: Sequence[int], second: ImagePrompt) -> ImagePrompt:
    """``first`` then ``second``, with the images of both (explicit spans needed where both
    have images: which image tokens are real cannot be told otherwise)."""
    shift = len(first)
    moved = None if second.spans is None else [(a + shift, b + shift) for a, b in second.spans]
    if not images_of(first):
        raw = None if second.raw is None else [*first, *second.raw]
        ids = [*first, *second]
        return ImagePrompt(ids, second.images, second.pixels, second.digest, moved, raw)
    head: ImagePrompt = first  # type: ignore[assignment]
    if head.spans is None or moved is None:
        raise ValueError("two image sequences joined without their spans")
    digest = hashlib.sha1(f"{head.digest}+{second.digest}".encode()).hexdigest()[:16]
    images = head.images + second.images
    raw = None if head.raw is None or second.raw is None else [*head.raw, *second.raw]
    spans = [*head.spans, *moved]
    return ImagePrompt([*head, *second], images, head.pixels, digest, spans, raw)


def image_spans(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The runs of ``token`` in ``ids`` as ``(start, stop)`` ranges (each image's tokens)."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate([*ids, None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            spans.append((start, i))
            start = None
    return spans


def spans_of(ids: Sequence[int], token: int | None) -> tuple[tuple[int, int], ...]:
    """The token ranges of ``ids`` that hold image features: an :class:`ImagePrompt`'s
    spans (every run of ``token`` when it has none), nothing for plain ids."""
    if not isinstance(ids, ImagePrompt) or not ids.images:
        return ()
    if ids.spans is not None:
        return ids.spans
    return tuple(image_spans(ids, token)) if token is not None else ()


def prompt_key(prompt: Sequence[int]) -> tuple[Any, ...]:
    """A prompt's identity: its tokens, and its images' digest when it has images."""
    return prompt.key() if isinstance(prompt, ImagePrompt) else tuple(prompt)


def images_of(prompt: Sequence[int]) -> tuple[Any, ...]:
    """The images a prompt carries (none for a text prompt)."""
    return prompt.images if isinstance(prompt, ImagePrompt) else ()


def render_with_images(prompt: str | list[dict[str, Any]], processor: Any) -> str:
    """A prompt with images as text for ``processor``: its chat template over content parts
    (a plain-text prompt then becomes one user message), else the text with each image as
    the processor's image token (messages joined as ``role: content`` lines)."""
    image_token = getattr(processor, "image_token", PLACEHOLDER)
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(
            with_image_parts(prompt), add_generation_prompt=True, tokenize=False
        )
    if isinstance(prompt, str):
        return prompt.replace(PLACEHOLDER, image_token)
    lines = []
    for m in with_image_parts(prompt):
        text = "".join(
            image_token if p["type"] == "image" else str(p.get("text", "")) for p in m["content"]
        )
        lines.append(f"{m['role']}: {text}")
    return "\n".join([*lines, "assistant:"])


def image_placeholder(processor: Any) -> str:
    """The text that stands for one image before ``processor`` expands it: what its chat
    template renders for an image part (Qwen2-VL's ``<|vision_start|><|image_pad|>
    <|vision_end|>``), else its ``image_token`` (Idefics3's ``<image>``)."""
    token = getattr(processor, "image_token", PLACEHOLDER)
    if not getattr(processor, "chat_template", None):
        return token
    before, after = "DAPO-BEFORE-7f3a9c", "DAPO-AFTER-7f3a9c"
    parts = [
        {"type": "text", "text": before},
        {"type": "image"},
        {"type": "text", "text": after},
    ]
    try:
        text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that takes no parts: the token it is
        return token
    start, end = text.find(before), text.find(after)
    between = text[start + len(before) : end] if 0 <= start < end else ""
    return between if token in between else token


def encode_with_images(
    texts: Sequence[str], images: Sequence[Sequence[Any]], processor: Any, pixels: PixelCache
) -> list[ImagePrompt]:
    """Token ids of prompts with images, each image placeholder expanded into the image
    tokens the processor gives it (no special tokens added, as for text prompts), with their
    unexpanded form (the text's tokens alone) as ``raw``."""
    token = image_token_of(processor)
    tokenizer = getattr(processor, "tokenizer", processor)
    out = []
    for text, imgs in zip(texts, images, strict=True):
        enc = processor(text=[text], images=[list(imgs)], add_special_tokens=False)
        ids = _id_list(enc["input_ids"][0])
        raw = _id_list(tokenizer([text], add_special_tokens=False)["input_ids"][0])
        out.append(ImagePrompt(ids, imgs, pixels, spans=image_spans(ids, token), raw=raw))
    return out


def _id_list(ids: Any) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def image_token_of(processor: Any) -> int:
    """The token id ``processor`` expands each image into (its ``image_token``)."""
    token = getattr(processor, "image_token_id", None)
    if token is None:
        tokenizer = getattr(processor, "tokenizer", processor)
        token = tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", PLACEHOLDER))
    return int(token)


def png_text(image: Any) -> str:
    """An image as base64 PNG text (lossless: the pixels come back exactly), to travel in
    JSON."""
    import base64

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_of_png_text(text: str) -> Any:
    """The RGB image of :func:`png_text`'s output; ``ValueError`` says why not."""
    import base64
    import binascii

    from PIL import Image, UnidentifiedImageError

    try:
        data = base64.b64decode(text, validate=True)
        image = Image.open(io.BytesIO(data), formats=["PNG"])
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"not a base64 PNG image ({type(exc).__name__}: {exc})") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(str(exc)) from None
    return image if image.mode == "RGB" else image.convert("RGB")


def copy_prompt(prompt: Sequence[int]) -> list[int]:
    """A copy of a prompt's token ids that keeps its images."""
    if isinstance(prompt, ImagePrompt):
        p = prompt
        return ImagePrompt(list(p), p.images, p.pixels, p.digest, p.spans, p.raw)
    return list(prompt)


class ImageText:
    """A vision-language model's processor as the multi-turn renderer uses it
    (:class:`~dapo.environments.rendering.ChatRenderer`): the text that stands for an image
    (:func:`image_placeholder`) and the encoding of rendered text with its images."""

    def __init__(self, processor: Any, pixels: PixelCache) -> None:
        self.processor, self.pixels = processor, pixels
        self.placeholder = image_placeholder(processor)
        self.chat_template = getattr(processor, "chat_template", None)

    def encode(self, text: str, images: Sequence[Any]) -> ImagePrompt:
        """``text`` with ``images`` (each a PIL image, path or bytes) as an
        :class:`ImagePrompt`; a ``ValueError`` says why not (an image that cannot be read,
        or the processor's refusal: placeholders and images that differ in number)."""
        where = "the messages' images"
        opened = [open_image(v, where, i, "image") for i, v in enumerate(images)]
        try:
            return encode_with_images([text], [opened], self.processor, self.pixels)[0]
        except Exception as exc:  # noqa: BLE001 - the processor's own error, said
            raise ValueError(
                f"the processor could not take the messages' {len(opened)} image(s) "
                f"({type(exc).__name__}: {exc}); give one image part per image, and no "
                f"{self.placeholder!r} in the text"
            ) from exc

    def with_parts(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages whose ``<image>`` placeholders are image parts (:func:`with_image_parts`),
        their other keys kept."""
        return [
            {**m, "content": parts["content"]}
            for m, parts in zip(messages, with_image_parts(messages), strict=True)
        ]
