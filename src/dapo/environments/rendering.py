"""Token-in/token-out rendering of multi-turn episodes with the model's chat template.

An episode is one token sequence, built only by appending: the opening messages rendered
once (with the tools' schemas), then each assistant turn exactly as the engine sampled it
(ending with the EOS token when the model stopped), then the environment's reply rendered
and tokenized on its own. Earlier turns are never re-rendered or re-tokenized, so the
trainer sees exactly the ids the engine saw (re-rendering the whole conversation changes
earlier tokens with templates that rewrite past turns or BPE merges across turn
boundaries: TRL #5224, verl #3960).

How a reply is rendered on its own: the template renders a fixed conversation ``[user,
assistant MARKER]`` followed by the new messages and the generation prompt; the text after
MARKER is what the template puts after an assistant turn, minus the EOS token's text when
the template closes the turn with it (the model sampled that token already). What is left
(for ChatML the ``"\\n"`` after ``<|im_end|>``, the reply, ``<|im_start|>assistant\\n``) is
the environment's part, tokenized alone. A template that closes turns with something else
than the EOS token gets its closing text after the sampled EOS token.

Images. Given a vision-language model's processor, a message's content may be parts
(``[{"type": "image", "image": ...}, {"type": "text", "text": ...}]``, as TRL's are): each
image stands where the template puts an image (the processor's placeholder), and the
rendered text goes through the processor, which expands each placeholder into the image's
tokens. The ids then come back as an :class:`~dapo.data.images.ImagePrompt` holding the
images and the spans of their tokens, so that an image token the model samples later stays
text (:func:`dapo.models.vision.token_inputs`). A template that renders string content is
given the parts as text with the placeholder in place of each image; one that reads only
parts (SmolVLM's) is given every message as parts.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from typing import Any

from dapo.environments.base import EnvironmentWarning, Message
from dapo.errors import ConfigError

_MARKER = "DAPO-TURN-END-7f3a9c"  # stands for an assistant turn's content; never tokenized
_DUMMY_USER = "DAPO-USER-7f3a9c"


def tools_system_prompt(schemas: list[dict[str, Any]]) -> str:
    """The tools described in the Hermes form, for templates that ignore ``tools=``."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You can call these tools:\n<tools>\n" + listed + "\n</tools>\nTo call one, write "
        '<tool_call>{"name": <tool name>, "arguments": <arguments as JSON>}</tool_call>; its '
        "result comes back in the next message."
    )


class RenderError(ValueError):
    """The chat template could not render an environment's messages (the episode ends)."""


NO_TEMPLATE_FIX = (
    "Fix: use a chat model (the built-in one for multi-turn episodes is "
    "model.name_or_path=builtin:tiny-tool; builtin:tiny and builtin:tiny-long have no template), "
    "or set the tokenizer's chat_template (tokenizer_config.json) to one that renders the roles "
    "your environment uses"
)


def no_template_error(model: str) -> ConfigError:
    """The error for multi-turn episodes on a model whose tokenizer has no chat template."""
    return ConfigError(
        "multi-turn episodes (rollout.environment, rollout.tools) need a chat template, and the "
        f"tokenizer of `model.name_or_path` = {model!r} has none. {NO_TEMPLATE_FIX}"
    )


