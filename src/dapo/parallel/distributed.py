"""Data-parallel helpers on torch.distributed (gloo on CPU, NCCL on GPU).

Launch with ``torchrun --nproc_per_node N -m dapo train ...``; without torchrun everything
here degrades to a single process. Ranks exchange small Python objects (scored groups,
metric sums) with the object collectives, and gradients through DDP or FSDP2
(``dapo.parallel.sharding``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistInfo:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        # With NCCL, CPU tensors (the float lists and objects gathered below) need gloo.
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def current() -> DistInfo:
    """The :class:`DistInfo` of an already initialised process group (or a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), backend
    )


_thread = threading.local()  # .group: this thread's process group for the helpers here


def new_group() -> Any:
    """A second gloo group over the same ranks (every rank must call this, in the same
    order): collectives of a background thread (the rollout producer) run on it, so they
    never interleave with the training thread's on the default group. None without one."""
    return dist.new_group(backend="gloo") if current().enabled else None


@contextlib.contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """Run this thread's collectives of this module on ``group`` (None: the default)."""
    before = getattr(_thread, "group", None)
    _thread.group = group
    try:
        yield
    finally:
        _thread.group = before


def _group() -> Any:
    return getattr(_thread, "group", None)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list without a process group)."""
    info = current()
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj, group=_group())
    return out


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks of a list of floats (float64, so counts stay exact)."""
    info = current()
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_group())
    return t.tolist()


def all_reduce_max(value: int) -> int:
    """The largest ``value`` over ranks."""
    if not current().enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group())
    return int(t.item())


def barrier() -> None:
    if current().enabled:
        dist.barrier(group=_group())


def balance_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Split item indices into ``parts`` bins with near-equal token totals (longest first)."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = min(range(parts), key=lambda b: (load[b], b))
        bins[j].append(i)
        load[j] += lengths[i]
    return [sorted(b) for b in bins]


def token_share(lengths: list[int], info: DistInfo) -> list[int]:
    """Indices of the items (of these token lengths) that this rank trains: a token-balanced
    share (every index on one process)."""
    if not info.enabled:
        return list(range(len(lengths)))
    return balance_by_tokens(lengths, info.world_size)[info.rank]


def shard(items: list[Any], info: DistInfo) -> list[Any]:
    """This rank's strided share of ``items``."""
    return items[info.rank :: info.world_size]


def unshard(parts: list[list[Any]]) -> list[Any]:
    """Undo :func:`shard` on the gathered shares: rank r held items r, r + W, r + 2W, ..."""
    out: list[Any] = []
    for i in range(max((len(p) for p in parts), default=0)):
        out.extend(p[i] for p in parts if i < len(p))
    return out


def destroy() -> None:
    """Leave the process group after a finished run; every rank must call it.

    The barrier first lets collectives still in flight on a peer finish: tearing gloo down
    under one aborted the process ("terminate called without an active exception") in
    about one of many 2-rank FSDP runs. It was still seen about once in 100 runs after
    that. A suspect (not proven): gloo work objects kept alive by reference cycles of
    dropped FSDP modules, released during interpreter finalisation, where releasing their
    tensors can abort (pytorch/pytorch PR 179291 describes that crash). Collecting garbage
    first releases them while the interpreter is whole.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
