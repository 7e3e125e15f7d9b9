"""A node's writes to the durable tier: each rank's file of a persisted step, from this
node's memory, in the calling thread (an agent's call thread: never the training path).

A write is named for the job's generation that asked for it (ckpt/dcp_format.py): one still
going when a recovery fences that generation off lands beside the next generation's files,
never over them, and no manifest lists it (supervisor/persist.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stalwart.ckpt.durable import DurableStore, open_store
from stalwart.ckpt.snapshot import Snapshot


class DurableWrites:
    def __init__(self, node_id: str, held: Callable[[int, int], Snapshot]):
        """`held(rank, step)`: that shard from this node's memory (raises if it is gone)."""
        self.node_id, self._held = node_id, held
        self._stores: dict[tuple[str, str], DurableStore] = {}

    def store(self, target: dict[str, Any]) -> DurableStore:
        """The store `target` names (DurableStore.target), opened once."""
        key = (target["uri"], target["job"])
        if key not in self._stores:
            self._stores[key] = open_store(target)
        return self._stores[key]

    def write(
        self,
        target: dict[str, Any],
        step: int,
        ranks: list[int],
        generation: int | None,
        die: Callable[[], None] | None = None,
    ) -> list[dict]:
        """Write `ranks`' shards of `step` (retries with backoff inside the store). Returns
        what the manifest needs of them. `die`: a chaos kill carried out after the first
        shard (never returns)."""
        store = self.store(target)
        records = []
        for rank in ranks:
            if die is not None and records:
                die()
            snap = self._held(rank, step)
            records.append(store.write_rank(step, rank, _private_copy(snap, rank), generation))
        if die is not None:
            die()  # this node wrote one shard only: the first one
        return records


def _private_copy(snap: Snapshot, rank: int) -> Snapshot:
    """`snap` with a payload of its own: a shard in a ring slot or a pooled buffer is a view
    of memory the store reuses once it drops the step, and a durable write outlasts the
    hold on it (a rank wrote step k+6 into the slot of step k mid-write: found by
    tests/component/test_fsdp_dcp.py). The copy is checked against the checksum taken at
    the hand-over, so a copy the reuse overtook is refused, not written."""
    own = Snapshot(snap.step, snap.skeleton, snap.metas, np.array(snap.payload), snap.checksum)
    if not own.intact():
        raise RuntimeError(
            f"rank {rank}'s shard of step {snap.step} changed while it was copied to be "
            "persisted (its memory was reused): the step is not written"
        )
    return own
