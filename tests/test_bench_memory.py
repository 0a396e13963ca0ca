"""Smoke test of ``benchmarks/bench_memory.py`` on a tiny model shape, so that it does not rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_memory.py"


def test_bench_memory_smoke(tmp_path: Path) -> None:
    sides = ["fp32", "bf16-mixed", "bf16-mixed+ckpt"]
    if importlib.util.find_spec("trl") is not None:
        sides.append("trl")
    out = tmp_path / "memory.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--threads",
        "1",
        "--prompts",
        "2",
        "--generations",
        "2",
        "--max-completion-length",
        "6",
        "--hidden",
        "32",
        "--layers",
        "2",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--mlp",
        "64",
        "--vocab",
        "4000",
        "--sides",
        ",".join(sides),
        "--output",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert list(report["results"]) == sides
    for side, r in report["results"].items():
        assert r["peak_mb"] >= r["before_mb"] > 0, side
        assert r["step_s"] > 0 and len(r["lengths"]) == 4, side
    assert report["settings"]["model"]["hidden"] == 32
    if "trl" in sides:
        ratio = (
            report["results"]["bf16-mixed+ckpt"]["peak_mb"] / report["results"]["trl"]["peak_mb"]
        )
        assert report["ckpt_over_trl"] == ratio
        assert "bf16-mixed+ckpt peak / TRL peak" in proc.stdout
