"""tests/ranks.py: a worker run that died of the gloo abort is run once more; nothing else is.
Under both launchers: torchrun itself and the forked ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from ranks import GLOO_ABORT, torchrun

pytestmark = pytest.mark.slow

# Each launch is an attempt with its own run id (TORCHELASTIC_RUN_ID, also given to forked
# ranks). The first attempt's id is published atomically by whichever rank gets there first:
# under torchrun a rank may be killed, when the other aborts, before it reaches this script's
# end or even its start, and it still belongs to that attempt. Every rank appends the id of
# each attempt it ran; it aborts like gloo (or fails otherwise) in the first attempt only.
SCRIPT = """
import os, sys
from pathlib import Path
run, rank = os.environ["TORCHELASTIC_RUN_ID"], os.environ["RANK"]
mine = Path(f".first.{run}.{rank}")  # a new file: first_run may be a link to an old one
mine.write_text(run)
try:
    os.link(mine, "first_run")
except FileExistsError:
    pass
with open(f"attempts{rank}", "a") as f:
    f.write(run + "\\n")
if Path("first_run").read_text() == run:
    if sys.argv[1] == "abort":
        sys.stderr.write("%s\\n" % sys.argv[2]); sys.stderr.flush(); os.abort()
    if sys.argv[1] == "fail":
        sys.exit(3)
"""


def _script(tmp_path: Path) -> str:
    path = tmp_path / "fake_worker.py"
    path.write_text(SCRIPT)
    return str(path)


def _attempts(tmp_path: Path) -> tuple[str, dict[int, list[str]]]:
    """The first attempt's run id, and the run ids each rank ran (in order)."""
    ran = {}
    for r in (0, 1):
        path = tmp_path / f"attempts{r}"
        ran[r] = path.read_text().split() if path.exists() else []
    return (tmp_path / "first_run").read_text(), ran


@pytest.fixture(params=[False, True], ids=["torchrun", "forked"])
def fork(request) -> bool:
    return request.param


def test_a_gloo_abort_is_run_once_more_with_a_warning(tmp_path: Path, fork: bool) -> None:
    with pytest.warns(UserWarning, match="gloo rank aborted"):
        proc = torchrun(
            _script(tmp_path), "abort", GLOO_ABORT, cwd=tmp_path, retry_abort=True, fork=fork
        )
    assert proc.returncode == 0
    first, ran = _attempts(tmp_path)
    # Both ranks ran a second attempt, and there was no third.
    second = {ids[-1] for ids in ran.values()}
    assert len(second) == 1 and first not in second
    assert {i for ids in ran.values() for i in ids} == {first} | second


def test_other_failures_and_unmarked_scripts_are_not_retried(tmp_path: Path, fork: bool) -> None:
    with pytest.raises(AssertionError):
        torchrun(_script(tmp_path), "fail", "-", cwd=tmp_path, retry_abort=True, fork=fork)
    first, ran = _attempts(tmp_path)
    assert {i for ids in ran.values() for i in ids} == {first}  # one attempt only
    for f in [*tmp_path.glob("attempts*"), *tmp_path.glob(".first.*"), tmp_path / "first_run"]:
        f.unlink()
    with pytest.raises(AssertionError, match="stages"):  # not the worker: no retry by default
        torchrun(_script(tmp_path), "abort", GLOO_ABORT, cwd=tmp_path, fork=fork)
    first, ran = _attempts(tmp_path)
    assert {i for ids in ran.values() for i in ids} == {first}
