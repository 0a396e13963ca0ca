"""The environment contract, and the checks every environment's output goes through.

An environment plays the other side of one episode (one instance per episode):

- ``reset(record) -> list[message]``: the opening chat messages for a prompt record;
- ``step(assistant_text) -> (messages, reward | None, done)``: its reply to one assistant
  turn, a reward when the episode ends (``None``: the configured reward functions score the
  final assistant text), and whether the episode ended.

A message is a dict with a string ``role`` and a ``content`` (other keys, such as
``name``, are passed to the chat template as they are): a string, or, for a
vision-language policy, TRL-style parts ``[{"type": "image", "image": <PIL image, path or
bytes>}, {"type": "text", "text": ...}]`` (:mod:`dapo.environments.rendering`). :class:`Environment` is an optional base
class: its ``reset`` opens with the record's prompt and its ``step`` ends the episode, and
a class attribute ``tools`` lists plain functions the model may call (see
:mod:`dapo.environments.tools`). This module imports neither torch nor transformers: it
runs in the environment worker processes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dapo.environments.tools import ToolCallParseError, call_tool

Message = dict[str, Any]
StepResult = tuple[list[Message], float | None, bool]


class EnvironmentWarning(UserWarning):
    """An environment or tool failed (raised, hung, returned malformed output): the episode
    ended with a recorded reason, training goes on. Warned once per class/tool and kind."""


class MalformedOutput(ValueError):
    """An environment returned something that is not what the contract says."""


def prompt_messages(record: Any) -> list[Message]:
    """The opening messages a record's prompt stands for: its chat messages, or one user
    message holding its text. ``record`` is a :class:`~dapo.data.records.PromptRecord` or a
    mapping with a ``prompt`` field."""
    prompt = record.get("prompt") if isinstance(record, Mapping) else record.prompt
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


class Environment:
    """Optional base class of an environment: subclass it and override what you need.

    The defaults make a single-turn episode on the record's prompt: ``reset`` opens with
    the prompt, ``step`` ends the episode without a reward (the reward functions score the
    answer). With ``tools`` set, tool calls in the model's turns are run and answered for
    you, and ``step`` sees only the turns without a tool call (the final answer).
    """

    tools: ClassVar[Sequence[Callable[..., Any]]] = ()

    def reset(self, record: Any) -> list[Message]:
        """The episode's opening messages for one prompt record (the default: its prompt
        as one user message, or its chat messages).

        ``record`` is a :class:`~dapo.data.records.PromptRecord`, one row of the training
        data after the column rules (``data.prompt_key``, ``data.answer_key``):

        - ``record.prompt``: ``str``, or chat messages ``[{"role": ..., "content": ...}]``;
        - ``record.ground_truth``: ``str``, the reference answer (the answer column);
        - ``record.data_source``: ``str``, the row's ``data.data_source_key`` column;
        - ``record.uid``: ``str``, a stable id of the problem (identical prompts share it);
        - ``record.extra``: ``dict``, the row's other columns as they are (the answer's
          column included), e.g. ``record.extra["table"]``.
        """
        return prompt_messages(record)

    def step(self, assistant_text: str) -> StepResult:
        """The reply to one assistant turn: ``(messages, reward, done)``. ``messages``: the
        chat messages that answer the model (``[]`` when ``done``); ``reward``: a number
        when the episode ends, or None to let the reward functions score the final
        assistant text; ``done``: whether the episode ends (the default: it does)."""
        return [], None, True


@dataclass
class TurnInfo:
    """What the tool layer saw in one assistant turn."""

    tool_calls: int = 0
    tool_errors: int = 0
    bad_tool_call: str | None = None  # why the turn's tool call did not parse (episode ends)
    raised: list[tuple[str, str]] = field(
        default_factory=list
    )  # (tool, error) of tools that raised


class ToolEnvironment:
    """Runs the model's tool calls; the turns without one go to ``inner`` (or end the episode).

    One instance per episode, like any environment. A call the parser cannot read ends the
    episode (``bad_tool_call``: the model's failure, counted). A call of an unknown tool,
    with wrong arguments, or of a tool that raises is answered with the error text as the
    tool's reply (``tool_errors``), and the episode goes on.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        parser: Callable[[str], list[Any]],
        inner: Any | None = None,
    ) -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        self.parser = parser
        self.inner = inner
        self.last_turn = TurnInfo()

    def reset(self, record: Any) -> list[Message]:
        return self.inner.reset(record) if self.inner is not None else prompt_messages(record)

    def step(self, assistant_text: str) -> StepResult:
        self.last_turn = turn = TurnInfo()
        try:
            calls = self.parser(assistant_text)
        except ToolCallParseError as exc:
            turn.bad_tool_call = str(exc)
            return [], None, True
        if not calls:
            return self.inner.step(assistant_text) if self.inner is not None else ([], None, True)
        replies = []
        for call in calls:
            text, error, raised = call_tool(self.tools, call)
            turn.tool_calls += 1
            if error is not None:
                turn.tool_errors += 1
                if raised:
                    turn.raised.append((call.name, error))
            replies.append({"role": "tool", "name": call.name, "content": text})
        return replies, None, False


