"""Agents for tests/test_agents.py, importable by agent worker processes. Like a user's
agent, they use only the openai client they are given (no dapo import)."""

from __future__ import annotations

import os
import sys
import time

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add whole numbers exactly.",
            "parameters": {
                "type": "object",
                "properties": {"terms": {"type": "string", "description": "e.g. 1+2"}},
                "required": ["terms"],
            },
        },
    }
]


def _three_requests(client, record):
    """Two requests each followed by a tool message, then a third that rewrites the history
    (a summary instead of the turns so far); the third reply."""
    messages = list(record["prompt"])
    for _ in range(2):
        reply = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=8
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "x", "content": "12345"})
    summary = [{"role": "user", "content": "Summary: the sum is 12345. Answer it."}]
    return client.chat.completions.create(model="m", messages=summary, tools=TOOLS, max_tokens=8)


def three_requests(client, record):
    """Three requests whatever the model says: each reply is followed by a tool message,
    and the third request rewrites the history (a summary instead of the turns so far)."""
    _three_requests(client, record)
    return None


def three_requests_scored(client, record):
    """As three_requests, and the reward is the parity of the last reply's characters'
    codes: groups of a random model get mixed rewards (a learning signal)."""
    text = _three_requests(client, record).choices[0].message.content or ""
    return float(sum(map(ord, text)) % 2)


def by_mode(client, record):
    """What ``record["extra"]["mode"]`` says: ok (one request, reward 1), raise, hang, exit,
    print (10 MB), or turns (requests until the endpoint refuses one; the refusal is caught)."""
    mode = record["extra"]["mode"]
    messages = list(record["prompt"])
    reply = client.chat.completions.create(model="m", messages=messages)
    if mode == "raise":
        raise ValueError("the agent's own bug")
    if mode == "hang":
        time.sleep(600)
    if mode == "exit":
        os._exit(3)  # kills its worker process
    if mode == "print":  # 10 MB to stdout, a line to stderr
        print("o" * 10_000_000)
        print("agent done", file=sys.stderr)
    if mode == "turns":
        try:
            for _ in range(50):
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                messages.append({"role": "user", "content": "again"})
                reply = client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError:
            return 1.0
    return 1.0
