"""Running one agent episode: the agent's call with its client, and the worker process loop.

Sync agents run in worker processes (fresh interpreters started with :mod:`dapo.workers`;
they import the agent's module, ``openai`` and this module, not torch), each episode on a
thread of its own so that many agents wait on their requests at once. Each episode's
result goes back as one message ``(token, reward, error, seconds)``.
"""

from __future__ import annotations

import math
import numbers
import os
import pickle
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from dapo import workers

Finished = tuple[str, float | None, str | None, float]  # token, reward, error, seconds


def load_agent(payload: bytes) -> Callable[..., Any]:
    """The agent function from :meth:`dapo.agents.runners.AgentSpec.payload`'s bytes."""
    kind, value = pickle.loads(payload)
    if kind == "object":
        return value
    from dapo.environments.loading import import_spec

    return import_spec(value, "rollout.agent")


def check_reward(value: Any) -> float | None:
    """An agent's return value as a reward: ``None`` or a finite number; ValueError if not."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(
        f"the agent returned {value!r} ({type(value).__name__}); return the episode's reward "
        "as a number, or None for the reward functions to score the last assistant message"
    )


_HTTP: list[Any] = []  # one HTTP connection pool per process, shared by its episodes' clients
_HTTP_LOCK = threading.Lock()


def http_client() -> Any:
    """The process's shared ``httpx`` client for sync agents' clients (making one per
    client costs tens of milliseconds: its SSL context)."""
    with _HTTP_LOCK:
        if not _HTTP:
            import openai

            class Shared(openai.DefaultHttpxClient):
                def close(self) -> None:  # an agent closing its client keeps the others' pool
                    pass

            _HTTP.append(Shared())
        return _HTTP[0]


def run_sync(
    agent: Callable[..., Any], token: str, base_url: str, key: str, record: Any, timeout_s: float
) -> Finished:
    """Call a sync agent with an ``openai.OpenAI`` client for its episode."""
    start = time.perf_counter()
    try:
        import openai

        client = openai.OpenAI(
            base_url=base_url,
            api_key=key,
            max_retries=0,
            timeout=timeout_s,
            http_client=http_client(),
        )
        result = check_reward(agent(client, record))
        return token, result, None, time.perf_counter() - start
    except Exception as exc:
        return _raised(token, exc, start)


async def run_async(
    agent: Callable[..., Any], token: str, base_url: str, key: str, record: Any, timeout_s: float
) -> Finished:
    """Await an ``async def`` agent with an ``openai.AsyncOpenAI`` client for its episode."""
    start = time.perf_counter()
    try:
        import openai

        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s
        )
        try:
            result = check_reward(await agent(client, record))
        finally:
            await client.close()
        return token, result, None, time.perf_counter() - start
    except Exception as exc:
        return _raised(token, exc, start)


def _raised(token: str, exc: Exception, start: float) -> Finished:
    """The outcome of an agent that raised: no reward, the exception, the time it ran."""
    return (
        token,
        None,
        "raised: " + workers.describe_exception(exc, 400),
        time.perf_counter() - start,
    )


def worker_main(conn: Connection) -> None:
    """A worker process: load the agent, then run each episode it is sent on a thread."""
    agent = load_agent(conn.recv())
    http_client()  # openai imported before "ready": no episode's time-out pays for it

    lock = threading.Lock()

    def episode(*args: Any) -> None:
        result = run_sync(agent, *args)
        with lock:
            workers.flush_output()  # what the agent printed arrives before its result
            try:
                conn.send(result)
            except OSError:  # the parent is gone
                os._exit(0)

    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # hung agents' threads must not keep the process alive
        threading.Thread(target=episode, args=args, daemon=True).start()
