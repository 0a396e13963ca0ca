"""Rollout-step time with 1 and 2 data-parallel ranks on this machine.

Runs the same short training (builtin:tiny, dynamic sampling off so every step does the
same work) once as a single process and once under torchrun with 2 gloo ranks (DDP, or
FSDP2 with ``--data-parallel fsdp``), and prints the median seconds per rollout step of
each and their ratio.

    python benchmarks/bench_ddp.py [--steps 8] [--data-parallel ddp|fsdp]
                                   [--output benchmarks/results/ddp.json]
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

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)


def run(
    ranks: int, steps: int, out: Path, threads: int, data_parallel: str, extra: list[str]
) -> list[float]:
    args = [
        "-m",
        "dapo",
        "train",
        f"output_dir={out}",
        f"train.steps={steps}",
        f"train.data_parallel={data_parallel}",
        "algorithm.dynamic_sampling=false",
        "evaluate=false",
        "logging.tensorboard=false",
        "logging.console=false",
        "checkpoint.save_every=0",
        "checkpoint.save_final_model=false",
        *extra,
    ]
    if ranks == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["perf/step_s"] for r in rows if "perf/step_s" in r][1:]  # first step warms up


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--output", default="benchmarks/results/ddp.json")
    parser.add_argument("extra", nargs="*", help="key.path=value overrides for both runs")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            t0 = time.time()
            threads = max(1, cores // ranks)
            times = run(
                ranks, args.steps, Path(tmp) / f"r{ranks}", threads, args.data_parallel, args.extra
            )
            results[ranks] = {
                "median_step_s": statistics.median(times),
                "steps_s": times,
                "wall_s": time.time() - t0,
                "threads_per_rank": max(1, cores // ranks),
            }
    ratio = results[1]["median_step_s"] / results[2]["median_step_s"]
    print(f"{'ranks':>5} {'threads/rank':>12} {'median s/step':>14}")
    for ranks, r in results.items():
        print(f"{ranks:>5} {r['threads_per_rank']:>12} {r['median_step_s']:>14.2f}")
    print(f"speed-up with 2 ranks: {ratio:.2f}x (same {cores} cores shared)")
    report = {
        **provenance(),
        "results": results,
        "data_parallel": args.data_parallel,
        "speedup_2_ranks": ratio,
    }
    write_report(args.output, report)
    return report


if __name__ == "__main__":
    main()
