"""Tools: plain Python functions the model may call, and the parsers of its tool calls.

A tool is a function with type hints and a Google-style docstring (an ``Args:`` section):
its JSON schema (:func:`tool_schema`, transformers' ``get_json_schema``) goes to the chat
template's ``tools=`` argument, and the model's calls are read from its text by the parser
of its template's format (:data:`PARSERS`, ``rollout.tool_parser``):

- ``hermes`` (default): ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, one
  block per call, whitespace around the JSON allowed (the format of Hermes, Qwen2.5/Qwen3
  and most chat templates that render ``tools``).

Another format: a parser given as ``module:function`` (``rollout.tool_parser``), a
function ``parse(text: str) -> list[ToolCall]``:

- it receives one assistant turn's text, as decoded (special tokens removed);
- it returns the calls in order, each a :class:`ToolCall` (``ToolCall(name: str,
  arguments: dict[str, Any])``, the keyword arguments the tool is called with); ``[]``
  when the turn holds no call (the turn is then a final answer: it goes to the
  environment's ``step``, or ends the episode);
- it raises :class:`ToolCallParseError` for a call it cannot read (the episode ends as
  ``bad_tool_call``: the model's failure, counted).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    """One call the model asked for."""

    name: str
    arguments: dict[str, Any]


class ToolCallParseError(ValueError):
    """The model wrote a tool call that cannot be read (the episode ends: the model's failure)."""


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """The calls in ``text``, in order: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    ``arguments`` may also be a JSON string of an object (some models write it so); a call
    without ``arguments`` gets none (the tool then says which are missing). Raises
    :class:`ToolCallParseError` for a block that is not such JSON or is left open.
    """
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError as exc:
            raise ToolCallParseError(
                f"tool call {_clip(block)} is not valid JSON ({exc})"
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallParseError(
                f"tool call {_clip(block)} is not an object with a string 'name'"
            )
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallParseError(
                    f"tool call {_clip(block)}: 'arguments' is a string that is not JSON"
                ) from None
        if not isinstance(args, dict):
            raise ToolCallParseError(f"tool call {_clip(block)}: 'arguments' is not an object")
        calls.append(ToolCall(obj["name"], args))
    rest = _HERMES_BLOCK.sub("", text)
    if "<tool_call>" in rest:
        raise ToolCallParseError(f"a <tool_call> is not closed: {_clip(rest)}")
    return calls


# The tool-call formats, by name (rollout.tool_parser); module:function gives another.
PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def _clip(text: str, limit: int = 80) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall
) -> tuple[str | list[dict[str, Any]], str | None, bool]:
    """Run one call: ``(reply, error or None, whether the tool itself raised)``.

    The reply is the tool's return value: a string as it is, a PIL image as one image part,
    a list of content parts (``{"type": "image", "image": ...}``, ``{"type": "text",
    "text": ...}``) as it is, anything else as JSON; on an error it is ``Error: ...``, which
    the model reads as the tool's reply.
    """
    fn = tools.get(call.name)
    if fn is None:
        error = f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(tools)) or 'none'}"
        return f"Error: {error}", error, False
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        error = f"bad arguments for {call.name}: {exc}"
        return f"Error: {error}", error, False
    except ValueError:  # no signature to check (a builtin): let the call say
        pass
    try:
        result = fn(**call.arguments)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return f"Error: {error}", error, True
    if isinstance(result, str):
        return result, None, False
    if type(result).__module__.startswith("PIL."):
        return [{"type": "image", "image": result}], None, False
    if isinstance(result, list) and result and all(_is_part(p) for p in result):
        return [dict(p) for p in result], None, False
    try:
        return json.dumps(result), None, False
    except (TypeError, ValueError):
        return str(result), None, False


def _is_part(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("type") in ("text", "image")


def tool_schema(fn: Callable[..., Any], where: str) -> dict[str, Any]:
    """The JSON schema of ``fn`` for the chat template (``{"type": "function", ...}``).

    Raises ``ConfigError`` naming ``where`` (the config key) and the fix when the signature
    or docstring does not give one.
    """
    from transformers.utils import get_json_schema

    from dapo.errors import ConfigError

    name = getattr(fn, "__name__", repr(fn))
    try:
        return get_json_schema(fn)
    except Exception as exc:
        raise ConfigError(
            f"`{where}` = {name!r}: no JSON schema from its signature and docstring "
            f"({type(exc).__name__}: {exc}). Fix: give every argument a type hint and a line in "
            "the Args: section of a Google-style docstring, e.g. def add(numbers: list[int]) "
            "-> int whose docstring is a line saying what it does (Add numbers.), a blank line, "
            "then Args: and an indented line per argument (numbers: the numbers to add)"
        ) from exc
