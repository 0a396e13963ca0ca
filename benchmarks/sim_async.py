"""A discrete-event model of streaming rollouts: steps per hour against synchronous.

The system: ``instances`` generation engines (generation GPUs / tensor-parallel size),
each a continuous-batching engine of at most ``max_seqs`` sequences; a trainer on its own
GPUs; the weights pushed from one to the other after every rollout step. Per rollout step
``prompts x group`` responses, their lengths drawn from a log-normal with the given mean
and 99th percentile, cut at ``max_len``.

Costs:

- a decode iteration of an engine with ``a`` active sequences takes
  ``decode_base_s + decode_seq_s * a`` (the batch effect: the weights are read once per
  iteration, each sequence adds its KV-cache reads and its share of compute); every active
  sequence gains one token per iteration;
- admitting sequences costs a prefill of ``prefill_tok_s`` per prompt token (a group's
  responses share their prompt's prefill), during which the engine does not decode;
- training batch k takes ``train_fixed_s + train_tok_s x`` its tokens (prompt and
  response); the batch is handed over ``producer_s`` after its last response (scoring);
- pushing the weights takes ``sync_s``, during which no engine decodes (a weight swap holds
  the engine, as :class:`dapo.rollout.versioned.VersionedEngine`'s lock does).

Policies (``n`` = ``rollout.max_staleness``), as in :mod:`dapo.producer.stream`: batch k
starts once the engines hold version ``>= k - n`` (n = 0: synchronous, generate then
train then push), and once batch k - 1 has finished generating and been scored (the
producer fills one batch at a time; ``continuous=True`` instead lets batch k's requests
queue as soon as batch k - 1's are all admitted, AReaL's request-level producer). A push
without partial rollouts waits until no response is in flight (a generate call holds the
engine to its end); with partial rollouts (``partial=True``) it waits for the engines'
next chunk boundary (``chunk_tokens``), and the interrupted responses then re-prefill
prompt and prefix under the new weights (the prefix cache is reset at a weight update).

So with one batch at a time, partial rollouts cannot shorten a step: the next batch waits
for this one's last response either way. They let a push proceed without waiting for the
batch in flight (which matters when the producer is ahead) and make the tail's tokens
newer, at the cost of re-prefills. With a request-level producer they keep the engines
busy through a push instead of draining them.

Consequences checked by the tests: with constant lengths a synchronous step takes
gen + train + sync and a streaming one max(gen, train) + sync in steady state, i.e.
max(gen, train + sync) when training is the longer side (generation pauses for the push, so
when generation is the longer side the push adds to it); with a request-level producer,
partial rollouts never lose on long-tailed lengths.

Two parameter sets:

- ``--calibrate-cpu JSON``: our CPU configuration, from ``benchmarks/bench_async.py``'s
  JSON (its median ``perf/gen_s``, ``perf/train_s``, ``perf/weight_sync_s``,
  ``perf/step_s`` and response lengths of the synchronous server run); prints the
  prediction for each measured N beside the measurement (target: within 15%).
- ``--dapo-32b``: Qwen2.5-32B shapes, DAPO's batch and 20k-token responses on 64
  generation and 64 training GPUs; every assumption is in :func:`dapo_32b`.

    python benchmarks/sim_async.py --dapo-32b [--ns 0,1,2,4,8] [--json out.json]
    python benchmarks/sim_async.py --calibrate-cpu benchmarks/results/stream_speed.json

Pure Python; seconds per table (``--dapo-32b`` with both producers: ~20 s).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Published speed-ups of asynchronous RL trainers over their synchronous baselines.
PUBLISHED = [
    (
        "verl fully-async (staleness_threshold, partial_rollout)",
        2.35,
        "128 GPUs, Qwen2.5-Math-7B, 28k-token responses; against verl's colocated synchronous "
        "trainer on the same GPUs, same AIME accuracy",
    ),
    (
        "AReaL (max_head_offpolicyness, interruptible generation)",
        2.77,
        "AReaL paper (Fu et al. 2025): against its synchronous system on the same GPUs, "
        "math reasoning models up to 32B",
    ),
]
Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class Params:
    """One system; times in seconds, lengths in tokens (see the module docstring)."""

    name: str
    prompts: int
    group: int
    prompt_len: int
    mean_len: float
    p99_len: float
    max_len: int
    instances: int
    max_seqs: int
    decode_base_s: float
    decode_seq_s: float
    prefill_tok_s: float
    train_fixed_s: float
    train_tok_s: float
    sync_s: float
    producer_s: float = 0.0
    chunk_tokens: int = 2048
    sim_instances: int = 0  # simulate this many engines with their share of the batch (0: all)


def lengths(p: Params, rng: random.Random, count: int) -> list[int]:
    """``count`` response lengths: log-normal with mean ``mean_len`` and 99th percentile
    ``p99_len`` (constant when they are equal), cut to 1..``max_len``."""
    if p.p99_len <= p.mean_len:
        return [max(1, min(p.max_len, round(p.mean_len)))] * count
    # mean = exp(mu + s^2/2), p99 = exp(mu + z s): ln(p99/mean) = z s - s^2/2, smaller root.
    gap = math.log(p.p99_len / p.mean_len)
    if 2 * gap > Z99 * Z99:
        raise ValueError(
            f"p99_len {p.p99_len} is more than {math.exp(Z99 * Z99 / 2):.1f}x mean_len "
            f"{p.mean_len}: no log-normal has that tail; lower p99_len"
        )
    sigma = Z99 - math.sqrt(Z99 * Z99 - 2 * gap)
    mu = math.log(p.mean_len) - sigma * sigma / 2
    return [max(1, min(p.max_len, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


class _Engine:
    """One continuous-batching engine. ``progress``: the tokens a sequence admitted at
    progress 0 would have by now; each sequence ends at its start plus its length."""

    def __init__(self) -> None:
        self.progress = 0.0
        self.ends: list[tuple[float, int]] = []  # heap of (end progress, sequence id)
        self.active: dict[int, tuple[int, float]] = {}  # id -> (batch, start progress)
        self.paused_until = 0.0
        self.hold_at: float | None = None  # partial rollouts: stop at this progress

    def iteration_s(self, p: Params) -> float:
        return p.decode_base_s + p.decode_seq_s * len(self.active)

    def admit(self, sid: int, batch: int, length: int) -> None:
        self.active[sid] = (batch, self.progress)
        heapq.heappush(self.ends, (self.progress + length, sid))

    def finished(self) -> list[int]:
        """Pop the sequences that have all their tokens; their batches."""
        out = []
        while self.ends and self.ends[0][0] <= self.progress + 1e-9:
            _, sid = heapq.heappop(self.ends)
            out.append(self.active.pop(sid)[0])
        return out

    def decoding(self, t: float) -> bool:
        held = self.hold_at is not None and self.progress >= self.hold_at - 1e-9
        return bool(self.active) and t >= self.paused_until - 1e-12 and not held

    def next_event(self, t: float, p: Params) -> float:
        if not self.active:
            return math.inf
        if t < self.paused_until - 1e-12:
            return self.paused_until
        target = self.ends[0][0]
        if self.hold_at is not None and self.hold_at < target:
            if self.progress >= self.hold_at - 1e-9:
                return math.inf  # held at the chunk boundary until the push
            target = self.hold_at
        return t + max(0.0, target - self.progress) * self.iteration_s(p)


@dataclass
class Result:
    step_s: float  # steady-state seconds per rollout step
    steps_per_hour: float
    step_ends: list[float]
    max_staleness: int  # the oldest batch trained: its step minus its starting version
    gen_busy: float  # share of the measured time an engine was decoding


def simulate(
    p: Params,
    n: int,
    *,
    partial: bool = False,
    continuous: bool = False,
    steps: int = 16,
    warmup: int | None = None,
    seed: int = 0,
) -> Result:
    """Run ``steps`` rollout steps at ``rollout.max_staleness = n``; the step time is the
    mean over the steps after ``warmup`` (default n + 3)."""
    warmup = n + 3 if warmup is None else warmup
    total = warmup + steps
    rng = random.Random(seed)
    # A subset of the engines gets its share of every batch; the trainer trains on the whole.
    engine_count = min(p.sim_instances or p.instances, p.instances)
    responses = max(1, round(p.prompts * engine_count / p.instances)) * p.group
    scale = p.prompts * p.group / responses
    # The producer goes on past the last measured step, as it would in a longer run.
    produced = total + n + 2
    batch_lens = [lengths(p, rng, responses) for _ in range(produced)]
    engines = [_Engine() for _ in range(engine_count)]
    queue: deque[tuple[int, int, int]] = deque()  # (batch, seq id, length)
    left = [len(b) for b in batch_lens]
    ready_at: list[float] = [math.inf] * produced  # scored, handed to the trainer
    start_version: list[int] = [0] * produced
    version, next_batch, seq_ids = 0, 0, 0
    trainer_step, train_end, sync_end = 0, math.inf, math.inf
    pushing = False  # an update waits for the engines (drain or chunk boundary)
    step_ends: list[float] = []
    busy = 0.0
    t = 0.0

    def can_start(k: int) -> bool:
        if k >= produced or version < k - n or pushing or sync_end < math.inf:
            return False
        if k == 0:
            return True
        if continuous:
            return not any(b == k - 1 for b, _, _ in queue)
        return t >= ready_at[k - 1] - 1e-12

    for _ in range(10_000_000):
        # Start batches and admit queued sequences.
        while can_start(next_batch):
            for length in batch_lens[next_batch]:
                queue.append((next_batch, seq_ids, length))
                seq_ids += 1
            start_version[next_batch] = version
            next_batch += 1
        # A push stops admissions, except with whole responses from one batch at a time:
        # the batch's generate call, queued sequences included, runs to its end first.
        admitting = sync_end == math.inf and (not pushing or not (partial or continuous))
        if queue and admitting:
            for e in sorted(engines, key=lambda e: len(e.active)):
                room = p.max_seqs - len(e.active)
                admitted = 0
                while room > 0 and queue:
                    k, sid, length = queue.popleft()
                    e.admit(sid, k, length)
                    room -= 1
                    admitted += 1
                if admitted:
                    prefill = p.prefill_tok_s * p.prompt_len * admitted / p.group
                    e.paused_until = max(t, e.paused_until) + prefill
        # The trainer: take the next batch when it is ready and the last push is done.
        if train_end == math.inf and not pushing and sync_end == math.inf:
            k = trainer_step
            if k < total and t >= ready_at[k] - 1e-12:
                tokens = scale * (sum(batch_lens[k]) + p.prompt_len * len(batch_lens[k]))
                train_end = t + p.train_fixed_s + p.train_tok_s * tokens
        if pushing:  # the update waits: drain (whole responses) or the chunk boundary
            if partial:
                waiting = any(e.active and e.progress < e.hold_at - 1e-9 for e in engines)
            else:
                waiting = any(e.active for e in engines) or (bool(queue) and not continuous)
            if not waiting:
                pushing = False
                sync_end = t + p.sync_s
                for e in engines:
                    e.paused_until = max(e.paused_until, sync_end)
        if trainer_step >= total:
            break
        # The next event.
        events = [e.next_event(t, p) for e in engines]
        events += [train_end, sync_end]
        events += [r for r in ready_at if r > t + 1e-12]
        t_next = min(events)
        if t_next == math.inf:
            raise RuntimeError(f"internal: the simulation of {p.name} stalled at t={t}")
        for e in engines:  # advance every decoding engine to t_next
            if e.decoding(t):
                dt = t_next - t
                gained = dt / e.iteration_s(p)
                if e.hold_at is not None:
                    gained = min(gained, e.hold_at - e.progress)
                e.progress += gained
                if trainer_step >= warmup:
                    busy += dt
        t = t_next
        for e in engines:  # finished sequences
            for k in e.finished():
                left[k] -= 1
                if left[k] == 0:
                    ready_at[k] = t + p.producer_s
        if train_end <= t + 1e-12:  # the update is done: push the weights
            train_end = math.inf
            pushing = True
            for e in engines:
                e.hold_at = (
                    math.ceil(e.progress / p.chunk_tokens - 1e-9) * p.chunk_tokens
                    if partial
                    else None
                )
        if sync_end <= t + 1e-12:  # the engines hold the new version
            sync_end = math.inf
            version = trainer_step + 1
            step_ends.append(t)
            trainer_step += 1
            for e in engines:
                e.hold_at = None
                if partial and e.active:  # re-prefill prompt + prefix under the new weights
                    prefix = sum(
                        p.prompt_len + e.progress - start for _, start in e.active.values()
                    )
                    e.paused_until = max(e.paused_until, t) + p.prefill_tok_s * prefix
    measured = step_ends[-1] - step_ends[warmup - 1] if warmup else step_ends[-1]
    step_s = measured / steps
    return Result(
        step_s=step_s,
        steps_per_hour=3600 / step_s,
        step_ends=step_ends,
        max_staleness=max(k - start_version[k] for k in range(total)),
        gen_busy=busy / (measured * engine_count),
    )


def speedups(
    p: Params, ns: list[int], *, continuous: bool = False, steps: int = 16
) -> dict[str, Any]:
    """Steps per hour for every N, with and without partial rollouts, and the speed-up over
    synchronous (N = 0) on the same GPUs."""
    base = simulate(p, 0, steps=steps)
    rows = []
    for n in ns:
        row: dict[str, Any] = {"n": n}
        for partial in (False, True):
            r = (
                base
                if n == 0
                else simulate(p, n, partial=partial, continuous=continuous, steps=steps)
            )
            row["partial" if partial else "whole"] = {
                "step_s": r.step_s,
                "steps_per_hour": r.steps_per_hour,
                "speedup": base.step_s / r.step_s,
                "gen_busy": r.gen_busy,
                "max_staleness": r.max_staleness,
            }
        rows.append(row)
    return {
        "params": asdict(p),
        "continuous": continuous,
        "sync_step_s": base.step_s,
        "parts": parts(p),
        "rows": rows,
    }


def parts(p: Params) -> dict[str, float]:
    """A synchronous step's parts: generation alone (the batch's last response included),
    the update, the push, scoring; and the mean response length after the cut."""
    alone = replace(p, train_fixed_s=0.0, train_tok_s=0.0, sync_s=0.0, producer_s=0.0)
    sample = lengths(p, random.Random(0), p.prompts * p.group)
    tokens = sum(sample) + p.prompt_len * len(sample)
    return {
        "gen_s": simulate(alone, 0, steps=4, warmup=1).step_s,
        "train_s": p.train_fixed_s + p.train_tok_s * tokens,
        "sync_s": p.sync_s,
        "producer_s": p.producer_s,
        "mean_len": sum(sample) / len(sample),
        "truncated": sum(x >= p.max_len for x in sample) / len(sample),
    }


def table(result: dict[str, Any], colocated_s: float | None = None) -> str:
    q = result["parts"]
    lines = [
        f"## {result['params']['name']}"
        + (" (request-level producer)" if result["continuous"] else ""),
        f"\nSynchronous step {result['sync_step_s']:.3g} s: generation {q['gen_s']:.3g} s (mean "
        f"response {q['mean_len']:.0f} tokens, {q['truncated']:.1%} cut at the limit), update "
        f"{q['train_s']:.3g} s, push {q['sync_s']:.3g} s, scoring {q['producer_s']:.3g} s.\n",
        "| N | steps/hour | speed-up | engines busy | steps/hour, partial | speed-up, partial "
        "| engines busy, partial |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        w, pr = row["whole"], row["partial"]
        lines.append(
            f"| {row['n']} | {w['steps_per_hour']:.1f} | {w['speedup']:.2f}x | "
            f"{w['gen_busy']:.0%} | {pr['steps_per_hour']:.1f} | {pr['speedup']:.2f}x | "
            f"{pr['gen_busy']:.0%} |"
        )
    if colocated_s is not None:
        best = max(max(r["whole"]["speedup"], r["partial"]["speedup"]) for r in result["rows"])
        ratio = colocated_s / result["sync_step_s"]
        lines.append(
            f"\nAgainst a colocated synchronous run on all the GPUs ({colocated_s:.0f} s/step, "
            f"{ratio:.2f}x the split synchronous step): best {best * ratio:.2f}x."
        )
    lines.append("\nPublished (other systems, other baselines):")
    for name, x, where in PUBLISHED:
        lines.append(f"- {name}: {x:.2f}x ({where})")
    return "\n".join(lines)


def dapo_32b() -> Params:
    """DAPO-scale run: Qwen2.5-32B, DAPO's batch, 64 generation and 64 training H100s.

    Assumptions and their sources:

    - model: Qwen2.5-32B (its config.json on the Hugging Face Hub): 32.5B parameters, 64
      layers, 8 KV heads of 128: bf16 weights 65 GB; KV cache 2 x 64 x 8 x 128 x 2 bytes =
      262 kB per token;
    - batch: DAPO paper (Yu et al. 2025, section 4.1): 512 prompts x 16 responses per
      rollout step, 16 gradient updates per step; responses up to 20,480 tokens (16,384 +
      4,096 overlong buffer); prompts ~200 tokens (DAPO-Math-17k problems);
    - lengths: mean 5,000 tokens (the paper's Figure 3: mean length rising from ~1k to
      4-6k during training), 99th percentile at the 20k cap (a long tail; 1% truncated);
    - H100 SXM datasheet: 3.35 TB/s HBM, 989 TFLOP/s dense bf16;
    - generation: tensor parallel 4 (weights 16 GB per GPU, the rest KV cache), so 64 GPUs
      are 16 engines of at most 64 sequences (4 x 80 GB - 65 GB leaves ~220 GB of KV cache,
      ~840k tokens: 64 sequences of up to 13k tokens on average); a decode iteration reads
      the weights once at ~70% of 4 x 3.35 TB/s: 6.9 ms, plus per sequence its KV cache at
      the mean context (200 + 5,000 / 2 tokens: 0.7 GB): 0.075 ms;
    - prefill: 2 x 32.5e9 FLOPs per token at 50% of 4 x 989 TFLOP/s: 33 us per token;
    - training: 8 x 32.5e9 FLOPs per trained token (forward and backward, 6 N, plus the
      old-log-prob forward, 2 N) at 35% MFU of 64 x 989 TFLOP/s: 11.7 us per token, plus
      20 s per step (16 optimizer steps, gathering, logging);
    - weight sync: 65 GB to the generation GPUs, reshard and load: 20 s (NCCL broadcast at
      ~25 GB/s between nodes, plus the engines' load; verl reports seconds to tens of
      seconds at this size);
    - scoring (math verification of 8,192 answers): 5 s; chunk: 2,048 tokens;
    - simulated: 4 of the 16 engines with a quarter of every batch (the engines are alike
      and share the batch evenly; it keeps the simulation to seconds).
    """
    return Params(
        name="DAPO-scale: Qwen2.5-32B, 512 x 16 responses, 20k max, 64 + 64 H100",
        prompts=512,
        group=16,
        prompt_len=200,
        mean_len=5000,
        p99_len=20480,
        max_len=20480,
        instances=16,
        max_seqs=64,
        decode_base_s=6.9e-3,
        decode_seq_s=0.075e-3,
        prefill_tok_s=33e-6,
        train_fixed_s=20.0,
        train_tok_s=11.7e-6,
        sync_s=20.0,
        producer_s=5.0,
        chunk_tokens=2048,
        sim_instances=4,
    )


def colocated(p: Params, train_gpus: int, gen_gpus: int) -> Params:
    """The same model synchronous on all the GPUs: every GPU generates, then trains."""
    scale = (train_gpus + gen_gpus) / gen_gpus
    return replace(
        p,
        name=f"{p.name}, colocated synchronous",
        instances=round(p.instances * scale),
        train_tok_s=p.train_tok_s * train_gpus / (train_gpus + gen_gpus),
    )


def calibrated_cpu(report: dict[str, Any], seq_share: float = 0.5) -> Params:
    """Our CPU configuration from a ``bench_async.py`` report: one engine (the rollout
    server, one thread) generating the whole batch at once, a decode iteration's cost split
    ``seq_share`` per sequence / the rest fixed, scaled so that the simulated generation
    time equals the synchronous run's median ``perf/gen_s``; the update
    (``perf/train_s`` minus ``perf/weight_sync_s``), the push and the producer's scoring and
    bookkeeping (the rest of the synchronous step) as measured."""
    sync = report["results"][base_mode(report)]
    s = report["shape"]
    responses = s["prompts"] * s["group"]
    p = Params(
        name="CPU: builtin:tiny, the rollout server, 1 thread each",
        prompts=s["prompts"],
        group=s["group"],
        prompt_len=s["prompt_len"],
        mean_len=sync["median_response_length"],
        p99_len=max(sync["median_response_length"], sync["median_response_length_max"]),
        max_len=s["max_len"],
        instances=1,
        max_seqs=responses,
        decode_base_s=1 - seq_share,
        decode_seq_s=seq_share / responses,
        prefill_tok_s=0.0,
        train_fixed_s=sync["median_train_s"] - sync["median_weight_sync_s"],
        train_tok_s=0.0,
        sync_s=sync["median_weight_sync_s"],
        producer_s=max(0.0, sync["median_step_s"] - sync["median_gen_s"] - sync["median_train_s"]),
        chunk_tokens=s.get("chunk_tokens", 32),
    )
    # Generation time alone (nothing else costs anything) for the unit iteration, on the
    # batches that calibration() simulates.
    alone = replace(p, train_fixed_s=0.0, sync_s=0.0, producer_s=0.0)
    unit = simulate(alone, 0).step_s
    scale = sync["median_gen_s"] / unit
    return replace(p, decode_base_s=p.decode_base_s * scale, decode_seq_s=p.decode_seq_s * scale)


def base_mode(report: dict[str, Any]) -> str:
    """The synchronous server run of a bench_async report."""
    for mode, r in report["results"].items():
        if r.get("n") == 0 and r.get("engine") == "vllm-server":
            return mode
    raise ValueError(
        "the bench_async report has no synchronous rollout-server run (n 0, engine "
        "vllm-server): run bench_async.py with --modes server-0,... first"
    )


def calibration(report: dict[str, Any], tolerance: float = 0.15) -> list[dict[str, Any]]:
    """Predicted against measured speed-up for every server run of the report."""
    p = calibrated_cpu(report)
    base = report["results"][base_mode(report)]
    sync_pred = simulate(p, 0).step_s
    rows = []
    for mode, r in report["results"].items():
        if r.get("engine") != "vllm-server":
            continue
        partial = r.get("partial", False)
        pred = simulate(p, r["n"], partial=partial).step_s
        measured, predicted = base["median_step_s"] / r["median_step_s"], sync_pred / pred
        row = {"mode": mode, "n": r["n"], "partial": partial, "error": predicted / measured - 1}
        row |= {"measured_step_s": r["median_step_s"], "predicted_step_s": pred}
        row |= {"measured_speedup": measured, "predicted_speedup": predicted}
        rows.append(row | {"within": abs(row["error"]) <= tolerance})
    return rows


def calibration_table(rows: list[dict[str, Any]], tolerance: float = 0.15) -> str:
    lines = [
        "| run | N | measured s/step | predicted s/step | measured speed-up | predicted | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['n']}{' partial' if r['partial'] else ''} | "
            f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
            f"{r['measured_speedup']:.2f}x | {r['predicted_speedup']:.2f}x | "
            f"{r['error']:+.1%}{'' if r['within'] else ' (beyond ' + format(tolerance, '.0%') + ')'} |"
        )
    ok = all(r["within"] for r in rows)
    lines.append(
        f"\nEvery prediction within {tolerance:.0%} of the measurement: {'yes' if ok else 'NO'}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--calibrate-cpu", metavar="JSON", help="a bench_async.py report")
    what.add_argument("--dapo-32b", action="store_true", help="Qwen2.5-32B at DAPO's scale")
    parser.add_argument("--ns", default="0,1,2,3,4,5,6,7,8", help="max_staleness values")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per simulation")
    parser.add_argument(
        "--continuous",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--dapo-32b: also the request-level producer (AReaL's): the next batch's "
        "requests queue as soon as the last batch's are admitted",
    )
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    ns = sorted({int(x) for x in args.ns.split(",") if x.strip()} | {0})
    if ns[0] < 0 or args.steps < 1:
        parser.error(f"--ns {args.ns!r} must be >= 0 and --steps >= 1")
    out: dict[str, Any] = {}
    if args.calibrate_cpu:
        report = json.loads(Path(args.calibrate_cpu).read_text())
        p = calibrated_cpu(report)
        rows = calibration(report)
        print("## CPU calibration: prediction against bench_async's measurement\n")
        print(calibration_table(rows))
        out["calibration"] = rows
        out["cpu"] = speedups(p, ns, steps=args.steps)
        print()
        print(table(out["cpu"]))
    else:
        p = dapo_32b()
        out["dapo_32b"] = speedups(p, ns, steps=args.steps)
        col = simulate(colocated(p, 64, 64), 0, steps=args.steps).step_s
        out["dapo_32b"]["colocated_sync_step_s"] = col
        print(table(out["dapo_32b"], col))
        if args.continuous:
            out["dapo_32b_continuous"] = speedups(p, ns, continuous=True, steps=args.steps)
            print()
            print(table(out["dapo_32b_continuous"], col))
    out["published"] = [{"system": s, "speedup": x, "setting": w} for s, x, w in PUBLISHED]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()
