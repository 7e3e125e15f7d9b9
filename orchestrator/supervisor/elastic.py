"""Elastic resizing (`workers: {min, max}`): shrink when replacements find no room, keep idle
workers waiting for room while below the maximum, grow back when they are placed.

Ranks stay 0..n-1: a shrink renumbers the survivors and every node store renames their
shards (after the workers drained their snapshot pipelines), so the next generation still
restores from memory; the dropped ranks' shards are renamed past the new world, not
dropped. A grown rank restores rank 0's shard (data-parallel state is the same on every
rank) until it has one of its own. A sharded model (FSDP2, HSDP) is loaded resharded from
the old world's shards instead (Checkpoints.reshard_from, ckpt/reshard.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.checkpoints import Checkpoints
from stalwart.orchestrator.supervisor.detect import Detection
from stalwart.orchestrator.supervisor.ledger import Ledger
from stalwart.orchestrator.supervisor.pool import ActorGone, WorkerPool
from stalwart.orchestrator.supervisor.preflight import Preflight

GROW_CHECK_S = 1.0  # how often the workers waiting for room are looked at
QUIESCE_TIMEOUT_S = 60.0


class Elastic:
    def __init__(
        self,
        spec: JobSpec,
        pool: WorkerPool,
        preflight: Preflight,
        detection: Detection,
        checkpoints: Checkpoints,
        ledger: Ledger,
        emit: Callable[..., None],
    ):
        self.spec = spec
        self.pool = pool
        self.preflight = preflight
        self.detection = detection
        self.checkpoints = checkpoints
        self.ledger = ledger
        self._emit = emit
        # ready() ref -> (worker waiting for room, its slot or None)
        self.growing: dict[Any, tuple[Any, int | None]] = {}
        self._last_check = 0.0

    def shrink(self, missing: list[int], extra: list[int] = ()) -> None:
        """Continue without `missing` (their replacements found no room) and `extra` (live
        ranks let go so that the world stays a multiple of workers.multiple_of): renumber
        the survivors 0..n-1 and rename their shards in every store. Idle workers then wait
        for room (`check_growth`): when Ray places them, the job grows back."""
        pool = self.pool
        old_world = pool.world
        pool.drop(missing)  # never placed: nothing to hand over
        self._quiesce()  # the ranks let go hand over their snapshots in flight too
        pool.drop(list(extra))
        survivors = sorted(pool.workers)
        mapping = {old: new for new, old in enumerate(survivors)}
        # The dropped ranks' shards stay, numbered past the new world: a sharded model is
        # restored from the whole old layout (ckpt/reshard.py).
        gone = sorted(set(range(old_world)) - set(survivors))
        kept = {**mapping, **{old: len(survivors) + i for i, old in enumerate(gone)}}
        self.checkpoints.rekey(kept)
        self.detection.renumbered()
        pool.renumber(mapping)
        self.ledger.resized(
            old_world,
            pool.world,
            f"no room for rank(s) {missing} within "
            f"failure.replacement_timeout_s={self.spec.failure.replacement_timeout_s}"
            + (
                f"; rank(s) {list(extra)} let go too: the world stays a multiple of "
                f"workers.multiple_of={self.spec.world_multiple}"
                if extra
                else ""
            ),
            mapping={str(k): v for k, v in mapping.items()},
        )

    def grow(self, grown: list[tuple[Any, int | None]]) -> None:
        """Add ready idle workers (with their slots) as ranks world..world+k-1; newcomers on
        nodes that fail preflight are dropped (the node cordoned) and the job grows less."""
        pool = self.pool
        old_world = pool.world
        self._quiesce()
        infos = ray.get([a.ready.remote() for a, _ in grown], timeout=30)
        bad = self.preflight.check_newcomers(
            [(a, i["node_id"]) for (a, _), i in zip(grown, infos, strict=True)]
        )
        if bad:
            keep = []
            for entry, info in zip(grown, infos, strict=True):
                if info["node_id"] in bad:
                    ray.kill(entry[0], no_restart=True)
                else:
                    keep.append(entry)
            grown = keep
            if not grown:
                return
        new = list(range(old_world, old_world + len(grown)))
        ray.get([a.assume.remote(r) for (a, _), r in zip(grown, new, strict=True)], timeout=30)
        for (actor, bundle), rank in zip(grown, new, strict=True):
            pool.workers[rank] = actor
            pool.bundle_of[rank] = bundle
            self.checkpoints.borrow(rank, 0)
        pool.await_ready(new, self.spec.failure.replacement_timeout_s)
        pool.world = old_world + len(grown)
        if pool.world >= self.spec.max_workers:
            self.stop_waiting()
        self.ledger.resized(old_world, pool.world, "capacity returned", new_ranks=new)

    def check_growth(self) -> list[tuple[Any, int | None]]:
        """While the world is below its maximum, keep that many workers waiting for room.
        Returns the ready ones on healthy nodes (with their slots) to grow by, if any."""
        pool = self.pool
        if pool.world >= self.spec.max_workers:
            return []
        if time.time() - self._last_check < GROW_CHECK_S:
            return []
        self._last_check = time.time()
        # Free slots first (held room on a healthy node), and one worker outside any slot
        # per missing rank, which Ray places when a node has room; whichever starts first
        # is used, the rest are stopped once the world is whole.
        free = self._free_bundles()
        missing = self.spec.max_workers - pool.world
        outside = sum(1 for _, b in self.growing.values() if b is None)
        for bundle in free[: max(0, missing - (len(self.growing) - outside))]:
            actor = pool.create_worker(None, bundle)
            self.growing[actor.ready.remote()] = (actor, bundle)
        for _ in range(max(0, missing - outside)):
            actor = pool.create_worker(None, None)
            self.growing[actor.ready.remote()] = (actor, None)
        ready, _ = ray.wait(list(self.growing), num_returns=len(self.growing), timeout=0)
        usable, nodes = [], set()
        for ref in ready:
            actor, bundle = self.growing.pop(ref)
            try:
                info = ray.get(ref)
            except ActorGone:
                continue
            if info["node_id"] in pool.bad_nodes():
                ray.kill(actor, no_restart=True)
                if bundle is not None:
                    pool.slots.release(bundle)  # its node was cordoned meanwhile
                continue
            usable.append((actor, bundle))
            nodes.add(info["node_id"])
        usable = usable[: self.spec.max_workers - pool.world]
        # Whole multiples of workers.multiple_of: the others wait on (asked again).
        whole = len(usable) // self.spec.world_multiple * self.spec.world_multiple
        for actor, bundle in usable[whole:]:
            self.growing[actor.ready.remote()] = (actor, bundle)
        usable = usable[:whole]
        if usable:
            self._emit("capacity_returned", nodes=sorted(nodes), workers=len(usable))
        return usable

    def stop_waiting(self) -> None:
        for actor, _ in self.growing.values():
            ray.kill(actor, no_restart=True)
        self.growing.clear()

    def waiting(self) -> list[Any]:
        """The idle workers waiting for room (for the teardown)."""
        return [a for a, _ in self.growing.values()]

    def _free_bundles(self) -> list[int]:
        """Held slots on usable nodes that no worker, spare or growing worker uses (their
        rank was dropped by a shrink)."""
        pool = self.pool
        used = pool.used_bundles() | {b for _, b in self.growing.values()}
        bad = pool.bad_nodes()
        return [s for s in pool.slots.held() if s not in used and pool.slots.node_of(s) not in bad]

    def _quiesce(self) -> None:
        """Every rank hands over its snapshots in flight and forgets its reserved slots:
        the stores are about to be renumbered. Between generations only."""
        workers = self.pool.workers
        ray.wait(
            [workers[r].quiesce.remote() for r in workers],
            num_returns=len(workers),
            timeout=QUIESCE_TIMEOUT_S,
        )
