"""Shared fixtures: small models built in the test session (no downloads)."""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

# train.precision=auto resolves to fp32 on every CPU in the suite (bf16-mixed where the CPU
# has native bf16, outside it), so that tests compute the same on every machine; subprocesses
# inherit it. tests/test_precision.py tests the detection itself.
os.environ.setdefault("DAPO_CPU_BF16", "0")

# Under pytest-xdist (`make test` runs two workers on the two cores) each worker, and every
# process it starts, computes on one thread: two workers of two threads each on two cores make
# torch many times slower, and the suite's models are too small to gain from a second thread.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

# `make test` (what CI runs) draws the property tests' examples from a fixed seed
# (`--hypothesis-profile=ci`): a gate that passes or fails on the same tree every time.
# `make test-quick` and plain pytest search anew at each run, and keep what they find in
# .hypothesis/.
settings.register_profile("ci", derandomize=True, database=None)

SUITE_BUDGET_S = 20 * 60  # make test's tests, on the 2-core machine (docs/development.md)
_STARTED = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """The suite's wall time against its budget, as the last lines: the guard against a suite
    that grows unnoticed (``--durations=30``, which ``make test`` passes, lists the slowest)."""
    seconds = time.monotonic() - _STARTED
    over = seconds > SUITE_BUDGET_S and config.option.markexpr == ""
    terminalreporter.write_line(
        f"suite time: {seconds / 60:.1f} min of the {SUITE_BUDGET_S // 60}-minute budget for "
        "the whole suite" + (" -- OVER BUDGET: see the slowest tests above" if over else "")
    )


@pytest.fixture(scope="session")
def random_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised builtin-architecture model saved as a transformers directory."""
    from dapo.models.tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("random_tiny")
    tok = build_tokenizer()
    build_model(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tok():
    """The builtin character tokenizer (eos id 1, pad id 0, as the tiny-model tests assume)."""
    from dapo.models.tiny import build_tokenizer

    t = build_tokenizer()
    assert (t.eos_token_id, t.pad_token_id) == (1, 0)
    return t


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests, restored afterwards: a second
    thread gains nothing on such models, and when other processes busy both cores a
    2-thread torch slows down by ~100x (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny-tool's architecture and chat template with random weights (no warm-up)."""
    from dapo.data.tasks.calculator import CHAT_TEMPLATE
    from dapo.models.tiny import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tool_model")
    tok = build_tokenizer(CHAT_TEMPLATE)
    build_model(len(tok), seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def pytest_collection_finish(session: Any) -> None:
    """The modules the tests imported (torch, transformers, dapo) live as long as the test
    process: out of the collector's sight, a full collection (vLLM's engine start runs 5)
    walks only what the tests made since."""
    gc.freeze()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Under pytest-xdist, files with the most ``slow`` tests run first (each file's tests
    together and in their order), so that short tests, not the vLLM and two-rank files, fill
    the end (measured: about a minute of the suite's 45, docs/development.md)."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") or config.getoption("numprocesses", None)):
        return
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
