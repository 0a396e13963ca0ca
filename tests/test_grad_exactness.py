"""``python benchmarks/grad_exactness.py``: the README's claim that the gradient does not
depend on the number of ranks, checked as a reader would check it, and shown to catch the
mistake it exists for (a per-rank mean)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "grad_exactness.py"


def _run(*args: str, cwd: Path) -> tuple[int, str, dict[str, float]]:
    """The script's exit status, output, and each parameter's relative difference."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rows = re.findall(r"^(\S+\.weight)\s+(\S+)\s+(\S+)\s+(\S+)$", done.stdout, re.M)
    return done.returncode, done.stdout + done.stderr, {n: float(rel) for n, _, _, rel in rows}


def test_two_ranks_give_the_gradient_of_one_process_and_a_per_rank_mean_does_not(
    tmp_path: Path,
) -> None:
    code, out, relative = _run(cwd=tmp_path)
    assert code == 0, out
    tolerance = float(re.search(r"tolerance \(relative\): (\S+): PASS", out)[1])
    assert tolerance == 1e-6
    assert len(relative) > 20 and "model.embed_tokens.weight" in relative
    assert max(relative.values()) <= tolerance
    # The two ranks held different loss-token counts, so a per-rank mean would differ.
    counts = [
        float(c) for c in re.findall(r"^rank \d: \d+ responses, loss denominator (\S+)$", out, re.M)
    ]
    assert len(counts) == 2 and counts[0] != counts[1]

    code, out, relative = _run("--normalisation", "per-rank", cwd=tmp_path)
    assert code == 1, out
    assert "FAIL" in out
    assert max(relative.values()) > 1000 * tolerance
