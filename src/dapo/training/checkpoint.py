"""Atomic checkpoints: a checkpoint directory either exists whole or not at all.

Each checkpoint is written into a temporary directory beside its final place, fsync-ed,
then renamed into ``checkpoints/step_NNNNNN`` in one ``os.replace``. A crash at any moment
leaves the previous checkpoints untouched and at most a stray ``.tmp-*`` directory, which
the next save removes. Old checkpoints are pruned by renaming them out of the
``step_*`` namespace first, so a crash while deleting never leaves a partial ``step_*``.
If writing fails (a full disk, lost permissions), the temporary directory is removed and
:class:`CheckpointError` says where and what to do; earlier checkpoints stay intact.

Two formats, each of which resumes a run of any kind (one process, DDP, FSDP at any world
size):

- one process and DDP: ``model.safetensors`` and ``optimizer.pt``, whole tensors in the
  format of ``model.state_dict()`` and ``optimizer.state_dict()``, written by rank 0;
- FSDP: ``model_optim/``, a ``torch.distributed.checkpoint`` directory into which every rank
  writes its own shards of the model and optimizer state (nothing is gathered; the output
  directory must be shared by all ranks). It loads into a sharded model of any world size
  (DCP reshards) and into a plain model in a single process.

``trainer_state.pt`` (step, data position, RNG, carry-over) is written by rank 0 in both.
A model with frozen parameters (LoRA) checkpoints its trainable ones only, in either format:
the adapters, their optimizer state and the trainer state; the frozen base comes from the
model path.

Last, inside the temporary directory, rank 0 writes the manifest (:mod:`.manifest`): every
file's size and checksum (all ranks' shards of an FSDP checkpoint). Resuming checks it
before loading anything and falls back to the newest intact checkpoint
(:func:`latest_intact_checkpoint`).
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dapo.atomic import as_new_file, fsync_dir
from dapo.errors import CheckpointError, CheckpointWarning
from dapo.parallel.distributed import all_gather_objects, all_reduce_sum, current
from dapo.parallel.sharding import (
    full_model_state,
    full_optimizer_state,
    is_fsdp,
    load_full_model_state,
    load_full_optimizer_state,
)
from dapo.training.manifest import MANIFEST, verify_manifest, write_manifest

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
# A finished checkpoint moved aside while the same step is re-saved: it is restored if the
# process died before the new one took its place.
_OLD_DIR = re.compile(r"^\.tmp-old-(step_\d{6,})-\d+$")
_FILES = ("model.safetensors", "optimizer.pt", "trainer_state.pt")
_SHARDED = "model_optim"  # the torch.distributed.checkpoint directory of an FSDP checkpoint
_SHARDED_FILES = (f"{_SHARDED}/.metadata", "trainer_state.pt")


def _fsync_tree(path: Path) -> None:
    for entry in path.iterdir():
        if entry.is_dir():
            _fsync_tree(entry)
        elif entry.is_file():
            with open(entry, "rb") as fh:
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
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's
        return local.numel() * local.element_size()
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
        f"({type(exc).__name__}: {exc}). {fix}. Nothing partial was left behind"
        + (
            " and earlier checkpoints are intact: continue with resume=true from the last "
            "complete one."
            if latest_checkpoint(root) is not None
            else "; no checkpoint was saved before it: rerun to start again."
        )
    )


@dataclass
class FullState:
    """A model's and its optimizer's full (unsharded) state dicts, as a checkpoint holds them."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """The state to checkpoint. For an FSDP model every rank must call this (it gathers the
    shards); rank 0 gets the state, the others empty dicts."""
    return FullState(
        _trainable_only(model, full_model_state(model)), full_optimizer_state(model, optimizer)
    )


def trainable_names(model: torch.nn.Module) -> set[str] | None:
    """The names a checkpoint holds when ``model`` has frozen parameters (LoRA): its trainable
    parameters; None when everything trains (the whole state dict is checkpointed)."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return None
    return {n for n, p in params if p.requires_grad}


