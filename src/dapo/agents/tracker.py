"""Token-exact trajectories of an agent's conversation: matching requests to the sequence.

An episode's sequence is built only by appending, as in multi-turn episodes
(:class:`~dapo.environments.ChatRenderer`): the first request's messages are rendered as
the prompt (with the request's tools); each reply the endpoint samples is kept as the ids
the engine sampled; a later request whose messages *extend* the conversation so far (the
same messages, the assistant's as the endpoint returned them, then new ones, with the same
tools) appends only the new messages, rendered on their own. The sampled ids are never
re-tokenised, whatever the template would render for them.

The segment rule. A request that extends no conversation of the episode so far (the agent
edited, dropped or summarised earlier messages, retried an earlier request, or changed its
tools) starts a new *segment*: its messages are rendered whole as a new prompt, earlier
assistant turns as the text they were sampled as. A request may extend any earlier segment
(sub-agents keep conversations of their own). Each segment is trained as its own sample,
with the episode's reward.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dapo.agents.protocol import content_text, wire_tool_calls
from dapo.environments import ChatRenderer, ToolCall

Key = tuple[Any, ...]


@dataclass
class Segment:
    """One trained sample of an episode: a prompt and everything appended after it."""

    prompt_ids: list[int]
    tools_key: str
    keys: list[Key] = field(default_factory=list)  # the messages the sequence holds
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens
    ended_eos: bool = True

    @property
    def sampled(self) -> int:
        return sum(self.mask)


@dataclass
class Prepared:
    """A request's prompt, applied to the conversation only once it is accepted."""

    prompt_ids: list[int]
    segment: Segment  # the segment the reply extends (a new one when ``new``)
    new: bool
    appended: list[int]  # ids added to an extended segment (mask 0)
    keys: list[Key]  # the request's messages


def message_key(message: dict[str, Any], calls: list[ToolCall] | None = None) -> Key:
    """What identifies a message when matching: role, content text and tool calls (ids of
    tool calls and names of tool messages are not compared)."""
    if calls is None:
        calls = wire_tool_calls(message) if message.get("role") == "assistant" else []
    text = content_text(message)
    if message.get("role") == "assistant":
        text = text.strip()
    listed = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls)
    return (message["role"], text, listed)


def hermes_text(content: str, calls: list[ToolCall]) -> str:
    """An assistant message written as the model writes it: content, then Hermes calls."""
    blocks = [
        "<tool_call>" + json.dumps({"name": c.name, "arguments": c.arguments}) + "</tool_call>"
        for c in calls
    ]
    return "".join([content, *blocks])


class Conversation:
    """One episode's segments and the raw text of every assistant turn it sampled."""

    def __init__(self, renderer_for: Callable[[list[dict[str, Any]] | None], ChatRenderer]):
        self.renderer_for = renderer_for
        self.segments: list[Segment] = []
        self.raw: dict[Key, str] = {}  # an assistant message's key -> the text it was sampled as

    @property
    def used(self) -> int:
        """Tokens after the prompts, over all segments (the episode budget's count)."""
        return sum(len(s.ids) for s in self.segments)

    def _template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            text = content_text(m)
            if m["role"] == "assistant":
                raw = self.raw.get(message_key(m))
                text = raw if raw is not None else hermes_text(text, wire_tool_calls(m))
                out.append({"role": "assistant", "content": text})
            else:
                msg = {"role": m["role"], "content": text}
                if m.get("name"):
                    msg["name"] = m["name"]
                out.append(msg)
        return out

    def prepare(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> Prepared:
        """The prompt ids for a request; raises RenderError when the template cannot render."""
        keys = [message_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True)
        renderer = self.renderer_for(tools)
        # The latest segment whose conversation this request extends (an agent with
        # sub-agents keeps several conversations going in one episode).
        for seg in reversed(self.segments):
            if (
                seg.tools_key == tools_key
                and seg.keys[-1][0] == "assistant"
                and keys[: len(seg.keys)] == seg.keys
            ):
                closing = [] if seg.ended_eos else [renderer.eos_token_id]
                new = self._template_messages(messages[len(seg.keys) :])
                appended = closing + renderer.reply(new)
                return Prepared(seg.prompt_ids + seg.ids + appended, seg, False, appended, keys)
        prompt = renderer.opening(self._template_messages(messages))
        return Prepared(list(prompt), Segment(prompt, tools_key), True, [], keys)

    def apply(
        self,
        prepared: Prepared,
        ids: list[int],
        logprobs: list[float],
        eos_token_id: int,
        key: Key,
        raw_text: str,
    ) -> None:
        """Append an accepted request's new messages and the reply sampled for it."""
        seg = prepared.segment
        if prepared.new:
            self.segments.append(seg)
        else:
            seg.ids += prepared.appended
            seg.logprobs += [0.0] * len(prepared.appended)
            seg.mask += [0] * len(prepared.appended)
        seg.keys = [*prepared.keys, key]
        seg.ids += ids
        seg.logprobs += logprobs
        seg.mask += [1] * len(ids)
        seg.ended_eos = bool(ids) and ids[-1] == eos_token_id
        self.raw[key] = raw_text
