"""A stand-in rollout server for the weight channel tests (``tests/test_gpu.py``).

A real :class:`~dapo.rollout.server.RolloutServer` (HTTP, request checks, the engine
thread) on 127.0.0.1:PORT whose engine has no vLLM: its "worker" is the real
:class:`~dapo.rollout.weight_channel.WeightReceiver` mixed into a class that keeps what arrives on
``--device`` instead of loading it into vLLM. Every weight-channel event (join, load,
leave) is appended, in order, to ``--record`` (JSON, rewritten after each event); a load
lists each tensor as it arrived: name, dtype, shape, device and its float64 sum.

``--served-device`` is what ``/health`` reports: ``cpu`` makes the trainer use gloo,
``cuda`` NCCL (vLLM's ``PyNcclCommunicator``, which needs vLLM on both sides).

    python tests/gpu_weight_receiver.py MODEL_DIR --port P --device cuda:0 --record out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from dapo.rollout.fingerprint import of_model_dir
from dapo.rollout.server import RolloutServer
from dapo.rollout.weight_channel import WeightReceiver


class Record:
    """The events so far, written atomically after each one."""

    def __init__(self, path: Path) -> None:
        self.path, self.events = path, []
        self.lock = threading.Lock()

    def add(self, kind: str, **data: Any) -> None:
        with self.lock:
            self.events.append({"event": kind, **data})
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.events))
            os.replace(tmp, self.path)


class StandInWorker(WeightReceiver):
    """What a vLLM worker offers the extension (rank, device, config, ``reload_weights``)."""

    rank = 0
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace()))

    def __init__(self, device: str, record: Record) -> None:
        self.device = torch.device(device)
        self.record = record

    def dapo_join_weights(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        super().dapo_join_weights(host, port, world_size, backend, timeout_s)
        self.record.add("join", backend=backend, world_size=world_size)

    def reload_weights(self, weights_iterator: Any, is_checkpoint_format: bool) -> None:
        tensors = []
        for name, tensor in weights_iterator:  # as they arrive, one broadcast each
            kept = tensor.to(self.device)
            tensors.append(
                {
                    "name": name,
                    "dtype": str(kept.dtype).removeprefix("torch."),
                    "shape": list(kept.shape),
                    "device": str(kept.device),
                    "sum": float(kept.double().sum()),
                }
            )
        self.record.add("load", tensors=tensors)

    def dapo_leave_weights(self) -> None:
        joined = getattr(self, "_dapo_group", None) is not None
        super().dapo_leave_weights()
        if joined:
            self.record.add("leave")


class StandInEngine:
    """The engine interface the server uses, without vLLM (no generation)."""

    eos_token_id = 1

    def __init__(self, worker: StandInWorker, served_device: str, max_model_len: int) -> None:
        self.on_cpu = served_device == "cpu"
        self.max_model_len = max_model_len
        self.llm = SimpleNamespace(
            collective_rpc=lambda method, args=(): [getattr(worker, method)(*args)],
            reset_prefix_cache=lambda: None,
        )

    def reset_caches(self) -> None:
        self.llm.reset_prefix_cache()

    def generate_many(self, calls: list) -> list:
        raise RuntimeError("the stand-in server does not generate")

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cpu", help="where the received tensors are kept")
    ap.add_argument("--served-device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--record", required=True)
    ap.add_argument("--max-model-len", type=int, default=256)
    args = ap.parse_args()
    worker = StandInWorker(args.device, Record(Path(args.record)))
    engine = StandInEngine(worker, args.served_device, args.max_model_len)
    server = RolloutServer(
        engine, model=args.model_dir, fingerprint=of_model_dir(args.model_dir, 1)
    )
    server.start("127.0.0.1", args.port)
    signal.signal(signal.SIGTERM, lambda *_: server.stop("SIGTERM"))
    status, message = server.wait()
    print(message, flush=True)
    os._exit(status)


if __name__ == "__main__":
    main()
