"""The memory preflight: before any worker starts, each node the job's slots are on is asked
for its memory available and the free room of its shared-memory folder, and the job is
refused when a node cannot hold the in-memory checkpoints of the ranks placed on it
(ckpt/footprint.py: the same sum the Helm chart sizes /dev/shm with). Only with
checkpoint.state_size_per_rank: the state's size is not known before the first snapshot.
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


def check_memory(spec: JobSpec, node_of_rank: Mapping[int, str], agents: Mapping[str, Any]) -> None:
    """Raise SchedulingError naming every node that cannot hold its ranks' checkpoints
    (`node_of_rank`: where each rank's slot is; `agents`: node -> its agent)."""
    ckpt = spec.checkpoint
    state = ckpt.state_size_per_rank
    if state is None:
        return
    ranks = Counter(node_of_rank.values())
    asked = {node: agents[node].memory.remote(ckpt.shm_dir) for node in ranks if node in agents}
    problems = []
    for node, ref in sorted(asked.items()):
        try:
            room = ray.get(ref, timeout=ASK_TIMEOUT_S)
        except (GetTimeoutError, RayActorError):
            continue  # a node that does not answer is the health checks' to judge
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
