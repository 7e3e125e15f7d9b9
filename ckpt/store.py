"""The shard store interface and its in-memory implementation (tier 0: the node's memory).

A store is owned by a long-lived process (the node agent), never by a worker: an object a
worker puts into Ray's object store dies with the worker. So ``put`` copies the payload into
memory the store owns. Buffers of dropped versions are reused for later ones of the same
size, so steady-state checkpointing allocates nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stalwart.ckpt.footprint import free_bytes
from stalwart.ckpt.snapshot import Snapshot


@dataclass(frozen=True)
class ShardInfo:
    rank: int
    step: int
    nbytes: int


OWNER_FILE = ".owner"


def _process_id(pid: int) -> str:
    """`pid:start-time`: a pid alone could be reused by a later process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command name
    except (OSError, IndexError):
        return f"{pid}:gone"
    return f"{pid}:{start}"


def _trimmed(keys, keep: set[int], newest: int, below: int | None) -> set[tuple[int, int]]:
    """The (rank, step) keys `trim` drops: steps below `below`, and steps neither in `keep`
    nor among their rank's `newest` newest."""
    doomed = set()
    for rank, steps in _steps_by_rank(keys).items():
        recent = set(steps[-newest:]) if newest > 0 else set()
        for step in steps:
            if (below is not None and step < below) or (step not in keep and step not in recent):
                doomed.add((rank, step))
    return doomed


def _steps_by_rank(keys) -> dict[int, list[int]]:
    """{(rank, step), ...} -> {rank: [steps, ascending]}."""
    out: dict[int, list[int]] = defaultdict(list)
    for rank, step in keys:
        out[rank].append(step)
    return {r: sorted(s) for r, s in out.items()}


class ShardStore(Protocol):
    """Where committed (and about-to-be-committed) shards live. Later tiers (peer replicas,
    durable storage) implement the same interface."""

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo: ...

    def get(self, rank: int, step: int) -> Snapshot | None: ...

    def stored(self) -> dict[int, list[int]]: ...

    def drop_below(self, step: int) -> int: ...

    def discard(self, rank: int, step: int) -> int: ...

    def drop_above(self, step: int) -> int: ...

    def trim(self, keep: set[int], newest: int, below: int | None = None) -> int: ...

    def rekey(self, ranks: dict[int, int]) -> int: ...

    def close(self) -> None: ...


class MemoryShardStore:
    free_per_rank = 2  # spare buffers kept per rank holding shards (steady state's)

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
        owned = Snapshot(
            snapshot.step, bytes(snapshot.skeleton), snapshot.metas, buf, snapshot.checksum
        )
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
        with self._lock:
            return _steps_by_rank(self._shards)

    def _drop(self, keep) -> int:
        """Drop every shard whose (rank, step) key `keep` rejects."""
        with self._lock:
            gone = [k for k in self._shards if not keep(k)]
            for k in gone:
                snap = self._shards.pop(k)
                self._free[snap.nbytes].append(snap.payload)
            # Bound the free pool: two spare buffers per rank holding shards cover steady state.
            keep_free = self.free_per_rank * max(1, len({r for r, _ in self._shards}))
            for bufs in self._free.values():
                del bufs[: max(0, len(bufs) - keep_free)]
        return len(gone)

    def drop_below(self, step: int) -> int:
        return self._drop(lambda k: k[1] >= step)

    def discard(self, rank: int, step: int) -> int:
        """Drop `rank`'s shard of `step` (a restore found it corrupt)."""
        return self._drop(lambda k: k != (rank, step))

    def drop_above(self, step: int) -> int:
        return self._drop(lambda k: k[1] <= step)

    def trim(self, keep: set[int], newest: int, below: int | None = None) -> int:
        """Keep only the steps in `keep` and each rank's `newest` newest ones, none below
        `below` (the supervisor's retained commits and replication target; the newest are
        what the next commit will be made of)."""
        with self._lock:
            doomed = _trimmed(self._shards, keep, newest, below)
        return self._drop(lambda k: k not in doomed)

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._shards.values())

    def allocated(self) -> int:
        """The bytes this store's buffers take: those holding shards and the spare ones."""
        with self._lock:
            spare = sum(b.nbytes for bufs in self._free.values() for b in bufs)
            return spare + sum(s.nbytes for s in self._shards.values())

    def rekey(self, ranks: dict[int, int]) -> int:
        """The world was renumbered: rank `old`'s shards become rank `ranks[old]`'s; shards
        of ranks not in `ranks` are dropped. Returns how many shards were kept."""
        with self._lock:
            old, self._shards = self._shards, {}
            for (rank, step), snap in old.items():
                if rank in ranks:
                    self._shards[(ranks[rank], step)] = snap
                else:
                    self._free[snap.nbytes].append(snap.payload)
            return len(self._shards)

    def close(self) -> None:
        with self._lock:
            self._shards.clear()
            self._free.clear()


