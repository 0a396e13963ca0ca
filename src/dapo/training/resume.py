"""What a resumed run must agree on with the checkpoint it continues.

A checkpoint holds the run's resolved config. Resuming with another model (or tokenizer, or
LoRA layout) would load weights of other shapes or meaning: refused in one line naming both.
Any other changed key is allowed (more steps, a lower learning rate, another preset) and
listed in a warning, so that a silently different run is not mistaken for a continuation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapo.errors import TrainingError

# The keys that fix what the checkpointed weights are: changing one cannot resume.
SAME_MODEL = (
    "model.name_or_path",
    "model.tokenizer",
    "model.lora.rank",
    "model.lora.target_modules",
)
# Keys whose change is the act of resuming itself, not a different run.
IGNORED = ("resume",)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key that differs (sorted by key)."""
    a, b = flatten(saved), flatten(current)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and k not in IGNORED
    ]


def check_resume(
    saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path
) -> str | None:
    """Raise :class:`TrainingError` when ``checkpoint`` (whose run config is ``saved``) was
    written for another model; else the warning that lists the other changed keys (None:
    nothing changed, or a checkpoint without a config)."""
    if saved is None:
        return None
    changes = config_changes(saved, current)
    model = [(k, old, new) for k, old, new in changes if k in SAME_MODEL]
    if model:
        what = "; ".join(f"{k} {old!r} there, {new!r} now" for k, old, new in model)
        raise TrainingError(
            f"cannot resume from {checkpoint}: it was written for another model ({what}). "
            "Resume with the same model, or choose a new output_dir to start a new run."
        )
    if not changes:
        return None
    listed = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)
    n = len(changes)
    return f"resuming with {n} changed key{'s' if n != 1 else ''}: {listed}"
