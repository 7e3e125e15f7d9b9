"""The host memory the in-memory checkpoints of a job take on a node: one formula, used by the
supervisor's memory preflight on the real nodes (orchestrator/supervisor/memory_check.py) and
mirrored by the Helm chart's sizing of /dev/shm (helm/stalwart/templates/_groups.tpl; a test
renders the chart and compares the two).

Per rank, a node keeps versions of its state in its snapshot ring (/dev/shm): the two newest
commits (a restore that finds one copy damaged falls back on the older), each rank's newest
three shards (ranks store a step at slightly different times; the next commit is made of
them) and the one being written. The commits are usually among the newest three; they are
apart when commits lag, and the ring is sized for that. The copies of peers' shards (in the
agents' memory, checkpoint.replicas - 1 of each shard) are kept on the same rule.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

COMMITS_KEPT = 2  # the newest commits every node keeps (ckpt/commit.py CommitTracker)
NEWEST_KEPT = 3  # each rank's newest shards a node keeps beyond the commits
IN_FLIGHT = 1  # the snapshot being written
VERSIONS = COMMITS_KEPT + NEWEST_KEPT + IN_FLIGHT  # the slots of a rank's snapshot ring
# Under a tight checkpoint.memory_budget: the newest commit and the one being written, of
# the own shards and of each copy (the lean rule: docs/checkpoints.md, "Host memory").
LEAN_VERSIONS = 2

GIB = 1 << 30
_UNITS = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
}
# A memory quantity as Kubernetes writes it; also the chart's values schema's pattern.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E)?$"


def parse_quantity(value: int | float | str, where: str = "") -> int:
    """A memory quantity as Kubernetes writes it ("12Gi", "512M", 1073741824) in bytes,
    rounded up as the chart rounds it. Raises ValueError (naming `where`, if given)."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    m = re.match(QUANTITY_PATTERN, text)
    if m is None:
        what = f"{value!r} is not a memory quantity (e.g. 16Gi, 512Mi, bytes)"
        raise ValueError(f"{where}: {what}" if where else what)
    unit = m.group(2) or ""
    return math.ceil(float(text[: len(text) - len(unit)]) * _UNITS[unit])


@dataclass(frozen=True)
class NodeNeed:
    """What one node needs for its ranks' in-memory checkpoints, in bytes."""

    ranks: int
    state_bytes: int
    replicas: int
    versions: int = VERSIONS

    @property
    def own(self) -> int:
        """The node's own ranks' shards: their snapshot rings, in /dev/shm."""
        return self.ranks * self.state_bytes * self.versions

    @property
    def copies(self) -> int:
        """Copies of peers' shards it keeps (as many ranks' as its own, replicas - 1 times),
        in its agent's memory."""
        return self.own * (self.replicas - 1)

    @property
    def total(self) -> int:
        return self.own + self.copies

    def sum_text(self, state_field: str) -> str:
        """The sum as the chart's error gives it."""
        return (
            f"{self.ranks} ranks x {_gib_text(self.state_bytes)} ({state_field}) x "
            f"{self.versions} versions = {self.own / GIB:.1f} GiB of own shards, "
            f"{self.copies / GIB:.1f} GiB of copies of peers' shards "
            f"(checkpoint.replicas {self.replicas})"
        )


def versions_for(budget: int | None, replicas: int) -> int:
    """The versions of each rank's state a node keeps, of its own and of each copy, under
    checkpoint.memory_budget `budget` (None: no budget)."""
    if budget is None or budget >= VERSIONS * replicas:
        return VERSIONS
    return LEAN_VERSIONS


def is_lean(budget: int | None, replicas: int) -> bool:
    """Does checkpoint.memory_budget `budget` take the lean rule (2 versions of each)?"""
    return versions_for(budget, replicas) == LEAN_VERSIONS


def commits_kept(versions: int) -> int:
    return COMMITS_KEPT if versions == VERSIONS else 1


def _gib_text(nbytes: int) -> str:
    return f"{nbytes / GIB:.4g}Gi" if nbytes % GIB else f"{nbytes // GIB}Gi"


def judge(need: NodeNeed, mem_available: int | None, shm_free: int | None) -> str | None:
    """Why a node with `mem_available` bytes of memory (MemAvailable) and `shm_free` bytes
    free in the shared-memory folder cannot hold `need`; None: it can (a figure not known
    is not judged). The own shards live in /dev/shm and count against the memory too."""
    problems = []
    if shm_free is not None and need.own > shm_free:
        problems.append(f"its /dev/shm has {shm_free / GIB:.1f} GiB free for the own shards")
    if mem_available is not None and need.total > mem_available:
        problems.append(f"it has {mem_available / GIB:.1f} GiB of memory available")
    if not problems:
        return None
    return f"{need.sum_text('checkpoint.state_size_per_rank')}: {need.total / GIB:.1f} GiB, " + (
        " and ".join(problems)
    )


def mem_available(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """The memory this process's machine can still give it, in bytes: MemAvailable, or less
    where its memory cgroup (a Kubernetes pod's limit) leaves less; None where neither says.
    In a container /proc/meminfo is the host's: the pod's limit is what counts."""
    found = [v for v in (_meminfo_available(meminfo), cgroup_room(cgroup)) if v is not None]
    return min(found) if found else None


def _meminfo_available(meminfo: str) -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


def own_cgroups(controller: str, self_cgroup: str = "/proc/self/cgroup") -> tuple[str, str]:
    """This process's cgroup paths: (its cgroup v2 path, its v1 path for `controller`),
    each "" where /proc/self/cgroup names none."""
    v2, v1 = "", ""
    try:
        with open(self_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path
                elif controller in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def cgroup_room(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """What this process's memory cgroup allows beyond its use (the limit, less the usage
    that cannot be reclaimed: the inactive page cache is left out); None without a limit.
    cgroup v2 (memory.max) or v1 (memory/memory.limit_in_bytes), at the process's own
    cgroup (/proc/self/cgroup) or, in a container's namespace, the root."""
    v2, v1 = own_cgroups("memory", self_cgroup)
    v2_files = ("memory.max", "memory.current", "inactive_file")
    v1_root = os.path.join(root, "memory")
    v1_files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    candidates = [
        (os.path.join(base, path.lstrip("/")), *files)
        for base, own, files in ((root, v2, v2_files), (v1_root, v1, v1_files))
        for path in (own, "/")  # its own cgroup, then the namespace's root
    ]
    for folder, limit_file, usage_file, inactive_key in candidates:
        try:
            with open(os.path.join(folder, limit_file)) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= NO_LIMIT:
                continue
            with open(os.path.join(folder, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        inactive = 0
        try:
            with open(os.path.join(folder, "memory.stat")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(raw) - (usage - inactive))
    return None


def free_bytes(path: str) -> int | None:
    """Free bytes of the file system `path` is on (or would be on: its nearest existing
    folder); None when none can be read."""
    p = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            if p == os.path.dirname(p):
                return None
            p = os.path.dirname(p)
