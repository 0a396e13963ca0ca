"""The decoding loop's buffers (:mod:`dapo.rollout.decode`): the static key/value cache
(:class:`RowCache`), every row's state on the device (:class:`DecodeState`), the batch-size
buckets the step runs at, and the workspaces an engine keeps between calls.

A workspace is kept between calls when its cache is small (:data:`KEEP_BYTES`: fresh pages
cost their zeroing, ~8 ms of a 0.2 s call for ``builtin:tiny``'s 23 MB), with the CUDA graphs
captured on it, which replay on its addresses. A larger one is freed with the call: it is the
largest thing generation allocates, and training needs the memory back.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers.cache_utils import Cache

KEEP_BYTES = 64 * 2**20  # a cache (or bf16 weight copies) this small is kept between calls


def buckets(max_rows: int) -> list[int]:
    """Batch sizes the decode step runs at: powers of two and the halfway sizes between
    them (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), up to ``max_rows``, which is always one."""
    sizes, p = set(), 1
    while p < max_rows:
        sizes.update(x for x in (p, 3 * p // 2) if 1 <= x < max_rows)
        p *= 2
    return sorted(sizes | {max_rows})


def bucket_for(rows: int, sizes: list[int]) -> int:
    """The smallest bucket that holds ``rows`` rows."""
    return next(s for s in sizes if s >= rows)


class RowCache(Cache):
    """A static key/value cache: ``keys[layer]`` and ``values[layer]`` are ``[rows, kv_heads,
    length, head_dim]``, allocated once; ``update`` writes each row's new key and value at
    ``slot[row]`` and returns the whole buffers (the attention mask hides unused slots).
    The keys may be the transposed view of a ``[rows, kv_heads, head_dim, length]`` buffer
    (for :class:`~dapo.rollout.llama_step.LlamaStep`: its scores read them contiguously)."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        slot: torch.Tensor,
        rows: torch.Tensor | None = None,
    ):
        super().__init__(layers=[])
        self.keys, self.values, self.slot = keys, values, slot
        self.rows = torch.arange(len(slot), device=slot.device) if rows is None else rows

    def __len__(self) -> int:
        return len(self.keys)

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *a: Any,
        **k: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows, :, self.slot] = key_states[:, :, 0].to(keys.dtype)
        values[self.rows, :, self.slot] = value_states[:, :, 0].to(values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given (position_ids); nothing reads this

    def view(self, rows: int, length: int) -> RowCache:
        """The same buffers, first ``rows`` rows and ``length`` slots."""
        return RowCache(
            [k[:rows, :, :length] for k in self.keys],
            [v[:rows, :, :length] for v in self.values],
            self.slot[:rows],
            self.rows[:rows],
        )


@dataclass
class DecodeState:
    """Every row's state, on the device, in buffers of ``rows`` rows that never move.

    ``logits``: the next-token logits to sample from; ``pos``: the next position id;
    ``slot``: where the next key goes; ``valid``: the slots the row attends to; ``gen``:
    tokens generated; ``done``: finished (EOS or the limit; also a free row); ``eos``:
    ended on EOS; ``tokens``/``logps``: the row's response so far (column ``max_tokens`` is
    scratch for finished rows); ``u``: one uniform number per row for the next draw.
    """

    logits: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    valid: torch.Tensor
    gen: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor
    tokens: torch.Tensor
    logps: torch.Tensor
    u: torch.Tensor

    @staticmethod
    def layout(length: int, max_tokens: int, vocab: int) -> dict[str, tuple[tuple, torch.dtype]]:
        """Each buffer's shape for one row, and its dtype."""
        one, long = (), torch.long
        return {
            "logits": ((vocab,), torch.float32),
            "pos": (one, long),
            "slot": (one, long),
            "valid": ((length,), torch.bool),
            "gen": (one, long),
            "done": (one, torch.bool),
            "eos": (one, torch.bool),
            "tokens": ((max_tokens + 1,), long),
            "logps": ((max_tokens + 1,), torch.float32),
            "u": (one, torch.float64),
        }

    @classmethod
    def row_bytes(cls, length: int, max_tokens: int, vocab: int) -> int:
        """The memory of one row's state."""
        layout = cls.layout(length, max_tokens, vocab).values()
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)

    @classmethod
    def allocate(
        cls, rows: int, length: int, max_tokens: int, vocab: int, device: torch.device
    ) -> DecodeState:
        state = cls(
            **{
                name: torch.zeros((rows, *shape), dtype=dtype, device=device)
                for name, (shape, dtype) in cls.layout(length, max_tokens, vocab).items()
            }
        )
        state.valid[:, 0] = True  # a free row attends to something (no NaN from an empty softmax)
        state.done.fill_(True)
        return state

    def buffers(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def view(self, rows: int, length: int) -> DecodeState:
        """The first ``rows`` rows, attending to the first ``length`` slots."""
        views = {f.name: getattr(self, f.name)[:rows] for f in fields(self)}
        views["valid"] = views["valid"][:, :length]
        return DecodeState(**views)


class Workspace:
    """The buffers of one call shape (rows, cache length, response limit, vocabulary, cache
    layout), and the CUDA graphs captured on them, which replay on its addresses as long as
    it is kept. ``busy`` while a call decodes on it."""

    def __init__(self, state: DecodeState, cache: RowCache) -> None:
        self.state, self.cache = state, cache
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.busy = False

    def nbytes(self) -> int:
        buffers = [*self.state.buffers(), *self.cache.keys, *self.cache.values]
        return sum(b.untyped_storage().nbytes() for b in buffers)


class Workspaces:
    """The engine's workspaces by call shape, the most recent :data:`KEEP` of them (those
    whose cache is under :data:`KEEP_BYTES`; a call with a larger one allocates its own)."""

    KEEP = 2

    def __init__(self) -> None:
        self.entries: dict[tuple, Workspace] = {}
        self.capture_failed = False
        self.lock = threading.Lock()  # held while a call sizes and takes its workspace
        self.told_fit = False  # the fewer rows a cache that did not fit decodes on: said once

    def idle(self, key: tuple) -> bool:
        """Whether a workspace of ``key`` is kept and free (a call would reuse it)."""
        return key in self.entries and not self.entries[key].busy

    def idle_bytes(self) -> int:
        """The memory of the kept workspaces no call is using."""
        return sum(ws.nbytes() for ws in self.entries.values() if not ws.busy)

    def drop_idle(self) -> None:
        """Free the kept workspaces no call is using (to make room for another shape). Under
        :attr:`lock` when called from outside a call's sizing."""
        self.entries = {k: ws for k, ws in self.entries.items() if ws.busy}

    def get(self, key: tuple, make: Callable[[], Workspace]) -> Workspace:
        """The workspace of ``key``, made if none is kept or the kept one is busy (a call on
        another thread decodes on it: this one gets its own, not kept)."""
        ws = self.entries.pop(key, None)
        if ws is not None and ws.busy:
            self.entries[key] = ws
            ws = make()
        else:
            ws = ws or make()
            self.entries[key] = ws  # most recent last
            while len(self.entries) > self.KEEP:
                self.entries.pop(next(iter(self.entries)))
        ws.busy = True
        return ws
