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

Bounded lag (checkpoint.max_lag_steps, `set_stride(..., bounded=True)`). Skipping to each
rank's newest shard can leave the ranks' copies on different steps, so that no step
commits until they meet again, which is how the copies used to lag by seconds. With a bound
nothing is skipped: every shard on the stride's grid is sent, oldest first, and each one
that reached every peer is reported (`on_replicated`: rank, step, the generation that
wrote it), which the agent writes into the rank's ring for the rank to wait on
(ckpt/replicas.py `lag_gate`). The queue cannot grow: the ranks wait for it. A copy a peer
failed is sent again (after 0.2 s, doubling to 2 s while it keeps failing) until it
succeeds or the peers change; a shard that cannot be sent at all (damaged since its
hand-over, or dropped by a rollback) is reported as passed, so that its rank is not held
forever: the bound then holds from the next step on the grid.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from stalwart.ckpt.snapshot import Snapshot
from stalwart.ckpt.store import MemoryShardStore, ShardInfo, ShardStore
from stalwart.orchestrator.agent.channel import ChannelError, ChannelTimeout, PeerLink, StaleCopy

SEND_TIMEOUT_S = 60.0
RETRY_S = (0.2, 2.0)  # bounded lag: a failed copy is sent again after this, doubling
CALM_NICE = 10
URGENT_STRIDES = 4  # a rank's copies this many strides behind its newest: full priority
URGENT_AFTER_S = 10.0  # or shards waiting this long, the queue never empty
ADDRESS_TIMEOUT_S = 10.0
NO_CHANNEL_RETRY_S = 30.0  # a peer whose channel address could not be had: Ray until then


def unrolled(
    queued: list[tuple[int, int | None]], step: int, generation: int | None
) -> list[tuple[int, int | None]]:
    """A rank's queue of (step, generation) to send, without the entries a rollback undid:
    those an older generation wrote of `step` or later, now that `generation` writes
    `step` (they would go out under the old generation's name, and be refused, while the
    new shard of that step waited behind them)."""
    if generation is None:
        return queued
    return [(s, g) for s, g in queued if g is None or g >= generation or s < step]


