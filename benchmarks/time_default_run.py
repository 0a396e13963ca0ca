"""Seconds per rollout step of the default run (``dapo train`` with no arguments), on this
machine's device: what a user's first command costs per step.

Runs ``python -m dapo train train.steps=N evaluate=false`` in a fresh process (the default
task, model and preset; no held-out evaluation, which the default run does before and after
training), reads its ``metrics.jsonl`` and reports the median step time over the steps after
the first (the first builds the engine's buffers and, on CUDA, captures its graphs), split
into generation and update, with the precision the run chose.

    python benchmarks/time_default_run.py                 # 20 steps
    python benchmarks/time_default_run.py --steps 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import provenance, write_report  # benchmarks/_report.py (run as a script)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default="benchmarks/results/default_run.json")
    ap.add_argument("extra", nargs="*", help="more key.path=value overrides")
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp()) / "run"
    cmd = [
        sys.executable,
        "-m",
        "dapo",
        "train",
        f"train.steps={args.steps}",
        "evaluate=false",
        "logging.tensorboard=false",
        "checkpoint.save_every=0",
        f"output_dir={out}",
        *args.extra,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"the run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in rows if "perf/step_s" in r][1:] or [r for r in rows if "perf/step_s" in r]

    def median(key: str) -> float:
        return round(statistics.median(r.get(key, 0.0) for r in steps), 4)

    precision = next(
        (
            line.split("precision: ", 1)[1]
            for line in proc.stdout.splitlines()
            if "precision: " in line
        ),
        "unknown",
    )
    result = {
        "steps": args.steps,
        "median_step_s": median("perf/step_s"),
        "median_gen_s": median("perf/gen_s"),
        "median_train_s": median("perf/train_s"),
        "run_s": round(seconds, 1),
        "precision": precision,
    }
    print(
        f"default run, {args.steps} steps ({precision}): median {result['median_step_s']:.3f} s "
        f"per step (generation {result['median_gen_s']:.3f} s, update "
        f"{result['median_train_s']:.3f} s); {seconds:.0f} s in all"
    )
    report = {
        "settings": {"steps": args.steps, "extra": args.extra},
        **provenance(),
        "result": result,
    }
    write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
