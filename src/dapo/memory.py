"""How much memory a device has for a new allocation: what the generation cache is sized by.

On CUDA: the driver's free memory plus what PyTorch's caching allocator holds unused. On a
CPU: the kernel's ``MemAvailable``, within the memory limit of the process's cgroup (a
container's ``--memory``), where one is set; a container sees its host's ``/proc/meminfo``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2**63


class Memory(NamedTuple):
    """Bytes a new allocation can take (``available``) of the device's ``total``."""

    available: int
    total: int


def device_memory(device: torch.device) -> Memory | None:
    """The memory of ``device`` (None where it cannot be read)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return Memory(free + unused, total)
    if device.type != "cpu":
        return None
    try:
        info = meminfo(Path("/proc/meminfo").read_text())
        available, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = cgroup_headroom(Path("/proc/self/cgroup").read_text(), Path("/sys/fs/cgroup"))
    except (OSError, ValueError):
        limit = None
    if limit is not None:
        return Memory(min(available, limit[0]), min(total, limit[1]))
    return Memory(available, total)


def meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes by field."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_headroom(proc_cgroup: str, root: Path) -> tuple[int, int] | None:
    """``(headroom, limit)`` in bytes of the tightest memory limit on this process's cgroup
    (named in ``proc_cgroup``, the text of ``/proc/self/cgroup``, under ``root``) and its
    ancestors, or None without a limit: the limit less what the group uses, its inactive file
    cache (which the kernel reclaims first) counted free. cgroup v2 (``memory.max``) and v1
    (``memory.limit_in_bytes``). A container whose own group is mounted at the root (Docker
    on cgroup v1 names ``/docker/<id>``, which its mount does not show) is read there."""
    best: tuple[int, int] | None = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, names = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = root / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the group, its ancestors, the mount's root
            found = _limit(base.joinpath(*parts[:depth]), names)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
    return best


def _limit(group: Path, names: tuple[str, str, str]) -> tuple[int, int] | None:
    if not (group / names[0]).exists():
        return None
    raw = (group / names[0]).read_text().strip()
    if raw == "max" or int(raw) >= _UNLIMITED:
        return None
    limit, used = int(raw), int((group / names[1]).read_text())
    stat = (group / "memory.stat").read_text() if (group / "memory.stat").exists() else ""
    inactive = next(
        (int(v) for k, v in (ln.split() for ln in stat.splitlines() if ln) if k == names[2]), 0
    )
    return max(0, limit - used + inactive), limit
