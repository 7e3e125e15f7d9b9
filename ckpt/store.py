"""The shard store interface and its in-memory implementation (tier 0: the node's memory).

A store is owned by a long-lived process (the node agent), never by a worker: an object a
worker puts into Ray's object store dies with the worker. So ``put`` copies the payload into
memory the store owns. Buffers of dropped versions are reused for later ones of the same
size, so steady-state checkpointing allocates nothing.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ckpt.snapshot import Snapshot


@dataclass(frozen=True)
class ShardInfo:
    rank: int
    step: int
    nbytes: int


class ShardStore(Protocol):
    """Where committed (and about-to-be-committed) shards live. Later tiers (peer replicas,
    durable storage) implement the same interface."""

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo: ...

    def get(self, rank: int, step: int) -> Snapshot | None: ...

    def stored(self) -> dict[int, list[int]]: ...

    def drop_below(self, step: int) -> int: ...

    def drop_above(self, step: int) -> int: ...


class MemoryShardStore:
    def __init__(self) -> None:
        self._shards: dict[tuple[int, int], Snapshot] = {}
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()

    def _buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        src = np.asarray(snapshot.payload, dtype=np.uint8).reshape(-1)
        buf = self._buffer(src.nbytes)
        np.copyto(buf, src)
        owned = Snapshot(snapshot.step, bytes(snapshot.skeleton), snapshot.metas, buf)
        with self._lock:
            old = self._shards.pop((rank, snapshot.step), None)
            self._shards[(rank, snapshot.step)] = owned
            if old is not None:
                self._free[old.nbytes].append(old.payload)
        return ShardInfo(rank, snapshot.step, buf.nbytes)

    def get(self, rank: int, step: int) -> Snapshot | None:
        with self._lock:
            return self._shards.get((rank, step))

    def stored(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = defaultdict(list)
        with self._lock:
            for rank, step in self._shards:
                out[rank].append(step)
        return {r: sorted(s) for r, s in out.items()}

    def _drop(self, keep) -> int:
        with self._lock:
            gone = [k for k in self._shards if not keep(k[1])]
            for k in gone:
                snap = self._shards.pop(k)
                self._free[snap.nbytes].append(snap.payload)
            # Bound the free pool: two spare buffers per size are enough for steady state.
            for size, bufs in self._free.items():
                del bufs[: max(0, len(bufs) - 2 * max(1, len({r for r, _ in self._shards})))]
                self._free[size] = bufs
        return len(gone)

    def drop_below(self, step: int) -> int:
        return self._drop(lambda s: s >= step)

    def drop_above(self, step: int) -> int:
        return self._drop(lambda s: s <= step)

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._shards.values())
