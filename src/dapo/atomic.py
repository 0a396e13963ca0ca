"""Atomic file writes: a reader sees the old file or the new one, never a torn one; appends
to a log land whole or not at all; a failed write says which file, how much room is left
and what to do."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from dapo.errors import OutputWriteError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# The errors of a write that failed for want of room or of a working file system.
WRITE_FAILURES = (*_NO_SPACE, errno.EIO, errno.EROFS)


def fsync_dir(path: Path, *, strict: bool = False) -> None:
    """fsync a directory so that a rename in it survives a power loss.

    Best effort unless ``strict`` (some file systems refuse to fsync a directory).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if strict:
            raise


def new_file_mode() -> int:
    """The permissions a file created here gets: 0o666 less the umask (0o644 under the
    usual umask 022)."""
    try:  # Linux says it without changing it
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def as_new_file(path: Path) -> None:
    """Give ``path`` the permissions of a newly created file (:func:`new_file_mode`), for
    writers that create theirs private: safetensors writes 0600."""
    os.chmod(path, new_file_mode())


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` atomically: temp file in the same directory, fsync, ``os.replace``.

    The file keeps its permissions when it exists, else gets those of a new file (the temp
    file's own are 0600); on any error the temp file is removed and the old file is
    untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`atomic_write` of UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary sibling of the directory ``final`` to fill, renamed to ``final``
    when the block ends without error (readers see a complete directory or none).

    If another process published ``final`` first, its copy is kept and this one dropped.
    On any error the temporary directory is removed and ``final`` is untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_error(
    path: Path,
    exc: OSError,
    left: str = "nothing half-written was left in it, and the checkpoints are as they were",
) -> OutputWriteError:
    """The error a run stops with when writing ``path`` failed: the file, the reason, the
    space left on its file system, the fix and (``left``) what the failure left behind."""
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    reason = exc.strerror or str(exc)
    if exc.errno in _NO_SPACE:
        fix = "Free disk space (or raise the quota), then continue with resume=true"
    elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = f"Make {path.parent} writable, then continue with resume=true"
    else:
        fix = f"Check the disk or file system of {path.parent}, then continue with resume=true"
    return OutputWriteError(
        f"could not write {path} ({reason}; {free} on its file system). {fix}: {left}"
    )


def append_whole(fd: int, data: bytes, path: Path) -> None:
    """Append ``data`` to ``path`` (``fd``: opened with ``O_APPEND``) whole or not at all:
    after a failed write (a full disk, an I/O error) the file is cut back to its size
    before, so that no reader or resume meets half a line; then :func:`write_error`."""
    size = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise write_error(path, exc) from exc
