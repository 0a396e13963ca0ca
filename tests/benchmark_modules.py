"""Import a script of ``benchmarks/`` in a test: the scripts are not a package and import
their siblings (``_report``, ``bench_ablation``) by name, so ``benchmarks/`` is on the path
while the module loads."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (cached like any import)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
