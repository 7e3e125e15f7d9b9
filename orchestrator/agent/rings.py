"""The node agent's side of its ranks' snapshot rings (ckpt/ring.py).

The agent creates one ring per rank and tensor layout in its shared-memory store's folder
and a doorbell FIFO beside them. One thread sleeps on the doorbell (50 ms at most: a
byte lost to a full pipe is found by the next look anyway), reads the rings' sequence
numbers and hands each published slot to the agent (`on_shard`), which keeps it as the
rank's shard or passes it over. When a rank's ring has no free slot left because the
agent keeps them all (commits lag, a copy to a peer is slow), the oldest is moved out of
the ring into a slot file of the store's own (`on_full`), so the rank's next snapshot
waits at most for that copy; with no room left for it, the node's shards move into the
agent's memory and its ranks send them through Ray (the rings close).

The rings also carry the ranks' heartbeats (`beats`: the newest each rank wrote into its
open ring, read when the agent reports), instead of a call per beat.

The hub also writes what the ranks wait on when copies must not lag (ckpt/ring.py, the
replication words): the node's replication stride into every ring, and each rank's newest
shard on every peer into that rank's rings, a new ring included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from stalwart.ckpt.footprint import VERSIONS
from stalwart.ckpt.ring import (
    BELL,
    NOT_REPLICATED,
    RingFile,
    RingReader,
    drain_bell,
    make_bell,
)
from stalwart.ckpt.snapshot import TensorMeta

# Per ring: a node keeps each rank's newest three shards (the next commit is made of
# them) and the two newest commits, which may be older; one more slot is being written
# (ckpt/footprint.py, which the memory preflight and the Helm chart count with). A shard is
# moved out (a copy) only when all are kept, so never in steady state.
SLOTS = VERSIONS
POLL_S = 0.05

log = logging.getLogger(__name__)


def newest_beats(called: dict[int, dict], ringed: dict[int, dict]) -> dict[int, dict]:
    """rank -> its newest heartbeat: the one its ring holds (written there while it has
    an open ring) or the one it sent by call (before its first snapshot, or through Ray),
    whichever was sent last."""
    beats = dict(called)
    for rank, beat in ringed.items():
        if rank not in beats or beat["sent_at"] > beats[rank].get("sent_at", 0.0):
            beats[rank] = beat
    return beats


class RingHub:
    def __init__(
        self,
        root: str | Path,
        on_shard: Callable[[RingReader, int, int, int, bytes], bool],
        on_full: Callable[[RingReader], None],
        slots: int = SLOTS,
    ):
        """`on_shard(reader, slot, step, generation, skeleton)` -> keep it?"""
        self.root = Path(root)
        self._on_shard = on_shard
        self._on_full = on_full
        self._slots = slots
        self._lock = threading.Lock()
        # One look at a slot at a time; re-entered when a full ring's move-out finds no
        # room and the fall-back closes every ring from inside the look.
        self._poll_lock = threading.RLock()
        self._readers: dict[str, RingReader] = {}
        self._count = 0
        self._stride = 0  # the replication words every ring gets (set_replication)
        self._replicated: dict[int, int] = {}  # rank -> its packed word
        self.bell = str(self.root / BELL)
        self._bell_fd = make_bell(self.bell)
        self._stop = threading.Event()
        self.polls = 0
        self._thread = threading.Thread(target=self._loop, name="stalwart-rings", daemon=True)
        self._thread.start()

    def open(
        self, rank: int, metas: tuple[TensorMeta, ...], payload_nbytes: int, skel_nbytes: int
    ) -> tuple[str, str]:
        """A new ring for `rank`'s snapshots of this layout: (its path, the doorbell's).
        The rank's earlier rings close (their kept slots stay until dropped). Raises
        OSError (ENOSPC) when the file system has no room for it."""
        with self._lock:
            self._count += 1
            path = self.root / f"ring-r{rank}-{self._count}"
        # Room for the skeleton to grow (RNG states, counters): a ring is made per layout.
        ring = RingFile.create(path, self._slots, metas, payload_nbytes, 2 * skel_nbytes + 4096)
        self.close_rank(rank)
        with self._lock:
            # Before the rank maps it: a new layout's ring goes on from the old one's copies.
            ring.set_replication(self._stride, self._replicated.get(rank, NOT_REPLICATED))
            self._readers[str(path)] = RingReader(ring, rank)
        return str(path), self.bell

    def set_replication(
        self, stride: int | None = None, rank: int | None = None, word: int | None = None
    ) -> None:
        """The replication stride the ranks wait on (0: none), for every ring; and/or
        `rank`'s newest shard on every peer (a ckpt/ring.py `pack_replicated` word)."""
        with self._lock:
            if stride is not None:
                self._stride = stride
            if rank is not None and word is not None:
                self._replicated[rank] = word
            for reader in self._readers.values():
                if stride is not None:
                    reader.ring.set_replication(stride=stride)
                if rank is not None and word is not None and reader.rank == rank:
                    reader.ring.set_replication(replicated=word)

    def close_rank(self, rank: int | None = None) -> None:
        """Close `rank`'s rings (None: every ring): their writers must open new ones. A
        closed ring's file is unlinked at once; its memory goes with the last mapping."""
        with self._poll_lock:
            with self._lock:
                doomed = [p for p, r in self._readers.items() if rank is None or r.rank == rank]
                readers = [self._readers.pop(p) for p in doomed]
            for reader in readers:
                reader.ring.close_for_writers()
                self._take(reader)  # what was published before it closed still counts
        for reader in readers:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(reader.ring.path)

    def beats(self) -> dict[int, dict]:
        """rank -> the newest heartbeat it wrote into its open ring (worker/actor.py), as
        received when it was written (the same machine's clock: a rank that stopped writing
        is seen silent); ranks that wrote none, or were rewriting it at every look, or
        whose bytes are not a beat, left out."""
        with self._lock:
            readers = list(self._readers.values())
        out, now = {}, time.time()
        for reader in readers:
            raw = reader.ring.read_beat()
            try:
                beat = json.loads(raw) if raw is not None else None
                sent = float(beat["sent_at"]) if isinstance(beat, dict) else None
            except (ValueError, TypeError, KeyError):
                continue
            if sent is not None:
                beat["sent_at"], beat["received_at"] = sent, min(sent, now)
                out[reader.rank] = beat
        return out

    def poll(self) -> int:
        """Deal with every published slot; returns how many."""
        with self._poll_lock:
            with self._lock:
                readers = list(self._readers.values())
            n = sum(self._take(reader) for reader in readers)
            self.polls += 1
        return n

    def _take(self, reader: RingReader) -> int:
        n = 0
        for slot, step, generation, skeleton in reader.published():
            keep = step >= 0 and self._shard(reader, slot, step, generation, skeleton)
            reader.settle(slot, step if keep else None)
            n += 1
        if not reader.ring.closed and len(reader.held()) >= reader.ring.slots:
            self._on_full(reader)  # the rank's next snapshot would wait for a slot
        return n

    def _shard(
        self, reader: RingReader, slot: int, step: int, generation: int, skeleton: bytes
    ) -> bool:
        """`on_shard`, or False (the slot passed over) where it fails: this thread is the
        only one freeing the ranks' slots, and a rank waits for a free one before its next
        step, so an error here must cost a shard (that step is not committed for the rank),
        never the thread (every rank of the node would hang)."""
        try:
            return self._on_shard(reader, slot, step, generation, skeleton)
        except Exception:
            log.exception("rank %d's shard of step %d was passed over", reader.rank, step)
            return False

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                ready, _, _ = select.select([self._bell_fd], [], [], POLL_S)
                if ready:
                    drain_bell(self._bell_fd)
            if self._stop.is_set():
                return
            self.poll()

    def close(self) -> None:
        self._stop.set()
        self.close_rank(None)
        self._thread.join(timeout=2 * POLL_S + 1)
        with contextlib.suppress(OSError):
            os.close(self._bell_fd)
