"""Where environments run: :class:`EpisodeHost` (the episodes' instances, in a worker
process or, without workers, in the trainer's) and the worker process's loop.

A worker is a fresh interpreter started by :class:`~dapo.environments.pool.EnvironmentPool`;
it imports the environment's module and this package, not torch. It answers each
operation of a batch with one message, so the parent knows which call is running (for the
time-out) and which one a crash interrupted.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from dapo import workers
from dapo.environments.base import (
    MalformedOutput,
    ToolEnvironment,
    check_messages,
    check_step,
)
from dapo.environments.loading import make_environment, resolve_refs


def describe_exception(exc: BaseException) -> str:
    """What a failure says of an environment's exception (at most 400 characters;
    :func:`dapo.workers.describe_exception`)."""
    return workers.describe_exception(exc, 400)


def new_result() -> dict[str, Any]:
    """One operation's result, as plain data (it crosses the process boundary)."""
    return {
        "messages": [],
        "reward": None,
        "done": False,
        "failure": None,
        "bad_tool_call": None,
        "tool_calls": 0,
        "tool_errors": 0,
        "raised": [],
        "seconds": 0.0,
    }


class EpisodeHost:
    """The environment instances of the episodes this process holds, by episode id.

    :meth:`run` never raises for a misbehaving environment: a failure is in the result,
    ``("raised" | "malformed" | "lost", text)``, and the episode's instance is dropped.
    """

    def __init__(
        self,
        factory: Callable[[], Any] | None,
        tools: Sequence[Callable[..., Any]],
        parser: Callable[[str], list[Any]],
        name: str,
    ) -> None:
        self.factory, self.tools, self.parser, self.name = factory, list(tools), parser, name
        self.envs: dict[int, Any] = {}

    def run(self, episode: int, kind: str, arg: Any) -> dict[str, Any]:
        """One operation: ``reset`` (arg: the record), ``step`` (the assistant's text) or
        ``replay`` (record, texts, replies: rebuild a lost episode's state)."""
        result = new_result()
        start = time.perf_counter()
        where = kind
        try:
            if kind == "reset":
                self.envs.pop(episode, None)
                where = "creating the environment"
                env = make_environment(self.factory, self.tools, self.parser, self.name)
                self.envs[episode] = env
                where = "reset"
                result["messages"] = check_messages(env.reset(arg), "reset", allow_empty=False)
            elif kind == "step":
                if episode not in self.envs:
                    raise _Lost()
                self._step(self.envs[episode], arg, result)
            else:
                self._replay(episode, *arg)
        except MalformedOutput as exc:
            result["failure"] = ("malformed", str(exc))
        except _Lost as exc:
            result["failure"] = ("lost", str(exc))
        except Exception as exc:
            result["failure"] = ("raised", f"{where} raised {describe_exception(exc)}")
        if result["failure"] is not None or result["done"]:
            self.envs.pop(episode, None)
        result["seconds"] = time.perf_counter() - start
        return result

    def _step(self, env: Any, text: str, result: dict[str, Any]) -> None:
        messages, reward, done = check_step(env.step(text), "step")
        result.update(messages=messages, reward=reward, done=done)
        if isinstance(env, ToolEnvironment):
            turn = env.last_turn
            result.update(
                tool_calls=turn.tool_calls, tool_errors=turn.tool_errors, raised=turn.raised
            )
            if turn.bad_tool_call is not None:
                result.update(bad_tool_call=turn.bad_tool_call, done=True)

    def _replay(
        self, episode: int, record: Any, texts: list[str], replies: list[list[dict[str, Any]]]
    ) -> None:
        """Rebuild an episode whose worker was lost (another episode hung or crashed it) by
        running its calls again; it must answer as before."""
        opening = self.run(episode, "reset", record)
        if opening["failure"] is None:
            for text, reply in zip(texts, replies, strict=True):
                step = self.run(episode, "step", text)
                if step["failure"] is not None or step["done"] or step["messages"] != reply:
                    break
            else:
                return
        self.envs.pop(episode, None)
        raise _Lost()


class _Lost(Exception):
    def __str__(self) -> str:
        return (
            "the environment's worker was restarted (another episode's environment hung or "
            "crashed it) and replaying this episode's calls gave other replies; make reset and "
            "step depend only on the record and the assistant's turns"
        )


def worker_main(conn: Connection) -> None:
    """Entry point of a worker (:func:`dapo.workers.start_worker`): load the environment,
    then run batches until EOF."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    # The parent closing the pipe (close(), exit) is the normal way to stop a worker.
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
        _worker_loop(conn)


def _worker_loop(conn: Connection) -> None:
    _, payload, name = conn.recv()
    try:
        host = EpisodeHost(*resolve_refs(pickle.loads(payload)), name)
    except BaseException as exc:
        workers.flush_output()
        conn.send(("init_error", describe_exception(exc)))
        return
    workers.flush_output()
    conn.send(("ready", os.getpid()))
    while True:
        kind, body = conn.recv()
        if kind == "drop":
            for episode in body:
                host.envs.pop(episode, None)
            continue
        for pos, (episode, op, arg) in enumerate(body):
            result = host.run(episode, op, arg)
            workers.flush_output()  # what the call printed arrives before its result
            try:
                conn.send(("result", pos, result))
            except (OSError, EOFError):
                raise
            except Exception as exc:  # the messages could not be pickled
                host.envs.pop(episode, None)
                bad = new_result()
                bad["failure"] = (
                    "malformed",
                    f"{op} returned messages that cannot be sent "
                    f"between processes ({type(exc).__name__}: {exc})",
                )
                conn.send(("result", pos, bad))
