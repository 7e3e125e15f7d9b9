"""orchestrator/agent/host.py: the cores a node's processes may use (affinity, less where a
cgroup's CPU quota grants less: a pod's limit) and which machine a node is on."""

from __future__ import annotations

import os

import pytest

from stalwart.orchestrator.agent.host import cgroup_cpus, host_key, usable_cores

pytestmark = pytest.mark.timeout(30)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_in_the_process_own_cgroup_or_the_root(tmp_path):
    self_cgroup = tmp_path / "self"
    _write(self_cgroup, "0::/kubepods/pod1\n")
    _write(tmp_path / "fs" / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    assert cgroup_cpus(str(tmp_path / "fs"), str(self_cgroup)) == 1.5
    _write(tmp_path / "fs" / "kubepods" / "pod1" / "cpu.max", "max 100000\n")
    assert cgroup_cpus(str(tmp_path / "fs"), str(self_cgroup)) is None
    _write(tmp_path / "fs" / "cpu.max", "400000 100000\n")  # a container's namespace root
    assert cgroup_cpus(str(tmp_path / "fs"), str(self_cgroup)) == 4.0


def test_a_cgroup_v1_quota_and_no_limit(tmp_path):
    self_cgroup = tmp_path / "self"
    _write(self_cgroup, "4:cpu,cpuacct:/docker/abc\n")
    folder = tmp_path / "fs" / "cpu" / "docker" / "abc"
    _write(folder / "cpu.cfs_quota_us", "200000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpus(str(tmp_path / "fs"), str(self_cgroup)) == 2.0
    _write(folder / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpus(str(tmp_path / "fs"), str(self_cgroup)) is None
    assert cgroup_cpus(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_usable_cores_is_the_affinity_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(str(tmp_path / "none"), str(tmp_path / "missing")) == affinity
    self_cgroup = tmp_path / "self"
    _write(self_cgroup, "0::/\n")
    _write(tmp_path / "fs" / "cpu.max", "50000 100000\n")
    assert usable_cores(str(tmp_path / "fs"), str(self_cgroup)) == min(affinity, 0.5)


def test_the_host_key_is_stable_and_follows_the_boot_id(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("1111\n")
    assert host_key(str(boot)) == host_key(str(boot)) and len(host_key(str(boot))) == 12
    first = host_key(str(boot))
    boot.write_text("2222\n")
    assert host_key(str(boot)) != first
