"""Atomic checkpoints: a checkpoint directory either exists whole or not at all.

Each checkpoint is written into a temporary directory beside its final place, fsync-ed,
then renamed into ``checkpoints/step_NNNNNN`` in one ``os.replace``. A crash at any moment
leaves the previous checkpoints untouched and at most a stray ``.tmp-*`` directory, which
the next save removes.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write ``root/step_{step}`` atomically and prune all but the newest ``keep_last``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stray in root.glob(".tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(_untie(weights), str(tmp / "model.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(state, tmp / "trainer_state.pt")
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it
        old = root / f".tmp-old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    for old_ckpt in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old_ckpt, ignore_errors=True)
    return final


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): store copies."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in weights.items():
        ptr = tensor.data_ptr()
        out[name] = tensor.clone() if ptr in seen else tensor
        seen.setdefault(ptr, name)
    return out


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return the trainer state."""
    path = Path(path)
    weights = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not _is_tied(model, m)]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; was it written for another model.name_or_path?"
        )
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    return torch.load(path / "trainer_state.pt", weights_only=False)


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name.endswith("lm_head.weight")
