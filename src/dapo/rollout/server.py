"""The rollout server: vLLM in its own process behind a small HTTP API (``dapo vllm-serve``).

A trainer started with ``rollout.engine=vllm-server rollout.server_url=http://HOST:PORT``
sends its prompts here (:class:`dapo.rollout.server_client.ServerEngine`) and, after its
updates, pushes the policy's weights over a process group of their own
(:mod:`dapo.rollout.weight_channel`): the HTTP call announces the tensors, the tensors
themselves go over gloo (CPU) or NCCL (GPU), never through files.

API (JSON in, JSON out; errors are ``{"error": "..."}``):

- ``GET /health`` (open to all): ``status`` (``ok``; ``unhealthy`` or ``stopping`` with
  status 503 and a ``reason``), the ``model``, ``max_model_len``, ``eos_token_id``,
  ``tensor_parallel_size``, ``device``, ``weight_version`` (the ``version`` of the last
  weight update, -1 before any), ``limits`` (:class:`~dapo.rollout.protocol.Limits`),
  ``fingerprint`` (vocabulary size, EOS id, parameter count, element count and hash) and
  ``auth`` (whether the other endpoints need the API key).
- ``GET /parameters``: the served model's parameter names and shapes (the trainer compares
  them with its policy's when it connects).
- ``POST /generate``: ``prompts`` (token ids), ``n``, ``temperature``, ``top_p``,
  ``top_k``, ``max_tokens``, ``seed`` -> ``groups``: per prompt ``response_ids``,
  ``logprobs`` (the sampling log-probs, as :class:`~dapo.rollout.VLLMEngine` returns them)
  and ``truncated``. Requests that wait together (one per trainer rank) are generated in
  one vLLM batch; each prompt keeps its own seed.
- ``POST /score``: ``sequences`` (token ids, prompt + response) -> ``logprobs``: per
  sequence the log-probs of its tokens ``1..`` under the served weights (vLLM's prompt
  log-probs, temperature 1); what a trainer with ``algorithm.teacher=server:URL`` asks.
- ``POST /init_weight_sync``: ``host``, ``port``, ``world_size``, ``backend``,
  ``timeout_s``: the workers join the trainer's weight group (the call returns once the
  trainer has joined too); an earlier group is left first.
- ``POST /update_weights``: ``specs`` (name, dtype, shape of each tensor, in sending order)
  and ``version``: the workers receive the tensors and load them in place (vLLM's
  ``reload_weights``); the call returns when they are loaded.
- ``POST /close_weight_sync``: leave the weight group (the trainer calls it at its end).

Every request is checked before it reaches vLLM (:mod:`dapo.rollout.protocol`): a bad one
gets a 400 naming the field, the value and the limit, and costs nothing else. With an API
key (``--api-key`` or ``DAPO_SERVER_API_KEY``) every endpoint but ``/health`` needs
``Authorization: Bearer KEY`` (401 otherwise).

All engine work (generation, joining, loading) runs on one thread, in arrival order, so
weights never change under a generation. If vLLM raises inside a generation or a weight
load, or one job runs past ``--job-timeout-s`` (the watchdog), the engine cannot be
trusted again: the server turns unhealthy (``/health`` and every request answer 503 with
the reason) and exits with status 1 and a one-line message :data:`EXIT_AFTER_S` seconds
later, for a supervisor to restart it. SIGTERM and SIGINT stop it within
:data:`STOP_WAIT_S` seconds, also while its engine is stuck.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

from dapo.rollout.fingerprint import Fingerprint, of_model_dir
from dapo.rollout.protocol import (
    API_KEY_ENV,
    Limits,
    RequestError,
    Unauthorized,
    Unavailable,
    parse_close_weight_sync,
    parse_generate,
    parse_init_weight_sync,
    parse_score,
    parse_update_weights,
)
from dapo.rollout.server_http import make_handler

log = logging.getLogger("dapo.rollout.server")

WORKER_EXTENSION = "dapo.rollout.weight_channel.WeightReceiver"
EXIT_AFTER_S = 5.0  # an unhealthy server answers 503 this long, then exits with status 1
STOP_WAIT_S = 3.0  # SIGTERM / SIGINT: how long a running engine job may still finish


@dataclass
class _Job:
    kind: str  # "generate", "score", "load" (weights), "join" / "leave" (the weight group)
    payload: Any  # (prompts, params) for "generate", else a function to call
    limit_s: float  # the watchdog's limit for this job
    fatal: bool  # whether a failure leaves the engine untrustworthy
    future: Future = field(default_factory=Future)


class RolloutServer:
    """An engine (a :class:`~dapo.rollout.VLLMEngine` built with :data:`WORKER_EXTENSION`)
    served over HTTP: :meth:`start` it, then :meth:`wait` until it is stopped or fails.

    Args:
        engine: ``generate_many``, ``check_request`` (optional), ``llm.collective_rpc``,
            ``close``, and ``max_model_len``, ``eos_token_id``, ``on_cpu``.
        model: the served model's path or name (for ``/health`` and messages).
        fingerprint: the served model's (:func:`~dapo.rollout.fingerprint.of_model_dir`).
        limits: what a request may ask for (default: :class:`Limits`' defaults).
        api_key: the key every endpoint but ``/health`` requires (None: no key).
        exit_after_s: how long an unhealthy server answers 503 before :meth:`wait` returns.
    """

    def __init__(
        self,
        engine: Any,
        *,
        model: str,
        fingerprint: Fingerprint,
        limits: Limits | None = None,
        api_key: str | None = None,
        tensor_parallel_size: int = 1,
        exit_after_s: float = EXIT_AFTER_S,
    ) -> None:
        self.engine, self.fingerprint, self.api_key = engine, fingerprint, api_key or None
        self.limits = limits or Limits(engine.max_model_len, fingerprint.vocab_size)
        self.info = {
            "model": model,
            "max_model_len": engine.max_model_len,
            "eos_token_id": engine.eos_token_id,
            "tensor_parallel_size": tensor_parallel_size,
            "device": "cpu" if engine.on_cpu else "cuda",
        }
        self.weight_version = -1
        self.exit_after_s = exit_after_s
        self.unhealthy: str | None = None  # the reason, once the engine failed
        self.stopping: str | None = None  # why the server is stopping (a signal)
        self._unhealthy_at = 0.0
        self._joined = False  # the workers are in a weight group
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._running: tuple[list[_Job], float] | None = None  # the engine's jobs, since when
        self._httpd: ThreadingHTTPServer | None = None
        self._worker = threading.Thread(target=self._run_jobs, name="dapo-engine", daemon=True)
        self._worker.start()
        threading.Thread(target=self._watchdog, name="dapo-watchdog", daemon=True).start()

    # --- the engine thread ----------------------------------------------------------------

    def submit(
        self, kind: str, payload: Any, *, limit_s: float | None = None, fatal: bool = True
    ) -> Any:
        """Queue engine work and wait for its result (exceptions are re-raised here)."""
        job = _Job(kind, payload, self.limits.job_timeout_s if limit_s is None else limit_s, fatal)
        with self._lock:
            self._refuse_if_down()
            self._jobs.put(job)
        return job.future.result()

    def check_available(self) -> None:
        """Raise :class:`Unavailable` (503) when the server is unhealthy or stopping."""
        with self._lock:
            self._refuse_if_down()

    def _refuse_if_down(self) -> None:
        if self.unhealthy is not None:
            raise Unavailable(f"the rollout server is unhealthy: {self.unhealthy}")
        if self.stopping is not None:
            raise Unavailable(f"the rollout server is stopping ({self.stopping})")

    def _run_jobs(self) -> None:
        held: _Job | None = None
        while True:
            job = held or self._jobs.get()
            held = None
            if job is None:
                return
            batch = [job]
            while job.kind == "generate":  # every generation request already waiting joins
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt.kind != "generate":
                    held = nxt
                    break
                batch.append(nxt)
            with self._lock:
                if self.unhealthy is not None:  # failed while this batch waited: not run
                    return
                self._running = (batch, time.monotonic())
            try:
                if job.kind == "generate":
                    results = self.engine.generate_many([j.payload for j in batch])
                else:
                    results = [job.payload()]
            except BaseException as exc:
                if job.fatal:
                    self.fail(f"the engine failed during {job.kind} ({type(exc).__name__}: {exc})")
                    return
                _settle(job.future, exc)
            else:
                for j, result in zip(batch, results, strict=True):
                    _settle(j.future, result)
            with self._lock:
                self._running = None
                if self.unhealthy is not None:  # the watchdog gave up on this job
                    return

    def _watchdog(self) -> None:
        """Declare the engine stuck when one job runs past its limit."""
        while self.unhealthy is None and self._worker.is_alive():
            time.sleep(0.25)
            running = self._running
            if running is not None:
                batch, since = running
                elapsed = time.monotonic() - since
                if elapsed > batch[0].limit_s:
                    self.fail(
                        f"one {batch[0].kind} job has run for {elapsed:.0f} s, over the limit "
                        f"of {batch[0].limit_s:g} s (dapo vllm-serve --job-timeout-s): the engine "
                        "is stuck"
                    )

    def fail(self, reason: str) -> None:
        """Mark the server unhealthy: every waiting and later request gets a 503 naming
        ``reason``; :meth:`wait` returns 1 after ``exit_after_s``."""
        with self._lock:
            if self.unhealthy is not None:
                return
            self.unhealthy, self._unhealthy_at = reason, time.monotonic()
            failed = Unavailable(f"the rollout server is unhealthy: {reason}")
            for j in self._running[0] if self._running else []:
                _settle(j.future, failed)
            self._refuse_queued(failed)
        log.error("dapo vllm-serve: unhealthy: %s", reason)
        self._wake.set()

    def _refuse_queued(self, refusal: Unavailable) -> None:
        """Answer every job waiting in the queue with ``refusal`` (under the lock)."""
        while True:
            try:
                j = self._jobs.get_nowait()
            except queue.Empty:
                return
            if j is not None:
                _settle(j.future, refusal)

    # --- the operations -------------------------------------------------------------------

    def generate(self, body: dict) -> dict:
        prompts, params = parse_generate(body, self.limits)
        check = getattr(self.engine, "check_request", None)
        if check is not None:
            try:
                check(prompts, params)  # what vLLM itself refuses, refused here, alone
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        if not prompts:
            return {"groups": []}
        groups = self.submit("generate", (prompts, params))
        return {
            "groups": [
                {"response_ids": g.response_ids, "logprobs": g.logprobs, "truncated": g.truncated}
                for g in groups
            ]
        }

    def score(self, body: dict) -> dict:
        sequences = parse_score(body, self.limits)
        if not sequences:
            return {"logprobs": []}
        return {"logprobs": self.submit("score", lambda: self.engine.score(sequences))}

    def init_weight_sync(self, body: dict) -> dict:
        world = 1 + int(self.info["tensor_parallel_size"])
        args = parse_init_weight_sync(body, self.limits, world, self.info["device"])

        def join() -> None:
            self._joined = False
            self.engine.llm.collective_rpc("dapo_join_weights", args=args)
            self._joined = True

        # A failed join (the trainer unreachable) leaves the engine as it was: not fatal.
        self.submit("join", join, limit_s=args[-1] + 30, fatal=False)
        return {"status": "ok"}

    def update_weights(self, body: dict) -> dict:
        if not self._joined:
            raise RequestError("no weight group to receive from: call /init_weight_sync first")
        try:
            specs, version = parse_update_weights(body, self.fingerprint)
        except RequestError as exc:  # leave, so that the sender's broadcast fails, not hangs
            self.close_weight_sync({})
            raise RequestError(f"{exc} (the server left the weight group)") from None

        def load() -> float:
            t0 = time.perf_counter()
            self.engine.llm.collective_rpc("dapo_receive_weights", args=(specs,))
            self.engine.reset_caches()  # what the old weights computed (KV, image features)
            self.weight_version = version
            return time.perf_counter() - t0

        return {"status": "ok", "seconds": self.submit("load", load), "version": version}

    def close_weight_sync(self, body: dict) -> dict:
        parse_close_weight_sync(body)

        def leave() -> None:
            self.engine.llm.collective_rpc("dapo_leave_weights")
            self._joined = False

        self.submit("leave", leave, fatal=False)
        return {"status": "ok"}

    def health(self) -> tuple[int, dict]:
        status, reason = "ok", None
        if self.unhealthy is not None:
            status, reason = "unhealthy", self.unhealthy
        elif self.stopping is not None:
            status, reason = "stopping", self.stopping
        body = {
            "status": status,
            **({"reason": reason} if reason else {}),
            **self.info,
            "weight_version": self.weight_version,
            "limits": self.limits.to_json(),
            "fingerprint": self.fingerprint.summary(),
            "auth": self.api_key is not None,
        }
        return (200 if status == "ok" else 503), body

    def authorized(self, header: str | None) -> None:
        """Raise :class:`Unauthorized` unless ``header`` is ``Bearer <the key>``."""
        if self.api_key is None:
            return
        if not header or not header.startswith("Bearer "):
            raise Unauthorized(
                "this rollout server requires an API key: send `Authorization: Bearer KEY` "
                f"(the trainer sends rollout.server_api_key or ${API_KEY_ENV})"
            )
        if not hmac.compare_digest(header[len("Bearer ") :].encode(), self.api_key.encode()):
            raise Unauthorized(
                "the API key does not match the one this rollout server was started with"
            )

    # --- running and stopping -------------------------------------------------------------

    def start(self, host: str, port: int, *, listener: ThreadingHTTPServer | None = None) -> None:
        """Answer HTTP requests on ``host:port`` (a thread), or on ``listener`` (bound
        already, by :func:`listen`); raises ``OSError`` when the address cannot be bound."""
        self._httpd = listener or listen(host, port)
        self._httpd.RequestHandlerClass = make_handler(self)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, name="dapo-http", daemon=True).start()

    def stop(self, reason: str) -> None:
        """Ask :meth:`wait` to stop the server; safe in a signal handler (it takes no lock,
        :meth:`wait` polls)."""
        self.stopping = self.stopping or reason

    def wait(self) -> tuple[int, str]:
        """Block until stopped (:meth:`stop`) or unhealthy for ``exit_after_s``; then stop
        serving and release the engine if it is idle. Returns ``(exit status, message)``:
        0 after a clean stop, 1 when the engine failed or was still busy."""
        while True:
            if self.unhealthy is not None and (
                self.stopping is not None
                or time.monotonic() >= self._unhealthy_at + self.exit_after_s
            ):
                self._shutdown_http()
                return 1, f"{self.unhealthy}; exiting so that a supervisor restarts the server"
            if self.stopping is not None:
                return self._stop_engine()
            self._wake.wait(0.25)  # signal handlers only set `stopping`: polled
            self._wake.clear()

    def _stop_engine(self) -> tuple[int, str]:
        with self._lock:  # no new work; what waits in the queue gets a 503
            self._refuse_queued(Unavailable(f"the rollout server is stopping ({self.stopping})"))
            self._jobs.put(None)
        self._worker.join(STOP_WAIT_S)
        self._shutdown_http()
        running = self._running
        if self._worker.is_alive() and running is not None:
            batch, since = running
            return 1, (
                f"stopped ({self.stopping}) while the engine was still running a {batch[0].kind} "
                f"job ({time.monotonic() - since:.0f} s); exited without waiting for it"
            )
        closer = threading.Thread(target=self.engine.close, name="dapo-close", daemon=True)
        closer.start()
        closer.join(STOP_WAIT_S)
        if closer.is_alive():
            return (
                1,
                f"stopped ({self.stopping}); the engine did not shut down within {STOP_WAIT_S:g} s",
            )
        return 0, f"stopped ({self.stopping})"

    def _shutdown_http(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def close(self) -> None:
        """Stop serving and release the engine (tests; ``wait`` does this for the CLI)."""
        self.stop("closed")
        self.wait()


def _settle(future: Future, outcome: Any) -> None:
    """Give ``future`` its result (an exception is raised to the waiter), once."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    seed: int = 0,
    api_key: str | None = None,
    max_n: int = 256,
    max_request_mb: float = 64,
    job_timeout_s: float = 1800.0,
    quantization: str | None = None,
    log_fn: Callable[[str], None] = print,
) -> NoReturn:
    """``dapo vllm-serve``: build the engine for ``model`` and serve it until SIGTERM or
    SIGINT, then end the process: with status 0 after a clean stop; with status 1 and a
    one-line message on stderr when the engine failed or did not stop in time (it may be
    stuck, where nothing can reach it)."""
    from dapo.models import load_tokenizer, resolve_model_path
    from dapo.rollout.vllm_engine import VLLMEngine

    listener = listen(host, port)  # a taken port fails now, not after the engine's start
    path = resolve_model_path(model, log=log_fn)
    eos = load_tokenizer(path).eos_token_id
    fingerprint = of_model_dir(path, eos)
    extra = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    engine = VLLMEngine(
        path,
        eos,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=False,
        seed=seed,
        distributed=False,
        worker_extension_cls=WORKER_EXTENSION,
        quantization=quantization,
        **extra,
    )
    limits = Limits(
        engine.max_model_len,
        fingerprint.vocab_size,
        max_n=max_n,
        max_request_bytes=int(max_request_mb * (1 << 20)),
        job_timeout_s=job_timeout_s,
    )
    server = RolloutServer(
        engine,
        model=path,
        fingerprint=fingerprint,
        limits=limits,
        api_key=api_key,
        tensor_parallel_size=tensor_parallel_size,
    )
    server.start(host, port, listener=listener)

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if server.stopping is not None:  # a second signal: no more waiting
            _exit(128 + signum, f"dapo vllm-serve: {name} again; exiting at once")
        server.stop(f"{name} received")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    auth = "requests need the API key" if api_key else "no API key"
    log_fn(
        f"dapo vllm-serve: {path} on http://{host}:{port} (max_model_len {engine.max_model_len}, "
        f"tensor parallel {tensor_parallel_size}, {server.info['device']}, {auth}); Ctrl-C stops it"
    )
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log_fn(
            f"dapo vllm-serve: warning: listening on {host} without an API key: anyone who "
            "reaches the port can generate and replace the weights. Give --api-key (or "
            f"${API_KEY_ENV}) and the same key to the trainer (rollout.server_api_key)"
        )
    status, message = server.wait()
    if status:
        _exit(status, f"dapo vllm-serve: error: {message}")
    log_fn(f"dapo vllm-serve: {message}")
    atexit._run_exitfuncs()  # the engine is closed; the interpreter's teardown took 4 s more
    _exit(0, "")


