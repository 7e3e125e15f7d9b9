"""A node's own shards: in shared-memory slot files while the file system has room, in the
agent's memory once it has none.

Workers write their snapshots straight into a slot file (one copy, ckpt/store.py's
ShmShardStore). When that file system is missing, too small or fills up (another tenant,
a small container /dev/shm, a leak), a reservation fails with ENOSPC (the slot is allocated
up front, never faulted in through the mapping, which would kill the writer with SIGBUS):
the store then moves every shard it holds into a MemoryShardStore and answers "no slot",
and workers send their shards through Ray from then on. The move is said once, with the
bytes needed and free, in a note the agent's next report carries.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from stalwart.ckpt.snapshot import Snapshot
from stalwart.ckpt.store import MemoryShardStore, ShardInfo, ShmShardStore


class OwnStore:
    def __init__(self, shm: ShmShardStore | None):
        self._lock = threading.Lock()
        self.shm = shm  # None once fallen back (or never usable)
        self.memory = MemoryShardStore() if shm is None else None
        self.notes: list[dict[str, Any]] = []  # for the agent's next report
        # Called before the shards move out of shared memory (the agent closes its rings).
        self.on_fall_back: Callable[[], None] | None = None

    @property
    def transport(self) -> str:
        """'shm': write shards into reserve()'s file; 'ray': send them to put()."""
        return "shm" if self.shm is not None else "ray"

    @property
    def current(self) -> ShmShardStore | MemoryShardStore:
        return self.shm if self.shm is not None else self.memory

    def fall_back(self, why: str) -> None:
        """Move every shard into memory; from now on shards come through Ray."""
        if self.shm is not None and self.on_fall_back is not None:
            self.on_fall_back()
        with self._lock:
            shm = self.shm
            if shm is None:
                return
            memory = MemoryShardStore()
            for rank, steps in shm.stored().items():
                for step in steps:
                    snap = shm.get(rank, step)
                    if snap is not None:
                        memory.put(rank, snap)
            self.memory, self.shm = memory, None
        shm.close()
        self.notes.append(
            {
                "type": "shm_full",
                "reason": f"{why}; this node's checkpoints are kept in its agent's memory "
                "from now on, and sent there through Ray (give the node a larger "
                "memory-backed checkpoint.shm_dir to get the one-copy path back)",
            }
        )

    def reserve(self, rank: int, nbytes: int) -> str | None:
        """A slot file for `rank`'s next shard, or None: send it with put() instead."""
        shm = self.shm
        if shm is None:
            return None
        try:
            return shm.reserve(rank, nbytes)
        except OSError as e:  # ShmFull, or the directory went with a fall-back meanwhile
            self.fall_back(str(e))
            return None

    def release(self, rank: int, path: str) -> None:
        shm = self.shm
        if shm is not None:
            shm.release(rank, path)

    def commit(
        self,
        rank: int,
        step: int,
        skeleton: bytes,
        metas: tuple,
        path: str,
        checksum: int | None = None,
    ) -> ShardInfo:
        """The worker wrote `path`. A slot reserved before a fall-back is still readable
        (its mapping stays until close): its shard is copied into memory."""
        with self._lock:
            shm = self.shm
            if shm is not None:
                return shm.commit(rank, step, skeleton, metas, path, checksum)
        return ShardInfo(rank, step, 0)  # the slot went with the move: this shard is lost

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        shm = self.shm
        if shm is not None:
            try:
                return shm.put(rank, snapshot)
            except OSError as e:  # ShmFull, or the directory went with a fall-back
                self.fall_back(str(e))
        return self.memory.put(rank, snapshot)

    def commit_ring(
        self, rank: int, step: int, skeleton: bytes, reader: Any, slot: int, checksum: int
    ) -> bool:
        """`rank`'s shard of `step` is in slot `slot` of its ring (ckpt/ring.py); False:
        the shards have moved out of shared memory meanwhile (the ring is closed)."""
        with self._lock:
            shm = self.shm
            if shm is None:
                return False
            shm.commit_ring(rank, step, skeleton, reader.ring.metas, reader, slot, checksum)
        return True

    def move_out(self, rank: int, step: int) -> bool:
        """Move `rank`'s shard of `step` out of its ring (see ShmShardStore.move_out). No
        room for it: every shard moves into memory, the rings close and the ranks send
        their shards through Ray (True: the ring has its slots back either way)."""
        shm = self.shm
        if shm is None:
            return False
        try:
            return shm.move_out(rank, step)
        except OSError as e:  # ShmFull
            self.fall_back(str(e))
            return True

    def take_notes(self) -> list[dict[str, Any]]:
        notes, self.notes = self.notes, []
        return notes

    # The rest of the ShardStore protocol: whichever store holds the shards now.
    def get(self, rank: int, step: int) -> Snapshot | None:
        return self.current.get(rank, step)

    def stored(self) -> dict[int, list[int]]:
        return self.current.stored()

    def drop_below(self, step: int) -> int:
        return self.current.drop_below(step)

    def drop_above(self, step: int) -> int:
        return self.current.drop_above(step)

    def discard(self, rank: int, step: int) -> int:
        return self.current.discard(rank, step)

    def trim(self, keep: set[int], newest: int, below: int | None = None) -> int:
        return self.current.trim(keep, newest, below)

    def rekey(self, ranks: dict[int, int]) -> int:
        return self.current.rekey(ranks)

    def nbytes(self) -> int:
        return self.current.nbytes()

    def allocated(self) -> int:
        return self.current.allocated()

    def locate(self, rank: int, step: int) -> tuple[str, int, int] | None:
        """(file, offset, bytes) of a shard in shared memory, or None (see ShmShardStore)."""
        shm = self.shm
        return shm.locate(rank, step) if shm is not None else None

    def release_rank(self, rank: int) -> None:
        shm = self.shm
        if shm is not None:
            shm.release(rank)

    def close(self) -> None:
        self.current.close()
