"""Generation tagged with the policy version that sampled each token, and partial rollouts.

:class:`VersionedEngine` wraps any :class:`~dapo.rollout.base.RolloutEngine` for streaming
rollouts (``rollout.max_staleness``). It holds the engine's *version* (how many rollout
steps of updates its weights hold) and a lock: every engine call, or every chunk of one,
runs under the lock with one version, and :meth:`VersionedEngine.load_weights` swaps the
weights and the version together under the same lock, so no token is ever sampled by
weights other than the version it is tagged with.

Partial rollouts (``chunk_tokens``): responses are generated ``chunk_tokens`` at a time.
Between chunks the lock is released, so a weight update waits at most one chunk; the
unfinished responses then continue from the tokens they have, as new prompts (prompt +
sampled ids, never re-tokenized) under whatever weights the engine holds now: their earlier
tokens keep the log-probs and version of the policy that sampled them. Each continuation
is a fresh prefill, so no key or value computed with older weights is used after an update
(the transformers engine builds its cache per call; vLLM's prefix cache is reset by
``load_weights``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dapo.data.images import copy_prompt
from dapo.rollout.base import Group, RolloutEngine, SamplingParams
from dapo.seeding import mix_seed

_CHUNK_SEED = 0x63686E6B  # "chnk": the seed stream of continuation chunks


@dataclass
class _Row:
    group: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: bool = False
    truncated: bool = False


class VersionedEngine:
    """``engine`` with a policy version, a weight lock and optional partial rollouts.

    ``version``: the version of the weights the engine starts with. ``chunk_tokens``: generate
    that many tokens per call and continue unfinished responses after a weight update (None:
    whole responses, each call under one version). Attributes the wrapper does not define
    (``sleep``, ``close``, ``score`` ...) are the engine's.
    """

    def __init__(
        self, engine: RolloutEngine, version: int = 0, chunk_tokens: int | None = None
    ) -> None:
        self.engine = engine
        self.version = version
        self.chunk_tokens = chunk_tokens
        self.lock = threading.RLock()
        self.continued = 0  # responses continued under newer weights than they began with
        self.updated = threading.Condition(self.lock)  # notified at every new version

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def set_version(self, version: int) -> None:
        """The engine's weights are now ``version`` (an engine that samples from the policy
        module itself changes with it)."""
        with self.lock:
            self.version = version
            self.updated.notify_all()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Swap the weights (and the version with them) between two engine calls or chunks."""
        with self.lock:
            self.engine.load_weights(named_tensors)
            if version is not None:
                self.version = version
            self.updated.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        if self.chunk_tokens is None or params.max_tokens <= self.chunk_tokens:
            with self.lock:
                version = self.version
                groups = self.engine.generate(prompts, params)
            for g in groups:
                g.versions = [[version] * len(r) for r in g.response_ids]
            return groups
        return self._generate_in_chunks(prompts, params)

    def _generate_in_chunks(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        n, budget, chunk = params.n, params.max_tokens, int(self.chunk_tokens or 0)
        rows = [_Row(i) for i in range(len(prompts)) for _ in range(n)]
        with self.lock:  # the first chunk: one prefill per prompt, shared by its n responses
            version = self.version
            first = self.engine.generate(prompts, replace(params, max_tokens=chunk))
        for i, g in enumerate(first):
            for j in range(n):
                self._extend(rows[i * n + j], g, j, version, budget)
        round_no = 1
        while live := [r for r in rows if not r.done]:
            seed = mix_seed(params.seed, _CHUNK_SEED, round_no)
            left = max(budget - len(r.ids) for r in live)
            cont = replace(params, n=1, max_tokens=min(chunk, left), seed=seed)
            with self.lock:
                version = self.version
                out = self.engine.generate([prompts[r.group] + r.ids for r in live], cont)
            for r, g in zip(live, out, strict=True):
                if r.versions and r.versions[-1] != version:
                    self.continued += 1
                self._extend(r, g, 0, version, budget)
            round_no += 1
        groups = [Group(prompt_ids=copy_prompt(p)) for p in prompts]  # its images too
        for r in rows:
            g = groups[r.group]
            g.response_ids.append(r.ids)
            g.logprobs.append(r.logprobs)
            g.truncated.append(r.truncated)
            g.versions = [*(g.versions or []), r.versions]
        return groups

    @staticmethod
    def _extend(row: _Row, g: Group, j: int, version: int, budget: int) -> None:
        """Append one chunk of a response; a chunk that stopped before its limit ended it."""
        ids = g.response_ids[j][: budget - len(row.ids)]
        row.ids += ids
        row.logprobs += g.logprobs[j][: len(ids)]
        row.versions += [version] * len(ids)
        if not g.truncated[j]:  # it ended (EOS)
            row.done = True
        elif len(row.ids) >= budget or not ids:
            row.done, row.truncated = True, True
