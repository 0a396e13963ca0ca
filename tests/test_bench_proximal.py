"""benchmarks/measure_proximal.py at tiny sizes: the log-linear proximal policy equals the
recomputed one at a step's first update and differs from it, by less than the gap it
corrects, later in the step."""

from __future__ import annotations

import pytest
from benchmark_modules import import_benchmark

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_loglinear_error_is_measured_per_update(tmp_path):
    measure_proximal = import_benchmark("measure_proximal")
    out = tmp_path / "proximal.json"
    code = measure_proximal.main(
        [
            "--model=builtin:tiny",
            "--task=builtin:addition",
            "--steps=4",
            "--prompts=4",
            "--updates=2",
            "--generations=4",
            "--max-length=40",
            f"--output-dir={tmp_path / 'run'}",
            f"--output={out}",
            # The log-linear error is second order in the update's size, the gap it corrects
            # first order: at 1e-3 the two came within 10% (error/gap 0.77-1.09 over runs, the
            # versions mixed depending on thread timing) and the check below failed once in
            # CI; at 1e-4 error/gap was 0.17-0.37.
            "train.lr=1e-4",
        ]
    )
    assert code == 0 and out.exists()
    table = {r["progress"]: r for r in measure_proximal_table(out)}
    assert set(table) == {0.0, 0.5}
    assert table[0.0]["abs_error"] < 1e-5  # exact at the first update
    assert 0 < table[0.5]["abs_error"] < table[0.5]["gap"]


def measure_proximal_table(path):
    import json

    return json.loads(path.read_text())["table"]
