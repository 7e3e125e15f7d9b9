"""The memory preflight: before any worker starts, each node the job's slots are on is asked
for its memory available and the free room of its shared-memory folder, and the job is
refused when a node cannot hold the in-memory checkpoints of the ranks placed on it
(ckpt/footprint.py: the same sum the Helm chart sizes /dev/shm with). Only with
checkpoint.state_size_per_rank: the state's size is not known before the first snapshot.
What the nodes answer also decides whether standbys fit (supervisor/standby.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from stalwart.ckpt.footprint import NodeNeed, judge
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.resources import SchedulingError

ASK_TIMEOUT_S = 10.0


def ask_rooms(nodes: set[str], shm_dir: str, agents: Mapping[str, Any]) -> dict[str, dict]:
    """Each node's memory available and free room of `shm_dir` (NodeAgent.memory); a node
    that does not answer is left out (the health checks judge it)."""
    asked = {node: agents[node].memory.remote(shm_dir) for node in nodes if node in agents}
    rooms = {}
    for node, ref in sorted(asked.items()):
        try:
            rooms[node] = ray.get(ref, timeout=ASK_TIMEOUT_S)
        except (GetTimeoutError, RayActorError):
            continue
    return rooms


def checkpoint_need(spec: JobSpec, ranks: int) -> int:
    """Bytes the in-memory checkpoints of `ranks` ranks take on a node (0 when the job does
    not state its state's size)."""
    ckpt = spec.checkpoint
    if ckpt.state_size_per_rank is None:
        return 0
    need = NodeNeed(ranks, int(ckpt.state_size_per_rank), ckpt.replicas, ckpt.versions)
    return need.total


def check_memory(
    spec: JobSpec, node_of_rank: Mapping[int, str], rooms: Mapping[str, Mapping[str, Any]]
) -> None:
    """Raise SchedulingError naming every node that cannot hold its ranks' checkpoints
    (`node_of_rank`: where each rank's slot is; `rooms`: what ask_rooms found)."""
    ckpt = spec.checkpoint
    state = ckpt.state_size_per_rank
    if state is None:
        return
    ranks = Counter(node_of_rank.values())
    problems = []
    for node, room in sorted(rooms.items()):
        if node not in ranks:
            continue
        need = NodeNeed(ranks[node], int(state), ckpt.replicas, ckpt.versions)
        why = judge(need, room.get("mem_available"), room.get("shm_free"))
        if why:
            problems.append(f"node {node[:12]}: {why}")
    if problems:
        raise SchedulingError(
            "the in-memory checkpoints do not fit: "
            + "; ".join(problems)
            + ". Lower checkpoint.state_size_per_rank if it overstates the state, "
            "checkpoint.replicas, or the ranks per node (placement), or use nodes with more "
            "memory"
        )