class ChatRenderer:
    """Renders an episode's non-model parts as token ids for one tokenizer and tool set;
    ``vision``: a vision-language model's :class:`~dapo.data.images.ImageText` (its
    processor), through which messages with images are rendered (without it an image is a
    :class:`RenderError`)."""

    def __init__(
        self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, vision: Any = None
    ) -> None:
        # The tokenizer's template, else (None passed on) the processor's.
        own = getattr(tokenizer, "chat_template", None)
        self.template = None if own else getattr(vision, "chat_template", None)
        if not own and not self.template:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise no_template_error(name)
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.vision = vision
        self.eos_token_id = tokenizer.eos_token_id
        self._eos_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)
        probe = [{"role": "user", "content": _DUMMY_USER}]
        self.placeholder = getattr(vision, "placeholder", "<image>")
        self.parts = False  # how _form gives messages to the template; the probe decides:
        # a template that shows no string content reads content parts only (SmolVLM's).
        self.parts = vision is not None and _DUMMY_USER not in self._render(probe, tools=False)
        # A template that ignores `tools=` (SmolLM2's, many base models'): the schemas go into
        # a system message in the Hermes form instead, so the model does see its tools.
        self.tools_prompt = None
        if self.tools and self._render(probe) == self._render(probe, tools=False):
            self.tools_prompt = tools_system_prompt(self.tools)
            warnings.warn(
                "the chat template ignores tools=; dapo describes the tools in a system "
                "message instead (Hermes form: <tool_call>{...}</tool_call>)",
                EnvironmentWarning,
                stacklevel=2,
            )

    def _render(self, messages: list[Message], tools: bool = True) -> str:
        messages = [self._form(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools if tools else None,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.template,
            )
        except Exception as exc:
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise RenderError(
                f"the chat template could not render messages with roles [{roles}] "
                f"({type(exc).__name__}: {exc}); use roles the model's template knows"
            ) from exc
        if not isinstance(text, str):
            raise RenderError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    def _form(self, message: Message) -> Message:
        """``message`` as the template takes it: content parts as text (each image the
        placeholder), or, for a template that reads parts only, every content as parts (the
        images' objects left out: the template only marks where they stand)."""
        content = message.get("content")
        if self.parts:
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            shown = [{"type": "image"} if p.get("type") == "image" else dict(p) for p in parts]
            return {**message, "content": shown}
        if isinstance(content, str):
            return message
        text = "".join(
            self.placeholder if p.get("type") == "image" else str(p.get("text", ""))
            for p in content
        )
        return {**message, "content": text}

    def _encode(self, text: str, images: Sequence[Any] = ()) -> list[int]:
        """``text``'s ids; with images, through the processor (an ImagePrompt)."""
        if not images:
            return self._ids(text)
        if self.vision is None:
            raise RenderError(
                f"the messages hold {len(images)} image(s) and the model is a text model; "
                "return images only to a vision-language model"
            )
        try:
            return self.vision.encode(text, images)
        except ValueError as exc:  # an image that cannot be read, or the processor refused
            raise RenderError(str(exc)) from None

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def opening(self, messages: list[Message], images: Sequence[Any] = ()) -> list[int]:
        """The prompt ids: the opening messages, the tools and the generation prompt.
        ``images``: a prompt record's images, for the image parts (and ``<image>``
        placeholders) of its messages that carry none, in order."""
        messages = self._with_record_images(messages, images)
        return self._encode(self.opening_text(messages), images_in(messages))

    def _with_record_images(self, messages: list[Message], images: Sequence[Any]) -> list[Message]:
        if not images or self.vision is None:
            return messages
        queue = list(images)
        out = []
        for m in self.vision.with_parts(messages):
            filled = []
            for p in m["content"]:
                if p.get("type") == "image" and p.get("image") is None:
                    if not queue:
                        raise RenderError(
                            f"the opening has more image parts than the record's {len(images)} "
                            "image(s)"
                        )
                    p = {**p, "image": queue.pop(0)}
                filled.append(p)
            out.append({**m, "content": filled})
        if queue:
            raise RenderError(
                f"the opening leaves {len(queue)} of the record's {len(images)} image(s) "
                "without an image part or <image> placeholder"
            )
        return out

    def opening_text(self, messages: list[Message]) -> str:
        """The text of :meth:`opening` (its images as the template's placeholders)."""
        messages = list(messages)
        if self.tools_prompt is not None:
            if messages and messages[0].get("role") == "system":
                first, extra = messages[0], f"\n\n{self.tools_prompt}"
                content = first["content"]
                if isinstance(content, str):
                    messages[0] = {**first, "content": content + extra}
                else:
                    messages[0] = {**first, "content": [*content, {"type": "text", "text": extra}]}
            else:
                messages.insert(0, {"role": "system", "content": self.tools_prompt})
        return self._render(messages)

    def reply_text(self, messages: list[Message]) -> str:
        """The text appended after an assistant turn that ended with EOS: the rest of the
        turn's closing, ``messages``, and the generation prompt of the next assistant turn."""
        dummy = [
            {"role": "user", "content": _DUMMY_USER},
            {"role": "assistant", "content": _MARKER},
        ]
        text = self._render(dummy + list(messages))
        at = text.rfind(_MARKER)
        if at < 0:
            raise RenderError(
                "the chat template does not show an assistant message's content as it is; "
                "multi-turn episodes need a template that does"
            )
        tail = text[at + len(_MARKER) :]
        if self._eos_text and tail.startswith(self._eos_text):
            tail = tail[len(self._eos_text) :]
        return tail

    def reply(self, messages: list[Message]) -> list[int]:
        """:meth:`reply_text` as token ids, to append to the episode (an
        :class:`~dapo.data.images.ImagePrompt` when the messages hold images)."""
        return self._encode(self.reply_text(messages), images_in(messages))

    def assistant_text(self, ids: list[int]) -> str:
        """An assistant turn's text, as the environment and the reward functions see it: the
        sampled ids decoded, without the EOS token that ended the turn."""
        if ids and ids[-1] == self.eos_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def transcript(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        """A whole conversation as :func:`~dapo.rollout.episodes.run_episodes` builds it: the
        ids after the opening and a mask that is 1 on the assistant's tokens (each turn's
        content tokenized, then EOS) and 0 on everything else. For supervised warm-ups.

        Returns ``(ids, mask)`` of the whole sequence, the opening included (mask 0).
        """
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("a transcript needs at least one assistant message")
        ids = self.opening(messages[:first])
        mask = [0] * len(ids)
        pending: list[Message] = []
        for m in messages[first:]:
            if m["role"] != "assistant":
                pending.append(m)
                continue
            if ids and mask[-1] == 1:  # after an assistant turn: the environment's part
                env = self.reply(pending)
                ids += env
                mask += [0] * len(env)
            turn = self._ids(m["content"]) + [self.eos_token_id]
            ids += turn
            mask += [1] * len(turn)
            pending = []
        return ids, mask


def images_in(messages: Sequence[Message]) -> list[Any]:
    """The images of ``messages``' content parts, in order."""
    found = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            continue
        for p in content:
            if p.get("type") == "image":
                if p.get("image") is None:
                    raise RenderError(
                        f"a {m.get('role')!r} message has an image part without its image: give "
                        "{'type': 'image', 'image': <PIL image, path or bytes>}"
                    )
                found.append(p["image"])
    return found
