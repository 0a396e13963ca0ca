"""The final model: the policy in transformers' format, loadable by transformers, vLLM and
``dapo eval``, with a manifest of its files (:mod:`dapo.training.manifest`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dapo.atomic import as_new_file, write_error
from dapo.training.manifest import MANIFEST, write_manifest


def export_final_model(final: Path, model: Any, tokenizer: Any, weights: dict[str, Any]) -> None:
    """Write ``weights`` (the policy's, gathered) and the tokenizer to ``final`` with
    ``save_pretrained``; the manifest last, so that a directory without one is an export
    that did not finish. A failed write (a full disk: safetensors' errors are not OSErrors)
    stops with :func:`~dapo.atomic.write_error`; the last checkpoint holds the same weights."""
    (final / MANIFEST).unlink(missing_ok=True)  # an earlier export's, stale from now on
    try:
        model.save_pretrained(final, state_dict=weights)
        tokenizer.save_pretrained(final)
        for weights_file in final.glob("*.safetensors"):  # written 0600
            as_new_file(weights_file)
        write_manifest(final)
    except Exception as exc:
        code = getattr(exc, "errno", None)
        if code is None and (found := re.search(r"os error (\d+)", str(exc))):
            code = int(found.group(1))
        if code is None:
            raise
        io = exc if isinstance(exc, OSError) else OSError(code, str(exc))
        left = "it has no manifest until an export ends (resume=true exports it again)"
        raise write_error(final, io, left) from exc
