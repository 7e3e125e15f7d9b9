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

The way there. A shard goes to each peer over that peer's channel (agent/channel.py): one
persistent connection per peer, the payload written from the shard's memory straight into
a buffer of the peer's replica store. The peer's address and key are asked of it over Ray
when first needed, and again after an error. A peer without a channel (its address cannot
be had) gets its copies through Ray as before (one `ray.put`, read by each such peer), and
is asked again 30 s later; a copy the channel fails goes through Ray at once, so a broken
channel costs speed, never a commit (one it timed out on does not: the peer is stalled).

Priority. Sending must not take a core from training, yet must progress on a saturated
machine (at 71 steps/s a nice-19 sender got no CPU and a node loss sent the job back to
step 0). Two threads share the work, one shard at a time, never both at once: the calm one
runs at nice 10 (about a tenth of a core's share against a busy training thread: socket
sends are mostly kernel copies), the urgent one at the process's own priority. While the
sender keeps up, the calm thread sends. It is behind when a rank's copies lag its newest
shard by more than `URGENT_STRIDES` (4) strides (that many newer shards were offered since
its last one was taken), or when shards have waited `URGENT_AFTER_S` (10 s) without the
queue ever emptying: the urgent thread then takes the next shards (each rank's newest),
until it has caught up. (One thread cannot do this alone: lowering a thread's niceness
takes a privilege that containers seldom grant.) `status()["sends"]["urgent"]` counts the
shards sent at full priority.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np
import ray

from stalwart.ckpt.snapshot import Snapshot
from stalwart.ckpt.store import MemoryShardStore, ShardInfo, ShardStore
from stalwart.orchestrator.agent.channel import ChannelError, ChannelTimeout, PeerLink

SEND_TIMEOUT_S = 60.0
CALM_NICE = 10
URGENT_STRIDES = 4  # a rank's copies this many strides behind its newest: full priority
URGENT_AFTER_S = 10.0  # or shards waiting this long, the queue never empty
ADDRESS_TIMEOUT_S = 10.0
NO_CHANNEL_RETRY_S = 30.0  # a peer whose channel address could not be had: Ray until then


class ReplicaStore(MemoryShardStore):
    """The copies of peers' shards. A copy over the channel is read straight into a buffer
    of this store (`reserve`) and kept as it is (`adopt`): no second copy."""

    def reserve(self, nbytes: int) -> np.ndarray:
        """A buffer for a copy on its way (a dropped copy's, when one of that size is free)."""
        return self._buffer(nbytes)

    def adopt(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        """Keep `snapshot` as `rank`'s copy, its payload (a `reserve`d buffer) and all."""
        with self._lock:
            old = self._shards.pop((rank, snapshot.step), None)
            self._shards[(rank, snapshot.step)] = snapshot
            if old is not None:
                self._free[old.nbytes].append(old.payload)
        return ShardInfo(rank, snapshot.step, snapshot.nbytes)


class Replicator:
    def __init__(
        self,
        store: ShardStore,
        timeout_s: float = SEND_TIMEOUT_S,
        here: str | None = None,
        urgent_after_s: float = URGENT_AFTER_S,
        urgent_strides: int = URGENT_STRIDES,
    ):
        self._store = store
        self._timeout_s = timeout_s
        self._here = here  # this node's address as Ray sees it (None: asked when needed)
        self._urgent_after_s = urgent_after_s
        self._urgent_strides = urgent_strides
        self._cv = threading.Condition()
        self._peers: dict[str, Any] = {}
        self._pending: dict[int, int] = {}  # rank -> newest step offered, not yet sent
        self._stride = 1  # only steps that are multiples of this are sent (set_stride)
        self._wanted: int | None = None  # a step every rank's shard of goes next
        self._batch: list[tuple[int, int]] = []  # the round being sent, one shard at a time
        self._sending: set[int] = set()
        self._busy = False  # a thread is sending a shard
        self._behind_since: float | None = None  # shards waiting since (None: caught up)
        self._unsent: dict[int, int] = {}  # rank -> shards offered since its last was taken
        self._links: dict[str, tuple[Any, PeerLink]] = {}  # node -> (its actor id, link)
        self._no_channel: dict[str, float] = {}  # node -> until when it goes through Ray
        self._stop = False
        self.errors = 0
        self.last_error: str | None = None
        self.seconds = 0.0  # time spent sending, in all
        self.rounds = 0  # rounds completed (one round: a batch of shards to every peer)
        self.sent_bytes = 0
        self.sends = {"channel": 0, "ray": 0, "urgent": 0}  # copies per way, shards urgent
        self.channel_errors = 0
        self.last_channel_error: str | None = None
        for urgent in (False, True):
            threading.Thread(
                target=self._loop,
                args=(urgent,),
                name=f"stalwart-replicate{'-urgent' if urgent else ''}",
                daemon=True,
            ).start()

    def set_peers(self, peers: dict[str, Any]) -> None:
        """node -> agent handle of the peers that keep copies of this node's shards."""
        with self._cv:
            self._peers = dict(peers)
            if peers:
                # Shards already here were sent to the old peers, or to none: send the
                # newest of each rank to the new group.
                for rank, steps in self._store.stored().items():
                    self._pending[rank] = max(steps[-1], self._pending.get(rank, -1))
                self._behind_since = time.monotonic() if self._has_work() else None
                self._cv.notify_all()

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
                self._unsent[rank] = self._unsent.get(rank, 0) + 1
                self._queued()

    def replicate(self, step: int) -> None:
        """Send every rank's shard of `step` next (the supervisor aligns the ranks)."""
        with self._cv:
            if self._wanted is None or step > self._wanted:
                self._wanted = step
                self._queued()

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
                "queued": len(self._pending) + len(self._batch),
                "errors": self.errors,
                "last_error": self.last_error,
                "seconds": round(self.seconds, 4),
                "rounds": self.rounds,
                "sent_bytes": self.sent_bytes,
                "sends": dict(self.sends),
                "channel_errors": self.channel_errors,
                "last_channel_error": self.last_channel_error,
            }

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            links, self._links = self._links, {}
        for _, link in links.values():
            link.close()

    # --- the sending threads ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._peers) and bool(self._batch or self._pending or self._wanted is not None)

    def _queued(self) -> None:
        if self._behind_since is None:
            self._behind_since = time.monotonic()
        self._cv.notify_all()

    def _behind(self) -> tuple[bool, float | None]:
        """(Is the sender behind?, in how many seconds it will be, if nothing changes)."""
        if max(self._unsent.values(), default=0) > self._urgent_strides:
            return True, None
        waited = time.monotonic() - (self._behind_since or time.monotonic())
        return waited >= self._urgent_after_s, self._urgent_after_s - waited

    def _next(self, urgent: bool) -> tuple[int, int, dict[str, Any]] | None:
        """The (rank, step) shard for this thread to send now, and the peers; None: stop.
        The calm thread takes it while the sender keeps up, the urgent one when it is
        behind (`_behind`)."""
        with self._cv:
            while not self._stop:
                timeout = None
                if self._has_work() and not self._busy:
                    behind, due = self._behind()
                    if behind == urgent:
                        break
                    if urgent:
                        timeout = due
                self._cv.wait(timeout)
            if self._stop:
                return None
            if not self._batch:
                if self._wanted is not None:
                    step, self._wanted = self._wanted, None
                    stored = self._store.stored().items()
                    self._batch = [(r, step) for r, steps in stored if step in steps]
                    for rank, _ in self._batch:
                        if self._pending.get(rank, -1) <= step:
                            self._pending.pop(rank, None)
                            self._unsent.pop(rank, None)
                else:
                    self._batch, self._pending = sorted(self._pending.items()), {}
                    self._unsent = {}
            if not self._batch:  # the step asked for is held for no rank
                self._after_round()
                return self._next(urgent)
            rank, step = self._batch.pop(0)
            self._sending = {step} | {s for _, s in self._batch}
            self._busy = True
            if urgent:
                self.sends["urgent"] += 1
            return rank, step, dict(self._peers)

    def _after_round(self) -> None:
        self.rounds += 1
        if not self._has_work():
            self._behind_since = None  # caught up: the calm thread sends the next ones

    def _loop(self, urgent: bool) -> None:
        if not urgent:
            # Training first: this thread yields the CPU to the node's workers (Linux: the
            # niceness of one thread). The urgent one keeps the process's priority.
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CALM_NICE)
        while (item := self._next(urgent)) is not None:
            rank, step, peers = item
            t0 = time.perf_counter()
            nbytes = 0
            try:
                nbytes = self._send(rank, step, peers)
            except Exception as e:  # never the end of the thread: reported, step uncommitted
                with self._cv:
                    self.errors += 1
                    self.last_error = f"rank {rank} step {step}: {type(e).__name__}: {e}"[:300]
            finally:
                with self._cv:
                    self._busy = False
                    self.seconds += time.perf_counter() - t0
                    self.sent_bytes += nbytes
                    if not self._batch:
                        self._sending = set()
                        self._after_round()
                    self._cv.notify_all()

    def _send(self, rank: int, step: int, peers: dict[str, Any]) -> int:
        snap = self._store.get(rank, step)
        if snap is None:
            return 0  # dropped meanwhile (a rollback)
        if not snap.intact():
            # Damaged here since its hand-over: a copy would spread it. The step stays
            # uncommitted on this rank (an older commit is the restore point).
            with self._cv:
                self.errors += 1
                self.last_error = f"rank {rank}'s shard of step {step} is corrupt: not sent"
            return 0
        for node in set(self._links) - set(peers):  # no longer a peer
            self._links.pop(node)[1].close()
        through_ray, failed = {}, {}
        for node, peer in peers.items():
            link = self._link(node, peer)
            if link is not None:
                try:
                    link.put(rank, snap, self._timeout_s)
                    with self._cv:
                        self.sends["channel"] += 1
                    continue
                except ChannelTimeout as e:  # a stalled peer: Ray would wait as long
                    self._links.pop(node, None)
                    failed[node] = f"over its channel: {e}"
                    continue
                except ChannelError as e:  # this copy goes through Ray; a new link next time
                    self._links.pop(node, None)
                    self._channel_error(f"rank {rank} step {step} to {node[:12]}: {e}")
            through_ray[node] = peer
        if through_ray:
            failed.update(self._send_through_ray(rank, snap, through_ray))
        if failed:
            with self._cv:
                self.errors += 1
                self.last_error = "; ".join(
                    f"step {step} to {node[:12]}: {why}" for node, why in sorted(failed.items())
                )
        return snap.nbytes * len(peers)

    def _channel_error(self, message: str) -> None:
        with self._cv:
            self.channel_errors += 1
            self.last_channel_error = message[:300]

    def _link(self, node: str, peer: Any) -> PeerLink | None:
        """The channel to `node`'s agent (None: it has none; its copies go through Ray)."""
        actor = getattr(peer, "_actor_id", id(peer))
        held = self._links.get(node)
        if held is not None and held[0] == actor:
            return held[1]
        if time.monotonic() < self._no_channel.get(node, 0.0):
            return None
        try:
            if self._here is None:
                self._here = ray.util.get_node_ip_address()
            address = ray.get(peer.channel_address.remote(self._here), timeout=ADDRESS_TIMEOUT_S)
            if not address:
                raise ChannelError("it serves none")
        except Exception as e:  # an agent without a channel, gone, or busy: Ray for now
            self._no_channel[node] = time.monotonic() + NO_CHANNEL_RETRY_S
            self._channel_error(f"no channel to {node[:12]}: {type(e).__name__}")
            return None
        link = PeerLink(address)
        self._links[node] = (actor, link)
        return link

    def _send_through_ray(self, rank: int, snap: Snapshot, peers: dict[str, Any]) -> dict:
        """Copy `snap` to `peers` through Ray's object store; node -> why, for those that
        failed or did not answer in time."""
        shared = ray.put(snap)  # serialized once, read by every peer
        refs = {peer.put_replica.remote(rank, shared): node for node, peer in peers.items()}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self._timeout_s)
        failed = {refs[r]: f"no answer within {self._timeout_s:g} s" for r in late}
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # the peer is gone or refused: reported, step uncommitted
                failed[refs[ref]] = f"{type(e).__name__}: {e}"[:300]
        with self._cv:
            self.sends["ray"] += len(peers) - len(failed)
        return failed
