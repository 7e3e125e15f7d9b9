"""The per-node agent: hosts the node's shard store and aggregates its workers' heartbeats.

One agent per node, pinned there. Workers hand snapshots and heartbeats to their own node's
agent; the supervisor asks each agent for one report per interval, so its load grows with
nodes, not ranks.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from stalwart.ckpt.dcp_format import shard_signature
from stalwart.ckpt.footprint import LEAN_VERSIONS, NEWEST_KEPT, VERSIONS, free_bytes, mem_available
from stalwart.ckpt.ring import RingReader
from stalwart.ckpt.snapshot import Snapshot, TensorMeta, payload_checksum
from stalwart.ckpt.store import ShardInfo, ShmShardStore
from stalwart.orchestrator.agent.channel import KEY_BYTES, ChannelServer, StaleCopy
from stalwart.orchestrator.agent.copy_gate import CopyGate
from stalwart.orchestrator.agent.durable_writes import DurableWrites
from stalwart.orchestrator.agent.fence import Fence, Refusals
from stalwart.orchestrator.agent.gpu_watch import GpuWatch
from stalwart.orchestrator.agent.host import host_key, usable_cores
from stalwart.orchestrator.agent.own_store import OwnStore
from stalwart.orchestrator.agent.raylet_watch import RayletWatch
from stalwart.orchestrator.agent.replication import ReplicaStore, Replicator
from stalwart.orchestrator.agent.rings import RingHub, newest_beats
from stalwart.orchestrator.agent.stacks import py_spy_dump
from stalwart.orchestrator.agent.tcp_stats import TcpStats
from stalwart.orchestrator.chaos import actions as chaos_actions

SHM_ROOT = "/dev/shm/stalwart"
# An agent no supervisor has called for this long exits (a supervisor polls it several
# times a second, but may be busy for minutes: scheduling, a replacement waiting for room).
LEASE_S = 600.0
LEASE_CHECK_S = 2.0
OUTPUT_KEPT = 20_000  # printed lines waiting for a report, at most (the oldest go first)
OUTPUT_PER_REPORT = 5_000


class NodeAgent:
    def __init__(
        self,
        node_id: str,
        store_key: str,
        shm_root: str | None = SHM_ROOT,
        gpu_probe: str = "none",
        gpu_interval_s: float = 2.0,
        lease_s: float | None = LEASE_S,
        durable: bool = False,
        lean: bool = False,
    ):
        """`lean`: the job's memory budget takes the lean rule (ckpt/footprint.py): rings
        of 2 slots, whose older shard goes when its rank names a newer floor, and 2 copies
        of each peer's shard."""
        self.node_id = node_id
        self._lean = lean
        if durable:
            # The job persists: the DCP files this agent writes need torch (2 s of CPU).
            # Imported now, beside the workers' start, not at the first durable step while
            # the ranks train ahead of it (the agent starts without torch otherwise).
            threading.Thread(target=_import_torch, daemon=True, name="import-torch").start()
        self.store_key = store_key
        # The TCP segments this node's connections sent, and sent again, per peer: which
        # link drops packets (supervisor/losses.py). Read at most once a second.
        self.tcp = TcpStats()
        self._fired: set[int] = set()  # chaos faults carried out on this node's ranks
        # Shared-memory slot files when this machine has room for them (workers write into
        # them directly); otherwise shards travel through Ray and live in this process.
        root = os.path.join(shm_root, store_key, node_id[:16]) if shm_root else None
        if shm_root and os.path.isdir(shm_root):
            ShmShardStore.reap_orphans(shm_root)
        self.shm_root = shm_root
        usable = root is not None and ShmShardStore.usable(os.path.dirname(root))
        self.store = OwnStore(ShmShardStore(root) if usable else None)
        # The ranks' snapshot rings in that folder (ckpt/ring.py): each rank copies its
        # snapshots into its ring and this agent finds them there, with no call per step.
        slots = LEAN_VERSIONS if lean else VERSIONS
        self.rings = (
            RingHub(root, self._ring_shard, self._ring_full, slots) if self.store.shm else None
        )
        if self.rings is not None:
            self.store.on_fall_back = self.rings.close_rank
        # Copies of the shards of this node's replica-group peers (ckpt/replicas.py), and
        # the threads that send this node's shards to them, and the channel (its own key)
        # peers put copies through and restoring workers fetch shards from.
        self.replicas = ReplicaStore(lean)
        # What the ranks wait on when the copies must not lag (checkpoint.max_lag_steps).
        self.gate = CopyGate(self.rings)
        self._bounded = False
        self.replicator = Replicator(self.store, on_replicated=self.gate.replicated)
        self.fence = Fence()  # the job's rollbacks: what hand-overs and copies are stale
        self.refusals = Refusals()  # what the fence refused, for the supervisor's events
        self.channel = ChannelServer(
            os.urandom(KEY_BYTES),
            self._channel_put,
            self.get_shard,
            self.replicas.reserve,
            before_put=self.replicas.make_room,
            fenced=self._refuses_copy,
        )
        self._refuse_upto = -1  # chaos drop_replicas: shards of steps <= this are lost
        self._prune_lock = threading.Lock()
        self._prune_seq: tuple[int, int] = (-1, -1)  # (supervisor incarnation, number)
        self._corrupt_next: dict[int, int] = {}  # chaos corrupt_shard: rank -> hand-overs
        self.writes = DurableWrites(node_id, self._held)  # this node's writes to storage
        self._sigs: dict[int, str | None] = {}  # rank -> its shards' signature (ReplicaPlan)
        self._lock = threading.Lock()
        self._beats: dict[int, dict[str, Any]] = {}
        self._output: list[dict[str, Any]] = []  # the ranks' printed lines, for the report
        self._output_dropped = 0
        self._stop = threading.Event()
        self.gpu = GpuWatch(gpu_probe, node_id, gpu_interval_s)
        self._contact = time.monotonic()  # the supervisor's last report request
        self.raylet_watch = RayletWatch(self._raylet_gone).start()
        if lease_s is not None:
            # The agent outlives its supervisor (it is detached: a restarted supervisor
            # takes the job back from this memory), but not for long without one.
            threading.Thread(
                target=self._lease_loop, args=(lease_s,), daemon=True, name="stalwart-lease"
            ).start()

    def _raylet_gone(self) -> None:
        """This node's raylet died alone: its processes are Ray's to take down once the
        GCS declares the node dead (seconds of health checks). The job's ranks here and
        this agent go now, so the supervisor sees the node lost at once."""
        print(
            f"stalwart: node {self.node_id}: its raylet died; stopping this job's processes here",
            file=sys.stderr,
            flush=True,
        )
        self.kill_job_here(-1)

    def _lease_loop(self, lease_s: float) -> None:
        """Exit, freeing this node's shards, once no supervisor asked for a report for
        `lease_s` (it asks several times a second): its driver is gone and no successor
        took the job back. No call to anyone: thousands of agents cost the GCS nothing."""
        while not self._stop.wait(LEASE_CHECK_S):
            if time.monotonic() - self._contact > lease_s:
                self.close()
                os._exit(0)  # a detached actor: nobody else would stop it

    def ping(self) -> str:
        self._contact = time.monotonic()
        return self.node_id

    def memory(self, shm_dir: str) -> dict[str, Any]:
        """This node's room: its memory available and the free bytes where its ranks' rings
        go (the supervisor's memory preflight), the cores its processes may use and which
        machine it is (agent/host.py: the standby choice)."""
        return {
            "mem_available": mem_available(),
            "shm_free": free_bytes(shm_dir),
            "cores": usable_cores(),
            "host": host_key(),
        }

    def open_ring(
        self, rank: int, metas: tuple[TensorMeta, ...], payload_nbytes: int, skel_nbytes: int
    ) -> tuple[str, str] | None:
        """A snapshot ring for `rank`'s shards of this tensor layout: (its file, the node's
        doorbell). None: this node's shared memory has no room (any more): send shards
        to put_shard() instead."""
        if self.rings is None or self.store.shm is None:
            return None
        try:
            return self.rings.open(rank, tuple(metas), payload_nbytes, skel_nbytes)
        except OSError as e:
            self.store.fall_back(f"no room for rank {rank}'s snapshot ring: {e}")
            return None

    def _ring_shard(
        self, reader: RingReader, slot: int, step: int, generation: int, skeleton: bytes
    ) -> bool:
        """A rank published `step` in its ring: keep it as its shard? A hand-over of a
        generation older than the newest rollback is refused (a shard of an aborted
        generation counts toward no commit), as is one lost with the node's memory."""
        rank = reader.rank
        if self._refused(rank, step, generation):
            return False
        checksum = payload_checksum(reader.ring.payload(slot))  # damage after this is found
        if not self.store.commit_ring(rank, step, skeleton, reader, slot, checksum):
            # Published as the node's shared memory filled: its ring closed with the move
            # into this agent's memory, and the shard with it. Never sent to the peers, so
            # its rank must not wait for its copies (as for one lost with the node's memory).
            self.gate.replicated(rank, step, generation)
            return False
        # Trimmed only by the supervisor's prunes, which know what persistence and the
        # next commit still need; a ring the prunes leave full moves a shard out instead.
        self._after_hand_over(rank, step, generation)
        return True

    def _ring_full(self, reader: RingReader) -> None:
        """Every slot of a ring is kept: move the oldest shard not being sent to peers out
        of the ring, so the rank's next snapshot finds a slot. Under the lean rule, drop
        those below the rank's floor instead (ckpt/ring.py): none moves out."""
        pinned = self.replicator.pinned()
        if self._lean:
            floor = reader.ring.floor
            if floor is None or self.fence.stale(floor[0]):
                return  # none named yet, or by a generation a roll back ended
            for step in reader.held_steps():
                if step < floor[1] and step not in pinned:
                    self.store.discard(reader.rank, step)
            return
        for step in reader.held_steps():
            if step not in pinned and self.store.move_out(reader.rank, step):
                return

    def _refused(self, rank: int, step: int, generation: int | None) -> bool:
        """A hand-over not kept: of an aborted generation, or lost with the node's memory
        (chaos drop_replicas). The latter is never sent to the peers either: its rank must
        not wait for those copies (checkpoint.max_lag_steps), so it counts as passed, as
        a shard the replicator cannot send does; the bound holds again from the next step
        kept."""
        if self.fence.stale(generation):
            self.refusals.note(
                "ring",
                generation,
                f"rank {rank}'s snapshot of step {step} refused: written by generation "
                f"{generation}, which a recovery ended (generation {self.fence.generation} "
                "runs now)",
            )
            return True
        if step > self._refuse_upto:
            return False
        self.gate.replicated(rank, step, generation)
        return True

    def put_shard(self, rank: int, snapshot: Snapshot, generation: int | None = None) -> ShardInfo:
        if self._refused(rank, snapshot.step, generation):
            return ShardInfo(rank, snapshot.step, 0)
        info = self.store.put(rank, snapshot)
        self._after_hand_over(rank, snapshot.step, generation)
        return info

    def fill_shm(self, seconds: float) -> int:
        """Chaos fill_shm: this node's checkpoint.shm_dir file system is full for `seconds`
        (chaos/actions.py refuses a large one). Returns the bytes taken."""
        os.makedirs(self.shm_root, exist_ok=True)
        return chaos_actions.fill_file_system(self.shm_root, seconds)

    def corrupt_shards(self, rank: int, following: int = 0) -> list[int]:
        """Chaos corrupt_shard: flip a byte in every shard of `rank` this node's own store
        holds, and in the next `following` it is handed (damaged memory, a torn write);
        copies held for peers are left alone. Returns the steps hit so far."""
        with self._lock:
            self._corrupt_next[rank] = following
        return [s for s in self.store.stored().get(rank, []) if self._corrupt(rank, s)]

    def _corrupt(self, rank: int, step: int) -> bool:
        snap = self.store.get(rank, step)
        if snap is None or not len(snap.payload):
            return False
        payload = snap.payload
        payload[len(payload) // 2] ^= 0xFF
        return True

    def _after_hand_over(self, rank: int, step: int, generation: int | None = None) -> None:
        with self._lock:
            left = self._corrupt_next.get(rank, 0)
            if left:
                self._corrupt_next[rank] = left - 1
        if left:
            self._corrupt(rank, step)  # chaos corrupt_shard, still at work
        self.replicator.offer(rank, step, generation)

    def discard(self, rank: int, step: int) -> None:
        """A rank could not restore `rank`'s shard of `step` from here (corrupt, torn):
        drop it, own store and copies alike."""
        for store in (self.store, self.replicas):
            store.discard(rank, step)

    def _held(self, rank: int, step: int) -> Snapshot:
        """`rank`'s shard of `step` from this node's memory, or why it is not here."""
        snap = self.get_shard(rank, step)
        if snap is None:
            raise RuntimeError(
                f"node {self.node_id[:12]} no longer holds rank {rank}'s shard of step "
                f"{step} (it holds steps {self.store.stored().get(rank, [])} of its own "
                f"and {self.replicas.stored().get(rank, [])} as copies)"
            )
        return snap

    def get_shard(self, rank: int, step: int) -> Snapshot | None:
        """`rank`'s shard of `step` from this node's memory: its own store, else a copy."""
        own = self.store.get(rank, step)
        return own if own is not None else self.replicas.get(rank, step)

    def locate_shard(self, rank: int, step: int) -> dict[str, Any] | None:
        """Where this node's shared memory holds `rank`'s own shard of `step`, for a rank
        of this node to read in place (no copy through Ray): the file, offset and bytes
        of its payload, and its skeleton, layout and checksum; None: not there."""
        where = self.store.locate(rank, step)
        snap = self.store.get(rank, step) if where is not None else None
        if snap is None:
            return None
        path, offset, nbytes = where
        return {
            "path": path,
            "offset": offset,
            "nbytes": nbytes,
            "skeleton": bytes(snap.skeleton),
            "metas": snap.metas,
            "checksum": snap.checksum,
        }

    def get_layout(self, rank: int, step: int) -> tuple[bytes, tuple] | None:
        """`rank`'s shard of `step`, its skeleton and tensor layout only (what a reshard
        plans with before it fetches the shards it needs)."""
        snap = self.get_shard(rank, step)
        return (bytes(snap.skeleton), snap.metas) if snap is not None else None

    # --- peer replicas ----------------------------------------------------------------------

    def set_peers(self, peers: dict[str, Any]) -> None:
        """node -> agent: the peers that keep copies of this node's shards."""
        self.replicator.set_peers(peers)
        self._publish_gate()

    def set_stride(self, stride: int, bounded: bool = False) -> None:
        """Copies of every `stride` steps; `bounded`: all of them, and the ranks wait for
        them (checkpoint.max_lag_steps)."""
        self.replicator.set_stride(stride, bounded)
        self._bounded = bounded
        self._publish_gate()

    def _publish_gate(self) -> None:
        """The stride the ranks wait on: the replicator's, with a bound and peers; else 0."""
        bounded = self._bounded and self.replicator.has_peers
        self.gate.set_stride(self.replicator.stride if bounded else 0)

    def copies_reached(
        self, rank: int, generation: int, step: int, timeout_s: float
    ) -> tuple[int, tuple[int, int] | None]:
        """For a rank that sends its shards through Ray (no ring to read): CopyGate.reached."""
        return self.gate.reached(rank, generation, step, timeout_s)

    def replicate(self, step: int) -> None:
        """Send this node's shards of `step` to the peers next (in the background)."""
        self.replicator.replicate(step)

    def put_replica(
        self, rank: int, snapshot: Snapshot, generation: int | None = None
    ) -> ShardInfo:
        """A peer's copy of `rank`'s shard (written by `generation`), through Ray (a peer
        that has no channel here). Refused (StaleCopy) when a recovery rolled that
        generation back to before its step (agent/fence.py)."""
        if (why := self._refuses_copy(generation, snapshot.step)) is not None:
            raise StaleCopy(why)
        if snapshot.step <= self._refuse_upto:  # lost with the node's memory (chaos)
            return ShardInfo(rank, snapshot.step, 0)
        return self.replicas.put(rank, snapshot)

    def _refuses_copy(self, generation: int | None, step: int) -> str | None:
        """Why a peer's copy of `step` written by `generation` is refused (noted), or None."""
        why = self.fence.refuses(generation, step)
        if why is not None:
            self.refusals.note("replicas", generation, f"a peer's copy of {why}")
        return why

    def _channel_put(self, rank: int, snapshot: Snapshot) -> None:
        """A peer's copy over the channel, read into a buffer of the replica store."""
        if snapshot.step > self._refuse_upto:  # else lost with the node's memory (chaos)
            self.replicas.adopt(rank, snapshot)

    def channel_address(self, caller: str | None = None) -> dict[str, Any]:
        """{host, port, key} of this agent's channel (agent/channel.py) for a caller on the
        node address `caller`: handed out over Ray only, to the job's own processes."""
        return self.channel.address(caller)

    def wipe(self, up_to: int) -> int:
        """Chaos drop_replicas: lose every shard this node holds, its own and its copies,
        and those of steps <= `up_to` still on their way here. Returns how many it lost."""
        self._refuse_upto = max(self._refuse_upto, up_to)
        n = sum(len(v) for v in self.store.stored().values())
        n += sum(len(v) for v in self.replicas.stored().values())
        self.store.drop_below(1 << 62)
        self.replicas.drop_below(1 << 62)
        return n

    # --- durable tier -----------------------------------------------------------------------

    def persist(
        self,
        target: dict[str, Any],
        step: int,
        ranks: list[int],
        fault: dict | None = None,
        generation: int | None = None,
    ) -> list[dict]:
        """Write `ranks`' shards of `step` from this node's memory to the durable target,
        each as a rank's file of a DCP checkpoint named for `generation`, the one that
        asked (agent/durable_writes.py). Returns what the manifest needs of them; raises
        DurableError when the target keeps failing. `fault`: chaos `during: persist`, a
        kill_node carried out after the first shard."""
        die = None if fault is None else lambda: self._die_for(fault)
        return self.writes.write(target, step, ranks, generation, die)

    def _die_for(self, fault: dict[str, Any]) -> None:
        """Carry out a kill_node on this node, from this agent: the raylet and all under it
        on a cluster the command started, else the job's processes here. Never returns."""
        self.note_fault(fault["index"])
        if fault.get("scope") == "raylet":
            chaos_actions.kill_node()
        self.kill_job_here(-1)

    def storage_outage(self, target: dict[str, Any], seconds: float) -> None:
        """Chaos storage_unavailable: this node's writes to `target` fail for `seconds`."""
        self.writes.store(target).fail_for(seconds)

    def note_fault(self, index: int) -> None:
        """A chaos fault (by its index in the spec) is being carried out."""
        with self._lock:
            self._fired.add(index)

    def kill_job_here(self, caller: int) -> None:
        """Chaos kill_node on a cluster this job does not own: kill the job's processes on
        this node (the ranks that beat here, then this agent, at once: the node is gone
        by the time anyone notices a rank's death) and nothing else: a pid is killed only
        while it is still a Ray worker of this node's raylet. Never returns. `caller` (the
        rank carrying the fault out) waits for this agent's death, then kills itself."""
        pids = {b.get("pid") for b in self._newest_beats().values()} - {caller, None}
        for pid in sorted(pids):
            chaos_actions.kill_if_sibling(pid)
        os.kill(os.getpid(), signal.SIGKILL)

    def worker_output(self, lines: list[dict[str, Any]]) -> None:
        """A batch of lines one of this node's ranks printed (worker/output.py); they go to
        the supervisor with the next report, so its load grows with nodes, not ranks."""
        with self._lock:
            self._output.extend(lines)
            over = len(self._output) - OUTPUT_KEPT
            if over > 0:
                del self._output[:over]
                self._output_dropped += over

    def heartbeat(self, rank: int, beat: dict[str, Any]) -> None:
        beat["received_at"] = time.time()
        with self._lock:
            self._beats[rank] = beat

    def _newest_beats(self) -> dict[int, dict[str, Any]]:
        """Each rank's newest heartbeat, from its ring or its last call (rings.py), kept:
        a ring that closes (the shared memory filled up) never brings back an older one."""
        ringed = self.rings.beats() if self.rings is not None else {}
        with self._lock:
            self._beats = newest_beats(self._beats, ringed)
            return dict(self._beats)

    def forget(self, rank: int) -> None:
        with self._lock:
            self._beats.pop(rank, None)
        self.store.release_rank(rank)
        if self.rings is not None:
            self.rings.close_rank(rank)  # its kept shards stay until dropped

    def close(self) -> None:
        """Free the node's shards (their shared-memory files) before the agent goes away."""
        self._stop.set()
        self.raylet_watch.close()
        self.replicator.close()
        self.channel.close()
        if self.rings is not None:
            self.rings.close()
        self.gpu.close()
        self.store.close()
        self.replicas.close()

    def rekey(self, ranks: dict[int, int]) -> int:
        """The job's ranks were renumbered (elastic shrink): old rank -> new rank."""
        with self._lock:
            self._beats.clear()
        ranks = {int(k): v for k, v in ranks.items()}
        self._sigs = {}
        if self.rings is not None:
            self.rings.close_rank(None)  # the workers open rings under their new ranks
        self.replicas.rekey(ranks)
        return self.store.rekey(ranks)

    def prune(
        self,
        below: int | None = None,
        above: int | None = None,
        keep: list[int] | None = None,
        newest: int = NEWEST_KEPT,
        fresh_above: int | None = None,
        seq: tuple[int, int] | None = None,
        fence: int | None = None,
    ) -> int:
        """Drop steps from this node's memory: above `above` (a rollback), below `below`;
        with `keep`, everything but those steps, the steps being replicated, each rank's
        `newest` newest (own store) and the copies newer than `fresh_above` (the newest
        commit: copies on their way to the next one). Calls to an agent run on several
        threads and may overtake each other: one numbered `seq` older than the last one
        applied is stale and ignored. `seq` is (the supervisor's incarnation, its count): a
        restarted supervisor's prunes, counted from 0 again, still come after its
        predecessor's. `fence` (with a rollback): the generation about to start; shards
        handed over by older ones are refused from now on."""
        with self._prune_lock:
            if seq is not None:
                seq = (int(seq[0]), int(seq[1]))
                if seq <= self._prune_seq:
                    return 0
                self._prune_seq = seq
            if fence is not None:
                self.fence.rolled_back(fence, above)
            dropped = 0
            for store in (self.store, self.replicas):
                if above is not None:
                    dropped += store.drop_above(above)
                if keep is not None:
                    kept = set(keep) | self.replicator.pinned()
                    if store is self.replicas and fresh_above is not None:
                        kept |= {s for v in store.stored().values() for s in v if s > fresh_above}
                    dropped += store.trim(kept, newest if store is self.store else 0, below)
                elif below is not None:
                    dropped += store.drop_below(below)
            return dropped

    # --- GPU health -----------------------------------------------------------------------

    def inject_gpu_fault(self, index: int, xid: int) -> None:
        """Chaos: the fake probe reports Xid `xid` on GPU `index` (read at once)."""
        self.gpu.inject(index, xid)

    # --- diagnostics ------------------------------------------------------------------------

    def dump_stacks(self, pid: int, timeout_s: float = 10.0) -> dict[str, Any]:
        """A process's Python stacks from the outside (py-spy), for a worker that cannot
        answer itself (its interpreter is stuck in C code holding the GIL)."""
        return py_spy_dump(pid, timeout_s)

    def _shard_sigs(self) -> dict[int, str]:
        """rank -> the signature of the DTensor shards its snapshots hold (ranks holding the
        same ones: HSDP's replicas), for the mesh-aware replica placement; each rank's
        worked out once (its layout does not change), ranks with no DTensors left out."""
        for rank, steps in self.store.stored().items():
            if rank not in self._sigs:
                self._sigs[rank] = _signature_of(self.store, rank, steps)
        return {r: sig for r, sig in self._sigs.items() if sig is not None}

    def report(self) -> dict[str, Any]:
        self._contact = time.monotonic()
        beats = self._newest_beats()
        with self._lock:
            output, self._output = (
                self._output[:OUTPUT_PER_REPORT],
                self._output[OUTPUT_PER_REPORT:],
            )
            if self._output_dropped and output:
                output.insert(
                    0,
                    {
                        **{k: output[0][k] for k in ("ts", "rank", "gen")},
                        "stream": "err",
                        "line": f"[stalwart: {self._output_dropped} lines dropped on the node, "
                        "output too fast]",
                    },
                )
                self._output_dropped = 0
            return {
                "node": self.node_id,
                "output": output,
                "at": time.time(),
                "beats": beats,
                "stored": self.store.stored(),
                "replicas": self.replicas.stored(),
                # What the checkpoints take: rings, slot files, copies, spare buffers.
                "held_bytes": self.store.allocated() + self.replicas.allocated(),
                "notes": self.store.take_notes() + self.refusals.take(),
                "fence": self.fence.generation,
                "shard_sigs": self._shard_sigs(),
                "replication": self.replicator.status(),
                "fired": sorted(self._fired),
                "gpus": self.gpu.report(),
                "gpu_probe": self.gpu.kind,
                "gpu_probe_error": self.gpu.error,
                "ip": self.tcp.ip(),
                "tcp": self.tcp.report(),
            }


def _signature_of(store: Any, rank: int, steps: list[int]) -> str | None:
    snap = store.get(rank, max(steps)) if steps else None
    return shard_signature(bytes(snap.skeleton)) if snap is not None else None


def _import_torch() -> None:
    import torch  # noqa: F401
