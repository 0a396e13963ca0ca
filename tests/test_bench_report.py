"""benchmarks/_report.py: the provenance every benchmark JSON carries, and how it is written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from benchmark_modules import import_benchmark  # tests/benchmark_modules.py

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def report_mod():
    _report = import_benchmark("_report")
    return _report


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def test_commit_is_the_checkouts_head_and_flags_local_changes(report_mod):
    head = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert report_mod.git_commit() == head + ("+dirty" if dirty else "")


def test_provenance_and_write_report(report_mod, tmp_path, capsys):
    import torch

    prov = report_mod.provenance(engine="hf")
    assert set(prov) == {"date", "commit", "machine"}
    assert prov["machine"]["torch"] == torch.__version__
    assert prov["machine"]["threads"] == torch.get_num_threads()
    assert prov["machine"]["engine"] == "hf"  # extra machine fields are kept
    assert report_mod.package_version("torch") == torch.__version__
    assert report_mod.package_version("no-such-package-dapo") is None

    out = tmp_path / "new" / "folder" / "r.json"
    report_mod.write_report(out, {"x": 1.5, **prov}, tmp_path / "plot.png")
    assert json.loads(out.read_text()) == {"x": 1.5, **prov}
    assert f"wrote {out} and {tmp_path / 'plot.png'}" in capsys.readouterr().out
