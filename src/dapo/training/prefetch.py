"""One-step-asynchronous rollouts (``rollout.async_steps=1``): generate while training.

With a separate engine (vLLM in this process, or the rollout server) the first generation
round of step k+1 is submitted before step k's update and collected after it; a
background thread calls ``engine.generate`` (an in-process vLLM engine computes there; a
server computes in its own process while the thread waits for its answer). With θ_k the
policy after k rollout steps' updates, pushed to the engine at the end of step k-1::

    step k:  batch B_k in hand (sampled by θ_{k-1})
             submit B_{k+1}'s first round        engine samples it with θ_k ...
             train on B_k: θ_k -> θ_{k+1}        ... meanwhile
             collect B_{k+1}; push θ_{k+1} to the engine

So the batch trained at step k >= 1 was sampled by the policy one rollout step older than
the one being trained (``rollout/staleness`` = 1; step 0 samples synchronously). Its
prompts and seeds are those a synchronous run would use (the prompt stream is consumed in
the same order), so dynamic-sampling decisions stay global and deterministic for a seed;
rounds beyond the first are generated synchronously with the current weights. The batch
in flight at a step boundary has already been collected, and a checkpoint stores it
(:meth:`RolloutPrefetcher.state_dict`), so a resumed run continues exactly where the
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo.errors import TrainingError
from dapo.parallel import distributed as D
from dapo.rollout import Group


@dataclass
class Prefetched:
    """A first generation round made ahead of its rollout step."""

    step: int  # the rollout step it is for
    indices: list[int]  # its prompts' indices, every rank's, in stream order
    version: int  # the policy that sampled it: after this many rollout steps' updates
    groups: list[Group] | None = None  # this rank's share (D.shard of indices), once collected
    skipped: list[int] = field(default_factory=list)  # prompts the skip rule passed over
    future: Future | None = None
    started: float = 0.0


class RolloutPrefetcher:
    """Holds at most one round generating in the background (or collected, not yet used)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.ahead: Prefetched | None = None

    @property
    def generating(self) -> bool:
        """Whether the engine is busy with a round now (it must not sleep or change weights)."""
        return self.ahead is not None and self.ahead.future is not None

    def submit(
        self,
        step: int,
        indices: list[int],
        version: int,
        generate: Callable[[], list[Group]],
        skipped: list[int] | None = None,
    ) -> None:
        """Start generating the first round of ``step`` (``generate`` runs in a thread)."""
        if self.ahead is not None:
            raise TrainingError(f"internal: a round for step {self.ahead.step} is still held")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dapo-rollout")
        self.ahead = Prefetched(
            step, list(indices), version, skipped=list(skipped or []), started=time.perf_counter()
        )
        threads = torch.get_num_threads()

        def run() -> list[Group]:
            # A new thread starts with OpenMP's default thread count, not the trainer's
            # (torch.set_num_threads is per thread); vLLM's CPU attention builds its metadata
            # with one count and checks it against the other ("thread_num (2 vs. 1)").
            torch.set_num_threads(threads)
            return generate()

        self.ahead.future = self._pool.submit(run)

    def collect(self) -> dict[str, float]:
        """Wait for the round in flight (if any); the time it took to generate
        (``perf/async_gen_s``) and the time the trainer waited for it after its update
        (``perf/async_wait_s``)."""
        ahead = self.ahead
        if ahead is None or ahead.future is None:
            return {}
        t0 = time.perf_counter()
        future, ahead.future = ahead.future, None
        ahead.groups = future.result()  # an engine error surfaces here, in the trainer
        t1 = time.perf_counter()
        return {"perf/async_gen_s": t1 - ahead.started, "perf/async_wait_s": t1 - t0}

    def take(self, step: int, k: int) -> Prefetched | None:
        """The collected first round of ``step`` if it has the ``k`` prompts asked for, else
        None (a round for another step, or one made before a resume that changed the batch
        size, is dropped: its prompts are skipped)."""
        ahead = self.ahead
        if ahead is None or ahead.step > step:
            return None
        self.collect()
        self.ahead = None
        return ahead if ahead.step == step and len(ahead.indices) == k else None

    def state_dict(self) -> dict[str, Any] | None:
        """The collected round with every rank's groups, for a checkpoint. Every rank must
        call it (the groups are gathered)."""
        self.collect()
        ahead = self.ahead
        parts = D.all_gather_objects(ahead.groups if ahead is not None else None)
        if ahead is None:
            return None
        return {
            "step": ahead.step,
            "indices": ahead.indices,
            "version": ahead.version,
            "skipped": ahead.skipped,
            "groups": [dataclasses.asdict(g) for g in D.unshard(parts)],  # plain data
        }

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Hold a checkpoint's round again (this rank's share) if it is for ``step``; one
        saved at any other point (a run stopped mid-step) is dropped: its prompts are
        skipped."""
        self.ahead = None
        if state is None or state["step"] != step:
            return
        info = D.current()
        self.ahead = Prefetched(
            state["step"],
            list(state["indices"]),
            int(state["version"]),
            groups=D.shard([_group(g) for g in state["groups"]], info),
            skipped=list(state["skipped"]),
        )

    def close(self) -> None:
        """Wait for a round in flight (the engine is still in use) and stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _group(state: dict[str, Any] | Group) -> Group:
    """A group from a checkpoint's plain data (or one pickled whole by an earlier release)."""
    data = state if isinstance(state, dict) else vars(state)
    names = {f.name for f in dataclasses.fields(Group)}
    return Group(**{k: v for k, v in data.items() if k in names})
