"""tests/ranks.py: a worker run that died of the gloo abort is run once more; nothing else is.
Under both launchers: torchrun itself and the forked ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ranks import GLOO_ABORT, forked, torchrun

pytestmark = pytest.mark.slow

# Each launch is an attempt with its own run id (TORCHELASTIC_RUN_ID, also given to forked
# ranks). The first attempt's id is published atomically by whichever rank gets there first:
# under torchrun a rank may be killed, when the other aborts, before it reaches this script's
# end or even its start, and it still belongs to that attempt. Every rank appends the id of
# each attempt it ran; it aborts like gloo (or fails otherwise) in the first attempt only.
SCRIPT = """
import os, sys
import os
import time
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


def test_a_forked_run_past_its_deadline_fails_with_each_ranks_stack(tmp_path: Path) -> None:
    """A hang in CI says where each rank hung: the ranks are stopped at the deadline and
    the failure shows the Python stack of each."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import time\n"
        "def wait_for_a_peer_that_never_comes():\n"
        "    print('started', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "wait_for_a_peer_that_never_comes()\n"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        forked([str(script)], tmp_path, dict(os.environ), timeout=3, ranks=2)
    assert time.monotonic() - start < 30
    text = str(failure.value)
    assert "timed out after 3 s" in text
    for rank in (0, 1):
        stack = text.split(f"--- rank {rank} stderr ---")[1]
        assert "in wait_for_a_peer_that_never_comes" in stack.split("--- rank")[0]


def test_a_failed_rank_stops_its_waiting_peer_after_the_grace(tmp_path: Path) -> None:
    """A rank that dies before its peer joins (as rank 0 did of a port taken, in CI) fails
    the run within the grace, not the timeout, with the waiting peer's stack."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, sys, time\n"
        "def wait_for_rank_0():\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "if os.environ['RANK'] == '0':\n"
        "    sys.exit(3)\n"
        "wait_for_rank_0()\n"
    )
    start = time.monotonic()
    proc = forked([str(script)], tmp_path, dict(os.environ), timeout=300, ranks=2, grace=2)
    assert time.monotonic() - start < 60
    assert proc.returncode == 3
    assert "in wait_for_rank_0" in proc.stderr


def test_a_rank_that_outlives_its_finished_peer_fails_with_its_stack(tmp_path: Path) -> None:
    """A run whose ranks wrote everything but one process never ends (as a rank waiting at its
    exit for a thread nobody stops) fails within the outlive bound, naming that rank and
    showing its stack, instead of passing on its files or waiting for the timeout."""
    script = tmp_path / "lingers.py"
    script.write_text(
        "import os, threading\n"
        "def wait_for_work_that_never_comes():\n"
        "    threading.Event().wait()\n"
        "if os.environ['RANK'] == '0':\n"
        "    wait_for_work_that_never_comes()\n"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        forked([str(script)], tmp_path, dict(os.environ), timeout=300, ranks=2, outlive=2)
    assert time.monotonic() - start < 60
    text = str(failure.value)
    assert "rank(s) [0] still running" in text
    assert "in wait_for_work_that_never_comes" in text.split("--- rank 0 stderr ---")[1]


def test_forked_ranks_join_the_store_this_process_hosts(tmp_path: Path) -> None:
    """No rank binds the group's port (which another process could take first): both are
    clients of the store the launching process holds, and they form a gloo group."""
    script = tmp_path / "group.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([dist.get_rank() + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print('sum', int(t.item()), 'agent', os.environ['TORCHELASTIC_USE_AGENT_STORE'])\n"
        "dist.destroy_process_group()\n"
    )
    proc = forked([str(script)], tmp_path, dict(os.environ), timeout=120, ranks=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("sum 3 agent True") == 2
