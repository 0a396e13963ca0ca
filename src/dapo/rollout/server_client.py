"""The trainer's side of the rollout server: ``rollout.engine=vllm-server``.

:class:`ServerEngine` implements the :class:`~dapo.rollout.RolloutEngine` interface over
HTTP (:mod:`dapo.rollout.server`). Under ``torchrun`` every rank sends its own share of the
prompts (the server generates requests that arrive together in one batch); only rank 0
pushes weights, over the weight channel (:mod:`dapo.rollout.weight_channel`), while the
other ranks take part in gathering FSDP shards and then wait for the push to finish, so
that no rank generates with the old weights.

At connect the client checks that the server fits the trainer: its ``max_model_len``,
its EOS id, and its model's fingerprint (vocabulary size and parameter names and shapes,
:mod:`dapo.rollout.fingerprint`) against the policy's. With an API key
(``rollout.server_api_key`` or ``DAPO_SERVER_API_KEY``) every request but ``/health``
carries ``Authorization: Bearer KEY``.

Failures name the server's URL and the fix: a server that does not come up within
``rollout.server_timeout_s``; one that serves another model; a refused key (401); an
unhealthy server (503, reported at once); a connection refused or dropped (retried 3
times, 1 s, 2 s and 4 s apart, then an error); an answer that takes longer than the
time-out; a server that dies during a weight push. The trainer's last checkpoint is
untouched by all of these: start a server again and continue with ``resume=true``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any
from urllib.parse import urlparse

import torch

from dapo.data.images import copy_prompt, images_of
from dapo.errors import RolloutServerError
from dapo.parallel import distributed as D
from dapo.rollout.base import Group, SamplingParams
from dapo.rollout.fingerprint import Fingerprint
from dapo.rollout.protocol import API_KEY_ENV, image_entries
from dapo.rollout.weight_channel import (
    WeightGroup,
    address_towards,
    dtype_name,
    free_port,
    host_store,
    spec_of,
)

RESUME_HINT = (
    "If the server stopped, start it again (dapo vllm-serve MODEL --port PORT) and continue "
    "the run with resume=true: training resumes from the last checkpoint in "
    "output_dir/checkpoints and pushes its weights to the new server."
)


class _Transient(Exception):
    """A failure worth retrying: the connection was refused or dropped."""


class _Refused(RolloutServerError):
    """The server answered with an error status (``status``: 400, 401, 503, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerEngine:
    """Generation on a rollout server; weights pushed to it from rank 0.

    Args:
        url: the server, ``http://HOST:PORT`` (``rollout.server_url``).
        max_model_len: prompt + response tokens the trainer needs; the server must fit them.
        eos_token_id: the trainer's end-of-sequence token; the server must stop on it.
        policy: the policy's fingerprint; the server's model must have the same vocabulary,
            EOS and parameter names and shapes (None: not compared).
        api_key: sent as ``Authorization: Bearer KEY`` (None: no key).
        timeout_s: how long to wait for the server to come up and for each answer.
        retries: re-tries of a refused or dropped connection (1 s, 2 s, 4 s, ... apart).
    """

    expands_images = True  # the server's vLLM expands the prompts' images itself

    def __init__(
        self,
        url: str,
        *,
        max_model_len: int,
        eos_token_id: int,
        policy: Fingerprint | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 1.0,
    ) -> None:
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if not parsed.hostname or not parsed.port:
            raise RolloutServerError(
                f"`rollout.server_url` = {url!r} is not of the form http://HOST:PORT (the "
                "address dapo vllm-serve printed)"
            )
        self.url = f"{parsed.scheme}://{parsed.hostname}:{parsed.port}"
        self.host, self.port = parsed.hostname, parsed.port
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.group: WeightGroup | None = None
        self.version = 0
        self.info = self._wait_until_up()
        self._check_model(policy)
        if self.info["eos_token_id"] != eos_token_id:
            raise RolloutServerError(
                f"the rollout server at {self.url} stops generation on token "
                f"{self.info['eos_token_id']}, the trainer's tokenizer on {eos_token_id}: serve "
                "the model the trainer trains (with its tokenizer)"
            )
        if self.info["max_model_len"] < max_model_len:
            raise RolloutServerError(
                f"the rollout server at {self.url} holds {self.info['max_model_len']} tokens per "
                f"sequence; data.max_prompt_length + rollout.max_completion_length = "
                f"{max_model_len}: restart it with --max-model-len {max_model_len} or more"
            )

    def served_fingerprint(self) -> Fingerprint:
        """The served model's fingerprint (``GET /parameters``, with the API key)."""
        return Fingerprint.from_json(self._request("GET", "/parameters", timeout=60))

    def _check_model(self, policy: Fingerprint | None) -> None:
        """Stop unless the server's model has the policy's vocabulary, EOS and parameters
        (fetched with the API key: a wrong key is reported here, at connect)."""
        served = self.served_fingerprint()
        diff = None if policy is None else served.difference(policy)
        if policy is not None and diff is not None:
            raise RolloutServerError(
                f"the rollout server at {self.url} serves another model than the trainer's: "
                f"{diff}. The server's model {served.name} has {served.describe()}; the "
                f"trainer's {policy.name or 'policy'} has {policy.describe()}. Serve the "
                f"trainer's model (dapo vllm-serve {policy.name or 'MODEL'} --port {self.port}), "
                "or point rollout.server_url at a server of it"
            )

    # --- RolloutEngine --------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        if not prompts:
            return []
        body: dict[str, Any] = {"prompts": [list(p) for p in prompts], **asdict(params)}
        images = image_entries(prompts)
        if images is not None:
            body["images"] = images
        out = self._request("POST", "/generate", body)
        return [
            Group(copy_prompt(p), g["response_ids"], g["logprobs"], g["truncated"])
            for p, g in zip(prompts, out["groups"], strict=True)
        ]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probs of tokens ``1..`` of each sequence under the served model (``/score``:
        vLLM's prompt log-probs, temperature 1); text sequences only."""
        if not sequences:
            return []
        if any(images_of(s) for s in sequences):
            raise ValueError("the rollout server scores text sequences only (no images)")
        return self._request("POST", "/score", {"sequences": sequences})["logprobs"]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 sends the tensors to the server; every rank must call this (the iterator
        may gather FSDP shards) and returns once the server has loaded them."""
        if not D.current().is_main:
            for _ in named_tensors:  # take part in the gathers; rank 0 sends
                pass
            D.barrier()
            return
        specs = getattr(named_tensors, "specs", None)
        if specs is None:
            named_tensors = list(named_tensors)
            specs = [spec_of(n, t) for n, t in named_tensors]
        else:
            specs = [(n, dtype_name(dt), list(shape)) for n, dt, shape in specs]
        self._join()
        self.version += 1
        body = {"specs": specs, "version": self.version}
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(self._request, "POST", "/update_weights", body, retry=False)
            try:
                self.group.send(named_tensors)  # type: ignore[union-attr]
            except RuntimeError as exc:
                self._leave()
                refused = None
                with contextlib.suppress(Exception):  # not done in time, or cancelled
                    refused = answer.exception(timeout=10)
                if isinstance(refused, _Refused):  # the server refused the push: say why
                    raise refused from exc
                raise RolloutServerError(
                    f"the weight push to the rollout server at {self.url} broke off "
                    f"({type(exc).__name__}: {str(exc)[:200]}). {RESUME_HINT}"
                ) from exc
            answer.result()
        D.barrier()

    def close(self) -> None:
        """Leave the weight channel (the server keeps running for the next trainer)."""
        if self.group is not None:
            with contextlib.suppress(RolloutServerError):
                self._request("POST", "/close_weight_sync", {}, retry=False, timeout=10)
            self._leave()

    # --- the weight channel ---------------------------------------------------------------

    def _join(self) -> None:
        """Build the weight group with the server's workers (once per server)."""
        if self.group is not None:
            return
        backend = "nccl" if torch.cuda.is_available() and self.info["device"] == "cuda" else "gloo"
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        host = address_towards(self.host, self.port)
        world_size = 1 + int(self.info["tensor_parallel_size"])
        # gloo: the store listens before the server is told its port (vLLM's NCCL group binds
        # its own port, so it gets one that is free now).
        store = host_store(host, world_size, self.timeout_s) if backend == "gloo" else None
        body = {
            "host": host,
            "port": store.port if store is not None else free_port(),
            "world_size": world_size,
            "backend": backend,
            "timeout_s": self.timeout_s,
        }
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server joins while we do
            answer = pool.submit(self._request, "POST", "/init_weight_sync", body, retry=False)
            try:
                self.group = WeightGroup(
                    body["host"],
                    body["port"],
                    0,
                    body["world_size"],
                    backend=backend,
                    device=device,
                    timeout_s=self.timeout_s,
                    store=store,
                )
            except Exception as exc:
                if answer.done() and answer.exception() is not None:
                    raise answer.exception() from exc  # type: ignore[misc]
                raise RolloutServerError(
                    f"the rollout server at {self.url} did not join the weight channel on "
                    f"{body['host']}:{body['port']} ({type(exc).__name__}: {str(exc)[:200]}); "
                    "it must reach the trainer's rank 0 at that address"
                ) from exc
            answer.result()

    def _leave(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    # --- HTTP -----------------------------------------------------------------------------

    def _wait_until_up(self) -> dict[str, Any]:
        """Poll ``/health`` until the server answers (it may still be starting)."""
        deadline = time.monotonic() + self.timeout_s
        reason = ""
        while True:
            try:
                return self._once("GET", "/health", None, timeout=min(30.0, self.timeout_s))
            except _Transient as exc:
                reason = str(exc)
            if time.monotonic() >= deadline:
                raise RolloutServerError(
                    f"no rollout server answers at {self.url} (waited rollout.server_timeout_s = "
                    f"{self.timeout_s:g} s; last error: {reason}). Start one with `dapo "
                    f"vllm-serve MODEL --port {self.port}` on that host, or fix rollout.server_url"
                )
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

    def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        *,
        retry: bool = True,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """One call, re-tried with back-off when the connection is refused or dropped."""
        delays = [self.backoff_s * 2**i for i in range(self.retries)] if retry else []
        for attempt in range(len(delays) + 1):
            try:
                return self._once(method, path, body, timeout=timeout or self.timeout_s)
            except _Transient as exc:
                if attempt == len(delays):
                    tries = f" after {attempt + 1} tries" if attempt else ""
                    raise RolloutServerError(
                        f"the rollout server at {self.url} did not answer {method} {path}"
                        f"{tries} ({exc}). {RESUME_HINT}"
                    ) from None
                time.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def _once(self, method: str, path: str, body: dict | None, *, timeout: float) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers=self._headers
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # the server answered: with an error
            try:
                answer = json.loads(exc.read())
                detail = answer.get("error") or answer.get("reason") or ""
            except (ValueError, OSError, AttributeError):
                detail = exc.reason
            raise _Refused(self._refusal(method, path, exc.code, detail), exc.code) from None
        except (
            TimeoutError,
            urllib.error.URLError,
            ConnectionError,
            http.client.HTTPException,
        ) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
                raise RolloutServerError(
                    f"the rollout server at {self.url} did not answer {method} {path} within "
                    f"{timeout:g} s (rollout.server_timeout_s): raise it for long generations, "
                    f"or check the server. {RESUME_HINT}"
                ) from None
            raise _Transient(f"{type(reason).__name__}: {reason}") from None

    def _refusal(self, method: str, path: str, code: int, detail: str) -> str:
        """The message for an error answer: what it means and what to do."""
        said = f"the rollout server at {self.url} answered {method} {path} with {code}: {detail}"
        if code == 401:
            return (
                f"{said}. Give the trainer the key the server was started with: "
                f"rollout.server_api_key=KEY or the {API_KEY_ENV} environment variable"
            )
        if code == 503:
            return f"{said}. {RESUME_HINT}"
        return said
