"""Rollout-step time with vLLM at each staleness bound: steps per minute against synchronous.

Runs the same short training (dynamic sampling off, so every step does the same work) in
several modes, one after the other in one invocation (``--rounds R`` alternates them R
times), and prints for each the median seconds per rollout step, steps per minute and the
ratio to the synchronous run of the same engine. A mode is ``ENGINE-N`` with an optional
``p``:

- ``ENGINE``: ``server`` (``rollout.engine=vllm-server`` against a ``dapo vllm-serve``
  process the script starts on 127.0.0.1; weights pushed over gloo after every step) or
  ``vllm`` (the engine in the trainer's process);
- ``N``: ``rollout.max_staleness`` (0: synchronous, generate then train; N >= 1: a
  producer generates up to N batches ahead while the trainer trains);
- ``p``: with ``rollout.partial_rollouts=true``.

The former names stay: ``sync`` = ``vllm-0``, ``async`` = ``vllm-1``, ``server`` =
``server-0``, ``server-async`` = ``server-1``. Default: ``server-0,server-1,server-2,server-4``.

Core split: the trainer and the server (or the in-process engine's thread) run with one
torch thread each (``OMP_NUM_THREADS=1``), so on a 2-core machine generation and training
get a core each when they overlap, and share them otherwise. Steps 1 and 2 are dropped
(start-up, and the first batch, generated before anything else), and with N > 0 the last
N (generated ahead while nothing else was left to generate).

    python benchmarks/bench_async.py [--steps 12] [--modes server-0,server-1,server-2,server-4]
        [--rounds 1] [--model tiny|100m] [--output benchmarks/results/stream_speed.json]
        [key.path=value ...]

``benchmarks/sim_async.py --calibrate-cpu OUTPUT`` reads the JSON written here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _in_process import in_process, run_here  # benchmarks/_in_process.py (run as a script)
from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

ALIASES = {"sync": "vllm-0", "async": "vllm-1", "server": "server-0", "server-async": "server-1"}
ENGINES = {"server": "vllm-server", "vllm": "vllm"}
DEFAULT_MODES = "server-0,server-1,server-2,server-4"
MODE = re.compile(r"(server|vllm)-(\d+)(p?)")
DEFAULTS = [
    "train.prompts_per_step=8",
    "train.mini_batch_size=8",
    "rollout.num_generations=8",
    "rollout.max_completion_length=64",
    "algorithm.dynamic_sampling=false",
]
SKIP = 2  # steps dropped at the start
# What starts `dapo vllm-serve` (subprocess.Popen's signature; the smoke test forks it from
# a process that has imported vLLM).
SERVER_POPEN: Any = subprocess.Popen


def parse_mode(mode: str) -> dict[str, Any] | None:
    """``server-2p`` -> engine vllm-server, n 2, partial; None when it is not a mode."""
    m = MODE.fullmatch(ALIASES.get(mode, mode))
    if m is None:
        return None
    return {"engine": ENGINES[m[1]], "n": int(m[2]), "partial": m[3] == "p"}


def mode_overrides(spec: dict[str, Any]) -> list[str]:
    out = [f"rollout.engine={spec['engine']}", f"rollout.max_staleness={spec['n']}"]
    if spec["partial"]:
        out.append("rollout.partial_rollouts=true")
    return out


def model_path(name: str, tmp: Path) -> str:
    """``builtin:tiny`` (warmed up, ~1M parameters) or a random 110M Llama saved in ``tmp``."""
    if name == "tiny":
        from dapo.models import resolve_model_path

        return resolve_model_path("builtin:tiny", log=lambda _: None)
    from _models import save_random_llama  # benchmarks/_models.py

    path = tmp / "model-100m"
    save_random_llama(path)
    return str(path)


def start_server(model: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    from dapo.rollout.server import launch

    return launch(model, port, log=log, max_model_len=1024, env=env, popen=SERVER_POPEN)


def run(
    mode: str, model: str, steps: int, out: Path, env: dict[str, str], extra: list[str]
) -> list[dict[str, Any]]:
    """One training run; the metrics of its measured steps (``SKIP`` + 1 .. steps - N)."""
    spec = parse_mode(mode)
    assert spec is not None
    server = None
    overrides = [*DEFAULTS, *mode_overrides(spec), *extra]
    try:
        if spec["engine"] == "vllm-server":
            from dapo.rollout.weight_channel import free_port

            port = free_port()
            server = start_server(model, port, env, out.parent / f"{out.name}-server.log")
            overrides.append(f"rollout.server_url=http://127.0.0.1:{port}")
        cmd = [
            sys.executable,
            "-m",
            "dapo",
            "train",
            f"model.name_or_path={model}",
            f"output_dir={out}",
            f"train.steps={steps}",
            "evaluate=false",
            "logging.tensorboard=false",
            "logging.console=false",
            "checkpoint.save_every=0",
            "checkpoint.save_final_model=false",
            *overrides,
        ]
        if in_process():  # the smoke test: the trainer in this process, no fresh imports
            from dapo.cli import main as dapo_main

            status = run_here(lambda: dapo_main(cmd[3:]), 1, out.parent / f"{out.name}.log")
            if status:
                raise RuntimeError(f"{mode}: dapo train exited {status}; see {out.name}.log")
        else:
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    return rows[SKIP : len(rows) - spec["n"]]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the measured steps' figures."""

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    step = med("perf/step_s")
    return {
        "median_step_s": step,
        "steps_per_min": 60 / step,
        "steps_s": [r["perf/step_s"] for r in rows],
        "median_gen_s": med("perf/gen_s"),  # the batch's generation (the producer's, N > 0)
        "median_score_s": med("perf/score_s"),
        "median_train_s": med("perf/train_s"),  # the update and the weight push
        "median_weight_sync_s": med("perf/weight_sync_s"),
        "median_data_wait_s": med("perf/data_wait_s"),  # the trainer waited for its batch
        "median_capacity_wait_s": med("perf/capacity_wait_s"),  # the producer waited
        "median_response_length": med("response_length/mean"),
        "median_response_length_max": med("response_length/max"),
        "staleness_max": max((r.get("stream/staleness_max", 0.0) for r in rows), default=0.0),
        "partial_responses": sum(r.get("stream/partial_responses", 0.0) for r in rows),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="ENGINE-N[p]: server or vllm, rollout.max_staleness, p for partial rollouts "
        f"(or {', '.join(ALIASES)})",
    )
    parser.add_argument("--rounds", type=int, default=1, help="times each mode runs, alternated")
    parser.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    parser.add_argument("--output", default="benchmarks/results/stream_speed.json")
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for every run")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if parse_mode(m) is None]
    if unknown or not modes:
        parser.error(
            f"--modes: unknown {unknown}; use ENGINE-N[p], e.g. server-0,server-2p "
            f"(ENGINE server or vllm), or {', '.join(ALIASES)}"
        )
    most = max(parse_mode(m)["n"] for m in modes)
    if args.steps < SKIP + most + 1 or args.rounds < 1:
        parser.error(
            f"--steps {args.steps} must be at least {SKIP + most + 1} (the first {SKIP} and "
            f"the last N={most} steps are dropped) and --rounds >= 1"
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    measured: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    wall: dict[str, float] = dict.fromkeys(modes, 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp))
        for r in range(args.rounds):
            for mode in modes:
                t0 = time.time()
                out = Path(tmp) / f"{mode}-{r}"
                measured[mode] += run(mode, model, args.steps, out, env, args.extra)
                wall[mode] += time.time() - t0
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        results[mode] = {**parse_mode(mode), **summarize(measured[mode]), "wall_s": wall[mode]}
    for r in results.values():  # the ratio to the synchronous run of the same engine
        base = next(
            (b for b in results.values() if b["n"] == 0 and b["engine"] == r["engine"]), None
        )
        r["speedup_vs_sync"] = (
            base["median_step_s"] / r["median_step_s"] if base is not None else float("nan")
        )
    print(
        f"{'mode':>10} {'s/step':>7} {'steps/min':>9} {'gen s':>6} {'train s':>7} "
        f"{'push s':>6} {'data wait':>9} {'cap. wait':>9} {'stale max':>9} {'vs N=0':>7}"
    )
    for mode, r in results.items():
        print(
            f"{mode:>10} {r['median_step_s']:>7.3f} {r['steps_per_min']:>9.1f} "
            f"{r['median_gen_s']:>6.2f} {r['median_train_s']:>7.2f} "
            f"{r['median_weight_sync_s']:>6.3f} {r['median_data_wait_s']:>9.2f} "
            f"{r['median_capacity_wait_s']:>9.2f} {r['staleness_max']:>9.0f} "
            f"{r['speedup_vs_sync']:>6.2f}x"
        )
    print(
        f"({os.cpu_count()} cores; trainer and engine/server 1 torch thread each; medians of "
        f"steps {SKIP + 1}-{args.steps} less the last N, over {args.rounds} round(s))"
    )
    settings = [*DEFAULTS, *args.extra]
    report = {
        **provenance(),
        "model": args.model,
        "settings": settings,
        "shape": shape(settings),
        "threads": {"trainer": 1, "engine_or_server": 1},
        "rounds": args.rounds,
        "results": results,
    }
    write_report(args.output, report)
    return report


def shape(settings: list[str]) -> dict[str, Any]:
    """The batch shape of the runs (``sim_async.py --calibrate-cpu`` models it)."""
    from dapo.config import load_config

    cfg = load_config(overrides=[s for s in settings if not s.startswith("model.")])
    return {
        "prompts": cfg.train.prompts_per_step,
        "group": cfg.rollout.num_generations,
        "prompt_len": 8,  # builtin:addition's prompts: "12+34=" and the like
        "max_len": cfg.rollout.max_completion_length,
        "chunk_tokens": cfg.rollout.partial_chunk_tokens,
    }


if __name__ == "__main__":
    main()
