"""The weight channel between the trainer and the rollout server: a process group of its own.

The trainer's rank 0 is rank 0 of the group and the server's vLLM workers are ranks
1..world_size-1 (one per tensor-parallel worker). It is separate from the trainer's default
process group and from vLLM's: on CPU a gloo group (``torch.distributed.ProcessGroupGloo``)
built on a ``TCPStore`` that rank 0 hosts; on GPUs an NCCL communicator built the way vLLM
builds its own weight-transfer group (``StatelessProcessGroup`` + ``PyNcclCommunicator``,
which needs vLLM on the trainer's side too). Tensors go as they are, one broadcast each,
in the order of the specs the trainer announced over HTTP. :class:`WeightReceiver` is the
server's side, mixed into every vLLM worker.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

# (name, dtype name such as "float32", shape): what the server allocates before receiving.
Spec = tuple[str, str, list[int]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_of(name: str, tensor: torch.Tensor) -> Spec:
    return (name, dtype_name(tensor.dtype), list(tensor.shape))


def free_port() -> int:
    """A TCP port that is free on this host now (the group's store listens on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def address_towards(host: str, port: int) -> str:
    """This machine's IP address on the route to ``host`` (what the server dials back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: no packet is sent, only the route is chosen
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def host_store(host: str, world_size: int, timeout_s: float = 600.0) -> Any:
    """Rank 0's store for a gloo weight group, listening on a port the OS picks as it binds
    (``.port``: what the other members are told). A port chosen free beforehand could be
    taken by another process before rank 0 bound it; this one cannot."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


class WeightGroup:
    """One member of the weight channel (``rank`` 0: the trainer, hosting the store; with
    gloo, ``store`` is the one :func:`host_store` made, already listening on ``port``).

    Building it blocks until all ``world_size`` members have joined (or ``timeout_s``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
        store: Any = None,
    ) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        self._pg = self._comm = None
        if backend == "gloo":
            import torch.distributed as dist

            if store is None:
                store = dist.TCPStore(
                    host, port, world_size, is_master=rank == 0, timeout=timeout,
                    wait_for_workers=False,
                )  # fmt: skip
            self._pg = dist.ProcessGroupGloo(
                dist.PrefixStore("dapo-weights", store), rank, world_size, timeout
            )
        elif backend == "nccl":  # GPUs: vLLM's own way of joining trainers and workers
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            group = StatelessProcessGroup.create(
                host=host, port=port, rank=rank, world_size=world_size
            )
            self._comm = PyNcclCommunicator(group, device=self.device)
        else:
            raise ValueError(f"weight channel backend must be gloo or nccl, not {backend!r}")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send (``src``) or receive ``tensor`` in place."""
        if self._pg is not None:
            self._pg.broadcast(tensor, src).wait()
        else:
            self._comm.broadcast(tensor, src=src, stream=torch.cuda.current_stream(self.device))
            torch.cuda.current_stream(self.device).synchronize()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every tensor from rank 0, in order; the number of bytes sent."""
        sent = 0
        for _, tensor in named_tensors:
            t = tensor.detach().to(self.device).contiguous()
            self.broadcast(t, src=0)
            sent += t.numel() * t.element_size()
        return sent

    def receive(self, specs: list[Spec]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``specs`` as they arrive from rank 0 (lazily: one at a time)."""
        for name, dtype, shape in specs:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self.broadcast(t, src=0)
            yield name, t

    def close(self) -> None:
        """Leave the group (a peer blocked in a broadcast gets an error, not a hang)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()
        self._comm = None


class WeightReceiver:
    """Mixed into every vLLM worker (``worker_extension_cls``): joins the trainer's weight
    group as rank ``1 + worker rank`` and loads the tensors it receives. Runs in the worker
    (this process with tensor parallel size 1)."""

    def dapo_join_weights(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        self.dapo_leave_weights()
        device = "cpu" if backend == "gloo" else self.device  # type: ignore[attr-defined]
        rank = 1 + int(self.rank)  # type: ignore[attr-defined]
        self._dapo_group = WeightGroup(
            host, port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s
        )

    def dapo_receive_weights(self, specs: list) -> None:
        from dapo.rollout.vllm_process import quiet_log, refresh_tied_lm_head

        group = getattr(self, "_dapo_group", None)
        if group is None:
            raise RuntimeError("no weight group: call /init_weight_sync first")
        try:
            with quiet_log(
                "vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights"
            ):
                self.reload_weights(  # type: ignore[attr-defined]
                    weights_iterator=group.receive([tuple(s) for s in specs]),
                    is_checkpoint_format=True,
                )
        except BaseException:
            self.dapo_leave_weights()  # the trainer's pending broadcast fails instead of hanging
            raise
        config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if getattr(config, "tie_word_embeddings", False):
            refresh_tied_lm_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def dapo_leave_weights(self) -> None:
        group = getattr(self, "_dapo_group", None)
        if group is not None:
            group.close()
        self._dapo_group = None
