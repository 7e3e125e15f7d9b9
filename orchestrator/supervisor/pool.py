"""The job's workers and the room they run in: ranks, slots, warm spares, node agents, and the
nodes that get no new ranks (lost or cordoned).

Placement rules (docs/architecture.md, "Placement of replacements"): a ready spare on a
healthy node; else a ready standby (failure.standby) in the lost rank's slot, or in a new
slot on a standby's node (when neither is ready but some are starting: the first ready);
else the lost rank's slot if its node is alive and not cordoned; else any healthy node,
outside any slot. The spares are supervisor/spares.py's, the standbys standby.py's.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    NodeLabelSchedulingStrategy,
    NotIn,
)

from stalwart.orchestrator.ray_classes import actor_class
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.agents import AGENT_PREFIX, start_agent
from stalwart.orchestrator.supervisor.memory_check import ask_rooms, check_memory, checkpoint_need
from stalwart.orchestrator.supervisor.nodes import BadNodes
from stalwart.orchestrator.supervisor.resources import (
    SchedulingError,
    check_capacity,
    worker_bundle,
)
from stalwart.orchestrator.supervisor.slots import Slots, SlotsUnavailable
from stalwart.orchestrator.supervisor.spares import Spares, actor_error_text
from stalwart.orchestrator.supervisor.standby import Standbys, choose
from stalwart.orchestrator.supervisor.startup import StartupClock
from stalwart.orchestrator.worker import zygote
from stalwart.orchestrator.worker.remote import WorkerActor

NODE_PING_TIMEOUT_S = 1.0  # a dead worker's node must answer this fast to keep its bundle
ATTACH_TIMEOUT_S = 30.0
SLOT_CHECK_S = 2.0  # how often a replacement waiting for its slot checks the slot's node
STANDBY_SLOT_S = 0.5  # how long a rank with a slot of its own waits for one by a standby
# An actor that is gone, or that cannot be reached (its node is down).
ActorGone = (RayActorError, ActorUnavailableError)


class WorkerPool:
    def __init__(
        self,
        spec: JobSpec,
        store_key: str,
        base_dir: str | None,
        emit: Callable[..., None],
    ):
        self.spec = spec
        self._spec_dict = spec.model_dump(mode="json")
        self.store_key = store_key
        self.base_dir = base_dir
        self._emit = emit
        self.world = spec.max_workers  # the current world size (elastic jobs vary)
        self.workers: dict[int, Any] = {}
        self.worker_info: dict[int, dict[str, Any]] = {}
        # rank -> its slot (supervisor/slots.py); None: placed outside any slot (its slot's
        # node was bad)
        self.bundle_of: dict[int, int | None] = {}
        # Chaos `during: replace`: (rank, node) -> kill the replacement that just started.
        self.chaos_replace: Callable[[int, str], bool] = lambda rank, node: False
        # failure.standby: an idle process per node, holding no room (supervisor/standby.py);
        # whether the job has them is decided when its slots are placed (schedule).
        self.standbys = Standbys(lambda node: self.create_worker(None, None, node), emit)
        self.standby_depth = 0  # standbys per node (0: none)
        self.agents: dict[str, Any] = {}
        self.slots = Slots(f"stalwart-{spec.name}")
        self.bad = BadNodes(spec, emit)  # nodes that get no new ranks (supervisor/nodes.py)
        self.supervisor: Any = None  # the supervisor's handle, for workers to report faults to
        # Workers forked from each node's zygote (worker/zygote.py), or spawned.
        self.forks, reason = zygote.start_method(spec)
        emit("start_method", method="fork" if self.forks else "spawn", reason=reason)
        self.clock = StartupClock()  # the cold start's marks (supervisor/startup.py)
        self.warm = Spares(
            spec.failure.spares,
            lambda slot: self.create_worker(None, slot),
            self.ensure_agent,
            self.usable_bundle,
            self.bad_nodes,
            self.clock,
            emit,
        )

    # --- nodes ------------------------------------------------------------------------------

    def node_of(self, rank: int) -> str:
        return self.worker_info[rank]["node_id"]

    def ranks_on(self, node: str) -> list[int]:
        """The ranks on the node whose id is `node` or starts with it (when just one does)."""
        nodes = {i["node_id"] for r, i in self.worker_info.items() if r in self.workers}
        match = [n for n in nodes if n == node] or [n for n in nodes if n.startswith(node)]
        if len(match) != 1:
            return []
        return sorted(r for r in self.workers if self.worker_info[r]["node_id"] == match[0])

    def bad_nodes(self) -> set[str]:
        """Nodes that get no new ranks: lost, dead in Ray's view, or cordoned."""
        return self.bad.all(time.time())

    def cordon(self, node: str, reason: str, now: float) -> None:
        self.bad.cordon(node, reason, now, self.world)

    def lose_node(self, node: str) -> int:
        """`node` is gone: its slots are released at once (Ray would keep trying to re-place
        them, see slots.py), its agent stopped, its spares killed. Returns the spares lost.
        A node cut off, not dead, heals with its agent alive: Ray's kill reaches it then, so
        it never serves this job again (nor a successor supervisor that adopts agents)."""
        self.bad.lost.add(node)
        self.slots.release_on({node})
        agent = self.agents.pop(node, None)
        if agent is not None:
            with contextlib.suppress(Exception):  # gone with its node already
                ray.kill(agent, no_restart=True)
        self.standbys.drop({node})
        return self.warm.drop_node(node)

    def usable_bundle(self, bundle_index: int | None) -> int | None:
        """`bundle_index` (a slot) if its node may take a rank, else None (place outside
        any slot; a slot on a bad node is released)."""
        if bundle_index is None:
            return None
        node = self.slots.node_of(bundle_index)
        if node is not None and node not in self.bad_nodes():
            return bundle_index
        self.slots.release(bundle_index)
        return None

    def local_ranks(self) -> dict[int, int]:
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(self.workers):
            by_node[self.worker_info[rank]["node_id"]].append(rank)
        return {r: i for ranks in by_node.values() for i, r in enumerate(ranks)}

    # --- agents -----------------------------------------------------------------------------

    def ensure_agent(self, node: str) -> Any:
        if node not in self.agents:
            self.agents[node] = start_agent(self.spec, self.store_key, node)
        return self.agents[node]

    def adopt_agents(self) -> None:
        """The node agents a dead supervisor left (detached, named after the store key);
        the room its slots held is given back first."""
        self.slots.remove_leftovers()
        prefix = f"{AGENT_PREFIX}{self.store_key}-"
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "stalwart" and a["name"].startswith(prefix)
        ]
        for name in names:
            try:
                agent = ray.get_actor(name, namespace="stalwart")
                node = ray.get(agent.ping.remote(), timeout=NODE_PING_TIMEOUT_S * 5)
            except (*ActorGone, ValueError, GetTimeoutError):
                continue  # its node is gone
            self.agents[node] = agent

    def forget_rank(self, rank: int) -> None:
        """Every agent drops `rank`'s slot reservations, synchronously: they must be
        released before its successor reserves its own."""
        ray.wait(
            [a.forget.remote(rank) for a in self.agents.values()],
            num_returns=len(self.agents),
            timeout=5,
        )

    # --- scheduling -------------------------------------------------------------------------

    def schedule(self, adopted: bool = False) -> None:
        """Hold the room for every rank and spare (all or nothing), start the workers and
        the spares, and wait until the workers are ready. The spares are not waited for:
        they become ready alongside the preflight and the first steps (check_spares), and
        a failure before then waits for one (replace). The standbys start with the workers:
        one per node, or all of them for a job `adopted` from a dead supervisor (it has
        trained, and its standbys died with that supervisor)."""
        spec = self.spec
        self.clock.mark("supervisor_init")
        check_capacity(spec, ray.nodes())
        bundle = worker_bundle(spec)
        n_bundles = self.world + spec.failure.spares
        try:
            self.slots.reserve(n_bundles, bundle, spec.placement, spec.failure.scheduling_timeout_s)
        except SlotsUnavailable as e:
            raise SchedulingError(
                f"{e}: {self.world} workers and {spec.failure.spares} spares "
                f"within failure.scheduling_timeout_s={spec.failure.scheduling_timeout_s}"
            ) from None
        self.clock.mark("slots")
        created = time.time()
        for node in sorted(self.slots.nodes()):
            self._time_span("agents", self.ensure_agent(node).ping.remote(), created)
        node_of_rank = {r: self.slots.node_of(r) for r in range(self.world)}
        # The nodes' memory: before any worker starts where the job states its checkpoints'
        # size (the preflight may refuse it), else while they start (for the standbys).
        sized = spec.checkpoint.state_size_per_rank is not None
        rooms = ask_rooms(self.slots.nodes(), spec.checkpoint.shm_dir, self.agents) if sized else {}
        check_memory(spec, node_of_rank, rooms)
        for rank in range(self.world):
            self.bundle_of[rank] = rank
            self.workers[rank] = self.create_worker(rank, rank)
        for bundle_index in range(self.world, n_bundles):
            self.warm.start(bundle_index)
        if not sized and spec.failure.standby is None and not spec.resources.gpu:
            rooms = ask_rooms(self.slots.nodes(), spec.checkpoint.shm_dir, self.agents)
        ranks_on = Counter(node_of_rank.values())
        self.standby_depth, why = choose(
            spec.failure.standby,
            spec.failure.standbys_per_node,
            bool(spec.resources.gpu),
            {n: room for n, room in rooms.items() if n in ranks_on},
            {n: checkpoint_need(spec, k) for n, k in ranks_on.items()},
            {n: k * max(1.0, spec.resources.cpu) for n, k in ranks_on.items()},
        )
        self._emit(
            "standby_plan",
            enabled=bool(self.standby_depth),
            per_node=self.standby_depth,
            reason=why,
        )
        if self.standby_depth:  # as soon as the ranks are placed: ready by their first steps
            self.standbys.fill(self.slots.nodes(), self.standby_depth if adopted else 1)
        self.await_ready(list(range(self.world)), spec.failure.scheduling_timeout_s)
        self.clock.workers_ready({r: self.worker_info[r].get("boot", {}) for r in self.workers})
        self.check_spares()  # those ready by now are preflighted with the ranks

    def scheduled(self, supervisor_node: str) -> None:
        """The `scheduled` event, after the start's preflight (which this ends in the cold
        start's phases): where the supervisor and every rank are."""
        self.clock.mark("preflight")
        info = self.worker_info
        self._emit(
            "scheduled",
            supervisor_node=supervisor_node,
            nodes=sorted({i["node_id"] for i in info.values()}),
            workers={r: info[r] for r in self.workers},
        )

    def _time_span(self, name: str, ref: Any, start: float) -> None:
        """The cold start's span `name`: from `start` until `ref` is done (or failed)."""
        ref.future().add_done_callback(lambda _: self.clock.span(name, start))

    def create_worker(
        self, rank: int | None, bundle_index: int | None, standby_on: str | None = None
    ) -> Any:
        """A worker for `rank` (None: a spare) in slot `bundle_index` (None: on any healthy
        node), or a standby pinned to node `standby_on`, holding no resources."""
        spec = self.spec
        if standby_on is not None:
            strategy: Any = NodeAffinitySchedulingStrategy(standby_on, soft=False)
        elif bundle_index is not None:
            strategy = self.slots.strategy(bundle_index)
        elif bad := self.bad_nodes():
            strategy = NodeLabelSchedulingStrategy(hard={"ray.io/node-id": NotIn(*sorted(bad))})
        else:
            strategy = "DEFAULT"
        options: dict[str, Any] = {
            "num_cpus": spec.resources.cpu,
            "num_gpus": spec.resources.gpu,
            "resources": dict(spec.resources.custom),
            "max_concurrency": 4,
            "max_restarts": 0,
            "max_task_retries": 0,
            "scheduling_strategy": strategy,
        }
        if standby_on is not None:
            options.update(num_cpus=0, num_gpus=0, resources={})
        if spec.runtime_env:
            options["runtime_env"] = spec.runtime_env
        elif self.forks:
            options["runtime_env"] = {"py_executable": zygote.command()}
        return (
            actor_class(WorkerActor)
            .options(**options)
            .remote(
                job=spec.name,
                spec=self._spec_dict,
                rank=rank,
                world_size=self.world,
                base_dir=self.base_dir,
                supervisor=self.supervisor,
            )
        )

    def await_ready(
        self, ranks: list[int], timeout_s: float, allow_missing: bool = False
    ) -> list[int]:
        """Wait for `ranks`' workers to start and attach them to their node agents. Returns
        the ranks still not started after `timeout_s` (only with `allow_missing`). With
        `allow_missing` (a replacement), a worker that dies while starting or does not
        attach is started again, within the same time."""
        deadline = time.monotonic() + timeout_s
        pending = {self.workers[r].ready.remote(): r for r in ranks}
        while pending:
            wait_s = max(deadline - time.monotonic(), 0)
            if allow_missing:
                wait_s = min(wait_s, SLOT_CHECK_S)
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
            if not ready:
                if not allow_missing or time.monotonic() >= deadline:
                    break
                self._move_off_dead_slots(pending)
                continue
            attaching, failed = {}, {}
            for ref in ready:  # one at a time only to tell which one died
                rank = pending.pop(ref)
                try:
                    info = ray.get(ref)
                except ActorGone as e:
                    failed[rank] = actor_error_text(e)
                    continue
                self.worker_info[rank] = {**info, "rank": rank}
                if allow_missing and self.chaos_replace(rank, info["node_id"]):
                    ray.kill(self.workers[rank], no_restart=True)  # chaos: during replace
                agent = self.ensure_agent(info["node_id"])
                attaching[self.workers[rank].attach.remote(agent)] = rank
            done, late = ray.wait(
                list(attaching), num_returns=len(attaching), timeout=ATTACH_TIMEOUT_S
            )
            for ref in late:
                failed[attaching[ref]] = (
                    f"it did not attach to its node agent within {ATTACH_TIMEOUT_S:g} s"
                )
            for ref in done:
                try:
                    ray.get(ref)
                except ActorGone as e:
                    failed[attaching[ref]] = actor_error_text(e)
            if failed and allow_missing:
                self.bad.note_dead_in_ray()  # once for all the restarts below
            for rank, why in sorted(failed.items()):
                if not allow_missing:
                    raise SchedulingError(f"a worker failed to start (rank {rank}): {why}")
                self._restart(rank, f"{why}; starting another", pending)
        missing = sorted(pending.values())
        if missing and not allow_missing:
            raise SchedulingError(
                f"workers {missing} did not start within {timeout_s:.0f} s "
                "(failure.scheduling_timeout_s, or failure.replacement_timeout_s for a "
                "replacement); no healthy node had room for them"
            )
        return missing

    def _move_off_dead_slots(self, pending: dict[Any, int]) -> None:
        """Start again, elsewhere, the pending replacements whose slot is on a node that has
        died since (Ray reports it dead, or the supervisor lost it): one waiting for a slot
        there would wait for good. Ray places the others itself as nodes come and go."""
        self.bad.note_dead_in_ray()
        bad = self.bad_nodes()
        for ref, rank in list(pending.items()):
            slot = self.bundle_of.get(rank)
            if slot is not None and self.slots.node_of(slot) in bad:
                del pending[ref]
                self._restart(
                    rank, "its slot's node has died or is cordoned; starting it elsewhere", pending
                )

    def _restart(self, rank: int, why: str, pending: dict[Any, int]) -> None:
        """Start `rank`'s replacement again, away from the bad nodes (the callers refresh
        which nodes Ray reports dead first; a slot on a bad node is released)."""
        self._emit("replacement_failed", rank=rank, reason=why)
        ray.kill(self.workers[rank], no_restart=True)
        self.bundle_of[rank] = self.usable_bundle(self.bundle_of.get(rank))
        self.workers[rank] = self.create_worker(rank, self.bundle_of[rank])
        pending[self.workers[rank].ready.remote()] = rank

    # --- spares (supervisor/spares.py) -----------------------------------------------------

    @property
    def spares(self) -> list[tuple[Any, int | None, str]]:
        """The ready spares: (actor, slot or None, node)."""
        return self.warm.ready

    def check_spares(self) -> None:
        self.warm.check()

    def refill_spares(self) -> None:
        """Start the spares a recovery used or lost, now that every replaced rank has its
        place (and, between recoveries, those that failed to start)."""
        self.warm.refill()

    def spare_nodes(self) -> frozenset[str]:
        return self.warm.nodes()

    def restart_spares_on(self, nodes: set[str] | dict[str, Any]) -> None:
        """Spares and standbys on `nodes` (which failed preflight) are stopped; the spares
        start again elsewhere."""
        self.standbys.drop(set(nodes))
        self.warm.restart_on(nodes)

    # --- replacing ranks --------------------------------------------------------------------

    def replace(self, ranks: set[int]) -> tuple[dict[int, int | None], dict[int, str]]:
        """Stop `ranks`' workers and start their successors: a warm spare on a healthy node
        if one is ready (its place refilled by refill_spares(), once every replacement
        has its place), else a ready standby in the lost rank's slot or a new slot on its
        node (with neither ready but some starting, the first to be ready), else a new
        worker in the lost rank's slot if its node is healthy, else on any healthy node.
        Returns the spares used (rank -> their slot) and how each rank was placed."""
        self.check_spares()
        used_spares: dict[int, int | None] = {}
        placed: dict[int, str] = {}
        for rank in sorted(ranks):
            ray.kill(self.workers[rank], no_restart=True)
            self.forget_rank(rank)
            freed = self.bundle_of[rank]
            spare = self.warm.take(rank)
            if spare is None:
                self._await_warm(self.slots.node_of(freed) if freed is not None else None)
                spare = self.warm.take(rank)
            if spare is not None:
                self.workers[rank], self.bundle_of[rank] = spare
                used_spares[rank] = spare[1]
                self.warm.refills.append(freed)
                placed[rank] = "spare"
                continue
            self.bundle_of[rank] = self.usable_bundle(freed)
            standby = self._from_standby(rank)
            if standby is not None:
                self.workers[rank] = standby
                placed[rank] = "standby"
                continue
            self.workers[rank] = self.create_worker(rank, self.bundle_of[rank])
            placed[rank] = "bundle" if self.bundle_of[rank] is not None else "healthy node"
        return used_spares, placed

    def _await_warm(self, node: str | None) -> None:
        """No spare, and no standby the rank (whose slot was on `node`) could take, ready;
        but some starting (a failure early in the job, or soon after another took them):
        wait for the first, as long as a worker started now would take to start (the ranks'
        boot took that long)."""
        limit = self.spec.failure.replacement_timeout_s
        deadline = time.monotonic() + min(self.clock.boot_seconds() or limit, limit)
        while self.warm.starting or self.standbys.starting:
            if self.warm.nodes() or self._standby_for(node):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            starting = [*self.warm.starting, *self.standbys.starting]
            ray.wait(starting, num_returns=1, timeout=left)
            self.warm.check()
            self.standbys.poll()

    def _standby_for(self, node: str | None) -> bool:
        """A ready standby a rank whose slot was on `node` could take: that node's, or one
        on a healthy node with room for a new slot."""
        ready = self.standbys.ready_nodes() - self.bad_nodes()
        if node in ready:
            return True
        return bool(ready) and bool(self.slots.room_for(worker_bundle(self.spec), ready))

    def _from_standby(self, rank: int) -> Any | None:
        """A ready standby now holding `rank`: its node's in the rank's slot, else one on
        another healthy node in a new slot there (the rank's node was lost, or its standby
        is in use or still starting; the rank's old slot is given back). None if there is
        none. With no old slot, a new slot stays the rank's either way."""
        self.standbys.poll()
        slot = self.bundle_of[rank]
        node = self.slots.node_of(slot) if slot is not None else None
        if node in self.standbys.ready_nodes():
            return self.standbys.take(node, rank)
        bundle = worker_bundle(self.spec)
        nodes = self.slots.room_for(bundle, self.standbys.ready_nodes() - self.bad_nodes())
        # A slot where there is room is placed in milliseconds; a rank that has a slot to
        # start cold in does not wait long for room another job may have taken.
        wait_s = SLOT_CHECK_S if slot is None else STANDBY_SLOT_S
        new = self.slots.add(bundle, nodes, wait_s) if nodes else None
        if new is None:
            return None
        actor = self.standbys.take(self.slots.node_of(new), rank)
        if slot is None:
            self.bundle_of[rank] = new
        elif actor is not None:
            self.slots.release(slot)
            self.bundle_of[rank] = new
        else:
            self.slots.release(new)
        return actor

    def keep_warm(self, trained: bool) -> None:
        """Between recoveries: start the spares that failed to start or died with their
        node, and the standbys missing (all of them once the job has `trained`, else one
        per node: more would only slow its first steps down)."""
        self.warm.refill()
        self.fill_standbys(self.standby_depth if trained else 1)

    def fill_standbys(self, depth: int) -> None:
        """Start standbys on every healthy node holding ranks or a spare (where a lost
        node's ranks go) until it has `depth`, when the job keeps them
        (supervisor/standby.py)."""
        if self.standby_depth:
            bad = self.bad_nodes()
            self.standbys.drop(bad)  # cordoned since they started: no new ranks there
            nodes = {self.node_of(r) for r in self.workers if r in self.worker_info}
            self.standbys.fill((nodes - bad) | self.spare_nodes(), min(depth, self.standby_depth))

    def move(self, ranks: list[int]) -> list[int]:
        """Start `ranks` again on healthy nodes; a rank with no room on one within
        failure.replacement_timeout_s stays where it is. Returns the ranks moved."""
        old = {r: (self.workers[r], self.worker_info[r], self.bundle_of[r]) for r in ranks}
        for rank in ranks:
            # The new worker starts outside any slot: the old slot, on the cordoned node,
            # still holds the old worker (kept if the new one finds no room), and must not
            # look like the new one's to await_ready, which releases slots on bad nodes.
            self.bundle_of[rank] = None
            self.workers[rank] = self.create_worker(rank, None)
        missing = self.await_ready(
            ranks, self.spec.failure.replacement_timeout_s, allow_missing=True
        )
        for rank in ranks:
            if rank in missing:
                ray.kill(self.workers[rank], no_restart=True)
                self.workers[rank], self.worker_info[rank], self.bundle_of[rank] = old[rank]
            else:
                ray.kill(old[rank][0], no_restart=True)
        moved = [r for r in ranks if r not in missing]
        if moved:
            self._emit(
                "preflight_moved",
                ranks={r: self.worker_info[r]["node_id"] for r in moved},
                reason="their nodes failed preflight",
            )
        if missing:
            self._emit(
                "preflight_kept",
                ranks=missing,
                reason="their nodes failed preflight, but no healthy node had room within "
                f"failure.replacement_timeout_s={self.spec.failure.replacement_timeout_s}; "
                "they stay (the node stays cordoned for new ranks)",
            )
        return moved

    def drop(self, ranks: list[int]) -> None:
        """Stop `ranks` for good (an elastic shrink)."""
        for rank in ranks:
            ray.kill(self.workers.pop(rank), no_restart=True)
            self.worker_info.pop(rank, None)
            self.bundle_of.pop(rank, None)

    def renumber(self, mapping: dict[int, int]) -> None:
        """Ranks old -> new (an elastic shrink keeps them 0..n-1)."""
        self.workers = {mapping[r]: a for r, a in self.workers.items()}
        self.worker_info = {
            mapping[r]: {**i, "rank": mapping[r]} for r, i in self.worker_info.items()
        }
        self.bundle_of = {mapping[r]: b for r, b in self.bundle_of.items()}
        self.world = len(self.workers)

    def used_bundles(self) -> set[int]:
        """Slots a rank or a spare uses."""
        return {b for b in self.bundle_of.values() if b is not None} | self.warm.slots()

    # --- the end ----------------------------------------------------------------------------

    def teardown(self, others: list[Any] = ()) -> None:
        """Stop every worker, spare and (`others`) idle worker, close the agents (they
        delete their shared-memory files; one that is gone took them with its node) and
        give the room back."""
        spares = self.warm.actors() + self.standbys.actors()
        for worker in [*self.workers.values(), *spares, *others]:
            ray.kill(worker, no_restart=True)
        closing = [agent.close.remote() for agent in self.agents.values()]
        ray.wait(closing, num_returns=len(closing), timeout=10)
        for agent in self.agents.values():
            ray.kill(agent, no_restart=True)
        self.slots.close()
