"""Atomic checkpoints: a checkpoint directory either exists whole or not at all.

Each checkpoint is written into a temporary directory beside its final place, fsync-ed,
then renamed into ``checkpoints/step_NNNNNN`` in one ``os.replace``. A crash at any moment
leaves the previous checkpoints untouched and at most a stray ``.tmp-*`` directory, which
the next save removes. Old checkpoints are pruned by renaming them out of the
``step_*`` namespace first, so a crash while deleting never leaves a partial ``step_*``.
If writing fails (a full disk, lost permissions), the temporary directory is removed and
:class:`CheckpointError` says where and what to do; earlier checkpoints stay intact.

Tensors are stored whole whatever the sharding (one process, DDP or FSDP), in the format
of ``model.state_dict()`` and ``optimizer.state_dict()``, so any of them resumes any other.
A model with frozen parameters (LoRA) checkpoints its trainable ones only: the adapters,
their optimizer state and the trainer state; the frozen base comes from the model path.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dapo.atomic import fsync_dir
from dapo.errors import CheckpointError
from dapo.parallel.sharding import (
    full_model_state,
    full_optimizer_state,
    is_fsdp,
    load_full_model_state,
    load_full_optimizer_state,
)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
# A finished checkpoint moved aside while the same step is re-saved: it is restored if the
# process died before the new one took its place.
_OLD_DIR = re.compile(r"^\.tmp-old-(step_\d{6,})-\d+$")
_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.pt")


def _fsync_tree(path: Path) -> None:
    for file in path.iterdir():
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path, strict=True)


def _recover(root: Path) -> None:
    """Put back checkpoints moved aside by a re-save that a crash interrupted."""
    for entry in root.iterdir():
        m = _OLD_DIR.match(entry.name)
        if m and entry.is_dir() and not (root / m.group(1)).exists():
            os.replace(entry, root / m.group(1))


def _remove(path: Path) -> None:
    """Delete a directory so that no partial copy is ever visible under its name."""
    doomed = path.with_name(f".tmp-del-{path.name}-{os.getpid()}")
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
# How torch.save and safetensors report a failed write (they do not raise OSError).
_WRITE_FAILURE = ("os error", "inline_container", "PytorchStreamWriter", "file write failed")


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _write_error(root: Path, step: int, exc: BaseException, need: int) -> CheckpointError | None:
    """A clear error for a failed checkpoint write, or None when it was not an I/O failure."""
    code = getattr(exc, "errno", None)
    if code is None and (m := re.search(r"os error (\d+)", str(exc))):
        code = int(m.group(1))
    try:
        free: int | None = shutil.disk_usage(root).free
    except OSError:
        free = None
    low = free is not None and free < need
    io_failure = isinstance(exc, OSError) or any(s in str(exc) for s in _WRITE_FAILURE)
    if not (io_failure or low):
        return None
    mb = 2**20
    if code in _NO_SPACE or (code is None and low):
        room = ""
        if free is not None:
            room = f" (a checkpoint needs about {need / mb:.0f} MiB, {free / mb:.0f} MiB are free)"
        fix = (
            f"No space left on the file system of {root}{room}. Free disk space, or choose "
            "another output_dir with enough room, or lower checkpoint.keep_last"
        )
    elif code in _NO_PERMISSION:
        fix = f"No permission to write in {root}. Make it writable, or choose another output_dir"
    else:
        fix = (
            f"Check that {root} is a writable directory with free space, or choose another "
            "output_dir"
        )
    return CheckpointError(
        f"could not write the checkpoint of step {step} in {root} "
        f"({type(exc).__name__}: {exc}). {fix}. Nothing partial was left behind and earlier "
        "checkpoints are intact: continue with resume=true from the last complete one."
    )


@dataclass
class FullState:
    """A model's and its optimizer's full (unsharded) state dicts, as a checkpoint holds them."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """The state to checkpoint. For an FSDP model every rank must call this (it gathers the
    shards); rank 0 gets the state, the others empty dicts."""
    weights = full_model_state(model)
    names = trainable_names(model)
    if names is not None:  # LoRA: the adapters only
        weights = {k: v for k, v in weights.items() if k in names}
    return FullState(weights, full_optimizer_state(model, optimizer))


def trainable_names(model: torch.nn.Module) -> set[str] | None:
    """The names a checkpoint holds when ``model`` has frozen parameters (LoRA): its trainable
    parameters; None when everything trains (the whole state dict is checkpointed)."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return None
    return {n for n, p in params if p.requires_grad}


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int = 2,
    *,
    full: FullState | None = None,
) -> Path:
    """Write ``root/step_{step}`` atomically and prune all but the newest ``keep_last``.

    ``full`` is :func:`full_state` of ``model`` and ``optimizer`` when the caller gathered
    it already (FSDP, where all ranks gather and one writes).

    Raises :class:`CheckpointError` (caused by the underlying error) when the checkpoint
    cannot be written, e.g. on a full disk: the temporary directory is removed first, so
    earlier checkpoints are untouched and no partial checkpoint is left.
    """
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if full is None:
        full = full_state(model, optimizer)
    weights = _untie({k: v.detach().contiguous().cpu() for k, v in full.weights.items()})
    opt_state = full.optimizer
    need = _tensor_bytes(weights) + _tensor_bytes(opt_state["state"]) + 2**20
    try:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        for stray in root.glob(".tmp-*"):
            shutil.rmtree(stray, ignore_errors=True)
        tmp.mkdir()
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save(opt_state, tmp / "optimizer.pt")
        torch.save(state, tmp / "trainer_state.pt")
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            old = root / f".tmp-old-{final.name}-{os.getpid()}"
            os.replace(final, old)  # a crash from here to the next line: _recover restores it
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root, strict=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = _write_error(root, step, exc, need) if isinstance(exc, Exception) else None
        if error is None:
            raise
        raise error from exc
    for old_ckpt in list_checkpoints(root)[:-keep_last]:
        _remove(old_ckpt)
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


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of rollout step ``step`` lives under ``root``."""
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first.

    A checkpoint moved aside by an interrupted re-save (``.tmp-old-step_N-*`` with no
    ``step_N``) counts as step N; the next save renames it back.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    aside: dict[int, Path] = {}
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if m := _STEP_DIR.match(p.name):
            found[int(m.group(1))] = p
        elif m := _OLD_DIR.match(p.name):
            aside[int(m.group(1)[len("step_") :])] = p
    for step, p in aside.items():
        found.setdefault(step, p)
    return [found[s] for s in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return the trainer state.

    Raises :class:`CheckpointError` naming the file when the checkpoint is incomplete or
    unreadable, or does not match the model.
    """
    path = Path(path)
    missing_files = [f for f in _FILES if not (path / f).is_file()]
    if missing_files:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {', '.join(missing_files)} missing. dapo never "
            "writes partial checkpoints, so it was changed by hand or the disk lost data; "
            "delete the directory to resume from the previous checkpoint."
        )
    weights = _read(path / "model.safetensors", lambda p: load_file(str(p)))
    sharded = is_fsdp(model)
    names = trainable_names(model)
    if sharded or names is not None:  # FSDP: every rank holds the full tensors
        expected = set(model.state_dict()) if names is None else names
        missing = sorted(expected - set(weights))
        unexpected = sorted(set(weights) - expected)
        if not sharded and not (missing or unexpected):
            model.load_state_dict(weights, strict=False)
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not _is_tied(model, m)]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; was it written for another model.name_or_path or model.lora setting?"
        )
    if sharded:
        load_full_model_state(model, weights)
    if optimizer is not None:
        opt_state = _read(path / "optimizer.pt", lambda p: torch.load(p, weights_only=False))
        try:
            if sharded:
                load_full_optimizer_state(model, optimizer, opt_state)
            else:
                optimizer.load_state_dict(opt_state)
        except (ValueError, KeyError, IndexError) as exc:
            raise CheckpointError(
                f"checkpoint {path}: the optimizer state does not match the model's parameters "
                f"({exc}); was it written for another model or optimizer setting?"
            ) from exc
    return _read(
        path / "trainer_state.pt",
        lambda p: torch.load(p, weights_only=False, pickle_module=_legacy_pickle),
    )


class _LegacyUnpickler(pickle.Unpickler):
    """Finds classes that moved since a checkpoint was written (the dynamic-sampling
    carry-over pickles its groups), so checkpoints of earlier versions still resume."""

    MOVED = {"dapo.sampling": "dapo.training.dynamic_sampling"}

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(self.MOVED.get(module, module), name)


_legacy_pickle = types.SimpleNamespace(
    Unpickler=_LegacyUnpickler, load=pickle.load, __name__="pickle"
)


def _read(file: Path, reader: Any) -> Any:
    try:
        return reader(file)
    except Exception as exc:  # safetensors / pickle raise many kinds for a damaged file
        raise CheckpointError(
            f"could not read {file} ({type(exc).__name__}: {exc}); the file is damaged. "
            f"Delete {file.parent} to resume from the previous checkpoint."
        ) from exc


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False)) and name.endswith("lm_head.weight")
