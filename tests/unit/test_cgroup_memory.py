"""ckpt/footprint.py mem_available in a container: /proc/meminfo there is the host's, and a
Kubernetes pod's memory limit is its cgroup's. The memory preflight and the standbys'
decision must read the smaller. Fake /proc and /sys/fs/cgroup trees, v2 and v1."""

from __future__ import annotations

import pytest

from stalwart.ckpt.footprint import GIB, cgroup_room, mem_available

pytestmark = pytest.mark.timeout(30)

HOST = "MemTotal: 2113929216 kB\nMemAvailable: 2000000000 kB\n"  # ~1.9 TiB


def _tree(tmp_path, files: dict[str, str], own: str):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(HOST)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(own)
    return str(root), str(meminfo), str(self_cgroup)


def test_a_pod_limit_under_cgroup_v2_is_what_is_available(tmp_path):
    root, meminfo, own = _tree(
        tmp_path,
        {
            "memory.max": f"{64 * GIB}\n",
            "memory.current": f"{20 * GIB}\n",
            "memory.stat": f"anon {12 * GIB}\ninactive_file {4 * GIB}\nactive_file 0\n",
        },
        "0::/\n",
    )
    # 64 GiB limit, 20 GiB used of which 4 GiB reclaimable page cache: 48 GiB.
    assert cgroup_room(root, own) == 48 * GIB
    assert mem_available(meminfo, root) == min(2000000000 * 1024, 48 * GIB)


def test_the_processs_own_cgroup_is_read_first_under_v1(tmp_path):
    root, _, own = _tree(
        tmp_path,
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
            "memory/kubepods/pod1/memory.limit_in_bytes": f"{16 * GIB}\n",
            "memory/kubepods/pod1/memory.usage_in_bytes": f"{10 * GIB}\n",
            "memory/kubepods/pod1/memory.stat": f"total_inactive_file {GIB}\n",
        },
        "4:memory:/kubepods/pod1\n0::/\n",
    )
    assert cgroup_room(root, own) == 7 * GIB


@pytest.mark.parametrize(
    "files",
    [
        {"memory.max": "max\n", "memory.current": "5\n"},
        {"memory/memory.limit_in_bytes": "9223372036854771712\n"},
        {},
    ],
)
def test_no_limit_leaves_the_hosts_memory_available(tmp_path, files):
    root, meminfo, own = _tree(tmp_path, files, "0::/\n")
    assert cgroup_room(root, own) is None
    assert mem_available(meminfo, root) == 2000000000 * 1024


def test_usage_over_the_limit_leaves_nothing(tmp_path):
    root, _, own = _tree(
        tmp_path, {"memory.max": f"{GIB}\n", "memory.current": f"{2 * GIB}\n"}, "0::/\n"
    )
    assert cgroup_room(root, own) == 0
