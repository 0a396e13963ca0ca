"""Keeping a separate rollout engine's weights in step with the policy being trained.

The transformers engine samples from the policy module itself; vLLM (in this process, one
engine per rank under ``torchrun``) and the rollout server hold their own copy of the
weights. :class:`EngineSync` counts optimizer updates, pushes the policy's weights to the
engine every ``rollout.vllm_sync_every`` updates (from the trainer's weight source: FSDP
shards gathered one layer at a time, :func:`dapo.parallel.sharding.full_named_parameters`;
with DDP the local module's parameters; a LoRA policy's merged weights under the base
model's names) and records which policy the engine holds (:attr:`EngineSync.version`),
from which the trainer reports how stale its rollouts are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class EngineSync:
    """Weight pushes to a separate engine (a no-op for the transformers engine).

    Args:
        engine: the rollout engine, versioned (:class:`~dapo.rollout.versioned.VersionedEngine`:
            ``load_weights`` with the version, ``set_version``, optionally ``sleep``).
        weights: the policy's ``(name, tensor)`` pairs as the engine loads them, made anew
            for each push (every rank iterates them: with FSDP they gather).
        separate: whether the engine holds its own weights (every engine but ``hf``).
        sync_every: push after this many optimizer updates (``rollout.vllm_sync_every``).
        sleep: let a GPU engine sleep while the trainer trains (``rollout.vllm_sleep``).
    """

    def __init__(
        self,
        engine: Any,
        weights: Callable[[], NamedTensors],
        *,
        separate: bool,
        sync_every: int,
        sleep: bool,
    ) -> None:
        self.engine = engine
        self.weights = weights
        self.separate = separate
        self.sync_every = sync_every
        self.sleep = sleep
        self.updates_since_sync = 0
        self.due = False

    @property
    def version(self) -> int:
        """The rollout step whose trained weights the engine holds: the policy after that
        many rollout steps' updates (0: the initial policy)."""
        return self.engine.version

    def before_update(self, n_updates: int, *, generating: bool = False) -> None:
        """Count this step's updates towards the next push; put the engine to sleep while
        the trainer trains, unless it is generating the next batch meanwhile."""
        if not self.separate:
            return
        self.updates_since_sync += n_updates
        self.due = self.updates_since_sync >= self.sync_every
        engine_sleep = getattr(self.engine, "sleep", None)
        if engine_sleep is not None and self.sleep and not generating:
            # Level 2 drops the weights, which are replaced right after; a no-op where
            # sleeping is not supported.
            engine_sleep(level=2 if self.due else 1)

    def after_update(self, step: int) -> dict[str, float]:
        """Push the weights if a push is due; ``step`` is the number of rollout steps whose
        updates they hold. The time it took (``perf/weight_sync_s``), or nothing."""
        if not self.separate:
            self.engine.set_version(step)  # the engine is the policy itself
            return {}
        if not self.due:
            if self.updates_since_sync == 0:  # no update since the last push: it is current
                self.engine.set_version(step)
            return {}
        return {"perf/weight_sync_s": self.push(step)}

    def push(self, step: int) -> float:
        """Load the policy's current weights into the engine (every rank calls this: with
        FSDP it gathers); the seconds it took."""
        t0 = time.perf_counter()
        if self.separate:  # the transformers engine samples from the policy module itself
            self.engine.load_weights(self.weights(), version=step)  # between two engine calls
        else:
            self.engine.set_version(step)
        self.updates_since_sync = 0
        self.due = False
        return time.perf_counter() - t0
