"""The checkpoint tiers seen from the supervisor: what the nodes' memory holds, which step is
committed, what each node may drop, where each rank restores from, and durable persistence.

A step is committed when every rank's shard for it is held on `copies` distinct live nodes
(ckpt/commit.py); the newest two commits are kept. The agents report what they hold; this
class turns that into the commit, the nodes' trimming (`prune`), the restore sources of the
next generation (ckpt/holdings.py) and the steps to persist (supervisor/persist.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray

from stalwart.ckpt import holdings
from stalwart.ckpt.commit import CommitTracker
from stalwart.ckpt.durable import CorruptCheckpoint, DurableError, Manifest
from stalwart.ckpt.footprint import NEWEST_KEPT, commits_kept
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.persist import Persister
from stalwart.orchestrator.supervisor.pool import WorkerPool
from stalwart.orchestrator.supervisor.replica_plan import ReplicaPlan
from stalwart.orchestrator.supervisor.resources import SchedulingError

FINAL_PERSIST_TIMEOUT_S = 300.0  # a finished job waits this long for its last checkpoint
# A durable write waits this long for a rank's own node to report its shard of the step
# (a peer's report of its copy came in first); then a peer holding it writes it.
OWN_REPORT_WAIT_S = 2.0


class Checkpoints:
    def __init__(
        self, spec: JobSpec, pool: WorkerPool, emit: Callable[..., None], incarnation: int = 0
    ):
        """`incarnation`: how many supervisors of this job came before this one (it numbers
        the prunes the agents receive)."""
        self.spec = spec
        self.incarnation = incarnation
        self.pool = pool
        self._emit = emit
        # Two commits, one under the lean rule (ckpt/footprint.py).
        self.commits_kept = commits_kept(spec.checkpoint.versions)
        self.commit = CommitTracker(pool.world, self.commits_kept)
        self.stored: dict[str, dict[int, list[int]]] = {}  # node -> its own store's steps
        self.replicas_held: dict[str, dict[int, list[int]]] = {}  # node -> copies it holds
        self.replication: dict[str, dict[str, Any]] = {}  # node -> its replicator's status
        self.held_bytes: dict[str, int] = {}  # node -> bytes its memory holds for the job
        self.fence = 0  # the newest generation an agent was told of (they refuse older ones)
        # rank -> (node or None for storage, whose shard, step, tier) of its last restore
        self.last_sources: dict[int, tuple[str | None, int, int, str | None]] = {}
        self.bad_durable: set[int] = set()  # durable steps a rank could not restore
        # The newest step committed with its copies (not merely complete in memory, as a
        # roll back's restore point may be): kept until a newer one is, so a restore that
        # fails on a single copy has it to fall back on.
        self.safe: int | None = None
        self.plan = ReplicaPlan(spec.checkpoint, pool, emit)
        # rank -> whose shard it restores (a rank added by a grow, until it has its own)
        self.borrowed: dict[int, int] = {}
        # The newest committed step when the world last changed size: a restore of it or
        # an older step finds a sharded model's shards in the old layout (`reshard_from`).
        self.resized_at: int | None = None
        self._kept: tuple[int, ...] = ()  # the steps last sent to agents as `keep`
        self._dropped_below: int | None = None
        self._prune_seq = 0  # numbers the agents' prune calls (they may overtake)
        self._own_wait: tuple[int, float] | None = None  # (step, since): OWN_REPORT_WAIT_S
        persist = spec.checkpoint.persist
        self.persister = (
            Persister(persist, spec.name, emit, run=pool.store_key) if persist.uri else None
        )
        self.resumed_from: int | None = None
        # Chaos `during: persist`: (step, writing nodes) -> node -> the fault its agent
        # carries out while it writes (FaultBook.wire sets it).
        self.chaos_persist: Callable[[int, list[str]], dict[str, dict]] = lambda s, n: {}

    def restore_point(self, at_step: int, durable: bool) -> tuple[int, Callable[[], int | None]]:
        """What a chaos fault with after_commit (after_persist: `durable`) waits for: the
        step it wants and how to read the step there is. Committed: the newest snapshot at
        or before `at_step`. Persisted: the newest step of the durable grid at or before it
        (checkpoint.persist.every_steps), or any step where the tier persists by time."""
        if not durable:
            every = self.spec.checkpoint.every_steps
            return at_step // every * every, lambda: self.commit.committed
        every = self.spec.checkpoint.persist.every_steps
        persister = self.persister
        return (
            at_step // every * every if every else 0
        ), lambda: persister.last_step if persister is not None else None

    # --- what memory holds ------------------------------------------------------------------

    def absorb(self, reports: list[dict[str, Any]], step: int) -> None:
        """Take the agents' reports: holdings, the commit, the copies to ask for, trimming.
        `step`: the job's newest step now."""
        merged: dict[int, set[int]] = defaultdict(set)
        for rep in reports:
            self.stored[rep["node"]] = rep["stored"]
            self.replicas_held[rep["node"]] = rep.get("replicas", {})
            self.replication[rep["node"]] = rep.get("replication", {})
            self.held_bytes[rep["node"]] = rep.get("held_bytes", 0)
            self.plan.holds[rep["node"]] = frozenset(rep.get("shard_sigs", {}).values())
            self.fence = max(self.fence, rep.get("fence", 0))
            for rank, steps in rep["stored"].items():
                merged[int(rank)].update(steps)
        before = self.commit.committed
        own = {r: merged.get(r, set()) for r in self.pool.workers}
        lost = self.pool.bad.lost
        live = [
            held
            for per_node in (self.stored, self.replicas_held)
            for node, held in per_node.items()
            if node not in lost
        ]
        committed = self.commit.observe(self.plan.replicated(own, live))
        if committed != before and committed is not None:
            self.safe = committed
            self.pool.clock.committed()
        for rank in [r for r in self.borrowed if committed in merged.get(r, ())]:
            del self.borrowed[rank]  # a grown rank's own shard is committed now
        self.plan.replicate(own, committed, self.replication)
        if committed != before and committed is not None:
            drop = self.commit.droppable_below()
            if drop is not None:
                self._dropped_below = drop
        self.trim(step)

    def forget_node(self, node: str) -> None:
        self.held_bytes.pop(node, None)
        self.stored.pop(node, None)
        self.replicas_held.pop(node, None)
        self.replication.pop(node, None)
        self.plan.holds.pop(node, None)
        if self.persister is not None:
            self.persister.writer_lost(node)

    def _holders(self, step: int) -> dict[int, list[str]]:
        """rank -> the live nodes whose memory holds its shard of `step` (own or copy)."""
        return holdings.holders(step, (self.stored, self.replicas_held), self.pool.agents)

    def in_memory(self) -> dict[int, set[int]]:
        """rank -> the steps of which some live node's memory holds a shard it can restore."""
        return holdings.in_memory(
            (self.stored, self.replicas_held), self.pool.bad.lost, self.borrowed
        )

    def _not_told(self, node: str | None, rank: int, step: int) -> bool:
        """`node`, live, has not reported `rank`'s shard of `step` or any newer one yet
        (False when it reported a newer one: it holds `step` no more)."""
        if node is None or node not in self.pool.agents or node in self.pool.bad.lost:
            return False
        held = self.stored.get(node, {})
        steps = held.get(rank, held.get(str(rank), ()))
        return max(steps, default=-1) < step

    def _waiting_for_own(self, step: int) -> bool:
        """Whether `step`'s write still waits for an own node's report: for
        OWN_REPORT_WAIT_S from the first time it did (a node that never reports the shard
        does not hold the write up)."""
        now = time.monotonic()
        if self._own_wait is None or self._own_wait[0] != step:
            self._own_wait = (step, now)
        return now - self._own_wait[1] < OWN_REPORT_WAIT_S

    def complete_in_memory(self) -> set[int]:
        """Steps of which every rank's shard is in some live node's memory."""
        return holdings.complete(self.in_memory(), self.pool.world)

    def trim(self, step: int) -> None:
        """Bound each node's memory: keep the retained commits, the step being replicated,
        the steps persistence still needs and each rank's newest few; drop everything
        below the oldest retained commit. `step`: the job's newest step now."""
        keep = set(self.commit.retained)
        if self.safe is not None:
            keep.add(self.safe)
        if self.plan.replicating is not None:
            keep.add(self.plan.replicating[0])
        if self.persister is not None:
            keep |= self.persister.pinned(step)
        keep = tuple(sorted(keep))
        if keep == self._kept:
            return
        self._kept = keep
        # Nothing kept is dropped for being old (a grid step waiting to be persisted).
        below = self._dropped_below
        if below is not None and keep:
            below = min(below, keep[0])
        self._prune_seq += 1
        for agent in self.pool.agents.values():
            agent.prune.remote(
                below=below,
                keep=list(keep),
                newest=NEWEST_KEPT,
                fresh_above=self.commit.committed,
                seq=(self.incarnation, self._prune_seq),
            )

    # --- restoring --------------------------------------------------------------------------

    def sources(
        self, step: int | None, durable: Manifest | None
    ) -> dict[int, tuple[Any, int, str | None]]:
        """rank -> where it restores `step` from: (its node agent or the durable target,
        whose shard, tier). From storage when `durable`: every rank reads its own shard
        (sha256-checked against the manifest); memory holds no complete set then."""
        pool = self.pool
        if durable is not None:
            target = self.persister.target
            # At another world size (a sharded job's: resharded), the rank's own part (its
            # random states, its data position) is the same rank's, or the last one's.
            whose = {r: min(r, durable.world_size - 1) for r in pool.workers}
            self.last_sources = {r: (None, whose[r], durable.step, "durable") for r in whose}
            return {r: (target, whose[r], "durable") for r in pool.workers}
        by_rank = self._holders(step) if step is not None else {}
        out = {}
        self.last_sources = {}
        for r in pool.workers:
            here = pool.worker_info.get(r, {}).get("node_id")
            src = holdings.restore_source(r, step, here, by_rank, self.borrowed.get(r))
            agent = pool.agents[src.node] if src.node is not None else None
            out[r] = (agent, src.rank, src.tier)
            if step is not None:
                self.last_sources[r] = (src.node, src.rank, step, src.tier)
        return out

    def restore_from(
        self, step: int | None, durable: Manifest | None
    ) -> tuple[dict[int, tuple[Any, int, str | None]], dict[str, Any] | None]:
        """(`sources`, `reshard_from`) of the next generation's restore of `step`."""
        return self.sources(step, durable), self.reshard_from(step, durable)

    def reshard_from(self, step: int | None, durable: Manifest | None) -> dict[str, Any] | None:
        """Where the old world's shards of `step` are, when the job's world size is not the
        one that wrote it: a sharded model's ranks load them resharded (worker/restore.py;
        the others never ask). None when the world did not change since."""
        if durable is not None:
            if durable.world_size == self.pool.world:
                return None
            return {"durable": self.persister.target}
        if step is None or self.resized_at is None or step > self.resized_at:
            return None
        agents = self.pool.agents
        held = self._holders(step)
        return {"memory": {r: agents[holdings.pick(nodes, None)] for r, nodes in held.items()}}

    def distrust(self, rank: int) -> None:
        """`rank` could not restore from its last source: that copy is dropped (its node's
        agent discards it; a durable step is skipped from now on), so the roll back that
        follows picks the next source: another node's copy, an older commit, storage."""
        src = self.last_sources.get(rank)
        if src is None:
            return
        node, whose, step, tier = src
        if node is None:
            self.bad_durable.add(step)
        else:
            agent = self.pool.agents.get(node)
            if agent is not None:
                # A node that does not answer is judged by detection.
                with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    ray.get(agent.discard.remote(whose, step), timeout=10)
            for per_node in (self.stored, self.replicas_held):
                held = per_node.get(node, {})
                for key in (whose, str(whose)):
                    if step in held.get(key, ()):
                        held[key] = [s for s in held[key] if s != step]
        self._emit(
            "restore_source_dropped",
            rank=rank,
            step=step,
            source=tier,
            node=node,
            reason=f"rank {rank} could not restore step {step} from "
            + (f"node {node[:12]}'s memory ({tier})" if node else "durable storage")
            + ": restoring from the next source",
        )

    def roll_back(self, next_generation: int | None = None) -> tuple[int | None, Manifest | None]:
        """After a failure (and a fresh poll): the newest step with a complete set of shards
        in memory (any live copy), else on durable storage, else None (start over). Every
        node drops what lies above it. Returns (step, manifest when from storage)."""
        world = self.pool.world
        if self.commit.world_size != world:
            self.commit = CommitTracker(world, self.commits_kept)
        self.commit.reset(self.in_memory())
        durable = None
        if self.commit.committed is None:
            durable = self.durable_restore_point(this_run=True)
            if durable is None:
                self._emit(
                    "restart_from_scratch",
                    reason="no step has a copy of every rank's shard on a living node "
                    f"(checkpoint.replicas={self.spec.checkpoint.replicas}, "
                    f"{self.plan.copies} kept) nor on durable storage"
                    + ("" if self.persister else " (checkpoint.persist.uri is not set)"),
                )
        restore = durable.step if durable is not None else self.commit.committed
        if self.safe is not None and (restore is None or self.safe > restore):
            self.safe = None  # dropped with everything above the restore point
        self.commit.rollback(self.commit.committed if self.commit.committed is not None else -1)
        self.plan.replicating, self._kept, self._dropped_below = None, (), None
        self._prune_seq += 1
        for agent in self.pool.agents.values():
            agent.prune.remote(
                above=restore if restore is not None else -1,
                seq=(self.incarnation, self._prune_seq),
                fence=next_generation,
            )
        if next_generation is not None:
            self.started(next_generation, restore)
        return restore, durable

    def started(self, generation: int, restore_step: int | None = None) -> None:
        """Generation `generation` runs (or is about to): writes to storage that older ones
        started and did not commit are fenced off (supervisor/persist.py)."""
        if self.persister is not None:
            self.persister.fence(generation, restore_step, frozenset(self.pool.bad.lost))

    def borrow(self, rank: int, source: int) -> None:
        """`rank` (added by a grow) restores `source`'s shard until it has its own."""
        self.borrowed[rank] = source
        self.resized_at = self.commit.committed

    def rekey(self, mapping: dict[int, int]) -> None:
        """Ranks were renumbered old -> new: every node store renames its shards. A rank
        the shrink dropped keeps its shards under a number past the new world's (its
        place in the old layout, for a sharded model's reshard)."""
        self.resized_at = self.commit.committed
        ray.get([a.rekey.remote(mapping) for a in self.pool.agents.values()], timeout=60)
        self.borrowed = {
            mapping[r]: mapping[src]
            for r, src in self.borrowed.items()
            if r in mapping and src in mapping
        }
        self.stored.clear()
        self.replicas_held.clear()

    def adopted_restore_point(self) -> int | None:
        """The newest step of which the adopted agents' memory holds every rank's shard
        (own stores or copies), after a poll."""
        self.commit.reset(self.in_memory())
        step = self.commit.committed
        self._emit(
            "resume",
            step=step,
            reason=(
                f"taking the job back from the node agents' memory at step {step}"
                if step is not None
                else "the node agents hold no complete step: durable storage or step 0"
            ),
        )
        return step

    # --- durable tier -----------------------------------------------------------------------

    def durable_restore_point(self, this_run: bool = False) -> Manifest | None:
        """The newest durable checkpoint of this job and world size that verifies (every
        shard's size and sha256); each newer one skipped is reported with its reason.
        `this_run` (a recovery): only steps this run wrote, or the one it resumed from and
        those before it; another run of the job under the same URI (`--resume never`, or
        one that went further) is not this run's past."""
        if self.persister is None:
            return None
        store = self.persister.store
        below = min(self.bad_durable) - 1 if self.bad_durable else None
        while True:
            try:
                manifest, skipped = store.newest_valid(self.pool.world, at_most=below, reshard=True)
            except DurableError as e:
                self._emit("durable_unavailable", reason=f"{store.describe()}: {e}")
                return None
            for step, why in skipped:
                self._emit("checkpoint_skipped", step=step, reason=why)
            if manifest is None or not this_run or self._of_this_run(manifest):
                return manifest
            self._emit(
                "checkpoint_skipped",
                step=manifest.step,
                reason=f"written by another run of the job ({manifest.extra.get('run')}), "
                "not this run's past",
            )
            below = manifest.step - 1

    def _of_this_run(self, manifest: Manifest) -> bool:
        if self.persister is not None and manifest.extra.get("run") == self.persister.run:
            return True
        return self.resumed_from is not None and manifest.step <= self.resumed_from

    def resume_point(self, resume: str) -> Manifest | None:
        """Whole-job resume at start (`stalwart run --resume auto|never|STEP`)."""
        if self.persister is None or resume == "never":
            return None
        store = self.persister.store
        world = self.pool.world
        if resume == "auto":
            manifest = self.durable_restore_point()
            if manifest is None:
                self._emit(
                    "resume",
                    step=None,
                    reason=f"no complete checkpoint of {world} ranks under "
                    f"{store.describe()}: starting from step 0",
                )
                return None
        else:
            step = int(resume)
            try:
                manifest = store.verify(step, world, reshard=True)
            except (CorruptCheckpoint, DurableError) as e:
                raise SchedulingError(f"--resume {step}: {e}") from None
        self.resumed_from = manifest.step
        self.persister.resumed_from(manifest.step)
        self._emit(
            "resume",
            step=manifest.step,
            reason=f"resuming from durable step {manifest.step} of {store.describe()} "
            f"(written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_at))})",
        )
        return manifest

    def maybe_persist(self, running: bool, step: int) -> None:
        """Start writing a committed step to storage when one is due (after a poll: what
        memory holds changes only with one). `step`: the job's newest step now."""
        p = self.persister
        if p is None:
            return
        p.poll()
        if not running:
            return
        due = p.choose(self.complete_in_memory(), self.commit.committed, time.time())
        if due is not None:
            self._start_persist(due, step)

    def _start_persist(self, due: int, step: int) -> bool:
        """Have the agents write `due`: each rank's shard by a node holding it in memory
        (the rank's own node when it can). False if some shard is not in memory now."""
        pool = self.pool
        by_rank = self._holders(due)
        assignment: dict[str, tuple[Any, list[int]]] = {}
        for rank in range(pool.world):
            nodes = by_rank.get(self.borrowed.get(rank, rank), [])
            if not nodes:
                return False  # (a shrink or rekey moved it): next time
            here = pool.worker_info.get(rank, {}).get("node_id")
            # A peer's report of its copy came in before the rank's own node's report of
            # the shard: a poll or two has it there (else every shard of a node would be
            # written by the lowest-id holder of its copies).
            early = here not in nodes and rank not in self.borrowed
            if early and self._not_told(here, rank, due) and self._waiting_for_own(due):
                return False
            node = holdings.pick(nodes, here)
            assignment.setdefault(node, (pool.agents[node], []))[1].append(rank)
        faults = self.chaos_persist(due, list(assignment))
        self.persister.start(due, pool.world, assignment, faults)
        self.trim(step)
        return True

    def persist_final(self, step: int) -> None:
        """At the end of a job, the newest step all ranks hold goes to storage too (after
        the write in flight), so a finished job's last state is durable."""
        p = self.persister
        if p is None:
            return
        if not p.wait(FINAL_PERSIST_TIMEOUT_S):
            self._emit("persist_failed", step=None, reason="the last write did not end")
            return
        last = p.last_step if p.last_step is not None else 0
        newest = max((s for s in self.complete_in_memory() if s > last), default=None)
        if newest is None or not self._start_persist(newest, step):
            return
        if not p.wait(FINAL_PERSIST_TIMEOUT_S):
            self._emit(
                "persist_failed", step=newest, reason="the final checkpoint's write did not end"
            )

    def storage_outage(self, seconds: float) -> None:
        """Chaos storage_unavailable: the durable target fails for `seconds`."""
        if self.persister is None:
            self._emit(
                "fault_refused",
                kind="storage_unavailable",
                reason="checkpoint.persist.uri is not set: there is no storage to fail",
            )
            return
        self.persister.outage(seconds, list(self.pool.agents.values()))

    # --- the end ----------------------------------------------------------------------------

    def final_copies(self) -> int | None:
        """At the end of a job, ask for the last step's copies too (the thinned grid of
        copies may have skipped it; the end state should be as safe as the rest). Returns
        the step to wait for, or None when there is nothing to copy."""
        workers = self.pool.workers
        if self.plan.copies <= 1 or not workers:
            return None
        own: dict[int, set[int]] = defaultdict(set)
        for held in self.stored.values():
            for r, steps in held.items():
                own[int(r)].update(steps)
        complete = set.intersection(*(own.get(r, set()) for r in workers))
        if not complete:
            return None
        newest = max(complete)
        self.plan.send(newest)
        return newest

    def replication_summary(self, wait_s: float) -> dict[str, Any]:
        """The peer tier for result.json; `wait_s`: training held for copies, in all."""
        agents = self.pool.agents
        held = {
            node: sum(map(len, self.stored.get(node, {}).values()))
            + sum(map(len, self.replicas_held.get(node, {}).values()))
            for node in self.plan.nodes
            if node in agents
        }
        summary = self.plan.summary(list(self.replication.values()), held)
        return {**summary, "wait_s": round(wait_s, 2)}
