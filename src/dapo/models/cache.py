"""Where dapo keeps the models it builds or converts, and the names of the built-in models.

The lowest module of :mod:`dapo.models`: ``loading`` resolves names with it, ``tiny``
(built-in models) and ``gguf`` (converted GGUF files) write under :func:`cache_root`.
"""

from __future__ import annotations

import os
from pathlib import Path

BUILTIN_MODEL = "builtin:tiny"  # the default; built by dapo.models.tiny
# Warmed up on builtin:addition, builtin:long_addition, builtin:calculator (multi-turn) and
# builtin:code (programs judged in the sandbox).
BUILTIN_MODELS = (BUILTIN_MODEL, "builtin:tiny-long", "builtin:tiny-tool", "builtin:tiny-code")
# A vision-language model (Idefics3 class), warmed up on builtin:colour_count.
BUILTIN_VLM = "builtin:tiny-vlm"


def cache_root() -> Path:
    """Where dapo caches built and converted models: ``$DAPO_CACHE`` or ``~/.cache/dapo``."""
    return Path(os.environ.get("DAPO_CACHE", Path.home() / ".cache" / "dapo"))
