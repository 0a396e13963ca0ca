"""Smoke test of ``benchmarks/bench_trl.py`` with tiny settings, so that it does not rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_trl.py"


def test_bench_trl_smoke(tmp_path: Path) -> None:
    pytest.importorskip(
        "trl", reason="trl is not installed (benchmark-only extra: pip install -e '.[bench]')"
    )
    out = tmp_path / "trl.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--steps",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--prompts",
        "4",
        "--generations",
        "4",
        "--max-completion-length",
        "16",
        "--output",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "throughput ratio" in proc.stdout

    report = json.loads(out.read_text())
    results = report["results"]
    for side in ("ours", "trl"):
        r = results[side]
        assert r["median_step_s"] > 0
        assert r["peak_rss_mb"] > 0
        assert r["kept_steps"] == 1  # 2 steps, the first dropped as warm-up
        (run,) = r["runs"]
        assert len(run["step_s"]) == 2
        assert all(s > 0 for s in run["step_s"])
    expected = results["trl"]["median_step_s"] / results["ours"]["median_step_s"]
    assert report["throughput_ratio"] == pytest.approx(expected)
    assert report["settings"]["prompts_per_step"] == 4
    assert report["machine"]["trl"] is not None  # installed, and its version recorded