@dataclass
class _Slot:
    path: str
    nbytes: int
    array: np.ndarray  # the store's own mapping of the file
    ring: Any = None  # (RingReader, slot index): a slot of a rank's snapshot ring


def read_in_place(where: dict[str, Any], step: int) -> Snapshot | None:
    """A shard that another process of this node keeps in shared memory, as its
    `ShmShardStore.locate` (through the node agent) names it, mapped read-only: no copy
    until the restore's own. None when its file is gone (its ring closed meanwhile)."""
    try:
        payload = np.memmap(
            where["path"],
            dtype=np.uint8,
            mode="r",
            offset=where["offset"],
            shape=(where["nbytes"],),
        )
    except (OSError, ValueError):
        return None
    return Snapshot(step, where["skeleton"], tuple(where["metas"]), payload, where["checksum"])


class ShmFull(OSError):
    """The shared-memory file system has no room for another slot."""


class ShmShardStore:
    """Shards in files under a shared-memory directory that the store's process owns.

    A worker on the same machine copies its snapshot straight into a slot file the store
    reserved for it (one memcpy, no serialization, no object-store round trip) and then
    commits it. The files belong to the store, not to the worker: they outlive a killed
    worker, as DLRover's flash checkpoints do. Slots of dropped versions are reused.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # Who owns these files: a store whose process died without close() (SIGKILL, its
        # job's driver gone) leaves them; the next store on the machine reaps them.
        (self.root / OWNER_FILE).write_text(_process_id(os.getpid()))
        self._shards: dict[tuple[int, int], tuple[Snapshot, _Slot]] = {}
        self._free: dict[int, list[_Slot]] = defaultdict(list)
        self._reserved: dict[str, tuple[int, _Slot]] = {}
        self._lock = threading.Lock()
        self._count = 0

    @staticmethod
    def reap_orphans(shm_root: str | Path) -> list[str]:
        """Delete the store directories under `shm_root` (JOB-KEY/NODE/) whose owning
        process is gone; returns them. Shared memory is the machine's RAM: a job killed
        without a clean stop must not keep it."""
        reaped = []
        for owner in Path(shm_root).glob(f"*/*/{OWNER_FILE}"):
            try:
                ident = owner.read_text().strip()
            except OSError:
                continue
            pid = ident.split(":", 1)[0]
            if not pid.isdigit() or _process_id(int(pid)) == ident:
                continue  # alive (same pid, same start time)
            shutil.rmtree(owner.parent, ignore_errors=True)
            reaped.append(str(owner.parent))
            with contextlib.suppress(OSError):
                owner.parent.parent.rmdir()  # the job's directory, once empty
        return reaped

    @staticmethod
    def usable(root: str | Path, need_bytes: int = 64 << 20) -> bool:
        """Is `root`'s file system there, writable and roomy enough (a small /dev/shm, as in
        a default container, is not)?"""
        root = Path(root)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        free = free_bytes(str(root))
        return free is not None and free >= need_bytes and os.access(root, os.W_OK)

    def reserve(self, rank: int, nbytes: int) -> str:
        """A slot file of `nbytes` for `rank` to write into; returns its path."""
        with self._lock:
            free = self._free[rank]
            for i, slot in enumerate(free):
                if slot.nbytes == nbytes:
                    del free[i]
                    self._reserved[slot.path] = (rank, slot)
                    return slot.path
            self._count += 1
            path = str(self.root / f"r{rank}-{self._count}")
        # Allocated now, not on first touch: a full file system fails here, with ENOSPC,
        # rather than with a SIGBUS in the worker writing through the mapping.
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
            except OSError as e:
                f.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise ShmFull(
                    f"{self.root}: no room for rank {rank}'s {nbytes} byte shard "
                    f"({free_bytes(str(self.root))} bytes free): {e.strerror}"
                ) from None
        array = np.memmap(path, dtype=np.uint8, mode="r+", shape=(max(nbytes, 1),))[:nbytes]
        slot = _Slot(path, nbytes, array)
        with self._lock:
            self._reserved[path] = (rank, slot)
        return path

    def commit(
        self,
        rank: int,
        step: int,
        skeleton: bytes,
        metas: tuple,
        path: str,
        checksum: int | None = None,
    ) -> ShardInfo:
        """The worker finished writing `path`: it now holds `rank`'s shard of `step`
        (`checksum`: the payload's, taken by the writer)."""
        with self._lock:
            owner, slot = self._reserved.pop(path)
            assert owner == rank, f"slot {path} was reserved by rank {owner}, not {rank}"
            self._keep(
                rank, Snapshot(step, bytes(skeleton), tuple(metas), slot.array, checksum), slot
            )
        return ShardInfo(rank, step, slot.nbytes)

    def commit_ring(
        self,
        rank: int,
        step: int,
        skeleton: bytes,
        metas: tuple,
        ring: Any,
        index: int,
        checksum: int | None = None,
    ) -> ShardInfo:
        """Slot `index` of `rank`'s snapshot ring (ckpt/ring.py, a RingReader) holds its
        shard of `step`: kept where it is, released to the ring when dropped."""
        array = ring.ring.payload(index)
        slot = _Slot(f"{ring.ring.path}#{index}", len(array), array, (ring, index))
        with self._lock:
            self._keep(rank, Snapshot(step, bytes(skeleton), tuple(metas), array, checksum), slot)
        return ShardInfo(rank, step, slot.nbytes)

    def move_out(self, rank: int, step: int) -> bool:
        """Copy `rank`'s shard of `step` out of its ring slot into a slot file of the
        store's own, giving the ring its slot back (the shard is kept longer than the
        ring has room for). False: not in a ring slot (any more). Raises ShmFull when the
        file system has no room for the copy."""
        with self._lock:
            entry = self._shards.get((rank, step))
        if entry is None or entry[1].ring is None:
            return False
        snap, old = entry
        path = self.reserve(rank, old.nbytes)
        with self._lock:
            _, slot = self._reserved.pop(path)
        # Outside the lock (250 MB is 0.1 s): a kept ring slot is never written, and one
        # dropped meanwhile is found below and its copy discarded.
        np.copyto(slot.array, old.array)
        with self._lock:
            if self._shards.get((rank, step)) is not entry:  # dropped or replaced meanwhile
                self._free[rank].append(slot)
                return False
            moved = Snapshot(snap.step, snap.skeleton, snap.metas, slot.array, snap.checksum)
            self._shards[(rank, step)] = (moved, slot)
            self._recycle(rank, old)
        return True

    def _keep(self, rank: int, snap: Snapshot, slot: _Slot) -> None:
        """`slot` now holds `rank`'s shard `snap`; a shard it replaces gives its slot back
        (lock held)."""
        old = self._shards.pop((rank, snap.step), None)
        self._shards[(rank, snap.step)] = (snap, slot)
        if old is not None:
            self._recycle(rank, old[1])

    def _recycle(self, rank: int, slot: _Slot) -> None:
        """A dropped shard's slot: back to its ring, or to the rank's free slots (lock held)."""
        if slot.ring is not None:
            reader, index = slot.ring
            reader.release(index)
        else:
            self._free[rank].append(slot)

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        src = np.asarray(snapshot.payload, dtype=np.uint8).reshape(-1)
        path = self.reserve(rank, src.nbytes)
        with self._lock:
            slot = self._reserved[path][1]
        np.copyto(slot.array, src)
        return self.commit(
            rank, snapshot.step, snapshot.skeleton, snapshot.metas, path, snapshot.checksum
        )

    def get(self, rank: int, step: int) -> Snapshot | None:
        with self._lock:
            entry = self._shards.get((rank, step))
        if entry is None:
            return None
        snap, slot = entry
        # A plain ndarray view: serializers copy its bytes, never the mapping.
        return Snapshot(
            snap.step, snap.skeleton, snap.metas, slot.array.view(np.ndarray), snap.checksum
        )

    def stored(self) -> dict[int, list[int]]:
        with self._lock:
            return _steps_by_rank(self._shards)

    def _drop(self, keep) -> int:
        """Drop every shard whose (rank, step) key `keep` rejects."""
        unlink = []
        with self._lock:
            gone = [k for k in self._shards if not keep(k)]
            for k in gone:
                _, slot = self._shards.pop(k)
                self._recycle(k[0], slot)
            # Two spare slots per rank cover steady state; give the rest back to the OS.
            for free in self._free.values():
                while len(free) > 2:
                    unlink.append(free.pop(0).path)
        for path in unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return len(gone)

    def drop_below(self, step: int) -> int:
        return self._drop(lambda k: k[1] >= step)

    def discard(self, rank: int, step: int) -> int:
        """Drop `rank`'s shard of `step` (a restore found it corrupt)."""
        return self._drop(lambda k: k != (rank, step))

    def drop_above(self, step: int) -> int:
        return self._drop(lambda k: k[1] <= step)

    def trim(self, keep: set[int], newest: int, below: int | None = None) -> int:
        """See MemoryShardStore.trim."""
        with self._lock:
            doomed = _trimmed(self._shards, keep, newest, below)
        return self._drop(lambda k: k not in doomed)

    def release(self, rank: int, path: str | None = None) -> None:
        """Unfinished reservations of `rank` (all of them, or `path`) are free again: its
        worker is gone, or will not use the slot."""
        with self._lock:
            for reserved, (owner, slot) in list(self._reserved.items()):
                if owner == rank and path in (None, reserved):
                    del self._reserved[reserved]
                    self._free[rank].append(slot)

    def nbytes(self) -> int:
        with self._lock:
            return sum(slot.nbytes for _, slot in self._shards.values())

    def locate(self, rank: int, step: int) -> tuple[str, int, int] | None:
        """Where `rank`'s shard of `step` lies: (file, byte offset, bytes), for a process
        on this node to map and read in place; None: not held."""
        with self._lock:
            entry = self._shards.get((rank, step))
        if entry is None:
            return None
        slot = entry[1]
        if slot.ring is None:
            return slot.path, 0, slot.nbytes
        reader, index = slot.ring
        return reader.ring.path, reader.ring.payload_offset(index), slot.nbytes

    def allocated(self) -> int:
        """The memory this store's folder takes: every ring and slot file's allocation."""
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def rekey(self, ranks: dict[int, int]) -> int:
        """The world was renumbered: rank `old`'s shards become rank `ranks[old]`'s; shards
        of ranks not in `ranks` are dropped, and unfinished reservations released (workers
        reserve again under their new rank). Returns how many shards were kept."""
        with self._lock:
            spare = [slot for _, slot in self._reserved.values()]
            spare += [slot for slots in self._free.values() for slot in slots]
            old, self._shards, self._reserved = self._shards, {}, {}
            self._free = defaultdict(list)
            for (rank, step), (snap, slot) in old.items():
                if rank in ranks:
                    self._shards[(ranks[rank], step)] = (snap, slot)
                elif slot.ring is not None:
                    self._recycle(rank, slot)
                else:
                    spare.append(slot)
            unlink = [slot.path for slot in spare]
        for path in unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return len(self._shards)

    def close(self) -> None:
        """Delete every file (the store's process is going away)."""
        with self._lock:
            self._shards.clear()
            self._free.clear()
            self._reserved.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        # The job's directory goes with its last node store on this machine.
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()