def _trainable_only(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the frozen parameters when ``model`` has some (LoRA), the tied
    output layer (a second name of the frozen embedding) included."""
    names = trainable_names(model)
    return state if names is None else {k: v for k, v in state.items() if k in names}


def _dcp_options(model: torch.nn.Module) -> Any:
    """``StateDictOptions`` of the sharded format: frozen parameters (LoRA's base) left out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = trainable_names(model) is not None
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write ``root/step_{step}`` atomically and prune all but the newest ``keep_last``.

    Under data parallelism every rank calls this. An FSDP model is saved sharded: each rank
    writes its shards (:func:`_save_sharded`). Otherwise rank 0 writes the whole state and the
    other ranks return at once.

    Raises :class:`CheckpointError` (caused by the underlying error) when the checkpoint
    cannot be written, e.g. on a full disk: the temporary directory is removed first, so
    earlier checkpoints are untouched and no partial checkpoint is left.
    """
    root = Path(root)
    if is_fsdp(model) and current().enabled:
        return _save_sharded(root, step, model, optimizer, state, keep_last)
    if not current().is_main:
        return step_dir(root, step)
    full = full_state(model, optimizer)
    weights = _untie({k: v.detach().contiguous().cpu() for k, v in full.weights.items()})
    need = _tensor_bytes(weights) + _tensor_bytes(full.optimizer["state"]) + 2**20

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "model.safetensors"))
        as_new_file(tmp / "model.safetensors")  # safetensors writes 0600, the rest 0644
        torch.save(full.optimizer, tmp / "optimizer.pt")
        torch.save(state, tmp / "trainer_state.pt")

    tmp = _start(root, step, os.getpid())
    try:
        write(tmp)
        _finish(root, step, tmp, keep_last)
    except BaseException as exc:
        error = _failed(root, step, tmp, exc, need)
        if error is exc:
            raise
        raise error from exc
    return step_dir(root, step)


def _start(root: Path, step: int, pid: int) -> Path:
    """Put back checkpoints an interrupted re-save moved aside, drop stray temporary
    directories; the new (empty) temporary directory."""
    tmp = root / f".tmp-{step_dir(root, step).name}-{pid}"
    root.mkdir(parents=True, exist_ok=True)
    _recover(root)
    for stray in root.glob(".tmp-*"):
        shutil.rmtree(stray, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _finish(root: Path, step: int, tmp: Path, keep_last: int) -> None:
    """fsync the written checkpoint, add its manifest, rename it into place, prune old ones."""
    final = step_dir(root, step)
    _fsync_tree(tmp)
    write_manifest(tmp)  # last: a checkpoint with a manifest is complete
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it
        old = root / f".tmp-old-{final.name}-{os.getpid()}"
        os.replace(final, old)  # a crash from here to the next line: _recover restores it
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root, strict=True)
    for old_ckpt in list_checkpoints(root)[:-keep_last]:
        _remove(old_ckpt)


def _failed(root: Path, step: int, tmp: Path, exc: BaseException, need: int) -> BaseException:
    """Remove the temporary directory; the error to raise for ``exc``."""
    shutil.rmtree(tmp, ignore_errors=True)
    error = _write_error(root, step, _cause(exc), need) if isinstance(exc, Exception) else None
    return exc if error is None else error


def _cause(exc: BaseException) -> BaseException:
    """The I/O error inside a ``torch.distributed.checkpoint`` failure (which wraps each
    rank's exception), or ``exc`` itself."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return exc


def _save_sharded(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Every rank writes its shards of the model and optimizer state with
    ``torch.distributed.checkpoint`` into the temporary directory; rank 0 adds the trainer
    state and renames it into place once all have written. The ranks agree on failure."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    main = current().is_main
    pid = all_gather_objects(os.getpid())[0]  # one temporary name, rank 0's
    tmp = root / f".tmp-{step_dir(root, step).name}-{pid}"
    # local shards, no gather
    model_state, optim_state = get_state_dict(model, optimizer, options=_dcp_options(model))
    model_state = _trainable_only(model, model_state)
    need = (_tensor_bytes(model_state) + _tensor_bytes(optim_state)) * current().world_size + 2**20
    failure: Exception | None = None

    def stage(fn: Any, everywhere: bool = False) -> None:
        nonlocal failure
        if failure is None and (main or everywhere):
            try:
                fn()
            except Exception as exc:
                failure = exc
        (failed,) = all_reduce_sum([float(failure is not None)])  # all ranks stop together
        if failed and main:
            error = _failed(root, step, tmp, failure, need)
            raise error from (None if error is failure else failure)
        if failed:
            raise CheckpointError(
                f"the checkpoint of step {step} in {root} could not be written (rank 0 says "
                "why); earlier checkpoints are intact"
            ) from failure

    stage(lambda: _start(root, step, pid))
    stage(
        lambda: dcp.save(
            {"model": model_state, "optim": optim_state}, checkpoint_id=tmp / _SHARDED
        ),
        everywhere=True,
    )
    stage(
        lambda: (torch.save(state, tmp / "trainer_state.pt"), _finish(root, step, tmp, keep_last))
    )
    return step_dir(root, step)


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


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def latest_intact_checkpoint(root: str | Path, warn: Callable[[str], None] = _warn) -> Path | None:
    """The newest checkpoint under ``root`` whose files match its manifest (None: there is
    no checkpoint). Newer damaged ones are skipped, said in one ``warn`` line; one without a
    manifest (an older release's) is taken as it is, with a notice. Reads every file of the
    checkpoints it checks; changes nothing.

    Raises :class:`CheckpointError` naming the damaged files when no checkpoint is intact:
    starting afresh is the user's decision, not a fallback."""
    root = Path(root)
    damaged: list[str] = []
    for path in reversed(list_checkpoints(root)):
        problems = verify_manifest(path)
        if problems:
            damaged.append(f"{path} is damaged ({'; '.join(problems)})")
            continue
        if damaged:
            warn(
                f"{', '.join(damaged)}; resuming from {path}, the newest intact checkpoint "
                "(nothing was deleted)"
            )
        if problems is None:
            warn(
                f"{path} has no {MANIFEST} (written by an older dapo): its files cannot be "
                "verified; loading it as it is"
            )
        return path
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint to resume from in {root}: {', '.join(damaged)}. Restore the "
            f"damaged files (e.g. from a backup), or delete {root} to start the run again; "
            "nothing was deleted."
        )
    return None


def checkpoint_to_resume(root: str | Path, warn: Callable[[str], None] = _warn) -> Path | None:
    """:func:`latest_intact_checkpoint`, checked by rank 0 alone and the same on every rank
    (every rank calls this); rank 0 warns, and every rank raises its error."""
    found: str | None = None
    failure: Exception | None = None
    if current().is_main:
        try:
            path = latest_intact_checkpoint(root, warn)
            found = None if path is None else str(path)
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised below
            failure = exc
    why = None if failure is None else str(failure)
    if failure is not None and not isinstance(failure, CheckpointError):
        why = f"rank 0 could not choose a checkpoint: {type(failure).__name__}: {failure}"
    found, why = all_gather_objects((found, why))[0]
    if failure is not None:
        raise failure
    if why is not None:
        raise CheckpointError(why)
    return None if found is None else Path(found)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Restore model (and optimizer) in place; return the trainer state.

    Raises :class:`CheckpointError` naming the file when the checkpoint is incomplete or
    unreadable, or does not match the model.
    """
    path = Path(path)
    sharded = (path / _SHARDED).is_dir()
    missing_files = [f for f in (_SHARDED_FILES if sharded else _FILES) if not (path / f).is_file()]
    if missing_files:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {', '.join(missing_files)} missing. dapo never "
            "writes partial checkpoints, so it was changed by hand or the disk lost data; "
            "delete the directory to resume from the previous checkpoint."
        )
    # The optimizer state carries the kernel flags of the optimizer that wrote it (before
    # dapo used the fused AdamW: none); they say how to compute, not what, so keep this one's.
    kernels = (
        []
        if optimizer is None
        else [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    )
    if sharded:
        _load_sharded(path, model, optimizer)
    else:
        _load_whole(path, model, optimizer)
    if optimizer is not None:
        for group, flags in zip(optimizer.param_groups, kernels, strict=True):
            group.update(flags)
    return read_trainer_state(path)


# Modules whose classes older releases pickled into trainer_state.pt, and where they are now.
MOVED_MODULES = {"dapo.training.dynamic_sampling": "dapo.handover"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


# What torch.load needs of a pickle module: its Unpickler (and load, for the legacy format).
_PICKLE = types.SimpleNamespace(
    __name__="pickle", Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load()
)


def load_state_file(path: str | Path) -> Any:
    """A ``trainer_state.pt`` (or other pickle) dapo wrote, also one of an older release whose
    classes have moved since (:data:`MOVED_MODULES`)."""
    return torch.load(path, weights_only=False, pickle_module=_PICKLE)


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of the checkpoint ``path`` (plain data: step, data position, RNG,
    carry-over, the run's resolved config), without touching model or optimizer."""
    return _read(Path(path) / "trainer_state.pt", load_state_file)


def _load_whole(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """model.safetensors and optimizer.pt into ``model`` (sharded or not) and ``optimizer``."""
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
            f"unexpected {unexpected[:5]}; was it written for another model.name_or_path or "
            "model.lora setting?"
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


def _load_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A ``torch.distributed.checkpoint`` directory into ``model`` and ``optimizer``: FSDP
    shards of any world size (every rank calls this; DCP reads the pieces each rank needs)
    or a plain model, in one process without a process group too."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _dcp_options(model)
    target = {"model": _trainable_only(model, get_model_state_dict(model, options=options))}
    if optimizer is not None:  # creates AdamW's state (a zero-lr step) for DCP to fill
        target["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    try:
        with warnings.catch_warnings():  # "assuming ... single process": yes, on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(target, checkpoint_id=path / _SHARDED, no_dist=not dist.is_initialized())
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path}: could not load {path / _SHARDED} into this model "
            f"({type(exc).__name__}: {str(exc)[:300]}); was it written for another "
            "model.name_or_path or model.lora setting? If a file is damaged, delete the directory to resume from "
            "the previous checkpoint."
        ) from exc
    set_model_state_dict(model, target["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, target["optim"], options=options)


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
