"""Where a rank reads the old layout's sharded state from after an elastic resize or a
resume at another world size (worker/restore.py asks only when its snapshot's mesh is not
the one the loop built): a DCP reader over the old world's shards of the restore step, in
the nodes' memory (`{"memory": {rank: agent}}`, every rank that held a shard of the step,
renumbered by the resize) or on durable storage (`{"durable": target}`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from stalwart.ckpt.durable import open_store
from stalwart.ckpt.snapshot import Snapshot


def reshard_source(
    spec: dict[str, Any] | None,
    step: int | None,
    fetch: Callable[[Any, int], Snapshot | None],
) -> tuple[Any, str] | None:
    """(a DCP reader of `step` in its saved layout, where it is), or None when the
    supervisor named no source. `fetch(agent, rank)` is the rank's own shard fetch."""
    if spec is None or step is None:
        return None
    if "durable" in spec:
        store = open_store(spec["durable"])
        return store.reader(
            step, store.manifest(step)
        ), f"durable step {step} of {store.describe()}"
    from stalwart.ckpt.dcp_read import MemoryReader  # torch.distributed.checkpoint: 0.5 s

    agents: dict[int, Any] = {int(r): a for r, a in spec["memory"].items()}
    found = ray.get([a.get_layout.remote(r, step) for r, a in agents.items()], timeout=60)
    layouts = {r: lay for r, lay in zip(agents, found, strict=True) if lay is not None}

    def whole(rank: int) -> Snapshot:
        snap = fetch(agents[rank], rank)
        if snap is None:
            raise RuntimeError(f"rank {rank}'s shard of step {step} is gone from its node")
        return snap

    return MemoryReader(layouts, whole), f"the old world's shards of step {step} in memory"
