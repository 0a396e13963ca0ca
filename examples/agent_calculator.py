"""An agent for the calculator task, written only against the OpenAI client.

Nothing here imports dapo: the same function runs against any OpenAI-compatible server.
dapo trains the model behind ``client`` with it (examples/agent_calculator.yaml):

    dapo train examples/agent_calculator.yaml

The agent asks the model, runs the ``add`` tool calls it makes, sends the results back, and
stops at the first reply without a tool call (at most 3 requests). It returns ``None``: the
run's reward functions score that last reply (``Answer: <sum>``) against the record's
ground truth.
"""

from __future__ import annotations

import json

MAX_REQUESTS = 3

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add whole numbers exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "terms": {
                        "type": "string",
                        "description": 'The numbers joined by "+", e.g. "12+345".',
                    }
                },
                "required": ["terms"],
            },
        },
    }
]


def add(terms: str) -> int:
    """The tool: the exact sum of whole numbers joined by "+"."""
    numbers = terms.replace(" ", "").split("+")
    if not all(n.isdigit() for n in numbers):
        raise ValueError(f"not whole numbers joined by '+': {terms!r}")
    return sum(int(n) for n in numbers)


def run_tool(name: str, arguments: str) -> str:
    if name != "add":
        return f"Error: unknown tool {name!r}"
    try:
        return str(add(**json.loads(arguments)))
    except Exception as exc:  # the model sees the error as the tool's reply
        return f"Error: {exc}"


def agent(client, record):
    """One episode: the record's prompt, then tool calls until the model answers."""
    prompt = record["prompt"]  # chat messages, or a text
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for _ in range(MAX_REQUESTS):
        response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = response.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return None  # the reward functions score this reply
        for call in choice.message.tool_calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": run_tool(call.function.name, call.function.arguments),
                }
            )
    return None


if __name__ == "__main__":  # against any OpenAI-compatible server
    import os

    from openai import OpenAI

    problem = {"prompt": [{"role": "user", "content": "Add 48213+905771+1234."}]}
    print(agent(OpenAI(base_url=os.environ["OPENAI_BASE_URL"]), problem))
