"""Copying a node's shards to its peers' memory, off every training step's path.

The node agent owns one Replicator. Each shard a worker stores on the node is offered to
it at once; its thread sends the shard to each peer of the node's replica group
(ckpt/replicas.py), which keeps it in its replica store. When sending falls behind, only
each rank's newest shard waits (older ones are skipped). Skipping can leave ranks with
copies of different steps; the supervisor then names one step every rank has
(`replicate`), which goes first. Shards queued or being sent are pinned, so trimming never
recycles their memory under the copy. A peer that fails or does not answer in time is
counted and reported; the step then stays uncommitted. A shard whose bytes no longer
match its hand-over checksum is never copied.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import ray

from stalwart.ckpt.store import ShardStore

SEND_TIMEOUT_S = 60.0


class Replicator:
    def __init__(self, store: ShardStore, timeout_s: float = SEND_TIMEOUT_S):
        self._store = store
        self._timeout_s = timeout_s
        self._cv = threading.Condition()
        self._peers: dict[str, Any] = {}
        self._pending: dict[int, int] = {}  # rank -> newest step offered, not yet sent
        self._stride = 1  # only steps that are multiples of this are sent (set_stride)
        self._wanted: int | None = None  # a step every rank's shard of goes next
        self._sending: set[int] = set()
        self._stop = False
        self.errors = 0
        self.last_error: str | None = None
        self.seconds = 0.0  # time spent sending, in all
        self.rounds = 0  # sends completed (one round: a batch of shards to every peer)
        self.sent_bytes = 0
        self._thread = threading.Thread(target=self._loop, name="stalwart-replicate", daemon=True)
        self._thread.start()

    def set_peers(self, peers: dict[str, Any]) -> None:
        """node -> agent handle of the peers that keep copies of this node's shards."""
        with self._cv:
            self._peers = dict(peers)
            if peers:
                # Shards already here were sent to the old peers, or to none: send the
                # newest of each rank to the new group.
                for rank, steps in self._store.stored().items():
                    self._pending[rank] = max(steps[-1], self._pending.get(rank, -1))
                self._cv.notify()

    def set_stride(self, stride: int) -> None:
        """Send only steps that are multiples of `stride` (the same on every node, so the
        ranks' copies meet on common steps): the supervisor thins fast steps out."""
        with self._cv:
            self._stride = max(1, int(stride))

    def offer(self, rank: int, step: int) -> None:
        """`rank`'s shard of `step` was just stored here: send it when the thread is free."""
        with self._cv:
            if step % self._stride:
                return
            if self._peers and step > self._pending.get(rank, -1):
                self._pending[rank] = step
                self._cv.notify()

    def replicate(self, step: int) -> None:
        """Send every rank's shard of `step` next (the supervisor aligns the ranks)."""
        with self._cv:
            if self._wanted is None or step > self._wanted:
                self._wanted = step
                self._cv.notify()

    def pinned(self) -> set[int]:
        """Steps that must stay in the store (queued or being sent)."""
        with self._cv:
            steps = set(self._pending.values()) | self._sending
            if self._wanted is not None:
                steps.add(self._wanted)
            return steps

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "peers": sorted(self._peers),
                "queued": len(self._pending),
                "errors": self.errors,
                "last_error": self.last_error,
                "seconds": round(self.seconds, 4),
                "rounds": self.rounds,
                "sent_bytes": self.sent_bytes,
            }

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _next(self) -> list[tuple[int, int]] | None:
        """The (rank, step) shards to send now; None: stop."""
        with self._cv:
            while not self._stop and (
                not self._peers or (self._wanted is None and not self._pending)
            ):
                self._cv.wait()
            if self._stop:
                return None
            if self._wanted is not None:
                step, self._wanted = self._wanted, None
                batch = [(r, step) for r, steps in self._store.stored().items() if step in steps]
                for rank, _ in batch:
                    if self._pending.get(rank, -1) <= step:
                        self._pending.pop(rank, None)
            else:
                batch, self._pending = sorted(self._pending.items()), {}
            self._sending = {step for _, step in batch}
            return batch

    def _loop(self) -> None:
        # Training first: this thread yields the CPU to the node's workers (Linux: the
        # niceness of one thread).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while (batch := self._next()) is not None:
            with self._cv:
                peers = dict(self._peers)
            t0 = time.perf_counter()
            try:
                nbytes = self._send(batch, peers)
            finally:
                with self._cv:
                    self._sending = set()
                    self.seconds += time.perf_counter() - t0
                    self.rounds += 1
            with self._cv:
                self.sent_bytes += nbytes

    def _send(self, batch: list[tuple[int, int]], peers: dict[str, Any]) -> int:
        refs, nbytes = {}, 0
        for rank, step in batch:
            snap = self._store.get(rank, step)
            if snap is None:
                continue  # dropped meanwhile (a rollback)
            if not snap.intact():
                # Damaged here since its hand-over: a copy would spread it. The step stays
                # uncommitted on this rank (an older commit is the restore point).
                with self._cv:
                    self.errors += 1
                    self.last_error = f"rank {rank}'s shard of step {step} is corrupt: not sent"
                continue
            shared = ray.put(snap)  # serialized once, read by every peer
            nbytes += snap.nbytes * len(peers)
            for node, peer in peers.items():
                refs[peer.put_replica.remote(rank, shared)] = (node, step)
        if not refs:
            return 0
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self._timeout_s)
        failed = {refs[r]: f"no answer within {self._timeout_s:g} s" for r in late}
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # the peer is gone or refused: reported, step uncommitted
                failed[refs[ref]] = f"{type(e).__name__}: {e}"[:300]
        if failed:
            with self._cv:
                self.errors += 1
                self.last_error = "; ".join(
                    f"step {step} to {node[:12]}: {why}"
                    for (node, step), why in sorted(failed.items())
                )
        return nbytes
