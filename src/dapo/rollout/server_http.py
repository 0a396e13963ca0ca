"""The rollout server's HTTP layer: routing, the API key, the bounded body, status codes.

400 for a bad request (:class:`~dapo.rollout.protocol.RequestError`), 401 without the API
key, 503 while the server is unhealthy or stopping, 500 for any other failure of one
request. A POST answered with an error closes its connection (its body may be unread).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from dapo.rollout.protocol import RequestError, Unauthorized, Unavailable, parse_body

log = logging.getLogger("dapo.rollout.server")


def make_handler(server: Any) -> type[BaseHTTPRequestHandler]:
    """The HTTP request handler class of ``server``, a
    :class:`~dapo.rollout.server.RolloutServer` (not imported: it imports this module)."""
    posts: dict[str, Callable[[dict], dict]] = {
        "/generate": server.generate,
        "/score": server.score,
        "/init_weight_sync": server.init_weight_sync,
        "/update_weights": server.update_weights,
        "/close_weight_sync": server.close_weight_sync,
    }

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 120  # a client that stops sending mid-request frees its thread

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.rstrip("/")
            if path == "/health":
                self._reply(*server.health())
            elif path == "/parameters":
                self._answer(lambda: server.fingerprint.to_json())
            else:
                self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            route = posts.get(self.path.rstrip("/"))
            if route is None:
                self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
                return
            self._answer(lambda: route(self._body()))

        def _body(self) -> dict:
            limit = server.limits.max_request_bytes
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise RequestError("a request body needs a Content-Length header") from None
            if not 0 <= length <= limit:
                raise RequestError(
                    f"the request body of {length} bytes is over the server's limit of {limit} "
                    "bytes (max_request_bytes in /health; dapo vllm-serve --max-request-mb)"
                )
            return parse_body(self.rfile.read(length))

        def _answer(self, fn: Callable[[], dict]) -> None:
            try:
                server.authorized(self.headers.get("Authorization"))
                server.check_available()
                self._reply(200, fn())
            except Unauthorized as exc:
                self._reply(401, {"error": str(exc)}, {"WWW-Authenticate": "Bearer"})
            except RequestError as exc:
                self._reply(400, {"error": f"bad request to {self.path}: {exc}"})
            except Unavailable as exc:
                self._reply(503, {"error": str(exc)})
            except Exception as exc:
                log.exception("%s failed", self.path)
                self._reply(500, {"error": f"{self.path} failed: {type(exc).__name__}: {exc}"})

        def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            if status != 200 and self.command == "POST":
                self.close_connection = True  # its body may be unread
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug(format, *args)

    return Handler
