"""The OpenAI chat-completions wire format: reading a request, writing a response or an error.

Only what a training run can honour is accepted. The run fixes the sampling distribution
(``temperature``, ``top_p``: the loss's log-probs must be those the engine sampled with), so
a request asking for other values, for penalties, several choices, stop sequences or
streaming is refused with HTTP 400 naming the field. The model name is not checked (agents
often hard-code one); ``seed``, ``user``, ``metadata``, ``logprobs`` and other fields that
do not change what is sampled are ignored.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from dapo.environments.tools import ToolCall, ToolCallParseError

# Fields whose only accepted values are those that leave sampling as the run fixes it.
_NEUTRAL = {
    "n": (None, 1),
    "stream": (None, False),
    "stop": (None, [], ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tool_choice": (None, "auto"),
}


class ApiError(Exception):
    """A request the endpoint answers with an OpenAI-style error (the agent sees it)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ("invalid_request_error" if status == 400 else "api_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param}}


@dataclass
class ChatRequest:
    """What the endpoint takes from a ``/v1/chat/completions`` body."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None


def parse_request(body: Any, temperature: float, top_p: float) -> ChatRequest:
    """The request in ``body`` (decoded JSON); :class:`ApiError` 400 naming the field when it
    asks for something the run does not sample with."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "`messages` must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"`messages[{i}]` is not a message with a `role`", "messages")
    for name, fixed in (("temperature", temperature), ("top_p", top_p)):
        value = body.get(name)
        if value is not None and not (
            isinstance(value, int | float) and math.isclose(value, fixed, abs_tol=1e-9)
        ):
            raise ApiError(
                400,
                f"`{name}` = {value!r}: this training run samples with {name}={fixed} (the "
                f"loss needs the log-probs of the distribution it sampled from); leave `{name}` "
                f"out or set it to {fixed}, or change rollout.{name} for the run",
                name,
            )
    for name, accepted in _NEUTRAL.items():
        if body.get(name, None) not in accepted:
            raise ApiError(
                400,
                f"`{name}` = {body[name]!r} is not supported by the training endpoint (it "
                f"would change what is sampled or how); leave it out",
                name,
            )
    tools = body.get("tools") or None
    if tools is not None and (
        not isinstance(tools, list)
        or not all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise ApiError(400, "`tools` must be a list of {type: function, function: {...}}", "tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise ApiError(400, f"`max_tokens` = {max_tokens!r} must be a positive int", "max_tokens")
    return ChatRequest(messages, tools, max_tokens)


def content_text(message: dict[str, Any]) -> str:
    """A message's content as text: a string, text parts joined, or "" for none."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"content parts of type {kind!r} are not supported", "messages")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise ApiError(400, f"a message's `content` is a {type(content).__name__}", "messages")


def wire_tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The tool calls of an assistant message as the agent sent them back."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, "an assistant message has a malformed `tool_calls`", "messages")
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ApiError(400, "tool call arguments that are not JSON", "messages") from None
        calls.append(ToolCall(fn["name"], args if isinstance(args, dict) else {"value": args}))
    return calls


def split_tool_calls(text: str, parser: Any) -> tuple[str, list[ToolCall]]:
    """The content shown to the agent and the tool calls of a sampled turn's text. A turn
    whose calls do not parse is shown whole, without tool calls."""
    try:
        calls = parser(text)
    except ToolCallParseError:
        return text, []
    if not calls:
        return text, []
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip()
    return content, calls


def completion(
    ident: str,
    model: str,
    content: str,
    calls: list[ToolCall],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{ident}_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for k, c in enumerate(calls)
        ]
        if not content:
            message["content"] = None
    return {
        "id": f"chatcmpl-{ident}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
