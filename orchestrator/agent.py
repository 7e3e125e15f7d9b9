"""The per-node agent: hosts the node's shard store and aggregates its workers' heartbeats.

One agent per node, pinned there. Workers hand snapshots and heartbeats to their own node's
agent; the supervisor asks each agent for one report per interval, so its load grows with
nodes, not ranks.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ckpt.snapshot import Snapshot
from ckpt.store import MemoryShardStore, ShardInfo, ShmShardStore

SHM_ROOT = "/dev/shm/stalwart"


class NodeAgent:
    def __init__(self, node_id: str, store_key: str, shm_root: str | None = SHM_ROOT):
        self.node_id = node_id
        # Shared-memory slot files when this machine has room for them (workers write into
        # them directly); otherwise shards travel through Ray and live in this process.
        root = os.path.join(shm_root, store_key, node_id[:16]) if shm_root else None
        if root and ShmShardStore.usable(os.path.dirname(root)):
            self.store: MemoryShardStore | ShmShardStore = ShmShardStore(root)
            self.transport = "shm"
        else:
            self.store = MemoryShardStore()
            self.transport = "ray"
        self._lock = threading.Lock()
        self._beats: dict[int, dict[str, Any]] = {}
        self._faults: list[dict[str, Any]] = []
        self._layouts: dict[int, tuple] = {}  # rank -> tensor layout of its last shard

    def ping(self) -> str:
        return self.node_id

    def store_transport(self) -> str:
        """'shm': write shards into reserve_slot()'s file; 'ray': send them to put_shard()."""
        return self.transport

    def reserve_slot(self, rank: int, nbytes: int) -> str:
        return self.store.reserve(rank, nbytes)

    def release_slot(self, rank: int, path: str) -> None:
        """A reserved slot the worker will not use (its state changed size)."""
        self.store.release(rank, path)

    def commit_slot(
        self,
        rank: int,
        step: int,
        skeleton: bytes,
        metas: tuple | None,
        path: str,
        reserve_next: int | None = None,
    ) -> tuple[ShardInfo, str | None]:
        """Commit `path` as `rank`'s shard of `step`. `metas=None`: the same tensor layout as
        this rank's previous shard. With `reserve_next`, the reply also carries the next
        slot of that size, saving the worker a call per snapshot."""
        if metas is None:
            metas = self._layouts[rank]
        self._layouts[rank] = metas
        info = self.store.commit(rank, step, skeleton, metas, path)
        following = self.store.reserve(rank, reserve_next) if reserve_next is not None else None
        return info, following

    def put_shard(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        return self.store.put(rank, snapshot)

    def get_shard(self, rank: int, step: int) -> Snapshot | None:
        return self.store.get(rank, step)

    def heartbeat(self, rank: int, beat: dict[str, Any]) -> None:
        beat["received_at"] = time.time()
        with self._lock:
            self._beats[rank] = beat

    def record_fault(self, fault: dict[str, Any]) -> None:
        with self._lock:
            self._faults.append(fault)

    def forget(self, rank: int) -> None:
        with self._lock:
            self._beats.pop(rank, None)
        if isinstance(self.store, ShmShardStore):
            self.store.release(rank)

    def close(self) -> None:
        """Free the node's shards (their shared-memory files) before the agent goes away."""
        self.store.close()

    def prune(self, below: int | None = None, above: int | None = None) -> int:
        dropped = 0
        if below is not None:
            dropped += self.store.drop_below(below)
        if above is not None:
            dropped += self.store.drop_above(above)
        return dropped

    def report(self) -> dict[str, Any]:
        with self._lock:
            faults, self._faults = self._faults, []
            return {
                "node": self.node_id,
                "at": time.time(),
                "beats": dict(self._beats),
                "stored": self.store.stored(),
                "faults": faults,
            }