# --- checks on what an environment returns ---------------------------------------------


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_messages(value: Any, where: str, *, allow_empty: bool = True) -> list[Message]:
    """``value`` as a list of plain message dicts, or :class:`MalformedOutput` saying why not."""
    if not isinstance(value, list | tuple):
        raise MalformedOutput(
            f"{where} returned {type(value).__name__} {_short(value)}, not a list of messages "
            "({'role': str, 'content': str})"
        )
    if not value and not allow_empty:
        raise MalformedOutput(f"{where} returned no messages; the episode needs an opening")
    out = []
    for i, m in enumerate(value):
        if not (
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or _parts(m.get("content")))
        ):
            raise MalformedOutput(
                f"{where} returned message [{i}] {_short(m)}: each message must be a dict "
                "with a string 'role' and a 'content' that is a string or a list of parts "
                "({'type': 'text', 'text': str} or {'type': 'image', 'image': <PIL image, "
                "path or bytes>})"
            )
        content = m["content"]
        parts = content if isinstance(content, str) else [dict(p) for p in content]
        out.append({**{str(k): v for k, v in m.items()}, "content": parts})
    return out


def _parts(content: Any) -> bool:
    """Whether ``content`` is a list of TRL-style content parts: text, or an image (checked
    for its kind here, opened where it is rendered)."""
    if not isinstance(content, list | tuple) or not content:
        return False
    for p in content:
        if not isinstance(p, Mapping):
            return False
        kind = p.get("type")
        if kind == "text" and isinstance(p.get("text"), str):
            continue
        if kind != "image" or not is_image_value(p.get("image")):
            return False
    return True


def is_image_value(value: Any) -> bool:
    """An image as dapo reads one: a PIL image, a path, bytes, or ``{"bytes", "path"}``;
    None stands for one of the prompt record's images (an opening's image parts)."""
    return (
        value is None
        or type(value).__module__.startswith("PIL.")
        or isinstance(value, str | bytes | bytearray | Mapping)
        or hasattr(value, "__fspath__")
    )


def check_step(value: Any, where: str) -> StepResult:
    """A step's ``(messages, reward, done)``, checked; a reward on a step that does not end
    the episode is dropped (only an episode's final reward counts)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise MalformedOutput(
            f"{where} returned {_short(value)}, not a (messages, reward, done) triple"
        )
    messages, reward, done = value
    if hasattr(done, "dtype") and getattr(done.dtype, "kind", "") == "b":  # numpy bool
        done = bool(done)
    if not isinstance(done, bool):
        raise MalformedOutput(f"{where} returned done={_short(done)}, not True or False")
    checked = check_messages(messages, where)
    if reward is not None:
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise MalformedOutput(
                f"{where} returned reward={_short(reward)}: give a finite number, or None to "
                "let the reward functions score the answer"
            )
        reward = float(reward)
    return checked, (reward if done else None), done
