"""Whether vLLM imports here, for the tests that need it (skipped with the import error as
the reason otherwise: `make test VLLM=` leaves vLLM out)."""

from __future__ import annotations

import pytest

from dapo.rollout import vllm_engine


def vllm_import_error() -> str | None:
    """The reason vLLM cannot be used here, or None."""
    try:
        vllm_engine.import_vllm()
    except vllm_engine.VLLMUnavailableError as exc:
        return str(exc)
    return None


VLLM_ERROR = vllm_import_error()
needs_vllm = pytest.mark.skipif(
    VLLM_ERROR is not None, reason=f"vllm does not import: {(VLLM_ERROR or '')[:300]}"
)
