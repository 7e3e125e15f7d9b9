"""The node agents' start: one detached agent per node and job (orchestrator/agent/), found
again by its name when a restarted supervisor takes the job back."""

from __future__ import annotations

from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stalwart.orchestrator.agent.actor import NodeAgent
from stalwart.orchestrator.ray_classes import actor_class
from stalwart.orchestrator.spec import JobSpec

AGENT_PREFIX = "stalwart-agent-"


def start_agent(spec: JobSpec, store_key: str, node: str) -> Any:
    """Job `store_key`'s node agent on `node`: the one already started (the driver starts
    the embedded Ray's as the supervisor starts), else a new one."""
    gpu = spec.health.gpu
    return (
        actor_class(NodeAgent)
        .options(
            num_cpus=0,
            max_concurrency=32,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            # Detached: the node's memory (its shards) outlives this supervisor, so a
            # restarted one takes the job back from it (the agent's lease ends it when no
            # supervisor of the job is left).
            lifetime="detached",
            name=f"{AGENT_PREFIX}{store_key}-{node[:16]}",
            namespace="stalwart",
            get_if_exists=True,
        )
        .remote(
            node,
            store_key,
            shm_root=spec.checkpoint.shm_dir,
            gpu_probe=gpu.probe,
            gpu_interval_s=gpu.interval_s,
            durable=bool(spec.checkpoint.persist.uri),
            lean=spec.checkpoint.lean,
        )
    )
