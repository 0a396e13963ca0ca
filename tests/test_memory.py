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


def test_the_tightest_limit_of_the_group_its_ancestors_or_the_containers_mount_counts(tmp_path):
    """A limit on a parent group (a systemd slice, a Kubernetes pod) bounds its children; a
    Docker container on cgroup v1 names ``/docker/<id>`` but sees its own group at the mount's
    root."""
    mount = tmp_path / "memory"
    mount.mkdir()
    (mount / "memory.limit_in_bytes").write_text(str(4 * 2**30))
    (mount / "memory.usage_in_bytes").write_text(str(2**30))
    assert cgroup_headroom("12:memory:/docker/0123abcd\n", tmp_path) == (3 * 2**30, 4 * 2**30)

    pod, job = tmp_path / "pod", tmp_path / "pod" / "job"
    job.mkdir(parents=True)
    (pod / "memory.max").write_text(str(2 * 2**30))
    (pod / "memory.current").write_text(str(2**30 + 5))
    (job / "memory.max").write_text("max\n")
    (job / "memory.current").write_text("5")
    assert cgroup_headroom("0::/pod/job\n", tmp_path) == (2**30 - 5, 2 * 2**30)
