"""The rollout server: vLLM in its own process behind a small HTTP API (``dapo vllm-serve``).

A trainer started with ``rollout.engine=vllm-server rollout.server_url=http://HOST:PORT``
sends its prompts here (:class:`dapo.rollout.server_client.ServerEngine`) and, after its
updates, pushes the policy's weights over a process group of their own
(:mod:`dapo.rollout.weight_channel`): the HTTP call announces the tensors, the tensors
themselves go over gloo (CPU) or NCCL (GPU), never through files.

API (JSON in, JSON out; errors are ``{"error": "..."}`` with status 400 or 500):

- ``GET /health``: ``status``, the ``model``, ``max_model_len``, ``eos_token_id``,
  ``tensor_parallel_size``, ``device``, ``weight_version`` (the ``version`` of the last
  weight update, -1 before any).
- ``POST /generate``: ``prompts`` (token ids), ``n``, ``temperature``, ``top_p``,
  ``top_k``, ``max_tokens``, ``seed`` -> ``groups``: per prompt ``response_ids``,
  ``logprobs`` (the sampling log-probs, as :class:`~dapo.rollout.VLLMEngine` returns them)
  and ``truncated``. Requests that wait together (one per trainer rank) are generated in
  one vLLM batch; each prompt keeps its own seed.
- ``POST /init_weight_sync``: ``host``, ``port``, ``world_size``, ``backend``,
  ``timeout_s``: the workers join the trainer's weight group (the call returns once the
  trainer has joined too); an earlier group is left first.
- ``POST /update_weights``: ``specs`` (name, dtype, shape of each tensor, in sending order)
  and ``version``: the workers receive the tensors and load them in place (vLLM's
  ``reload_weights``); the call returns when they are loaded.
- ``POST /close_weight_sync``: leave the weight group (the trainer calls it at its end).

All engine work (generation, joining, loading) runs on one thread, in arrival order, so
weights never change under a generation. There is no authentication: run the server on
a network only the trainer's machines reach.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dapo.rollout.base import Group, SamplingParams

log = logging.getLogger("dapo.rollout.server")

WORKER_EXTENSION = "dapo.rollout.server.WeightReceiver"


class WeightReceiver:
    """Mixed into every vLLM worker (``worker_extension_cls``): joins the trainer's weight
    group as rank ``1 + worker rank`` and loads the tensors it receives. Runs in the worker
    (this process with tensor parallel size 1)."""

    def dapo_join_weights(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        from dapo.rollout.weight_channel import WeightGroup

        self.dapo_leave_weights()
        device = "cpu" if backend == "gloo" else self.device  # type: ignore[attr-defined]
        rank = 1 + int(self.rank)  # type: ignore[attr-defined]
        self._dapo_group = WeightGroup(
            host, port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )

    def dapo_receive_weights(self, specs: list) -> None:
        from dapo.rollout.vllm_engine import _quiet, _refresh_tied_lm_head

        group = getattr(self, "_dapo_group", None)
        if group is None:
            raise RuntimeError("no weight group: call /init_weight_sync first")
        try:
            with _quiet("vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights"):
                self.reload_weights(  # type: ignore[attr-defined]
                    weights_iterator=group.receive([tuple(s) for s in specs]),
                    is_checkpoint_format=True,
                )
        except BaseException:
            self.dapo_leave_weights()  # the trainer's pending broadcast fails instead of hanging
            raise
        config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if getattr(config, "tie_word_embeddings", False):
            _refresh_tied_lm_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def dapo_leave_weights(self) -> None:
        group = getattr(self, "_dapo_group", None)
        if group is not None:
            group.close()
        self._dapo_group = None


@dataclass
class _Job:
    kind: str  # "generate" or "call"
    payload: Any
    future: Future = field(default_factory=Future)


class RolloutServer:
    """An engine (a :class:`~dapo.rollout.VLLMEngine` built with :data:`WORKER_EXTENSION`)
    served over HTTP; :meth:`serve` blocks until interrupted."""

    def __init__(self, engine: Any, *, model: str, tensor_parallel_size: int = 1) -> None:
        self.engine = engine
        self.info = {
            "model": model,
            "max_model_len": engine.max_model_len,
            "eos_token_id": engine.eos_token_id,
            "tensor_parallel_size": tensor_parallel_size,
            "device": "cpu" if engine.on_cpu else "cuda",
        }
        self.weight_version = -1
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run_jobs, name="dapo-engine", daemon=True)
        self._worker.start()

    # --- the engine thread ----------------------------------------------------------------

    def submit(self, kind: str, payload: Any) -> Any:
        """Queue engine work and wait for its result (exceptions are re-raised here)."""
        job = _Job(kind, payload)
        self._jobs.put(job)
        return job.future.result()

    def _run_jobs(self) -> None:
        held: _Job | None = None
        while True:
            job = held or self._jobs.get()
            held = None
            if job is None:
                return
            if job.kind != "generate":
                _settle(job.future, job.payload)
                continue
            batch = [job]
            while True:  # every generation request already waiting joins this batch
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt.kind != "generate":
                    held = nxt
                    break
                batch.append(nxt)
            try:
                results = self.engine.generate_many([j.payload for j in batch])
            except BaseException as exc:
                for j in batch:
                    j.future.set_exception(exc)
                continue
            for j, groups in zip(batch, results, strict=True):
                j.future.set_result(groups)

    # --- the operations -------------------------------------------------------------------

    def generate(self, body: dict) -> dict:
        prompts = body["prompts"]
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise ValueError("`prompts` must be a list of token-id lists")
        fields = ("n", "temperature", "top_p", "top_k", "max_tokens", "seed")
        params = SamplingParams(**{k: body[k] for k in fields if k in body})
        self.engine.check_prompts(prompts)  # a bad request fails alone, not the whole batch
        groups: list[Group] = self.submit("generate", (prompts, params))
        return {
            "groups": [
                {"response_ids": g.response_ids, "logprobs": g.logprobs, "truncated": g.truncated}
                for g in groups
            ]
        }

    def init_weight_sync(self, body: dict) -> dict:
        args = (body["host"], int(body["port"]), int(body["world_size"]), body.get("backend", "gloo"),
                float(body.get("timeout_s", 600)))  # fmt: skip
        self.submit("call", lambda: self.engine.llm.collective_rpc("dapo_join_weights", args=args))
        return {"status": "ok"}

    def update_weights(self, body: dict) -> dict:
        specs, version = body["specs"], int(body["version"])

        def load() -> float:
            t0 = time.perf_counter()
            self.engine.llm.collective_rpc("dapo_receive_weights", args=(specs,))
            self.engine.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
            self.weight_version = version
            return time.perf_counter() - t0

        return {"status": "ok", "seconds": self.submit("call", load), "version": version}

    def close_weight_sync(self, body: dict) -> dict:
        self.submit("call", lambda: self.engine.llm.collective_rpc("dapo_leave_weights"))
        return {"status": "ok"}

    def health(self) -> dict:
        return {"status": "ok", **self.info, "weight_version": self.weight_version}

    # --- HTTP -----------------------------------------------------------------------------

    def serve(self, host: str, port: int, ready: threading.Event | None = None) -> None:
        """Answer requests on ``host:port`` until interrupted (Ctrl-C, SIGTERM)."""
        routes = {
            "/generate": self.generate,
            "/init_weight_sync": self.init_weight_sync,
            "/update_weights": self.update_weights,
            "/close_weight_sync": self.close_weight_sync,
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.rstrip("/") == "/health":
                    self._reply(200, server.health())
                else:
                    self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                route = routes.get(self.path.rstrip("/"))
                if route is None:
                    self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", 0))
                    body = json.loads(self.rfile.read(length) or b"{}")
                    self._reply(200, route(body))
                except (KeyError, ValueError, TypeError) as exc:
                    self._reply(400, {"error": f"bad request to {self.path}: {type(exc).__name__}: {exc}"})
                except Exception as exc:
                    log.exception("%s failed", self.path)
                    self._reply(500, {"error": f"{self.path} failed: {type(exc).__name__}: {exc}"})

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug(format, *args)

        httpd = ThreadingHTTPServer((host, port), Handler)
        httpd.daemon_threads = True
        if ready is not None:
            ready.set()
        try:
            httpd.serve_forever()
        finally:
            httpd.server_close()

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=60)
        self.engine.close()


def _settle(future: Future, fn: Any) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(
    model: str,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    seed: int = 0,
    log_fn: Any = print,
) -> None:
    """``dapo vllm-serve``: build the engine for ``model`` and serve it until interrupted."""
    from dapo.models import load_tokenizer, resolve_model_path
    from dapo.rollout.vllm_engine import VLLMEngine

    path = resolve_model_path(model, log=log_fn)
    eos = load_tokenizer(path).eos_token_id
    extra = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    engine = VLLMEngine(
        path, eos, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=False, seed=seed,
        distributed=False, worker_extension_cls=WORKER_EXTENSION, **extra,
    )  # fmt: skip
    server = RolloutServer(engine, model=path, tensor_parallel_size=tensor_parallel_size)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does: cleanly
    log_fn(
        f"dapo vllm-serve: {path} on http://{host}:{port} (max_model_len {engine.max_model_len}, "
        f"tensor parallel {tensor_parallel_size}, {server.info['device']}); Ctrl-C stops it"
    )
    try:
        server.serve(host, port)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


def launch(
    model: str, port: int, *, log: Path, max_model_len: int, env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> subprocess.Popen:  # fmt: skip
    """Start ``dapo vllm-serve MODEL`` on 127.0.0.1:``port`` in a subprocess (its output
    to ``log``) and return it once it answers ``/health`` (tests and benchmarks).
    Raises ``RuntimeError`` with the end of its log if it exits or does not come up."""
    cmd = [sys.executable, "-m", "dapo", "vllm-serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=dict(os.environ) if env is None else env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dapo vllm-serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"dapo vllm-serve did not come up in {timeout_s:g} s: {log.read_text()[-3000:]}")