class ReplicaStore(MemoryShardStore):
    """The copies of peers' shards. A copy over the channel is read straight into a buffer
    of this store (`reserve`) and kept as it is (`adopt`): no second copy.

    `lean` (the lean rule, ckpt/footprint.py): a rank's copy of step s arrives only once
    every rank's shard of its previous snapshot is on every peer (ckpt/ring.py, the floor),
    so the rank's older copies go as it arrives (`make_room`, before its buffer is made):
    2 copies per rank, the newest commit and the one arriving, and no spare buffers."""

    def __init__(self, lean: bool = False):
        super().__init__()
        self.lean = lean
        if lean:
            self.free_per_rank = 0  # a dropped copy's buffer goes: 2 per rank, no spare

    def make_room(self, rank: int, step: int) -> int:
        """Under the lean rule: drop `rank`'s copies older than its newest one before
        `step` (which is arriving). Returns how many went."""
        if not self.lean:
            return 0
        with self._lock:
            below = [s for r, s in self._shards if r == rank and s < step]
        if not below:
            return 0
        keep = max(below)
        return self._drop(lambda k: k[0] != rank or k[1] >= keep)

    def put(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        self.make_room(rank, snapshot.step)
        return super().put(rank, snapshot)

    def reserve(self, nbytes: int) -> np.ndarray:
        """A buffer for a copy on its way (a dropped copy's, when one of that size is free)."""
        return self._buffer(nbytes)

    def adopt(self, rank: int, snapshot: Snapshot) -> ShardInfo:
        """Keep `snapshot` as `rank`'s copy, its payload (a `reserve`d buffer) and all."""
        self.make_room(rank, snapshot.step)
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
        on_replicated: Callable[[int, int, int | None], None] | None = None,
    ):
        self._store = store
        self._timeout_s = timeout_s
        self._here = here  # this node's address as Ray sees it (None: asked when needed)
        self._urgent_after_s = urgent_after_s
        self._urgent_strides = urgent_strides
        self._cv = threading.Condition()
        self._peers: dict[str, Any] = {}
        self._on_replicated = on_replicated
        # rank -> [(step, generation)] offered, not yet sent, oldest first (unbounded: the
        # newest alone)
        self._pending: dict[int, list[tuple[int, int | None]]] = {}
        self._newest: dict[int, tuple[int, int | None]] = {}  # rank -> (step, generation)
        self._stride = 1  # only steps that are multiples of this are sent (set_stride)
        self._bounded = False  # send every step of the grid, in order (set_stride)
        self._wanted: int | None = None  # a step every rank's shard of goes next
        # the round being sent, one shard at a time: (rank, step, generation)
        self._batch: list[tuple[int, int, int | None]] = []
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
        self._retry_s = RETRY_S[0]
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
                    queued = self._pending.get(rank, [])
                    if not queued or steps[-1] > queued[-1][0]:
                        newest = self._newest.get(rank)
                        gen = newest[1] if newest and newest[0] == steps[-1] else None
                        self._pending[rank] = [*queued, (steps[-1], gen)]
                self._behind_since = time.monotonic() if self._has_work() else None
                self._cv.notify_all()

    def set_stride(self, stride: int, bounded: bool = False) -> None:
        """Send only steps that are multiples of `stride` (the same on every node, so the
        ranks' copies meet on common steps): the supervisor thins fast steps out.
        `bounded`: every one of them, in order (the ranks wait for them)."""
        with self._cv:
            self._stride = max(1, int(stride))
            self._bounded = bounded

    @property
    def stride(self) -> int:
        return self._stride

    @property
    def has_peers(self) -> bool:
        return bool(self._peers)

    def offer(self, rank: int, step: int, generation: int | None = None) -> None:
        """`rank`'s shard of `step` (written by `generation`) was just stored here: send it
        when the thread is free."""
        with self._cv:
            self._newest[rank] = (step, generation)  # for new peers (set_peers)
            queued = unrolled(self._pending.get(rank, []), step, generation)
            if queued:
                self._pending[rank] = queued
            else:  # never an empty queue: the senders take each rank's first
                self._pending.pop(rank, None)
            if step % self._stride or not self._peers:
                return
            if queued and step <= queued[-1][0]:
                return
            self._pending[rank] = (
                [*queued, (step, generation)] if self._bounded else [(step, generation)]
            )
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
            steps = {s for queued in self._pending.values() for s, _ in queued} | self._sending
            if self._wanted is not None:
                steps.add(self._wanted)
            return steps

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "peers": sorted(self._peers),
                "queued": sum(map(len, self._pending.values())) + len(self._batch),
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

    def _next(self, urgent: bool) -> tuple[int, int, int | None, dict[str, Any]] | None:
        """The (rank, step, generation) shard for this thread to send now, and the peers;
        None: stop.
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
                    self._batch = []
                    for rank, steps in stored:
                        if step not in steps:
                            continue
                        queued = self._pending.get(rank, [])
                        gen = next((g for s, g in queued if s == step), None)
                        self._batch.append((rank, step, gen))
                        left = [(s, g) for s, g in queued if s > step]  # sent with this one
                        if left:
                            self._pending[rank] = left
                        else:
                            self._pending.pop(rank, None)
                            self._unsent.pop(rank, None)
                elif self._bounded:  # each rank's oldest, in step order
                    self._batch = sorted(
                        ((r, *queued[0]) for r, queued in self._pending.items()),
                        key=lambda x: (x[1], x[0]),
                    )
                    for rank, _, _ in self._batch:
                        del self._pending[rank][0]
                        if not self._pending[rank]:
                            del self._pending[rank]
                            self._unsent.pop(rank, None)
                else:
                    self._batch = sorted((r, *q[-1]) for r, q in self._pending.items())
                    self._pending, self._unsent = {}, {}
            if not self._batch:  # the step asked for is held for no rank
                self._after_round()
                return self._next(urgent)
            rank, step, gen = self._batch.pop(0)
            self._sending = {step} | {s for _, s, _ in self._batch}
            self._busy = True
            if urgent:
                self.sends["urgent"] += 1
            return rank, step, gen, dict(self._peers)

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
            rank, step, gen, peers = item
            t0 = time.perf_counter()
            nbytes, outcome = 0, "failed"
            try:
                nbytes, outcome = self._send(rank, step, peers, gen)
                if outcome in ("sent", "unsendable") and self._on_replicated is not None:
                    self._on_replicated(rank, step, gen)
            except Exception as e:  # never the end of the thread: reported, step uncommitted
                with self._cv:
                    self.errors += 1
                    self.last_error = f"rank {rank} step {step}: {type(e).__name__}: {e}"[:300]
            finally:
                with self._cv:
                    if outcome == "failed" and self._bounded and not self._stop:
                        self._again(rank, step, gen)
                    elif outcome == "sent":
                        self._retry_s = RETRY_S[0]
                    self._busy = False
                    self.seconds += time.perf_counter() - t0
                    self.sent_bytes += nbytes
                    if not self._batch:
                        self._sending = set()
                        self._after_round()
                    self._cv.notify_all()

    def _again(self, rank: int, step: int, gen: int | None) -> None:
        """Bounded lag: a copy a peer failed goes first again, after a back-off this thread
        waits out holding the sender (called with the lock held)."""
        queued = [x for x in self._pending.get(rank, []) if x[0] != step]
        self._pending[rank] = [(step, gen), *queued]
        self._cv.wait_for(lambda: self._stop, timeout=self._retry_s)
        self._retry_s = min(2 * self._retry_s, RETRY_S[1])

    def _send(
        self, rank: int, step: int, peers: dict[str, Any], gen: int | None = None
    ) -> tuple[int, str]:
        """Copy `rank`'s shard of `step` (written by generation `gen`) to every peer:
        (bytes sent, "sent" when it reached every peer, "failed" when one failed,
        "fenced" when the peers refused it (a recovery rolled `gen` back to before `step`),
        "unsendable" when the shard is gone or damaged)."""
        snap = self._store.get(rank, step)
        if snap is None:
            return 0, "unsendable"  # dropped meanwhile (a rollback)
        if not snap.intact():
            # Damaged here since its hand-over: a copy would spread it. The step stays
            # uncommitted on this rank (an older commit is the restore point).
            with self._cv:
                self.errors += 1
                self.last_error = f"rank {rank}'s shard of step {step} is corrupt: not sent"
            return 0, "unsendable"
        for node in set(self._links) - set(peers):  # no longer a peer
            self._links.pop(node)[1].close()
        through_ray, failed, fenced = {}, {}, set()
        for node, peer in peers.items():
            link = self._link(node, peer)
            if link is not None:
                try:
                    link.put(rank, snap, self._timeout_s, generation=gen)
                    with self._cv:
                        self.sends["channel"] += 1
                    continue
                except StaleCopy as e:  # refused: through Ray it would be refused again
                    failed[node] = str(e)
                    fenced.add(node)
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
            failed.update(self._send_through_ray(rank, snap, through_ray, gen, fenced))
        if failed:
            with self._cv:
                self.errors += 1
                self.last_error = "; ".join(
                    f"step {step} to {node[:12]}: {why}" for node, why in sorted(failed.items())
                )
        sent = snap.nbytes * (len(peers) - len(failed))
        if failed and set(failed) <= fenced:
            # A generation a recovery rolled back wrote it: never kept anywhere, not sent
            # again, counted for nothing.
            return sent, "fenced"
        return sent, "failed" if failed else "sent"

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

    def _send_through_ray(
        self,
        rank: int,
        snap: Snapshot,
        peers: dict[str, Any],
        gen: int | None = None,
        fenced: set[str] | None = None,
    ) -> dict:
        """Copy `snap` to `peers` through Ray's object store; node -> why, for those that
        failed or did not answer in time (those that refused it as fenced off also go in
        `fenced`)."""
        shared = ray.put(snap)  # serialized once, read by every peer
        refs = {peer.put_replica.remote(rank, shared, gen): node for node, peer in peers.items()}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=self._timeout_s)
        failed = {refs[r]: f"no answer within {self._timeout_s:g} s" for r in late}
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # the peer is gone or refused: reported, step uncommitted
                failed[refs[ref]] = f"{type(e).__name__}: {e}"[:300]
                if isinstance(e, StaleCopy) and fenced is not None:
                    fenced.add(refs[ref])
        with self._cv:
            self.sends["ray"] += len(peers) - len(failed)
        return failed
