"""tests/ranks.py: a worker run that died of the gloo abort is run once more; nothing else is.
Under both launchers: torchrun itself and the forked ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import GLOO_ABORT, torchrun

pytestmark = pytest.mark.slow

# Each rank counts its attempts in a file; it aborts like gloo (or fails otherwise) on the
# first attempt only.
SCRIPT = """
import os, sys
rank = os.environ["RANK"]
from pathlib import Path
tries = Path(f"tries{rank}")
n = int(tries.read_text()) + 1 if tries.exists() else 1
tries.write_text(str(n))
if n == 1 and sys.argv[1] == "abort":
    sys.stderr.write("%s\\n" % sys.argv[2]); sys.stderr.flush(); os.abort()
if n == 1 and sys.argv[1] == "fail":
    sys.exit(3)
"""


def _script(tmp_path: Path) -> str:
    path = tmp_path / "fake_worker.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture(params=[False, True], ids=["torchrun", "forked"])
def fork(request) -> bool:
    return request.param


def test_a_gloo_abort_is_run_once_more_with_a_warning(tmp_path: Path, fork: bool) -> None:
    with pytest.warns(UserWarning, match="gloo rank aborted"):
        proc = torchrun(
            _script(tmp_path), "abort", GLOO_ABORT, cwd=tmp_path, retry_abort=True, fork=fork
        )
    assert proc.returncode == 0
    assert [(tmp_path / f"tries{r}").read_text() for r in (0, 1)] == ["2", "2"]


def test_other_failures_and_unmarked_scripts_are_not_retried(tmp_path: Path, fork: bool) -> None:
    with pytest.raises(AssertionError):
        torchrun(_script(tmp_path), "fail", "-", cwd=tmp_path, retry_abort=True, fork=fork)
    assert (tmp_path / "tries0").read_text() == "1"
    for f in tmp_path.glob("tries*"):
        f.unlink()
    with pytest.raises(AssertionError, match="stages"):  # not the worker: no retry by default
        torchrun(_script(tmp_path), "abort", GLOO_ABORT, cwd=tmp_path, fork=fork)
    assert (tmp_path / "tries0").read_text() == "1"