def listen(host: str, port: int) -> ThreadingHTTPServer:
    """A server socket bound to ``host:port``, answering nothing until started; ``OSError``
    naming the address and the fix when it cannot be bound."""
    try:
        return ThreadingHTTPServer((host, port), BaseHTTPRequestHandler)
    except OSError as exc:
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose "
            "another --port, or stop what listens there"
        ) from None


def _exit(status: int, message: str) -> NoReturn:
    """Print ``message`` and end the process now: the engine thread may be stuck inside
    vLLM, where no clean shutdown can reach it. (``os.write``: safe in a signal handler.)"""
    sys.stdout.flush()
    if message:
        os.write(2, (message + "\n").encode())
    os._exit(status)


def launch(
    model: str,
    port: int,
    *,
    log: Path,
    max_model_len: int,
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    args: Sequence[str] = (),
    command: Sequence[str] | None = None,
    popen: Callable[..., Any] = subprocess.Popen,
) -> subprocess.Popen:
    """Start ``dapo vllm-serve MODEL`` on 127.0.0.1:``port`` in a subprocess (its output
    to ``log``) and return it once it answers ``/health`` (tests and benchmarks). ``args``:
    more options; ``command``: what runs instead of ``python -m dapo``; ``popen``: what
    starts it (``subprocess.Popen``'s signature; the tests fork it from a warm process).
    Raises ``RuntimeError`` with the end of its log if it exits or does not come up."""
    cmd = [
        *(command or [sys.executable, "-m", "dapo"]),
        "vllm-serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *args,
    ]
    proc = popen(
        cmd,
        env=dict(os.environ) if env is None else env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dapo vllm-serve exited with {proc.returncode}: {log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(
        f"dapo vllm-serve did not come up in {timeout_s:g} s: {log.read_text()[-3000:]}"
    )
