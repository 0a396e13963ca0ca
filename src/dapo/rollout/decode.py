"""The transformers engine's decoding loop, in gpt-fast's shape: a prefill, a decode step
that is one function of static shapes, and a loop that only calls it.

- The key/value cache (:class:`RowCache`) is allocated once per call at its final size,
  ``[rows, kv_heads, prompt_width + max_tokens, head_dim]`` per layer. Every row writes its
  next key and value at its own slot, and a boolean mask ``[rows, length]`` says which
  slots it attends to: nothing grows, nothing is concatenated, no mask is rebuilt.
- Positions, slots, masks, finished flags and each row's tokens and log-probs stay on the
  device and are updated in place; the loop reads anything back only every
  :data:`SYNC_EVERY` tokens.
- Continuous batching: the call's responses wait in a queue. At each look, the rows whose
  response finished hand it back and take the next ones (their prompts prefilled into the
  rows' slots, one prefill per distinct prompt; a prefix that all the call's prompts share,
  such as a chat template's system prompt, is forwarded once per call, and the decode step
  attends to it through that one copy: :mod:`dapo.rollout.attention`). A prompt's images
  (:class:`~dapo.data.images.ImagePrompt`) go into its prefill, so the vision encoder runs
  once per distinct prompt; a shared prefix stops before the first image token. Once the queue is
  empty, the live rows are packed into the smallest batch-size bucket (:func:`buckets`) that
  holds them, so the long tail runs on a small batch.
- On CUDA each bucket's decode step is captured once as a CUDA graph and replayed per token
  (``cuda_graphs``); the step takes its random numbers as an input (``DecodeState.u``). A
  captured step attends over a fixed window of cache slots, so it is captured per window
  too (:data:`GRAPH_MIN_WINDOW` slots and the bucket sizes above it): the smallest that
  holds the rows' next slots, not the whole cache from the first token.
- The rows fit the device: when the cache of the rows asked for would take more than
  :data:`CACHE_SHARE` of its available memory (a long ``max_completion_length``), the call
  decodes on fewer rows, and says so once.

The buffers (cache, row state, buckets, the workspaces kept between calls) live in
:mod:`dapo.rollout.buffers`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from dapo.data.images import prompt_key
from dapo.errors import ConfigError
from dapo.memory import device_memory
from dapo.models.inputs import after_prefix, shared_prefix
from dapo.models.vision import (
    image_token_id,
    rope_delta,
    rope_positions,
    text_prefix,
    token_inputs,
    uses_mrope,
)
from dapo.rollout import buffers
from dapo.rollout.attention import SharedPrefix, sharing
from dapo.rollout.base import SamplingParams
from dapo.rollout.buffers import (
    DecodeState,
    RowCache,
    Workspace,
    Workspaces,
    bucket_for,
    buckets,
)
from dapo.rollout.llama_step import LlamaStep, unsupported
from dapo.rollout.sampling import sample_with

SYNC_EVERY = 8  # decode steps between two looks at the host (finished rows, refills)
SYNC_EVERY_CPU = 4  # on a CPU a look costs little and a finished row a whole row of compute
CACHE_SHARE = 0.8  # of the device's available memory, what a call's cache and rows may take
PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (its activations' bound)
GRAPH_MIN_WINDOW = 256  # under CUDA graphs, the fewest cache slots a captured step attends to


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def decode_step(
    model: torch.nn.Module,
    s: DecodeState,
    cache: RowCache,
    params: SamplingParams,
    eos_token_id: int,
    forward: LlamaStep | None = None,
) -> None:
    """One token for every row, in place on ``s`` and ``cache``: sample from ``s.logits``,
    record the token, then forward it at each row's position to get the next logits
    (through ``forward`` where given, else the model's own forward).

    Static shapes and no host synchronisation: a CUDA graph can capture it. Finished rows
    run too (their results are discarded: the token goes to the scratch column, their
    position and slot stay put).
    """
    max_tokens = s.tokens.shape[1] - 1
    tok, logp = sample_with(s.logits, params, s.u)
    live = ~s.done
    col = torch.where(live, s.gen, max_tokens)
    s.tokens[cache.rows, col] = tok
    s.logps[cache.rows, col] = logp.float()
    ended_eos = live & (tok == eos_token_id)
    s.eos.logical_or_(ended_eos)
    s.gen.add_(live)
    s.done.logical_or_(ended_eos | (s.gen >= max_tokens))

    s.valid[cache.rows, s.slot] = True
    if forward is not None:
        s.logits.copy_(forward(tok, s.pos, s.valid, cache))
    else:
        out = model(
            input_ids=tok[:, None],
            position_ids=s.pos[:, None],
            attention_mask=s.valid[:, None, None, :],
            past_key_values=cache,
            use_cache=True,
        )
        s.logits.copy_(out.logits[:, -1])
    s.pos.add_(live)
    s.slot.add_(live).clamp_(max=s.valid.shape[1] - 1)  # a finished row's writes stay in


@dataclass
class Results:
    """Per response: its tokens, log-probs, length and whether it ended on EOS (device)."""

    tokens: torch.Tensor
    logps: torch.Tensor
    lengths: torch.Tensor
    eos: torch.Tensor


class Decoder:
    """Generates every response of one engine call on up to ``rows`` rows.

    ``model`` is a transformers causal LM in eval mode, inside the engine's precision and
    attention contexts. Responses come back in order: prompt ``i``'s ``k``-th response is
    ``i * n + k``. ``graphs``: replay the decode step from CUDA graphs; ``direct``: step a
    Llama-family model through :class:`~dapo.rollout.llama_step.LlamaStep` where it
    applies; ``log``: where a fallback is said.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        rows: int,
        eos_token_id: int,
        pad_token_id: int,
        gen: torch.Generator,
        device: torch.device,
        workspaces: Workspaces,
        graphs: bool = False,
        direct: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        self.model, self.prompts, self.params = model, prompts, params
        self.eos, self.pad, self.gen, self.device = eos_token_id, pad_token_id, gen, device
        self.workspaces, self.graphs, self.log = workspaces, graphs, log
        self.queue = deque((p, k) for p in range(len(prompts)) for k in range(params.n))
        total = len(self.queue)
        width = max(map(len, prompts))
        if graphs:  # few distinct shapes, so that captured graphs are reused across calls
            self.rows = bucket_for(min(rows, total), buckets(rows))
            width = -(-width // 32) * 32
        else:
            self.rows = min(rows, total)
        # With graphs, one capture per bucket; else any batch size (packing is a copy).
        self.sizes = buckets(self.rows) if graphs else list(range(1, self.rows + 1))
        self.sync_every = SYNC_EVERY if graphs or device.type == "cuda" else SYNC_EVERY_CPU
        self.length = width + params.max_tokens
        # With graphs, the windows a step is captured for: bucket sizes from GRAPH_MIN_WINDOW
        # (256, 384, 512, 768, ...) and the whole length; a step reads at most 1.5x its need.
        low = min(GRAPH_MIN_WINDOW, self.length)
        self.windows = [w for w in buckets(self.length) if w >= low] if graphs else []
        # Llama-family models step through LlamaStep (the same maths, fewer operators).
        self.forward = (
            LlamaStep(model, self.length, fuse=not graphs)
            if direct and unsupported(model) is None
            else None
        )
        # The prompts' common prefix (a chat template's system prompt, few-shot turns): its
        # keys and values are computed at the first prefill and reused by every later one.
        # Never an image: a prefix is shared only up to the first image token.
        distinct = list({prompt_key(p): p for p in prompts}.values())
        self.prefix = shared_prefix(text_prefix(distinct, image_token_id(model)))
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.held: list[int] = [-1] * self.rows  # the response each row holds (-1: free)
        self.ws: Workspace | None = None
        self._views: dict[tuple[int, int], tuple[DecodeState, RowCache]] = {}
        t = params.max_tokens
        self.out = Results(
            tokens=torch.zeros((total, t), dtype=torch.long, device=device),
            logps=torch.zeros((total, t), dtype=torch.float32, device=device),
            lengths=torch.zeros(total, dtype=torch.long, device=device),
            eos=torch.zeros(total, dtype=torch.bool, device=device),
        )

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> Results:
        try:
            with sharing(self._share_prefix()):
                return self._run()
        finally:
            if self.ws is not None:
                self.ws.busy = False

    def _run(self) -> Results:
        self._refill()
        active, window = self.rows, self._window(self.rows)
        while True:
            for _ in range(self.sync_every):
                if self.params.temperature != 0:
                    self.ws.state.u[:active].uniform_(generator=self.gen)
                self._step_or_replay(active, window)
            done = self.ws.state.done[:active].tolist()
            self._retire([r for r in range(active) if done[r] and self.held[r] >= 0])
            if self.queue:
                self._refill()
            else:
                live = [r for r in range(active) if self.held[r] >= 0]
                if not live:
                    return self.out
                smaller = bucket_for(len(live), self.sizes)
                if smaller < active and (self.graphs or len(live) <= 0.9 * active):
                    self._pack(live, smaller, window)
                    active = smaller
            window = self._window(active)

    def _window(self, rows: int) -> int:
        """The cache slots the next :attr:`sync_every` steps can reach: up to the furthest
        row's slot plus those steps, so that attention does not run over slots no row has
        written yet; with CUDA graphs, the smallest of :attr:`windows` that holds them (one
        captured step per window)."""
        furthest = int(self.ws.state.slot[:rows].max())
        need = min(self.length, furthest + self.sync_every + 1)
        return bucket_for(need, self.windows) if self.graphs else need

    def _step(self, rows: int, window: int) -> None:
        views = self._views.get((rows, window))
        if views is None:  # views of the same buffers stay valid for the whole call
            views = self._views[rows, window] = (
                self.ws.state.view(rows, window),
                self.ws.cache.view(rows, window),
            )
        decode_step(self.model, *views, self.params, self.eos, self.forward)

    def _step_or_replay(self, rows: int, window: int) -> None:
        if not self.graphs or self.workspaces.capture_failed:
            self._step(rows, window)
            return
        p = self.params
        key = (rows, window, p.temperature, p.top_p, p.top_k, self.eos)
        graph = self.ws.graphs.get(key)
        if graph is None:
            graph = self._capture(rows, window)
            if graph is None:
                self._step(rows, window)
                return
            self.ws.graphs[key] = graph
        graph.replay()

    def _capture(self, rows: int, window: int) -> torch.cuda.CUDAGraph | None:
        """The decode step of ``rows`` rows over ``window`` cache slots as a CUDA graph (None,
        said once, when the model cannot be captured). Warm-up steps run for real on a side
        stream, as capturing requires; the rows' small state is put back after them (the
        cache slots and response columns they wrote are written again by the real step, at
        the same places)."""
        s = self.ws.state.view(rows, self.length)
        small = [b for b in s.buffers() if b is not s.tokens and b is not s.logps]
        saved = [b.clone() for b in small]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(rows, window)
            torch.cuda.current_stream().wait_stream(side)
            if self.ws.pool is None:
                self.ws.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.ws.pool):
                self._step(rows, window)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
            self.workspaces.capture_failed = True
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.log(
                "rollout.cuda_graphs: the decode step could not be captured as a CUDA graph "
                f"({type(exc).__name__}: {first[:200]}); decoding without CUDA graphs"
            )
            graph = None
        finally:
            for b, v in zip(small, saved, strict=True):
                b.copy_(v)
        return graph

    # -- between steps: prefill, retire, pack --------------------------------------------------

    def _refill(self) -> None:
        """Give the free rows the next responses of the queue: each distinct prompt is
        prefilled once and its keys and values copied into the rows of its responses. The
        prompts go in chunks of at most :data:`PREFILL_TOKENS` padded tokens (one prompt at
        least), so that a prefill's activations stay bounded; the first chunk of a call sizes
        the workspace, which may give fewer rows."""
        free = [r for r in range(self.rows) if self.held[r] < 0]
        take = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        rows = free[: len(take)]
        pending = list(dict.fromkeys(p for p, _ in take))
        while pending:
            chunk = self._prefill_chunk(pending)
            pending = pending[len(chunk) :]
            ids, attn, pos, cache = self._prefill_inputs([self.prompts[p] for p in chunk])
            given = [self.prompts[p] for p in chunk]
            out = self.model(
                **token_inputs(self.model, ids, given, [ids.shape[1] - len(p) for p in given]),
                attention_mask=attn,
                position_ids=rope_positions(self.model, given, pos),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            if self.ws is None:  # the first chunk: the rows may be fewer once sized
                self.ws = self._workspace(out.past_key_values, out.logits.shape[-1])
                self.queue.extendleft(reversed(take[self.rows :]))
                take, rows = take[: self.rows], rows[: self.rows]
                needed = {p for p, _ in take}
                pending = [p for p in pending if p in needed]
            where = {p: i for i, p in enumerate(chunk)}
            mine = [(r, p, k) for r, (p, k) in zip(rows, take, strict=True) if p in where]
            rows_of = [r for r, _, _ in mine]
            self._fill(rows_of, [where[p] for _, p, _ in mine], out, attn, [p for _, p, _ in mine])
            for r, p, k in mine:
                self.held[r] = p * self.params.n + k

    def _prefill_chunk(self, prompts: list[int]) -> list[int]:
        """The first of ``prompts`` (indices) whose prefill, left-padded to the longest,
        stays within :data:`PREFILL_TOKENS` tokens (at least one)."""
        longest = 0
        for i, p in enumerate(prompts):
            longest = max(longest, len(self.prompts[p]) - self.prefix)
            if i and (i + 1) * longest > PREFILL_TOKENS:
                return prompts[:i]
        return prompts

    def _fill(
        self, rows: list[int], src: list[int], out: Any, attn: torch.Tensor, prompts: list[int]
    ) -> None:
        """Start ``rows`` on the prefill ``out`` (row ``src[i]`` of it, whose attention mask
        is ``attn``; prompt ``prompts[i]``): its keys and values copied into the rows' first
        slots, their state reset."""
        dst = torch.tensor(rows, device=self.device)
        src_t = torch.tensor(src, device=self.device)
        w = attn.shape[1]
        cache, s = self.ws.cache, self.ws.state
        for i, layer in enumerate(out.past_key_values.layers):
            cache.keys[i][dst, :, :w] = layer.keys.index_select(0, src_t).to(cache.keys[i].dtype)
            cache.values[i][dst, :, :w] = layer.values.index_select(0, src_t).to(
                cache.values[i].dtype
            )
        s.valid[dst] = False
        s.valid[dst, :w] = attn.bool().index_select(0, src_t)
        s.slot[dst] = w
        s.pos[dst] = attn.sum(-1).index_select(0, src_t)
        if uses_mrope(self.model):  # the text after an image continues from its grid
            shift = [rope_delta(self.model, self.prompts[p]) for p in prompts]
            s.pos[dst] += torch.tensor(shift, device=self.device)
        s.logits[dst] = out.logits[:, -1].float().index_select(0, src_t)
        s.gen[dst] = 0
        s.done[dst] = False
        s.eos[dst] = False

    def _prefill_inputs(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache]:
        """Token ids, attention mask, positions and cache of a prefill of ``prompts``: the
        prompts left-padded, from an empty cache; or, when the call's prompts share a prefix
        (:attr:`prefix` tokens), only what follows it, left-padded, from the prefix's keys
        and values (the mask covers both: ``[prefix | padding | rest]``)."""
        c = self.prefix
        ids, attn, pos = (x.to(self.device) for x in after_prefix(prompts, c, self.pad))
        cache = DynamicCache()
        if not c:
            return ids, attn, pos, cache
        n = len(prompts)
        for i, (k, v) in enumerate(self._prefix_kv):
            cache.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), i)
        return ids, attn, pos, cache

    def _share_prefix(self) -> SharedPrefix | None:
        """Forward the prefix the call's prompts share, once per call (the weights do not
        change during one): every prefill starts from its keys and values. The decode step
        reads them through one copy, not the rows': LlamaStep is handed it here; for the
        model's own attention it is returned, for :func:`~dapo.rollout.attention.sharing`.
        None under CUDA graphs, whose captured step would keep reading this call's prefix."""
        if not self.prefix:
            return None
        head = DynamicCache()
        self.model(
            input_ids=torch.tensor([self.prompts[0][: self.prefix]], device=self.device),
            position_ids=torch.arange(self.prefix, device=self.device)[None],
            past_key_values=head,
            use_cache=True,
            logits_to_keep=1,
        )
        self._prefix_kv = [(layer.keys, layer.values) for layer in head.layers]
        if self.graphs:
            return None
        kv = self._prefix_kv
        shared = SharedPrefix.from_cache(kv, self._cache_dtype(kv[0][0])) if kv else None
        if self.forward is not None:
            self.forward.share_prefix(shared)
            return None
        return shared

    def _cache_dtype(self, x: torch.Tensor) -> torch.dtype:
        """What the cache stores ``x`` (a prefill's keys or values) as: under autocast, the
        dtype the attention products read it in. The keys leave bf16-mixed's rotary
        embedding in float32, and autocast would round the whole cache to bf16 again at
        every step of every layer (a quarter of the copying in SmolLM2's bf16 decoding,
        profiled); stored rounded once, the products read the same numbers."""
        kind = self.device.type
        if torch.is_autocast_enabled(kind) and x.is_floating_point():
            low = torch.get_autocast_dtype(kind)
            if low.itemsize < x.dtype.itemsize:
                return low
        return x.dtype

    def _buffer(self, x: torch.Tensor, slots_last: bool) -> torch.Tensor:
        """A zeroed cache buffer ``[rows, heads, length, head_dim]`` for the layer whose
        prefill keys or values are ``x``; with ``slots_last``, the transposed view of a
        ``[rows, heads, head_dim, length]`` buffer."""
        rows, heads, dim, length = self.rows, x.shape[1], x.shape[3], self.length
        shape = (rows, heads, dim, length) if slots_last else (rows, heads, length, dim)
        b = torch.zeros(shape, dtype=self._cache_dtype(x), device=self.device)
        return b.transpose(2, 3) if slots_last else b

    def _workspace(self, prefill: DynamicCache, vocab: int) -> Workspace:
        layout = tuple(
            (tuple(x.shape[1::2]), self._cache_dtype(x)) for layer in prefill.layers
            for x in (layer.keys, layer.values)
        )  # fmt: skip
        # LlamaStep reads the keys as [head_dim, slots] (its score product's fast layout);
        # the model's own attention reads them as [slots, head_dim].
        keys_last = self.forward is not None
        key = (
            self.rows, self.length, self.params.max_tokens, vocab, layout, keys_last,
            str(self.device),
        )  # fmt: skip

        def make() -> Workspace:
            state = DecodeState.allocate(
                self.rows, self.length, self.params.max_tokens, vocab, self.device
            )
            keys = [self._buffer(layer.keys, keys_last) for layer in prefill.layers]
            values = [self._buffer(layer.values, False) for layer in prefill.layers]
            return Workspace(state, RowCache(keys, values, state.slot))

        slot_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout)
        held, peak = self._row_bytes(slot_bytes, vocab)
        # Sized and allocated as one step: calls on two threads would otherwise each count
        # the other's memory as available.
        with self.workspaces.lock:
            if not self.workspaces.idle(key):
                key = self._fit(key, peak)
            # Kept with its graphs when small; else freed with the call, for training's use.
            keep = self.rows * held <= buffers.KEEP_BYTES
            ws = self.workspaces.get(key, make) if keep else make()
        ws.state.done.fill_(True)  # every row free until filled
        return ws

    def _row_bytes(self, slot_bytes: int, vocab: int) -> tuple[int, int]:
        """The memory of one row: what its workspace holds (cache and state), and at most
        (adding a step's logits, probabilities and sampling copies, and a refill's prefill of
        its prompt with the copy into the row)."""
        t, width = self.params.max_tokens, self.length - self.params.max_tokens
        held = self.length * slot_bytes + DecodeState.row_bytes(self.length, t, vocab)
        return held, held + 3 * 4 * vocab + 2 * width * slot_bytes

    def _fit(self, key: tuple, per_row: int) -> tuple:
        """The workspace key of the rows this call decodes on: fewer than :attr:`rows` when
        they would take (``per_row`` each, at most) more than :data:`CACHE_SHARE` of the
        device's available memory (counting the kept workspaces no call uses, which are
        freed unless one of them has the shape chosen): the largest batch-size bucket that
        fits, said once; the other responses wait in the queue. Raises when not even one row
        fits."""
        t = self.params.max_tokens
        memory = device_memory(self.device)
        if memory is None or self.rows * per_row <= CACHE_SHARE * memory.available:
            return key
        room = CACHE_SHARE * (memory.available + self.workspaces.idle_bytes())
        rows = max((s for s in self.sizes if s * per_row <= room), default=0)
        share = f"{CACHE_SHARE:.0%} of the {_size(memory.available)} available on {self.device}"
        if rows == 0:
            raise ConfigError(
                f"rollout.max_completion_length={t}: one response's key/value cache "
                f"({self.length:,} slots: prompt and response) and state take up to "
                f"{_size(per_row)}, more than {share}; use a shorter "
                "rollout.max_completion_length or data.max_prompt_length, or a device with "
                "more free memory",
                key="rollout.max_completion_length",
            )
        if rows < self.rows and not self.workspaces.told_fit:
            self.workspaces.told_fit = True
            self.log(
                f"rollout: the key/value cache and state of {self.rows} rows x "
                f"{self.length:,} slots take up to {_size(self.rows * per_row)}, more than "
                f"{share}: decoding {rows} rows at a time (lower "
                "rollout.generation_batch_size or rollout.max_completion_length to fit)"
            )
        self.rows, self.held = rows, self.held[:rows]
        self.sizes = [s for s in self.sizes if s <= rows]
        key = (rows, *key[1:])
        if not self.workspaces.idle(key):
            self.workspaces.drop_idle()
        return key

    def _retire(self, rows: list[int]) -> None:
        """Copy the finished rows' responses out and free the rows."""
        if not rows:
            return
        src = torch.tensor(rows, device=self.device)
        dst = torch.tensor([self.held[r] for r in rows], device=self.device)
        s, t = self.ws.state, self.params.max_tokens
        self.out.tokens[dst] = s.tokens.index_select(0, src)[:, :t]
        self.out.logps[dst] = s.logps.index_select(0, src)[:, :t]
        self.out.lengths[dst] = s.gen.index_select(0, src)
        self.out.eos[dst] = s.eos.index_select(0, src)
        for r in rows:
            self.held[r] = -1

    def _pack(self, live: list[int], rows: int, window: int) -> None:
        """Bring the live rows into the first ``rows`` rows: only those beyond move, each
        into a free row in front (copying the cache's first ``window`` slots: no row has
        written beyond); the rows left behind are free."""
        keep = set(live)
        movers = [r for r in live if r >= rows]
        holes = [r for r in range(rows) if r not in keep][: len(movers)]
        if movers:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            for b in self.ws.state.buffers():
                b[dst] = b.index_select(0, src)
            for b in [*self.ws.cache.keys, *self.ws.cache.values]:
                b[dst, :, :window] = b[:, :, :window].index_select(0, src)
            for h, m in zip(holes, movers, strict=True):
                self.held[h] = self.held[m]
        self.held[rows:] = [-1] * (self.rows - rows)
