"""What verified checkpoints cost: checksum speeds, and the time to write and to check the
manifest of the builtin tiny model's checkpoint and of a synthetic one of about 500 MB.

1. Candidate checksums over a file in the page cache, read in 8 MiB chunks as
   ``dapo.training.manifest`` reads it (best of 3): zlib's CRC-32 and Adler-32, hashlib's
   SHA-256, SHA-1, MD5, BLAKE2b.
2. For each checkpoint (``save_checkpoint`` of a model after one AdamW step): the seconds
   ``write_manifest`` adds to a save, ``verify_manifest`` with the files in the page cache
   (just written, as on a resume soon after) and after evicting them from it
   (``posix_fadvise(DONTNEED)`` on the checkpoint's own files: read from the disk, as on a
   resume days later), and ``load_checkpoint`` for comparison.

    python benchmarks/measure_checkpoint_integrity.py           # 512 MiB, ~500 MB checkpoint
    python benchmarks/measure_checkpoint_integrity.py --mb 16   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapo.training.checkpoint import load_checkpoint, save_checkpoint
from dapo.training.manifest import MANIFEST, verify_manifest, write_manifest

CHUNK = 8 * 2**20


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _best(fn: Callable[[], Any], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def checksum_speeds(path: Path) -> dict[str, float]:
    """MiB/s of each candidate over ``path`` (in the page cache)."""

    def run(update: Callable[[memoryview], None]) -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                update(view[:n])

    def rolling(fn: Callable[[memoryview, int], int], start: int) -> Callable[[], None]:
        def go() -> None:
            state = start

            def update(b: memoryview) -> None:
                nonlocal state
                state = fn(b, state)

            run(update)

        return go

    def hashed(name: str) -> Callable[[], None]:
        return lambda: run(hashlib.new(name).update)

    mib = path.stat().st_size / 2**20
    candidates = {
        "read only": lambda: run(lambda b: None),
        "zlib.crc32": rolling(zlib.crc32, 0),
        "zlib.adler32": rolling(zlib.adler32, 1),
        **{name: hashed(name) for name in ("sha256", "sha1", "md5", "blake2b")},
    }
    run(lambda b: None)  # into the page cache
    return {name: round(mib / _best(fn)) for name, fn in candidates.items()}


def _evict(directory: Path) -> None:
    """Drop ``directory``'s (clean, fsynced) files from the page cache."""
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def checkpoint_costs(model: torch.nn.Module, root: Path) -> dict[str, float]:
    """Seconds to write, check (cached and from disk) and load a checkpoint of ``model``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    path = save_checkpoint(root, 1, model, opt, {"step": 1})
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    (path / MANIFEST).unlink()
    write = _best(lambda: write_manifest(path))
    assert verify_manifest(path) == []
    cached = _best(lambda: verify_manifest(path))
    disk = []
    for _ in range(3):
        _evict(path)
        t = time.perf_counter()
        verify_manifest(path)
        disk.append(time.perf_counter() - t)
    load = _best(lambda: load_checkpoint(path, model, opt), repeat=2)
    return {
        "MB": round(size / 1e6, 1),
        "write_manifest_s": round(write, 3),
        "verify_cached_s": round(cached, 3),
        "verify_from_disk_s": round(min(disk), 3),
        "load_checkpoint_s": round(load, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--mb", type=int, default=512, help="MiB hashed; the synthetic checkpoint's size"
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    blob = work / "blob.bin"
    with open(blob, "wb") as fh:
        for _ in range(args.mb):
            fh.write(os.urandom(2**20))
    report: dict[str, Any] = {"cpu": cpu_model(), "checksum_MiB_per_s": checksum_speeds(blob)}
    blob.unlink()
    from dapo.models.tiny import build_model, build_tokenizer

    report["builtin:tiny"] = checkpoint_costs(
        build_model(len(build_tokenizer()), seed=0), work / "tiny"
    )
    # Weights + AdamW's two moments: 12 bytes a parameter, 2048 x 2048 matrices.
    layers = max(1, round(args.mb * 2**20 / (12 * 2048 * 2048)))
    synthetic = torch.nn.Sequential(
        *[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)]
    )
    report["synthetic"] = checkpoint_costs(synthetic, work / "synthetic")
    for key, value in report.items():
        print(f"{key}: {value}")
    return report


if __name__ == "__main__":
    main()
