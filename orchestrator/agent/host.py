"""The machine a node runs on: which one (several Ray nodes of a local cluster share one),
and how many cores its processes may use. The supervisor's standby choice reads them from
each node's agent (NodeAgent.memory): a standby's start costs ~3 s of CPU (torch, the train
loop, DDP's warm-up), which a machine whose cores the ranks already fill takes from training.
"""

from __future__ import annotations

import hashlib
import os
import socket

from stalwart.ckpt.footprint import own_cgroups


def usable_cores(cgroup: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float:
    """The cores this process may run on: its CPU affinity, or less where its CPU cgroup (a
    Kubernetes pod's limit) grants less time (cgroup v2 cpu.max, v1 cfs_quota_us)."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    quota = cgroup_cpus(cgroup, self_cgroup)
    return min(cores, quota) if quota is not None else cores


def cgroup_cpus(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> float | None:
    """The CPUs this process's cgroup grants (quota / period); None without a limit. Its own
    cgroup, then the namespace's root (a container's)."""
    v2, v1 = own_cgroups("cpu", self_cgroup)
    for path in (v2, "/"):
        try:
            with open(os.path.join(root, path.lstrip("/"), "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            if quota != "max" and int(period) > 0:
                return int(quota) / int(period)
        except (OSError, ValueError):
            continue
    for path in (v1, "/"):
        folder = os.path.join(root, "cpu", path.lstrip("/"))
        try:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota_us = int(f.read().strip())
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period_us = int(f.read().strip())
            if quota_us > 0 and period_us > 0:
                return quota_us / period_us
        except (OSError, ValueError):
            continue
    return None


def host_key(boot_id: str = "/proc/sys/kernel/random/boot_id") -> str:
    """The same for every Ray node on one machine and in one container (the nodes of a local
    multi-node cluster, network namespaces included), different for two pods on one machine
    (their host names differ) and for two machines (their boot ids differ)."""
    try:
        with open(boot_id) as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{socket.gethostname()}\n{boot}".encode()).hexdigest()[:12]
