"""Rollout-step time with vLLM: synchronous, one-step-asynchronous, and a rollout server.

Runs the same short training (dynamic sampling off, so every step does the same work) in
up to four ways and prints the median seconds per rollout step of each, with the ratio to
the synchronous colocated run:

- ``sync``: ``rollout.engine=vllm``, generate then train (the engine in the trainer's
  process);
- ``async``: the same with ``rollout.async_steps=1`` (the engine generates the next batch
  in a background thread while the trainer trains);
- ``server``: ``rollout.engine=vllm-server`` against a ``dapo vllm-serve`` process that the
  script starts on 127.0.0.1 (weights pushed over gloo after every step);
- ``server-async``: the server with ``rollout.async_steps=1``.

Core split: the trainer and the server (or the in-process engine's thread) run with one
torch thread each (``OMP_NUM_THREADS=1``), so on a 2-core machine generation and training
get a core each when they overlap, and share them otherwise. Steps 1 and 2 are dropped
(start-up, and the synchronous first batch of an asynchronous run).

    python benchmarks/bench_async.py [--steps 10] [--modes sync,async,server,server-async]
        [--model tiny|100m] [--output benchmarks/results/async.json] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)

MODES = {
    "sync": ["rollout.engine=vllm", "rollout.async_steps=0"],
    "async": ["rollout.engine=vllm", "rollout.async_steps=1"],
    "server": ["rollout.engine=vllm-server", "rollout.async_steps=0"],
    "server-async": ["rollout.engine=vllm-server", "rollout.async_steps=1"],
}
DEFAULTS = [
    "train.prompts_per_step=8",
    "train.mini_batch_size=8",
    "rollout.num_generations=8",
    "rollout.max_completion_length=64",
    "algorithm.dynamic_sampling=false",
]


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

    return launch(model, port, log=log, max_model_len=1024, env=env)


def run(
    mode: str, model: str, steps: int, out: Path, env: dict[str, str], extra: list[str]
) -> dict:
    """One training run; the per-step figures of steps 3.."""
    server = None
    overrides = [*DEFAULTS, *MODES[mode], *extra]
    try:
        if mode.startswith("server"):
            from dapo.rollout.weight_channel import free_port

            port = free_port()
            server = start_server(model, port, env, out.parent / f"{mode}-server.log")
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
        t0 = time.time()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        wall = time.time() - t0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r][2:]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    return {
        "median_step_s": med("perf/step_s"),
        "steps_s": [r["perf/step_s"] for r in rows],
        "median_gen_s": med("perf/gen_s"),  # generation the trainer waited for in fill_batch
        "median_train_s": med("perf/train_s"),  # update (+ waiting for the round ahead, + sync)
        "median_async_gen_s": med("perf/async_gen_s"),  # the round generated ahead
        "median_async_wait_s": med("perf/async_wait_s"),
        "median_weight_sync_s": med("perf/weight_sync_s"),
        "staleness": [r.get("rollout/staleness") for r in rows],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    parser.add_argument("--model", choices=["tiny", "100m"], default="tiny")
    parser.add_argument("--output", default="benchmarks/results/async.json")
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for every run")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown or args.steps < 3:
        parser.error(f"unknown modes {sorted(unknown)}" if unknown else "--steps must be >= 3")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp))
        for mode in modes:
            results[mode] = run(mode, model, args.steps, Path(tmp) / mode, env, args.extra)
    base = results.get("sync")
    print(
        f"{'mode':>12} {'s/step':>8} {'gen s':>7} {'train s':>8} {'ahead s':>8} {'wait s':>7} {'vs sync':>8}"
    )
    for mode, r in results.items():
        ratio = base["median_step_s"] / r["median_step_s"] if base else float("nan")
        r["speedup_vs_sync"] = ratio
        print(
            f"{mode:>12} {r['median_step_s']:>8.2f} {r['median_gen_s']:>7.2f} "
            f"{r['median_train_s']:>8.2f} {r['median_async_gen_s']:>8.2f} "
            f"{r['median_async_wait_s']:>7.2f} {ratio:>7.2f}x"
        )
    print(
        f"({os.cpu_count()} cores; trainer and engine/server 1 torch thread each; medians of "
        f"steps 3-{args.steps})"
    )
    report = {
        **provenance(),
        "model": args.model,
        "settings": [*DEFAULTS, *args.extra],
        "threads": {"trainer": 1, "engine_or_server": 1},
        "results": results,
    }
    write_report(args.output, report)
    return report


if __name__ == "__main__":
    main()
