"""The OpenAI-compatible HTTP endpoint that agents call during a training run.

A stdlib ``ThreadingHTTPServer`` on 127.0.0.1 (a free port) with a random per-run key.
Every episode has its own base URL, ``http://127.0.0.1:PORT/e/<episode token>/v1``, so a
request tells which episode it belongs to; under it ``POST /chat/completions`` and
``GET /models``. The handler threads do nothing but hand each request to the thread that
runs the episodes (:func:`dapo.agents.episodes.run_agent_episodes`) and wait for its
answer: that thread renders, batches and samples, so the tokenizer and the engine are used
from one thread only.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("dapo.agents")

MAX_BODY_BYTES = 32 * 2**20


@dataclass
class Call:
    """One chat-completions request, waiting for its answer."""

    token: str
    body: Any
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 0
    reply: dict[str, Any] = field(default_factory=dict)

    def answer(self, status: int, reply: dict[str, Any]) -> None:
        self.status, self.reply = status, reply
        self.done.set()


class _Server(ThreadingHTTPServer):
    # Hundreds of agents connect at once; the default backlog of 5 drops connections.
    request_queue_size = 1024
    daemon_threads = True


class AgentEndpoint:
    """The endpoint: puts each request on ``events`` as a :class:`Call` and serves its answer.

    ``model`` is the name ``/v1/models`` lists; requests may name any model.
    """

    def __init__(self, events: queue.Queue, model: str = "dapo-policy", wait_s: float = 3600.0):
        self.events, self.model, self.wait_s = events, model, wait_s
        self.key = "dapo-" + secrets.token_urlsafe(24)
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="dapo-agent-endpoint", daemon=True
        )
        self._thread.start()

    def base_url(self, token: str) -> str:
        """The base URL of one episode (what ``openai.OpenAI(base_url=...)`` takes)."""
        return f"http://127.0.0.1:{self.port}/e/{token}/v1"

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(8)

    def close(self) -> None:
        """Stop serving and end the server's thread (its request threads are daemons)."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None}}


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 120

        def _route(self) -> tuple[str | None, str]:
            """The episode token (None without one) and the path under ``/v1``."""
            path = self.path.split("?")[0].rstrip("/")
            parts = path.split("/")
            if len(parts) >= 4 and parts[1] == "e" and parts[3] == "v1":
                return parts[2], "/" + "/".join(parts[4:])
            if len(parts) >= 2 and parts[1] == "v1":
                return None, "/" + "/".join(parts[2:])
            return None, path

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization") or ""
            if secrets.compare_digest(given.encode(), f"Bearer {endpoint.key}".encode()):
                return True
            self._reply(
                401,
                _error("a wrong or missing API key (use the key this run gave)", "auth_error"),
            )
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            _, path = self._route()
            if not self._authorized():
                return
            if path == "/models":
                model = {"id": endpoint.model, "object": "model", "created": 0, "owned_by": "dapo"}
                self._reply(200, {"object": "list", "data": [model]})
            else:
                self._reply(404, _error(f"no such endpoint: GET {self.path}"))

        def do_POST(self) -> None:  # noqa: N802
            token, path = self._route()
            try:  # read first: a connection whose body was read stays usable after an error
                length = int(self.headers.get("Content-Length", ""))
                if not 0 <= length <= MAX_BODY_BYTES:
                    raise ValueError(f"a body of {length} bytes")
                data = self.rfile.read(length)
            except ValueError as exc:
                self.close_connection = True
                self._reply(400, _error(f"the request body is not readable ({exc})"))
                return
            if not self._authorized():
                return
            if path != "/chat/completions" or token is None:
                self._reply(
                    404,
                    _error(
                        f"no such endpoint: POST {self.path}; use the episode's base URL "
                        "(.../e/<episode>/v1) and /chat/completions under it"
                    ),
                )
                return
            try:
                body = json.loads(data)
            except ValueError as exc:
                self._reply(400, _error(f"the request body is not readable JSON ({exc})"))
                return
            call = Call(token, body)
            endpoint.events.put(call)
            if not call.done.wait(endpoint.wait_s):
                self._reply(504, _error("no answer in time", "timeout"))
                return
            self._reply(call.status, call.reply)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the agent gave up on the request (its time-out)
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug(format, *args)

    return Handler
