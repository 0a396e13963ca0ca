"""Streaming rollouts with bounded staleness (``rollout.max_staleness`` = N >= 1).

A producer thread fills the batches of the coming rollout steps, one after the other, with
the same code, prompt order, seeds and dynamic-sampling decisions as a synchronous run
(:meth:`dapo.producer.rollouts.Rollouts.fill_batch`), while the trainer trains on the
batch before. Versions count rollout steps: version v is the policy after v steps of
updates, the one the trainer updates at step v. The bound, by capacity rather than by
discarding: the producer starts filling batch k only once the engine holds version
``>= k - N`` (AReaL's ``(N + v + 1) * B`` capacity, in batches), and every token it samples
afterwards is at least that new. Batch k is trained at step k whatever time it spent in the
queue, so no trained token is more than N versions older than the weights being updated.
Dynamic sampling's surplus, carried from batch k to k+1, is one version older there: it is
kept while it stays within N and dropped (counted) otherwise.

Timeline with N = 1 (v_k: the weights after k steps, pushed to the engine after step k-1)::

    producer:  fill B_1 with v_0 .. | fill B_2 with v_1 ........... | fill B_3 with v_2 ...
    trainer:   train B_0 (v_0->v_1) | push v_1; train B_1 (v_1->v_2) | push v_2; train B_2 ...

The producer waits (``perf/capacity_wait_s``) when it is N batches ahead, the trainer
(``perf/data_wait_s``) when the batch it needs is not filled yet. :meth:`RolloutStream.paused`
stops the producer between two batches, for an evaluation or a checkpoint, whose state then
holds the batches filled ahead (:meth:`RolloutStream.state_dict`): a resumed run trains on
exactly those, with their versions.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dapo.errors import TrainingError
from dapo.handover import RolloutBatch, ScoredGroup
from dapo.parallel import distributed as D
from dapo.rollout.versioned import VersionedEngine


class RolloutStream:
    """Fills batches ``start, start + 1, ...`` (below ``end``) ahead of the trainer.

    ``fill(k)``: batch k and the metrics of its generation. ``engine``: the versioned
    engine, whose version gates each batch's start. ``group``: the process group of the
    producer's collectives under torchrun (:func:`dapo.parallel.distributed.new_group`).
    """

    def __init__(
        self,
        fill: Callable[[int], RolloutBatch],
        engine: VersionedEngine,
        *,
        max_staleness: int,
        end: int,
        group: Any = None,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"a stream needs max_staleness >= 1, got {max_staleness}")
        self.fill, self.engine, self.n, self.end, self.group = (
            fill,
            engine,
            max_staleness,
            end,
            group,
        )
        self.ready: dict[int, RolloutBatch] = {}
        self.next_step = 0  # the batch the producer fills next
        self.capacity_wait_s = 0.0  # since the last take
        self._cond = threading.Condition()
        self._paused = 0
        self._busy = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --- the trainer's side -----------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, step: int) -> None:
        """Start producing at batch ``step`` (after the batches already held)."""
        self.next_step = max([step, *(k + 1 for k in self.ready)])
        threads = torch.get_num_threads()
        self._thread = threading.Thread(
            target=self._run, args=(threads,), name="dapo-producer", daemon=True
        )
        self._thread.start()

    def take(self, step: int) -> RolloutBatch:
        """Batch ``step`` (waiting for it) and its metrics, with the time waited."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self.ready:
                self._raise_if_failed()
                if self._thread is None or not self._thread.is_alive():
                    raise TrainingError(f"internal: no producer is filling batch {step}")
                self._cond.wait(0.2)
            batch = self.ready.pop(step)
            capacity, self.capacity_wait_s = self.capacity_wait_s, 0.0
            self._cond.notify_all()
        return RolloutBatch(
            batch.groups,
            {
                **batch.metrics,
                "perf/data_wait_s": time.perf_counter() - t0,
                "perf/capacity_wait_s": capacity,
                "stream/queued_batches": float(len(self.ready)),
            },
            batch.left_out,
        )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No batch is being filled inside this block (the engine, scorer and prompt stream
        are the caller's); the producer goes on after it."""
        with self._cond:
            self._paused += 1
            while self._busy:
                self._raise_if_failed()
                self._cond.wait(0.2)
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The batches filled ahead, as plain data (call it inside :meth:`paused`)."""
        return {
            str(k): {"groups": [g.to_state() for g in b.groups], "metrics": dict(b.metrics)}
            for k, b in sorted(self.ready.items())
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.ready = {
            int(k): RolloutBatch(
                [ScoredGroup.from_state(g) for g in v["groups"]], dict(v["metrics"])
            )
            for k, v in (state or {}).items()
        }

    def close(self) -> None:
        """Stop the producer after the batch it is filling."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        with self.engine.updated:
            self.engine.updated.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TrainingError(
                f"the rollout producer failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    # --- the producer's side ----------------------------------------------------------

    def _run(self, threads: int) -> None:
        # A new thread starts with OpenMP's default thread count, not the trainer's.
        torch.set_num_threads(threads)
        try:
            with D.collectives_on(self.group):
                while self._produce_one():
                    pass
        except BaseException as exc:  # surfaced in the trainer by take() / paused()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _produce_one(self) -> bool:
        """Fill the next batch once there is room and capacity; False when done."""
        with self._cond:
            while not self._stop and (
                self._paused or self.next_step >= self.end or len(self.ready) > self.n
            ):
                self._cond.wait(0.5)
            if self._stop:
                return False
            step = self.next_step
        t0 = time.perf_counter()
        with self.engine.updated:  # capacity: the engine holds version >= step - N
            while self.engine.version < step - self.n and not self._stop:
                self.engine.updated.wait(0.5)
        waited = time.perf_counter() - t0
        with self._cond:
            self.capacity_wait_s += waited
            if self._stop or self._paused:
                return not self._stop  # look again once resumed
            self._busy = True
        try:
            filled = self.fill(step)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        with self._cond:
            self.ready[step] = filled
            self.next_step = step + 1
            self._cond.notify_all()
        return True


def make_stream(cfg: Any, rollouts: Any, log: Callable[[str], None]) -> RolloutStream | None:
    """The producer of ``cfg.rollout.max_staleness >= 1`` (None for 0) over ``rollouts``
    (:class:`dapo.producer.rollouts.Rollouts`); says what it does and how it corrects."""
    r, a = cfg.rollout, cfg.algorithm
    if r.max_staleness == 0:
        return None
    if D.current().enabled and r.engine == "hf":
        raise TrainingError(
            f"rollout.max_staleness={r.max_staleness} with rollout.engine=hf under "
            "torchrun: the hf engine would sample from a copy of a sharded policy; use "
            "rollout.engine=vllm (one engine per rank) or vllm-server"
        )
    stream = RolloutStream(
        rollouts.fill_batch,
        rollouts.engine,
        max_staleness=r.max_staleness,
        end=cfg.train.steps,
        group=D.new_group(),  # its collectives apart from the training thread's
    )
    log(
        f"streaming rollouts: up to {r.max_staleness} rollout steps ahead"
        + (", partial rollouts" if r.partial_rollouts else "")
        + "; off-policy correction: "
        + (
            "ratio against the proximal policy (recomputed), behaviour "
            f"importance weights capped at {a.is_cap:g} ({a.is_level}, {a.is_mode})"
            if a.is_cap is not None
            else "none (algorithm.is_cap=null): the ratio is taken against the "
            "behaviour policy's log-probs"
        )
    )
    return stream


def staleness_metrics(groups: list[ScoredGroup], step: int, max_staleness: int) -> dict[str, float]:
    """How old the trained tokens are at ``step``: mean, max, the share at each staleness
    0..N (a histogram), and the versions mixed per response (partial rollouts)."""
    ages: list[int] = []
    mixed: list[float] = []
    for g in groups:
        for versions in g.versions or []:
            ages.extend(step - v for v in versions)
            mixed.append(float(len(set(versions))) if versions else 1.0)
    if not ages:
        return {}
    out = {
        "stream/staleness_mean": sum(ages) / len(ages),
        "stream/staleness_max": float(max(ages)),
        "stream/versions_per_response": sum(mixed) / max(len(mixed), 1),
    }
    for age in range(max(max_staleness, max(ages)) + 1):
        out[f"stream/staleness_{age}"] = sum(a == age for a in ages) / len(ages)
    return out
