"""Compare two runs' metrics.jsonl line by line: every metric but wall-clock timings must match.

For refactors that must not change behaviour: run the same config and seed before and after,
then ``python scripts/compare_runs.py RUN_A RUN_B``. Exits 1 and lists the differences when
a step, a metric name or a value (beyond ``--tol``) differs. ``perf/*`` and ``time`` are
skipped (they measure the machine); ``--skip`` adds more prefixes (metrics whose definition
changed on purpose).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TIMING = ("perf/", "time")


def load(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(a: list[dict], b: list[dict], skip: tuple[str, ...], tol: float) -> list[str]:
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} lines vs {len(b)} lines")
    for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
        keys_a = {k for k in ra if not k.startswith(skip)}
        keys_b = {k for k in rb if not k.startswith(skip)}
        for k in sorted(keys_a ^ keys_b):
            out.append(f"line {i + 1}: {k} only in {'A' if k in keys_a else 'B'}")
        for k in sorted(keys_a & keys_b):
            va, vb = ra[k], rb[k]
            same = va == vb or (
                isinstance(va, (int, float))
                and isinstance(vb, (int, float))
                and math.isclose(va, vb, rel_tol=tol, abs_tol=tol)
            )
            if not same:
                out.append(f"line {i + 1} (step {ra.get('step')}): {k}: {va} vs {vb}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--skip", nargs="*", default=[], help="more metric-name prefixes to ignore")
    ap.add_argument(
        "--tol", type=float, default=0.0, help="absolute/relative tolerance (default exact)"
    )
    args = ap.parse_args(argv)
    a, b = load(args.run_a), load(args.run_b)
    diffs = differences(a, b, TIMING + tuple(args.skip), args.tol)
    n_values = sum(len([k for k in r if not k.startswith(TIMING)]) for r in a)
    if diffs:
        print("\n".join(diffs))
        print(f"DIFFERENT: {len(diffs)} differences")
        return 1
    print(f"identical: {len(a)} lines, {n_values} values (timings skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
