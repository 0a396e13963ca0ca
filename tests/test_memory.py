"""Tests for ``dapo.memory``: the memory a device has for a new allocation."""

from __future__ import annotations

import torch

from dapo.memory import cgroup_headroom, device_memory, meminfo


def test_meminfo_reads_kilobytes_as_bytes():
    text = "MemTotal:       24576000 kB\nMemAvailable:   1000 kB\nHugePages_Total:       0\n"
    assert meminfo(text) == {
        "MemTotal": 24_576_000 * 1024,
        "MemAvailable": 1_024_000,
        "HugePages_Total": 0,
    }


def test_a_cgroup_limit_bounds_the_headroom_v2_and_v1(tmp_path):
    """The limit less the usage, the inactive file cache counted free; no limit: None."""
    v2 = tmp_path / "job"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")  # 8 GiB
    (v2 / "memory.current").write_text("3221225472\n")  # 3 GiB
    (v2 / "memory.stat").write_text("anon 1\ninactive_file 1073741824\nactive_file 5\n")
    assert cgroup_headroom("0::/job\n", tmp_path) == (6 * 2**30, 8 * 2**30)
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom("0::/job\n", tmp_path) is None

    v1 = tmp_path / "memory" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(4 * 2**30))
    (v1 / "memory.usage_in_bytes").write_text(str(2**30))
    (v1 / "memory.stat").write_text("inactive_file 7\ntotal_inactive_file 512\n")
    text = "4:memory:/box\n1:cpu,cpuacct:/box\n0::/\n"
    assert cgroup_headroom(text, tmp_path) == (3 * 2**30 + 512, 4 * 2**30)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's "no limit"
    assert cgroup_headroom(text, tmp_path) is None


def test_this_cpu_reports_available_memory_within_its_total():
    memory = device_memory(torch.device("cpu"))
    assert memory is not None and 0 < memory.available <= memory.total
    assert device_memory(torch.device("meta")) is None
