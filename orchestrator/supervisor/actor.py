"""The job supervisor: one Ray actor per job, an explicit state machine that executes decisions.

It places the workers, runs a fresh rendezvous per process-group generation, collects worker
outcomes and node-agent reports, asks the failure policy what to do and does it. It decides
nothing itself: health.policy.decide does.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import statistics
import threading
import time
import uuid
from collections import Counter, defaultdict
from typing import Any

import ray
import torch.distributed as dist
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    NodeLabelSchedulingStrategy,
    NotIn,
)

from ckpt.commit import CommitTracker, with_copies
from ckpt.durable import CorruptCheckpoint, DurableError, Manifest
from ckpt.replicas import choose_stride
from ckpt.replicas import effective as effective_copies
from ckpt.replicas import groups as replica_groups
from ckpt.replicas import peers as replica_peers
from health.classify import classify_death
from health.cordon import CordonList
from health.liveness import Hang
from health.observations import Budget, FailureKind, WorkerFailure
from health.policy import NODE_CLASSES, Action, Decision, decide, per_rank
from health.preflight import PreflightResult, judge_preflight
from health.straggler import straggler_decision
from orchestrator.agent.actor import NodeAgent
from orchestrator.events import EventLog
from orchestrator.observe.metrics import JobMetrics
from orchestrator.spec import JobSpec
from orchestrator.state import JobState, StateMachine, Transition
from orchestrator.supervisor.monitor import HealthMonitor
from orchestrator.supervisor.persist import Persister
from orchestrator.supervisor.poller import ReportPoller
from orchestrator.supervisor.resources import SchedulingError, check_capacity, worker_bundle
from orchestrator.supervisor.slots import Slots, SlotsUnavailable
from orchestrator.worker.actor import TrainWorker
from orchestrator.worker.probes import pair_rounds

log = logging.getLogger(__name__)

RAY_NODES_CHECK_S = 1.0  # how often Ray's node table is read
FINAL_REPLICATION_S = 10.0  # a finished job waits this long for its last step's copies
FINAL_PERSIST_TIMEOUT_S = 300.0  # a finished job waits this long for its last checkpoint
AGENT_PREFIX = "stalwart-agent-"
METRICS_REFRESH_S = 0.5  # the exporter's values are at most this old (plus a poll)...
METRICS_DUTY = 0.1  # ...unless refreshing them would take more of the supervisor's time
REPLICATE_PER_S = 4.0  # copies to peers at most this often (thinned to a grid of steps)
REPLICATION_ALIGN_S = 1.0  # no commit for this long: name the step every agent sends
REPLICATION_STALL_S = 30.0  # no commit for this long: an event says so (again every 30 s)
NEWEST_KEPT = 3  # each rank's newest steps a node's own store keeps beyond the commits
THROUGHPUT_EVENT_S = 1.0  # how often a throughput event is written
RANK_TIMES_MAX = 64  # ranks whose step times a throughput event carries, at most
NODE_FAULTS = ("kill_node", "gpu_xid")  # faults that hit the node hosting the rank
COLLECTIVE_TIMEOUT_S = 1800.0
NODE_PING_TIMEOUT_S = 1.0  # a dead worker's node must answer this fast to keep its bundle
# An actor that is gone, or that cannot be reached (its node is down).
ActorGone = (
    RayActorError,
    ActorUnavailableError,
)  # a backstop only: recoveries abort collectives explicitly


class JobSupervisor:
    def __init__(
        self,
        spec: dict[str, Any],
        base_dir: str | None = None,
        resume: str = "auto",
        store_key: str | None = None,
        adopt: dict[str, Any] | None = None,
    ):
        """`adopt`: this supervisor replaces one that died ({"restarts": n}); it takes the
        job back from the node agents of `store_key`, which outlived it."""
        self.spec = JobSpec.model_validate(spec)
        self.resume = resume  # "auto", "never" or a step number (whole-job resume)
        self.adopt = adopt
        self.supervisor_restarts = adopt["restarts"] if adopt else 0
        self.resumed_from: int | None = None
        self.spec_dict = self.spec.model_dump(mode="json")
        self.base_dir = base_dir
        self.events = EventLog()
        self.metrics = JobMetrics(self.spec.name)
        self.events.subscribe(self.metrics.on_event)
        self.metrics_url: str | None = None
        self._metrics_at = 0.0  # when the metrics were last refreshed
        self._metrics_cost = 0.0  # seconds the last refresh took
        self.sm = StateMachine()
        self.sm.add_hook(self._on_transition)
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        n = self.world = self.spec.max_workers  # the current world size (elastic jobs vary)
        self.workers: dict[int, Any] = {}
        self.worker_info: dict[int, dict[str, Any]] = {}
        # rank -> its slot (supervisor/slots.py); None: placed outside any slot (its slot's node
        # was bad)
        self.bundle_of: dict[int, int | None] = {}
        # Started and ready: (actor, slot or None, node). Starting: ready() ref -> (actor,
        # slot or None).
        self.spares: list[tuple[Any, int | None, str]] = []
        self.spares_starting: dict[Any, tuple[Any, int | None]] = {}
        self.agents: dict[str, Any] = {}
        self.slots = Slots(f"stalwart-{self.spec.name}")
        self.generation = 0
        self.futures: dict[Any, int] = {}
        self.finished: dict[int, dict[str, Any]] = {}
        self.commit = CommitTracker(n)
        self.stored: dict[str, dict[int, list[int]]] = {}  # node -> its own store's steps
        self.replicas_held: dict[str, dict[int, list[int]]] = {}  # node -> copies it holds
        self.replication: dict[str, dict[str, Any]] = {}  # node -> its replicator's status
        self.copies = 1  # copies of each shard the replica plan keeps (ckpt/replicas.py)
        self._plan_nodes: tuple[str, ...] = ()
        self._replicating: tuple[int, float] | None = None  # (step asked for, when)
        self._stride = self.spec.checkpoint.every_steps  # steps apart of the copies sent
        self._send_mark: dict[str, tuple[float, int]] = {}  # node -> (send seconds, rounds)
        self._steady_rate: float | None = None  # steps/s, median of the last 10 steps
        self._round_s: float | None = None  # the last measured cost of a round of copies
        self._commit_seen: tuple[int | None, float] = (None, time.time())  # (step, since)
        self._stall_reported = 0.0
        self._kept: tuple[int, ...] = ()  # the steps last sent to agents as `keep`
        self._prune_seq = 0  # numbers the agents' prune calls (they may overtake)
        self.restore_tiers: dict[str, int] = {}  # this generation's restores, per tier
        self.restored_remotely: dict[int, str] = {}
        self.beats: dict[int, dict[str, Any]] = {}
        self.fault_records: list[dict[str, Any]] = []
        self.fired: set[int] = set()
        self.pending: list[WorkerFailure] = []
        self.failures: list[dict[str, Any]] = []
        self.open_recovery: dict[str, Any] | None = None
        self.restarts = 0
        self.user_errors = 0
        self.error: dict[str, Any] | None = None
        self.started_at = time.time()
        self.store_key = store_key or f"{self.spec.name}-{uuid.uuid4().hex[:12]}"
        self.running_since: float | None = None
        self.ended_at: float | None = None
        self._store = None
        self._dropped_below: int | None = None
        self.monitor = HealthMonitor(self.spec.health)
        self.cordons = CordonList(self.spec.health.cordon_ttl_s)
        self.lost_nodes: set[str] = set()
        self.incidents: list[tuple[str, float]] = []  # (node, when): one per node per recovery
        self.stragglers: list[dict[str, Any]] = []  # every straggler flag, for the result
        self.cordon_log: list[dict[str, Any]] = []
        self.preflight_passed: dict[str, float] = {}  # node -> its matmul seconds
        self.resizes: list[dict[str, Any]] = []  # elastic shrinks and grows
        self.restore_rank: dict[int, int] = {}  # rank -> whose shard it restores (a grow)
        # ready() ref -> (worker waiting for capacity, its slot or None)
        self.growing: dict[Any, tuple[Any, int | None]] = {}
        self._last_grow_check = 0.0
        self._straggling: set[int] = set()
        self.poller = ReportPoller(lambda node: self.agents[node].report.remote(), self.monitor)
        self._last_ray_check = 0.0
        self._throughput_mark: tuple[float, int] | None = None
        self._last_rate: float | None = None  # steps/s of the newest throughput event
        self.home_node = ray.get_runtime_context().get_node_id()
        self.handle = None  # this actor's own handle, for workers to report faults to
        persist = self.spec.checkpoint.persist
        self.persister = (
            Persister(persist, self.spec.name, self.events.emit) if persist.uri else None
        )

    # --- public API (called by the driver) ---------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.handle = ray.get_runtime_context().current_actor
        self._start_exporter()
        try:
            self._set(JobState.SCHEDULING, f"placing {self.world} workers")
            if self.adopt:
                self._adopt_agents()
            self._schedule()
            memory = self._adopted_restore_point() if self.adopt else None
            durable = self._resume_point() if memory is None else None
            restore = memory if memory is not None else (durable.step if durable else None)
            self._start_generation(restore_step=restore, durable=durable)
            self.running_since = time.time()
            self._set(JobState.RUNNING, f"generation {self.generation} started")
            while not self.sm.state.terminal:
                if self._cancel.is_set():
                    self._abort_all("job cancelled")
                    self._set(JobState.CANCELLED, "cancelled by the user")
                    break
                self._tick()
        except SchedulingError as e:
            self.error = {"message": str(e)}
            self._set(JobState.FAILED, str(e))
        except Exception as e:
            log.exception("supervisor failed")
            self.error = {"message": f"supervisor error: {type(e).__name__}: {e}"}
            if not self.sm.state.terminal:
                self._set(JobState.FAILED, self.error["message"])
        finally:
            self.ended_at = time.time()
            try:
                self._refresh_metrics()  # the final values, for the last scrapes
            except Exception:
                log.exception("final metrics refresh failed")
            self._teardown()
        return self.result()

    def poll(self, since: int = 0) -> dict[str, Any]:
        return {"events": self.events.since(since), "progress": self.progress()}

    def cancel(self) -> None:
        self._cancel.set()

    def record_fault(self, fault: dict[str, Any]) -> None:
        """A worker is about to carry out a chaos fault (called before it does)."""
        with self._lock:
            self.fault_records.append(fault)
            self.fired.add(fault["index"])
        self.events.emit("fault_injected", **fault)

    def uncordon(self, node: str) -> bool:
        """Let `node` get ranks of this job again (`stalwart uncordon`)."""
        with self._lock:
            gone = self.cordons.uncordon(node)
        if gone is not None:
            self.events.emit("uncordoned", node=node, reason="by the user")
        return gone is not None

    def cordoned(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {
                n: {"reason": c.reason, "since": c.at, "until": c.until}
                for n, c in self.cordons.active(time.time()).items()
            }

    def progress(self) -> dict[str, Any]:
        with self._lock:
            beats = [b for b in self.beats.values() if b.get("generation") == self.generation]
            # A finished rank stops beating; its outcome holds its last step.
            steps = [b["step"] for b in beats] + [o["step"] for o in self.finished.values()]
            losses = [b["metrics"]["loss"] for b in beats if "loss" in b.get("metrics", {})]
            return {
                "state": self.sm.state.value,
                "generation": self.generation,
                "step": max(steps) if steps else 0,
                "total_steps": self.spec.steps,
                "committed_step": self.commit.committed,
                "loss": sum(losses) / len(losses) if losses else None,
                "samples": sum(b.get("samples", 0.0) for b in beats),
                "failures": len(self.failures),
                "restarts": self.restarts,
                "goodput": self.metrics.goodput,
                "steps_per_s": self._last_rate,
                "workers": len(self.workers),
                "spares": len(self.spares),
                "cordoned": len(self.cordons.active(time.time())),
                "slowest": sorted(
                    self.monitor.last_scores.items(), key=lambda kv: kv[1], reverse=True
                )[:3],
                "now": time.time(),
            }

    # --- state --------------------------------------------------------------------------------

    def _set(self, state: JobState, reason: str) -> Transition:
        return self.sm.set(state, reason)

    def _on_transition(self, t: Transition) -> None:
        self.events.emit("state", old=t.old.value, new=t.new.value, reason=t.reason)

    # --- scheduling ---------------------------------------------------------------------------

    def _schedule(self) -> None:
        spec = self.spec
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
        for node in sorted(self.slots.nodes()):
            self._ensure_agent(node)
        for rank in range(self.world):
            self.bundle_of[rank] = rank
            self.workers[rank] = self._create_worker(rank, rank)
        for bundle_index in range(self.world, n_bundles):
            self._start_spare(bundle_index)
        self._await_ready(list(range(self.world)), spec.failure.scheduling_timeout_s)
        if self.spares_starting:
            # Start with the spares ready, so an early failure finds one.
            ray.wait(
                list(self.spares_starting),
                num_returns=len(self.spares_starting),
                timeout=spec.failure.scheduling_timeout_s,
            )
            self._check_spares()
        self._preflight_and_move(list(range(self.world)), initial=True)
        self.events.emit(
            "scheduled",
            supervisor_node=self.home_node,
            nodes=sorted({i["node_id"] for i in self.worker_info.values()}),
            workers={r: self.worker_info[r] for r in self.workers},
        )

    # --- preflight ------------------------------------------------------------------------

    def _preflight(
        self,
        ranks: list[int],
        idle: list[tuple[Any, str]] = (),
        pairs: bool = False,
        peers: list[int] = (),
    ) -> dict:
        """Check the nodes of `ranks` and of `idle` (rankless workers: spares, newcomers,
        with their nodes): a matmul timing on every worker and, with `pairs`, an all-reduce
        between neighbour ranks. `peers`: idle ranks on nodes that passed before, timed at
        the same moment as the reference (a shared machine's load then weighs on both sides
        alike). Returns the nodes to cordon with why; nodes that pass are remembered."""
        cfg = self.spec.health.preflight
        t0 = time.time()
        slow = {
            f.rank: f.factor
            for i, f in enumerate(self.spec.chaos.faults)
            if f.kind == "slow" and f.at_step == 0 and i not in self.fired
        }
        actors = [(r, self.workers[r]) for r in [*ranks, *peers]]
        actors += [(None, a) for a, _ in idle]
        idle_node = {id(a): n for a, n in idle}
        refs = {
            actor.preflight_matmul.remote(cfg.matmul_size, cfg.matmul_repeats, slow.get(r, 1.0)): (
                r,
                actor,
            )
            for r, actor in actors
        }
        per_actor = self._gather(refs, cfg.timeout_s, "matmul")
        allreduce: dict[int, dict[str, Any]] = {}
        if pairs and len(ranks) > 1:
            rendezvous = self._new_store()
            for i, pairs_round in enumerate(pair_rounds(sorted(ranks))):
                refs = {}
                for a, b in pairs_round:
                    for pair_rank, r in enumerate((a, b)):
                        ref = self.workers[r].preflight_allreduce.remote(
                            rendezvous, f"{i}-{a}-{b}", pair_rank, cfg.timeout_s
                        )
                        refs[ref] = (r, self.workers[r])
                for (r, _), res in self._gather(refs, cfg.timeout_s, "all-reduce").items():
                    prev = allreduce.get(r)
                    if (
                        prev is None
                        or "error" in res
                        or res.get("allreduce_s", 0) > prev.get("allreduce_s", 0)
                    ):
                        allreduce[r] = res
        results: dict[str, dict[str, Any]] = {}
        for (r, actor), res in per_actor.items():
            node = res.get("node_id") or (
                self.worker_info[r]["node_id"] if r is not None else idle_node[id(actor)]
            )
            agg = results.setdefault(node, {"matmul": [], "allreduce": [], "errors": []})
            if "error" in res:
                agg["errors"].append(res["error"])
            else:
                agg["matmul"].append(res["matmul_s"])
            ar = allreduce.get(r) if r is not None else None
            if ar is not None:
                if "error" in ar:
                    agg["errors"].append(ar["error"])
                else:
                    agg["allreduce"].append(ar["allreduce_s"])
        checked = {
            node: PreflightResult(
                node,
                max(a["matmul"]) if a["matmul"] and not a["errors"] else None,
                statistics.median(a["allreduce"]) if a["allreduce"] else None,
                "; ".join(a["errors"]) or None,
            )
            for node, a in results.items()
        }
        # Without peers timed now, a later node is judged against the earlier ones' times.
        reference = (
            statistics.median(self.preflight_passed.values())
            if self.preflight_passed and not pairs and not peers
            else None
        )
        bad, reason = judge_preflight(checked, cfg.max_slowdown, reference)
        peer_nodes = {self.worker_info[r]["node_id"] for r in peers}
        bad = {n: why for n, why in bad.items() if n not in peer_nodes}
        for node, res in checked.items():
            if node not in bad:
                self.preflight_passed[node] = res.matmul_s
        self.events.emit(
            "preflight",
            nodes={
                n: {
                    "matmul_ms": _ms(r.matmul_s),
                    "allreduce_ms": _ms(r.allreduce_s),
                    "error": r.error,
                }
                for n, r in checked.items()
            },
            reference_ms=_ms(reference),
            failed=bad,
            seconds=round(time.time() - t0, 3),
            reason=reason,
        )
        return bad

    def _gather(self, refs: dict[Any, tuple], timeout_s: float, what: str) -> dict[tuple, dict]:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for ref, key in refs.items():
            if ref not in ready:
                out[key] = {"error": f"{what} did not finish within {timeout_s} s"}
                continue
            try:
                out[key] = ray.get(ref)
            except ActorGone as e:
                out[key] = {"error": f"{what}: worker died: {_actor_error_text(e)[:300]}"}
        return out

    def _preflight_peers(self, ranks: list[int]) -> list[int]:
        """Up to three idle ranks (between generations) on nodes that passed preflight."""
        return [
            r
            for r in sorted(self.workers)
            if r not in ranks and self.worker_info[r]["node_id"] in self.preflight_passed
        ][:3]

    def _cordon_failed_preflight(self, bad: dict[str, str]) -> None:
        now = time.time()
        for node, why in bad.items():
            reason = f"preflight: {why}"
            c = self.cordons.cordon(node, reason, now)
            self.cordon_log.append({"node": node, "at": now, "until": c.until, "reason": reason})
            self.events.emit("cordoned", node=node, until=c.until, reason=reason)

    def _preflight_and_move(self, ranks: list[int], initial: bool) -> None:
        """Preflight `ranks` (at the start: every rank with neighbour all-reduces, and the
        spares); cordon failing nodes and move their ranks until every rank's node passed."""
        if not self.spec.health.preflight.enabled or not ranks:
            return
        idle = [(a, n) for a, _, n in self.spares] if initial else []
        peers = [] if initial else self._preflight_peers(ranks)
        bad = self._preflight(ranks, idle, pairs=initial, peers=peers)
        for _attempt in range(3):
            if not bad:
                return
            self._cordon_failed_preflight(bad)
            for entry in [s for s in self.spares if s[2] in bad]:
                self.spares.remove(entry)
                ray.kill(entry[0], no_restart=True)
                self._start_spare(None)
            movers = [r for r in ranks if self.worker_info[r]["node_id"] in bad]
            moved = self._move(movers)
            for i, f in enumerate(self.spec.chaos.faults):
                if f.kind == "slow" and f.at_step == 0 and f.rank in moved:
                    self.fired.add(i)  # the slow node it stood for is cordoned
            if not moved:
                return
            ranks = moved
            bad = self._preflight(moved, peers=self._preflight_peers(moved))
        raise SchedulingError(f"preflight kept failing after moving ranks 3 times: {bad}")

    def _move(self, ranks: list[int]) -> list[int]:
        """Start `ranks` again on healthy nodes; a rank with no room on one within
        failure.replacement_timeout_s stays where it is. Returns the ranks moved."""
        old = {r: (self.workers[r], self.worker_info[r], self.bundle_of[r]) for r in ranks}
        for rank in ranks:
            self.workers[rank] = self._create_worker(rank, None)
        missing = self._await_ready(
            ranks, self.spec.failure.replacement_timeout_s, allow_missing=True
        )
        for rank in ranks:
            if rank in missing:
                ray.kill(self.workers[rank], no_restart=True)
                self.workers[rank], self.worker_info[rank], self.bundle_of[rank] = old[rank]
            else:
                ray.kill(old[rank][0], no_restart=True)
                self.bundle_of[rank] = None
        moved = [r for r in ranks if r not in missing]
        if moved:
            self.events.emit(
                "preflight_moved",
                ranks={r: self.worker_info[r]["node_id"] for r in moved},
                reason="their nodes failed preflight",
            )
        if missing:
            self.events.emit(
                "preflight_kept",
                ranks=missing,
                reason="their nodes failed preflight, but no healthy node had room within "
                f"failure.replacement_timeout_s={self.spec.failure.replacement_timeout_s}; "
                "they stay (the node stays cordoned for new ranks)",
            )
        return moved

    def _bad_nodes(self) -> set[str]:
        """Nodes that get no new ranks: lost or cordoned."""
        return self.lost_nodes | set(self.cordons.active(time.time()))

    def _usable_bundle(self, bundle_index: int | None) -> int | None:
        """`bundle_index` (a slot) if its node may take a rank, else None (place outside
        any slot; a slot on a bad node is released)."""
        if bundle_index is None:
            return None
        node = self.slots.node_of(bundle_index)
        if node is not None and node not in self._bad_nodes():
            return bundle_index
        self.slots.release(bundle_index)
        return None

    def _ensure_agent(self, node: str) -> Any:
        if node not in self.agents:
            gpu = self.spec.health.gpu
            self.agents[node] = (
                ray.remote(NodeAgent)
                .options(
                    num_cpus=0,
                    max_concurrency=32,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                    # Detached: the node's memory (its shards) outlives this supervisor, so
                    # a restarted one takes the job back from it (the agent's lease ends
                    # it when no supervisor of the job is left).
                    lifetime="detached",
                    name=f"{AGENT_PREFIX}{self.store_key}-{node[:16]}",
                    namespace="stalwart",
                )
                .remote(
                    node,
                    self.store_key,
                    gpu_probe=gpu.probe,
                    gpu_interval_s=gpu.interval_s,
                )
            )
        return self.agents[node]

    def _start_spare(self, bundle_index: int | None) -> None:
        """Start an idle worker (in `bundle_index`, or on any healthy node if None); it
        becomes usable once ready() returns."""
        actor = self._create_worker(None, bundle_index)
        self.spares_starting[actor.ready.remote()] = (actor, bundle_index)

    def _check_spares(self) -> None:
        if not self.spares_starting:
            return
        ready, _ = ray.wait(
            list(self.spares_starting), num_returns=len(self.spares_starting), timeout=0
        )
        for ref in ready:
            actor, bundle_index = self.spares_starting.pop(ref)
            try:
                info = ray.get(ref)
                ray.get(actor.attach.remote(self._ensure_agent(info["node_id"])), timeout=30)
            except (*ActorGone, GetTimeoutError) as e:
                self.events.emit("spare_failed", bundle=bundle_index, message=_actor_error_text(e))
                continue
            self.spares.append((actor, bundle_index, info["node_id"]))
            self.events.emit(
                "spare_ready", bundle=bundle_index, node=info["node_id"], spares=len(self.spares)
            )

    def _take_spare(self, rank: int) -> tuple[Any, int | None] | None:
        """A ready spare on a healthy node, now holding `rank`; None if there is none."""
        bad = self._bad_nodes()
        for entry in list(self.spares):
            actor, bundle_index, node = entry
            if node in bad:
                continue
            self.spares.remove(entry)
            try:
                ray.get(actor.assume.remote(rank), timeout=10)
            except (*ActorGone, GetTimeoutError) as e:
                self.events.emit("spare_failed", bundle=bundle_index, message=_actor_error_text(e))
                ray.kill(actor, no_restart=True)
                self._start_spare(self._usable_bundle(bundle_index))
                continue
            return actor, bundle_index
        return None

    def _create_worker(self, rank: int | None, bundle_index: int | None) -> Any:
        spec = self.spec
        if bundle_index is not None:
            strategy: Any = self.slots.strategy(bundle_index)
        elif bad := self._bad_nodes():
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
        if spec.runtime_env:
            options["runtime_env"] = spec.runtime_env
        return (
            ray.remote(TrainWorker)
            .options(**options)
            .remote(
                job=spec.name,
                spec=self.spec_dict,
                rank=rank,
                world_size=self.world,
                base_dir=self.base_dir,
                supervisor=self.handle,
            )
        )

    def _await_ready(
        self, ranks: list[int], timeout_s: float, allow_missing: bool = False
    ) -> list[int]:
        """Wait for `ranks`' workers to start and attach them to their node agents. Returns
        the ranks still not started after `timeout_s` (only with `allow_missing`)."""
        refs = {self.workers[r].ready.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        missing = sorted(r for ref, r in refs.items() if ref not in ready)
        if missing and not allow_missing:
            raise SchedulingError(
                f"workers {missing} did not start within {timeout_s:.0f} s "
                "(failure.scheduling_timeout_s, or failure.replacement_timeout_s for a "
                "replacement); no healthy node had room for them"
            )
        try:
            infos = ray.get(ready)
        except ActorGone as e:
            raise SchedulingError(f"a worker failed to start: {_actor_error_text(e)}") from None
        attached = []
        for info, ref in zip(infos, ready, strict=True):
            rank = refs[ref]
            self.worker_info[rank] = {**info, "rank": rank}
            agent = self._ensure_agent(info["node_id"])
            attached.append(self.workers[rank].attach.remote(agent))
        ray.get(attached, timeout=30)
        return missing

    def _local_ranks(self) -> dict[int, int]:
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank in sorted(self.workers):
            by_node[self.worker_info[rank]["node_id"]].append(rank)
        return {r: i for ranks in by_node.values() for i, r in enumerate(ranks)}

    # --- generations --------------------------------------------------------------------------

    def _start_generation(self, restore_step: int | None, durable: Manifest | None = None) -> None:
        self.generation += 1
        gen = self.generation
        rendezvous = {
            "timeout_s": self.spec.failure.rendezvous_timeout_s,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        }
        if self.spec.max_workers > 1:
            # A fresh store (and port) per generation: nothing of a broken generation can
            # leak into the next one's rendezvous.
            rendezvous.update(self._new_store())
        faults = self._faults_for_generation()
        local = self._local_ranks()
        self.monitor.start_generation(
            {r: (self.worker_info[r]["node_id"], self.worker_info[r]["pid"]) for r in self.workers},
            time.time(),
        )
        self._throughput_mark = None
        self._last_rate = None  # the rate of a generation that is gone
        self.futures = {}
        self.finished = {}
        if durable is not None:
            # Every rank reads its own shard from storage (sha256-checked against the
            # manifest); memory holds no complete set.
            target = self.persister.target
            sources = {r: (target, r, "durable") for r in self.workers}
        else:
            holders = self._holders(restore_step) if restore_step is not None else {}
            sources = {r: self._restore_source(r, restore_step, holders) for r in self.workers}
        # Where this generation's ranks restore from: counts per tier, and the ranks that
        # restore from another node's memory (a lost node's ranks).
        self.restore_tiers = dict(Counter(t for _, _, t in sources.values() if t))
        self.restored_remotely = {
            r: t for r, (_, _, t) in sources.items() if t not in (None, "memory")
        }
        for rank, worker in self.workers.items():
            source, source_rank, _ = sources[rank]
            ref = worker.run.remote(
                gen,
                rendezvous,
                restore_step,
                source,
                faults,
                local[rank],
                rank=rank,
                world_size=self.world,
                restore_rank=source_rank,
            )
            self.futures[ref] = rank
        self.events.emit(
            "generation",
            generation=gen,
            restore_step=restore_step,
            restore_tiers=self.restore_tiers,
            restored_remotely=self.restored_remotely,
            world_size=self.world,
            rendezvous_port=rendezvous.get("port"),
        )

    def _new_store(self) -> dict[str, Any]:
        """A fresh TCPStore on this actor: its host and port, and gloo_host when every worker
        is on this machine (then rendezvous and gloo stay on loopback)."""
        host = ray.util.get_node_ip_address()
        out: dict[str, Any] = {}
        if {i["node_ip"] for i in self.worker_info.values()} == {host}:
            host = out["gloo_host"] = "127.0.0.1"
        self._store = dist.TCPStore(
            host,
            0,
            None,
            True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.spec.failure.rendezvous_timeout_s),
        )
        return {**out, "host": host, "port": self._store.port}

    def _faults_for_generation(self) -> list[dict[str, Any]]:
        faults = []
        for i, f in enumerate(self.spec.chaos.faults):
            if i in self.fired:
                continue
            fault = {**f.model_dump(mode="json"), "index": i}
            if f.kind == "kill_node" and self.worker_info[f.rank]["node_id"] == self.home_node:
                # Killing this node would kill the supervisor (and on a cluster's head node,
                # the cluster): refused, with the reason in the event log.
                self.fired.add(i)
                self.events.emit(
                    "fault_refused",
                    **fault,
                    reason="the node hosting this rank also hosts the job's supervisor",
                )
                continue
            faults.append(fault)
        return faults

    def _holders(self, step: int) -> dict[int, list[str]]:
        """rank -> the live nodes whose memory holds its shard of `step` (own or copy)."""
        out: dict[int, list[str]] = defaultdict(list)
        for held in (self.stored, self.replicas_held):
            for node, by_rank in held.items():
                if node not in self.agents:
                    continue
                for r, steps in by_rank.items():
                    if step in steps:
                        out[int(r)].append(node)
        return out

    def _restore_source(
        self, rank: int, step: int | None, holders: dict[int, list[str]]
    ) -> tuple[Any, int, str | None]:
        """Where `rank` restores `step` from: (agent, whose shard, tier). The tier is
        "memory" (the rank's own node holds it) or "peer" (another node's memory: its own
        store or a copy it keeps). Whose shard: the rank's own, or for a rank added by a
        grow, the peer it copies until it has one."""
        if step is None:
            return None, rank, None
        here = self.worker_info.get(rank, {}).get("node_id")
        for source in (rank, self.restore_rank.get(rank)):
            if source is None:
                continue
            nodes = holders.get(source, [])
            if nodes:
                node = here if here in nodes else min(nodes)
                return self.agents[node], source, "memory" if node == here else "peer"
        raise RuntimeError(f"no store holds rank {rank}'s shard of committed step {step}")

    # --- durable tier ------------------------------------------------------------------------

    def _durable_restore_point(self) -> Manifest | None:
        """The newest durable checkpoint of this job and world size that verifies (every
        shard's size and sha256); each newer one skipped is reported with its reason."""
        if self.persister is None:
            return None
        store = self.persister.store
        try:
            manifest, skipped = store.newest_valid(self.world)
        except DurableError as e:
            self.events.emit("durable_unavailable", reason=f"{store.describe()}: {e}")
            return None
        for step, why in skipped:
            self.events.emit("checkpoint_skipped", step=step, reason=why)
        return manifest

    def store_key_of(self) -> str:
        """Which job run this is (node agents check their supervisor by it)."""
        return self.store_key

    def _adopt_agents(self) -> None:
        """The node agents the dead supervisor left (detached, named after the store key);
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
        self.events.emit(
            "supervisor_adopted",
            agents=sorted(self.agents),
            restarts=self.supervisor_restarts,
            reason=f"supervisor restarted ({self.supervisor_restarts} so far): "
            f"{len(self.agents)} node agent(s) of the job kept their memory",
        )

    def _adopted_restore_point(self) -> int | None:
        """The newest step of which the adopted agents' memory holds every rank's shard
        (own stores or copies)."""
        self._poll_agents(wait_s=5.0)
        self.commit.reset(self._in_memory())
        step = self.commit.committed
        self.events.emit(
            "resume",
            step=step,
            reason=(
                f"taking the job back from the node agents' memory at step {step}"
                if step is not None
                else "the node agents hold no complete step: durable storage or step 0"
            ),
        )
        return step

    def _resume_point(self) -> Manifest | None:
        """Whole-job resume at start (`stalwart run --resume auto|never|STEP`)."""
        if self.persister is None or self.resume == "never":
            return None
        store = self.persister.store
        if self.resume == "auto":
            manifest = self._durable_restore_point()
            if manifest is None:
                self.events.emit(
                    "resume",
                    step=None,
                    reason=f"no complete checkpoint of {self.world} ranks under "
                    f"{store.describe()}: starting from step 0",
                )
                return None
        else:
            step = int(self.resume)
            try:
                manifest = store.verify(step, self.world)
            except (CorruptCheckpoint, DurableError) as e:
                raise SchedulingError(f"--resume {step}: {e}") from None
        self.resumed_from = manifest.step
        self.persister.resumed_from(manifest.step)
        self.events.emit(
            "resume",
            step=manifest.step,
            reason=f"resuming from durable step {manifest.step} of {store.describe()} "
            f"(written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_at))})",
        )
        return manifest

    def _maybe_persist(self) -> None:
        p = self.persister
        if p is None:
            return
        p.poll()
        if self.sm.state is not JobState.RUNNING:
            return
        complete = self._complete_in_memory()
        step = p.choose(complete, self.commit.committed, time.time())
        if step is not None:
            self._start_persist(step)

    def _start_persist(self, step: int) -> bool:
        """Have the agents write `step`: each rank's shard by a node holding it in memory
        (the rank's own node when it can). False if some shard is not in memory now."""
        holders = self._holders(step)
        assignment: dict[str, tuple[Any, list[int]]] = {}
        for rank in range(self.world):
            nodes = holders.get(self.restore_rank.get(rank, rank), [])
            if not nodes:
                return False  # (a shrink or rekey moved it): next time
            here = self.worker_info.get(rank, {}).get("node_id")
            node = here if here in nodes else min(nodes)
            assignment.setdefault(node, (self.agents[node], []))[1].append(rank)
        self.persister.start(step, self.world, assignment)
        self._trim()
        return True

    def _in_memory(self) -> dict[int, set[int]]:
        """rank -> the steps of which some live node's memory holds a shard it can restore
        (its own node's store or a copy; a rank added by a grow restores a peer's)."""
        held_by_rank: dict[int, set[int]] = defaultdict(set)
        for per_node in (self.stored, self.replicas_held):
            for node, by_rank in per_node.items():
                if node in self.lost_nodes:
                    continue
                for r, steps in by_rank.items():
                    held_by_rank[int(r)].update(steps)
        for rank, source in self.restore_rank.items():
            held_by_rank[rank] |= held_by_rank.get(source, set())
        return held_by_rank

    def _complete_in_memory(self) -> set[int]:
        """Steps of which every rank's shard is in some live node's memory."""
        held = self._in_memory()
        sets = [held.get(r, set()) for r in range(self.world)]
        return set.intersection(*sets) if sets else set()

    def _replicate_final(self) -> None:
        """At the end of a job the last step's copies too: the thinned grid of copies may
        have skipped it, and the job's end state should be as safe as the rest."""
        if self.copies <= 1 or not self.workers:
            return
        own: dict[int, set[int]] = defaultdict(set)
        for held in self.stored.values():
            for r, steps in held.items():
                own[int(r)].update(steps)
        complete = set.intersection(*(own.get(r, set()) for r in self.workers))
        if not complete:
            return
        newest = max(complete)
        for node in self._plan_nodes:
            self.agents[node].replicate.remote(newest)
        deadline = time.monotonic() + FINAL_REPLICATION_S
        while (self.commit.committed or -1) < newest and time.monotonic() < deadline:
            self._poll_agents(wait_s=0.5)

    def _persist_final(self) -> None:
        """At the end of a job, the newest step all ranks hold goes to storage too (after
        the write in flight), so a finished job's last state is durable."""
        p = self.persister
        if p is None:
            return
        if not p.wait(FINAL_PERSIST_TIMEOUT_S):
            self.events.emit("persist_failed", step=None, reason="the last write did not end")
            return
        complete = self._complete_in_memory()
        last = p.last_step if p.last_step is not None else 0
        newest = max((s for s in complete if s > last), default=None)
        if newest is None or not self._start_persist(newest):
            return
        if not p.wait(FINAL_PERSIST_TIMEOUT_S):
            self.events.emit(
                "persist_failed", step=newest, reason="the final checkpoint's write did not end"
            )

    def storage_outage(self, seconds: float) -> None:
        """Chaos storage_unavailable (called by the worker carrying out the fault)."""
        if self.persister is None:
            self.events.emit(
                "fault_refused",
                kind="storage_unavailable",
                reason="checkpoint.persist.uri is not set: there is no storage to fail",
            )
            return
        self.persister.outage(seconds, list(self.agents.values()))

    # --- the control loop ---------------------------------------------------------------------

    def _tick(self) -> None:
        self._check_spares()
        self._check_growth()
        ready, _ = ray.wait(list(self.futures), num_returns=1, timeout=0.05)
        if ready:
            ready, _ = ray.wait(list(self.futures), num_returns=len(self.futures), timeout=0)
        for ref in ready:
            self._collect(ref)
        if (
            time.time() - self.poller.last_poll >= self.spec.health.report_interval_s
            or self.pending
        ):
            self._poll_agents()
            self._detect()
            # What memory holds changes only with a poll: so does what can be persisted.
            self._maybe_persist()
        if self.pending:
            self._handle_failures()
        elif len(self.finished) == len(self.workers) and not self.futures:
            self._finish()
        # At 16,384 ranks a refresh costs ~0.3 s: spacing refreshes by 1/METRICS_DUTY of
        # their cost keeps the exporter from taking the control loop's time.
        if time.time() - self._metrics_at >= max(
            METRICS_REFRESH_S, self._metrics_cost / METRICS_DUTY
        ):
            self._refresh_metrics()

    # --- metrics ------------------------------------------------------------------------------

    def _start_exporter(self) -> None:
        """Serve the job's metrics (orchestrator/observe/metrics.py). A port that cannot be bound
        costs the metrics, not the job: an event says why."""
        m = self.spec.metrics
        try:
            port = self.metrics.serve(m.host, m.port)
        except OSError as e:
            self.events.emit(
                "metrics_unavailable",
                reason=f"cannot serve metrics on {m.host}:{m.port} (metrics.host/metrics.port): "
                f"{e.strerror or e}",
            )
            return
        self.metrics_url = f"http://{m.host}:{port}/metrics"
        self.events.emit("metrics_exporter", url=self.metrics_url, host=m.host, port=port)

    def _refresh_metrics(self) -> None:
        self._metrics_at = now = time.time()
        started = time.perf_counter()
        progress = self.progress()
        with self._lock:
            beats = {
                r: {**b, "node_id": self.worker_info.get(r, {}).get("node_id", "")}
                for r, b in self.beats.items()
                if b.get("generation") == self.generation and r in self.workers
            }
            redone = sum(f["steps_redone"] or 0 for f in self.failures)
        self.metrics.refresh(
            progress,
            beats,
            dict(self.monitor.last_scores),
            now,
            self._budget().restarts_left,
            redone,
            dict(self.replication),
            1 / self._steady_rate if self._steady_rate else None,
        )
        self._metrics_cost = time.perf_counter() - started

    def _collect(self, ref: Any) -> WorkerFailure | None:
        rank = self.futures.pop(ref)
        now = time.time()
        try:
            out = ray.get(ref)
        except ActorGone as e:
            f = WorkerFailure(
                classify_death(str(e)),
                rank,
                self.worker_info[rank]["node_id"],
                now,
                step=self.beats.get(rank, {}).get("step"),
                message=_actor_error_text(e),
                process_lost=True,
            )
            self.pending.append(f)
            return f
        if out["outcome"] in ("finished", "interrupted"):
            self.finished[rank] = out
            return None
        kind = {
            "user_error": FailureKind.USER_ERROR,
            "oom": FailureKind.OOM,
        }.get(out["outcome"], FailureKind.COMM_ERROR)
        f = WorkerFailure(
            kind,
            rank,
            out["node_id"],
            now,
            step=out["step"],
            error_type=out.get("error_type"),
            message=out.get("message"),
            traceback=out.get("traceback"),
        )
        self.finished[rank] = out
        self.pending.append(f)
        return f

    def _poll_agents(self, wait_s: float = 0.0) -> None:
        """Ask every agent for its report; take the answers that are in (waiting up to
        `wait_s` for all). An agent that does not answer is not waited for: its silence
        is what node-loss detection measures."""
        reports = self.poller.poll(list(self.agents), wait_s)
        if time.time() - self._last_ray_check >= RAY_NODES_CHECK_S:
            self._last_ray_check = time.time()
            self.monitor.ray_states({n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()})
        merged: dict[int, set[int]] = defaultdict(set)
        with self._lock:
            for rep in reports:
                self.stored[rep["node"]] = rep["stored"]
                self.replicas_held[rep["node"]] = rep.get("replicas", {})
                self.replication[rep["node"]] = rep.get("replication", {})
                # Faults carried out (an agent outlives a dead supervisor that saw them).
                self.fired.update(rep.get("fired", ()))
                for rank, steps in rep["stored"].items():
                    merged[int(rank)].update(steps)
                for rank, beat in rep["beats"].items():
                    rank = int(rank)
                    if rank in self.workers and beat["pid"] == self.worker_info[rank]["pid"]:
                        self.beats[rank] = beat
                        if beat.get("generation") == self.generation:
                            self.monitor.beat(rank, beat)
                if rep["gpus"]:
                    # GPU gauges from NVML, or from the fake probe when the spec asks for it:
                    # `auto`'s stand-in on a CPU node has no GPU to read.
                    real = rep.get("gpu_probe") == "nvml" or self.spec.health.gpu.probe == "fake"
                    self.metrics.gpu_readings(rep["node"], rep["gpus"], gauges=real)
                    self._judge_gpus(rep["node"], rep["gpus"])
            before = self.commit.committed
            own = {r: merged.get(r, set()) for r in self.workers}
            committed = self.commit.observe(self._replicated(own))
            for rank in [r for r in self.restore_rank if committed in merged.get(r, ())]:
                del self.restore_rank[rank]  # a grown rank's own shard is committed now
        self._replicate(own, committed)
        if committed != before and committed is not None:
            drop = self.commit.droppable_below()
            if drop is not None:
                self._dropped_below = drop
        self._trim()
        self._close_recovery()

    # --- peer replicas ------------------------------------------------------------------------

    def _sync_replica_plan(self) -> None:
        """Tell every agent its replica-group peers when the set of live nodes changed."""
        nodes = tuple(sorted(n for n in self.agents if n not in self.lost_nodes))
        if nodes == self._plan_nodes:
            return
        self._plan_nodes = nodes
        wanted = self.spec.checkpoint.replicas
        plan = replica_peers(nodes, wanted)
        self.copies = max(1, effective_copies(nodes, wanted))
        for node, others in plan.items():
            self.agents[node].set_stride.remote(self._stride)
            self.agents[node].set_peers.remote({n: self.agents[n] for n in others})
        self._replicating = None  # a step asked of the old groups may never complete
        self.events.emit(
            "replica_plan",
            groups=replica_groups(nodes, wanted),
            copies=self.copies,
            reason=(
                f"{self.copies} cop{'y' if self.copies == 1 else 'ies'} of every shard on "
                f"distinct nodes"
                + (
                    f" (checkpoint.replicas={wanted}, but the job has {len(nodes)} node(s))"
                    if self.copies < wanted
                    else ""
                )
            ),
        )

    def _replicated(self, own: dict[int, set[int]]) -> dict[int, set[int]]:
        """rank -> the steps of which `self.copies` nodes hold its shard (own store or a
        peer's copy): the steps that count for the commit."""
        self._sync_replica_plan()
        live = [
            held
            for per_node in (self.stored, self.replicas_held)
            for node, held in per_node.items()
            if node not in self.lost_nodes
        ]
        return with_copies(own, live, self.copies)

    def _replicate(self, own: dict[int, set[int]], committed: int | None) -> None:
        """Agents send each new shard to their peers by themselves. When that falls behind
        and each rank's copies are of a different step, nothing commits: then name the
        newest step every rank holds in its own node's memory, which every agent sends
        next. Asked again while the commit stays behind, with an event when it is long."""
        now = time.time()
        if committed != self._commit_seen[0]:
            self._commit_seen = (committed, now)
            self._replicating = None
            return
        if self.copies <= 1 or not own:
            return
        complete = set.intersection(*own.values())
        # A step on the thinned grid, which the agents send anyway, when there is one.
        newest = max([s for s in complete if s % self._stride == 0] or complete, default=-1)
        if newest <= (committed if committed is not None else -1):
            return
        stalled_s = now - self._commit_seen[1]
        # Thinned copies commit once per stride: only a commit later than two strides'
        # time (or REPLICATION_ALIGN_S) is behind.
        grid_s = self._stride / self._steady_rate if self._steady_rate else 0.0
        if stalled_s < max(REPLICATION_ALIGN_S, 2 * grid_s):
            return
        if self._replicating is not None and now - self._replicating[1] < REPLICATION_ALIGN_S:
            return
        if stalled_s >= REPLICATION_STALL_S and now - self._stall_reported >= REPLICATION_STALL_S:
            self._stall_reported = now
            self.events.emit(
                "replication_behind",
                committed_step=committed,
                newest_step=newest,
                seconds=round(stalled_s, 1),
                errors={
                    n[:12]: st["last_error"]
                    for n, st in self.replication.items()
                    if st.get("last_error")
                },
                reason=f"no step reached {self.copies} nodes for {stalled_s:.0f} s "
                f"(newest in every rank's own memory: {newest}, committed: {committed})",
            )
        self._replicating = (newest, now)
        for node in self._plan_nodes:
            self.agents[node].replicate.remote(newest)

    def _set_replication_stride(self, steps_per_s: float) -> None:
        """Thin the copies to peers (ckpt/replicas.choose_stride): at most
        REPLICATE_PER_S rounds a second, and each node's sender busy at most
        checkpoint.replication_duty of the time, by the cost of a round measured since the
        last call (the slowest node's). A lost node then redoes up to the stride's steps."""
        round_s = None
        for node, rep in self.replication.items():
            seconds, rounds = rep.get("seconds", 0.0), rep.get("rounds", 0)
            before = self._send_mark.get(node)
            if before is not None and rounds < before[1]:
                before = None  # a new agent: its counters started again
            elif before is not None and rounds == before[1]:
                continue  # no round since the mark: keep it until there is one
            self._send_mark[node] = (seconds, rounds)
            if before is not None:
                cost = (seconds - before[0]) / (rounds - before[1])
                round_s = cost if round_s is None else max(round_s, cost)
        # Thinned copies are rare: without a round since the last call, the last cost stands.
        round_s = self._round_s = round_s if round_s is not None else self._round_s
        stride, why = choose_stride(
            steps_per_s,
            self.spec.checkpoint.every_steps,
            self._stride,
            REPLICATE_PER_S,
            self.spec.checkpoint.replication_duty,
            round_s,
        )
        if stride == self._stride:
            return
        self._stride = stride
        for node in self._plan_nodes:
            self.agents[node].set_stride.remote(self._stride)
        self.events.emit(
            "replication_stride",
            stride=self._stride,
            reason=f"copies of every {stride} steps: {why}",
        )

    def _replication_summary(self) -> dict[str, Any]:
        statuses = list(self.replication.values())
        return {
            "replicas": self.spec.checkpoint.replicas,
            "copies": self.copies,
            "groups": replica_groups(self._plan_nodes, self.spec.checkpoint.replicas),
            "sent_bytes": sum(s.get("sent_bytes", 0) for s in statuses),
            "seconds": round(sum(s.get("seconds", 0.0) for s in statuses), 3),
            "errors": sum(s.get("errors", 0) for s in statuses),
            # Shards in each node's memory at the last report (own store + copies).
            "shards_held": {
                node: sum(map(len, self.stored.get(node, {}).values()))
                + sum(map(len, self.replicas_held.get(node, {}).values()))
                for node in self._plan_nodes
                if node in self.agents
            },
        }

    def _trim(self) -> None:
        """Bound each node's memory: keep the retained commits, the step being replicated
        and each rank's newest few; drop everything below the oldest retained commit."""
        keep = set(self.commit.retained)
        if self._replicating is not None:
            keep.add(self._replicating[0])
        if self.persister is not None:
            keep |= self.persister.pinned(self.progress()["step"])
        keep = tuple(sorted(keep))
        if keep == self._kept:
            return
        self._kept = keep
        # Nothing kept is dropped for being old (a grid step waiting to be persisted).
        below = self._dropped_below
        if below is not None and keep:
            below = min(below, keep[0])
        self._prune_seq += 1
        for agent in self.agents.values():
            agent.prune.remote(
                below=below,
                keep=list(keep),
                newest=NEWEST_KEPT,
                fresh_above=self.commit.committed,
                seq=self._prune_seq,
            )

    # --- detection ----------------------------------------------------------------------------

    def _detect(self) -> None:
        """Run the detectors on what the agents reported; failures go to self.pending."""
        if self.sm.state is not JobState.RUNNING:
            return
        now = time.time()
        self._expire_cordons(now)
        self._throughput(now)
        lost, reason = self.monitor.lost_nodes(now)
        for node in lost:
            self._node_lost(node, reason, now)
        if self.pending:
            return
        hang, reason = self.monitor.hang(now)
        if hang is not None:
            self._on_hang(hang, reason, now)
            return
        self._on_stragglers(now)

    def _node_lost(self, node: str, reason: str, now: float) -> None:
        ranks = self.monitor.ranks_on(node)
        self.lost_nodes.add(node)
        # Its slots go at once: Ray would keep trying to re-place them (see slots.py).
        self.slots.release_on({node})
        self.monitor.forget_node(node)
        self.metrics.forget_node(node)
        self.poller.forget(node)
        self.agents.pop(node, None)
        self.stored.pop(node, None)
        self.replicas_held.pop(node, None)
        self.replication.pop(node, None)
        dropped = [s for s in self.spares if s[2] == node]
        self.spares = [s for s in self.spares if s[2] != node]
        for actor, _, _ in dropped:
            ray.kill(actor, no_restart=True)
        self.events.emit(
            "node_lost", node=node, ranks=ranks, spares_lost=len(dropped), reason=reason
        )
        for rank in ranks:
            self.pending.append(
                WorkerFailure(
                    FailureKind.NODE_LOST,
                    rank,
                    node,
                    now,
                    step=self.beats.get(rank, {}).get("step"),
                    message=reason,
                )
            )

    def _unresponsive(self, nodes: set[str]) -> list[str]:
        """Those of `nodes` whose agent does not answer a ping within NODE_PING_TIMEOUT_S."""
        nodes = {n for n in nodes if n in self.agents}
        refs = {self.agents[n].ping.remote(): n for n in nodes}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=NODE_PING_TIMEOUT_S)
        dead = [n for ref, n in refs.items() if ref not in ready]
        for ref in ready:
            try:
                ray.get(ref)
            except ActorGone:
                dead.append(refs[ref])
        return sorted(dead)

    def _on_hang(self, hang: Hang, reason: str, now: float) -> None:
        stacks = self._capture_stacks()
        self.events.emit(
            "hang",
            culprits=list(hang.culprits),
            waiting=list(hang.waiting),
            stalled_s=round(hang.stalled_for_s, 3),
            reason=reason,
        )
        self.events.emit("stacks", generation=self.generation, reason=reason, stacks=stacks)
        kind = FailureKind.HUNG if hang.culprits else FailureKind.COMM_ERROR
        for rank in hang.culprits or hang.waiting:
            self.pending.append(
                WorkerFailure(
                    kind,
                    rank,
                    self.worker_info[rank]["node_id"],
                    now,
                    step=self.beats.get(rank, {}).get("step"),
                    error_type="Hang" if hang.culprits else "StuckCollective",
                    message=reason,
                )
            )

    def _capture_stacks(self) -> dict[int, dict[str, Any]]:
        """Every rank's Python stacks: asked of the worker (another of its threads answers);
        a worker that cannot answer is dumped from outside by its node's agent (py-spy)."""
        refs = {self.workers[r].stacks.remote(): r for r in self.workers}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=3.0)
        out: dict[int, dict[str, Any]] = {}
        for ref in ready:
            with contextlib.suppress(*ActorGone):
                out[refs[ref]] = ray.get(ref)
        missing = [r for r in self.workers if r not in out]
        dumps = {}
        for rank in missing:
            info = self.worker_info[rank]
            agent = self.agents.get(info["node_id"])
            if agent is not None:
                dumps[agent.dump_stacks.remote(info["pid"])] = rank
        if dumps:
            ready, _ = ray.wait(list(dumps), num_returns=len(dumps), timeout=15.0)
            for ref in ready:
                out[dumps[ref]] = {"rank": dumps[ref], **ray.get(ref)}
        for rank in self.workers:
            out.setdefault(rank, {"rank": rank, "via": None, "text": "no stack: no answer"})
        return out

    def _on_stragglers(self, now: float) -> None:
        report, reason = self.monitor.stragglers()
        flagged = set(self.monitor.flagged_since)  # flags clear only after a calm span
        for rank in sorted(self._straggling - flagged):
            self.events.emit("straggler_cleared", rank=rank, score=report.scores.get(rank))
        new = sorted(flagged - self._straggling)
        self._straggling = flagged
        if not new:
            return
        node_of = {r: self.worker_info[r]["node_id"] for r in self.workers}
        bad = self._bad_nodes()
        spare_nodes = frozenset(n for _, _, n in self.spares if n not in bad)
        decision, action_reason = straggler_decision(
            tuple(new), self.spec.health.straggler.policy, node_of, spare_nodes, self._budget()
        )
        for rank in new:
            flag = {
                "rank": rank,
                "node": node_of[rank],
                "score": report.scores.get(rank),
                # the first step whose data supported the flag
                "through_step": self.monitor.flagged_since.get(rank, report.through_step),
                "rank_step": self.beats.get(rank, {}).get("step"),
                # the job's rate over the steps the verdict covers
                "steps_per_s": self.monitor.steps_per_s(
                    self.monitor.flagged_since.get(rank, report.through_step),
                    self.monitor.straggler_cfg.span,
                ),
                "at": now,
                "action": decision.action.value,
            }
            self.stragglers.append(flag)
            self.events.emit(
                "straggler",
                **flag,
                scores=report.scores,
                reason=reason,
                decision=action_reason,
            )
        if decision.action is Action.REPLACE:
            for rank in decision.ranks:
                self.pending.append(
                    WorkerFailure(
                        FailureKind.STRAGGLER,
                        rank,
                        node_of[rank],
                        now,
                        step=self.beats.get(rank, {}).get("step"),
                        error_type="Straggler",
                        message=reason,
                    )
                )

    def _judge_gpus(self, node: str, gpus: list[dict[str, Any]]) -> None:
        verdict, _reason = self.monitor.gpu_readings(node, gpus)
        now = time.time()
        for (gnode, index), why in verdict.info.items():
            self.events.emit("gpu_note", node=gnode, gpu=index, reason=why)
        for (gnode, index), why in verdict.fatal.items():
            ranks = self.monitor.ranks_on(gnode)
            self.events.emit("gpu_fatal", node=gnode, gpu=index, ranks=ranks, reason=why)
            for rank in ranks:
                self.pending.append(
                    WorkerFailure(FailureKind.GPU_FATAL, rank, gnode, now, message=why)
                )
        for (gnode, index), why in verdict.application.items():
            ranks = self.monitor.ranks_on_gpu(gnode, index)
            self.events.emit("gpu_error", node=gnode, gpu=index, ranks=ranks, reason=why)
            for rank in ranks:
                self.pending.append(
                    WorkerFailure(FailureKind.GPU_ERROR, rank, gnode, now, message=why)
                )

    def _expire_cordons(self, now: float) -> None:
        for c in self.cordons.expire(now):
            self.events.emit("uncordoned", node=c.node, reason="cordon TTL passed")

    def _throughput(self, now: float) -> None:
        progress = self.progress()
        # Until a rank of a new generation has beaten, the progress step reads 0: the
        # restore point stands for it (else the first interval counts every step since 0).
        step = max(progress["step"], progress["committed_step"] or 0)
        mark = self._throughput_mark
        if mark is None:
            self._throughput_mark = (now, step)
        elif now - mark[0] >= THROUGHPUT_EVENT_S:
            rate = (step - mark[1]) / (now - mark[0])
            # The stride wants the steady rate: the median step of the last 10 (a 1 s
            # window of 1 s steps sees 0 or 2 of them).
            steady = self.monitor.steps_per_s(step - 1, 10)
            if steady:
                self._steady_rate = steady
                self._set_replication_stride(steady)
            committed = self.commit.committed
            loss = progress["loss"]
            self._last_rate = round(rate, 3)
            self.events.emit(
                "throughput",
                generation=self.generation,
                step=step,
                steps_per_s=round(rate, 3),
                committed_step=committed,
                # Steps a loss of `copies - 1` nodes would cost now (replication lag incl.).
                commit_lag_steps=step - committed if committed is not None else None,
                loss=None if loss is None else round(loss, 6),
                # rank -> median compute seconds of its steps in this interval (the report's
                # per-rank heatmap; the exporter has only the newest step's).
                **self._rank_times(mark[1], step),
            )
            self._throughput_mark = (now, step)

    def _rank_times(self, after_step: int, through_step: int) -> dict[str, Any]:
        """A throughput event's per-rank view: rank -> median compute seconds of its steps
        in the interval, for at most RANK_TIMES_MAX ranks (the slowest: a 16,384-rank job
        would otherwise log a megabyte a second), and how many ranks there are."""
        times = self.monitor.rank_step_times(after_step, through_step)
        median = round(statistics.median(times.values()), 6) if times else None
        if len(times) > RANK_TIMES_MAX:
            times = dict(sorted(times.items(), key=lambda kv: kv[1])[-RANK_TIMES_MAX:])
        return {
            "rank_compute_s": {str(r): t for r, t in sorted(times.items())},
            "compute_median_s": median,  # over every rank: what the slowest compare with
            "ranks_total": len(self.workers),
        }

    def _budget(self) -> Budget:
        return Budget(
            self.restarts,
            self.spec.failure.max_restarts,
            self.user_errors,
            self.spec.failure.user_error_retries,
        )

    def _handle_failures(self) -> None:
        decision, reason = decide(
            self.pending, self._budget(), time.time(), node_history=self.incidents
        )
        if decision.action is Action.NOOP:
            return
        failures, self.pending = self.pending, []
        self.events.emit(
            "decision",
            action=decision.action.value,
            ranks=list(decision.ranks),
            reason=reason,
            failures=[_failure_event(f) for f in failures],
        )
        now = time.time()
        self.incidents.extend(
            (n, now)
            for n in {f.node for f in failures if f.node and f.failure_class in NODE_CLASSES}
            if n not in self.lost_nodes
        )
        for node in decision.cordon:
            if node not in self.lost_nodes:
                c = self.cordons.cordon(node, reason, now)
                self.cordon_log.append(
                    {"node": node, "at": now, "until": c.until, "reason": reason}
                )
                self.events.emit("cordoned", node=node, until=c.until, reason=reason)
        if decision.action is Action.FAIL:
            root = _root_cause(failures)
            self.error = {
                "message": reason,
                "rank": root.rank,
                "kind": root.kind.value,
                "error_type": root.error_type,
                "traceback": root.traceback,
            }
            self._abort_all(reason)
            self._record_failures(failures, restored_step=None, decided_at=time.time())
            self._set(JobState.FAILED, reason)
            return
        self._recover(decision, reason, failures)

    # --- recovery -----------------------------------------------------------------------------

    def _recover(
        self,
        decision: Decision,
        reason: str,
        failures: list[WorkerFailure],
        grow: list[tuple[Any, int | None]] = (),
    ) -> None:
        """Execute `decision`; with `grow` (ready idle workers and their bundles), add them
        as new ranks."""
        t_decided = time.time()
        if failures:
            self.restarts += 1
        if any(f.kind in (FailureKind.USER_ERROR, FailureKind.OOM) for f in failures):
            self.user_errors += 1
        self._set(JobState.RECOVERING, reason)
        replace = set(decision.ranks)
        gen = self.generation
        # A dead worker's node may be dead too (the worker's death often reaches us first):
        # confirm it answers before its bundle gets the replacement.
        for node in self._unresponsive(
            {f.node for f in failures if f.kind is FailureKind.WORKER_DIED and f.node}
        ):
            self._node_lost(
                node,
                f"node {node[:12]}: its agent did not answer after its "
                f"worker died (within {NODE_PING_TIMEOUT_S} s)",
                time.time(),
            )
            lost, self.pending = self.pending, []
            failures.extend(lost)
            replace.update(f.rank for f in lost)

        # 1. Release survivors: fail their collectives, unwind their loops. Ranks to be
        # replaced (dead, hung, on a lost or cordoned node) are killed first.
        t0 = time.time()
        for ref, rank in list(self.futures.items()):
            if rank in replace:
                self.futures.pop(ref)
                ray.kill(self.workers[rank], no_restart=True)
        for rank, worker in self.workers.items():
            if rank not in replace:
                worker.abort.remote(gen, reason)
        deadline = time.time() + self.spec.failure.abort_timeout_s
        while self.futures and time.time() < deadline:
            ready, _ = ray.wait(
                list(self.futures), num_returns=1, timeout=max(0.0, deadline - time.time())
            )
            for ref in ready:
                extra = self._collect(ref)
                if extra is not None:
                    failures.append(extra)
                    if extra.process_lost:
                        replace.add(extra.rank)
        stuck = sorted(self.futures.values())
        for ref in list(self.futures):
            self.futures.pop(ref)
        for rank in stuck:
            self.events.emit(
                "abort_timeout",
                rank=rank,
                reason=f"did not leave its train loop within "
                f"failure.abort_timeout_s={self.spec.failure.abort_timeout_s}",
            )
            replace.add(rank)
        self.pending = [p for p in self.pending if p.kind is not FailureKind.COMM_ERROR]
        t_aborted = time.time()

        # 2. Replace lost ranks: a warm spare on a healthy node if one is ready, else a new
        # worker in the lost rank's bundle if its node is healthy, else on any healthy node
        # (outside the placement group). A used spare's place is refilled in the background.
        self._check_spares()
        used_spares = {}
        placed = {}
        for rank in sorted(replace):
            ray.kill(self.workers[rank], no_restart=True)
            self.beats.pop(rank, None)
            # Synchronously: the lost rank's slot reservations must be released before its
            # successor reserves its own.
            ray.wait(
                [a.forget.remote(rank) for a in self.agents.values()],
                num_returns=len(self.agents),
                timeout=5,
            )
            freed = self.bundle_of[rank]
            spare = self._take_spare(rank)
            if spare is not None:
                self.workers[rank], self.bundle_of[rank] = spare
                used_spares[rank] = spare[1]
                self._start_spare(self._usable_bundle(freed))
            else:
                self.bundle_of[rank] = self._usable_bundle(freed)
                self.workers[rank] = self._create_worker(rank, self.bundle_of[rank])
            placed[rank] = (
                "spare"
                if spare
                else ("bundle" if self.bundle_of[rank] is not None else "healthy node")
            )
        if used_spares:
            self.events.emit("spares_used", ranks=used_spares, spares_left=len(self.spares))
        resized = False
        if replace:
            missing = self._await_ready(
                sorted(replace), self.spec.failure.replacement_timeout_s, allow_missing=True
            )
            if missing and self.world - len(missing) >= self.spec.min_workers:
                self._shrink(missing)
                replace -= set(missing)
                resized = True
            elif missing:
                self.error = {
                    "message": f"recovery failed: no healthy node had room for rank(s) "
                    f"{missing} within failure.replacement_timeout_s="
                    f"{self.spec.failure.replacement_timeout_s}"
                    + (
                        f", and the job may not shrink below workers.min={self.spec.min_workers}"
                        if self.spec.min_workers < self.spec.max_workers
                        else ""
                    )
                }
                self._set(JobState.FAILED, self.error["message"])
                return
            fresh = [
                r
                for r in sorted(replace)
                if self.worker_info[r]["node_id"] not in self.preflight_passed
            ]
            try:
                self._preflight_and_move(fresh, initial=False)
            except SchedulingError as e:
                self.error = {"message": f"recovery failed: {e}"}
                self._set(JobState.FAILED, self.error["message"])
                return
            self.events.emit(
                "replaced",
                ranks={
                    r: {"node": self.worker_info[r]["node_id"], "via": placed[r]}
                    for r in sorted(replace)
                },
            )
        t_replaced = time.time()

        if grow:
            self._grow(grow)
            resized = True

        # 3. Roll back to the newest step with a complete set of shards: in memory (any
        # live copy: a node's own store or a peer's), else on durable storage.
        self._poll_agents(wait_s=2.0)
        merged = self._in_memory()
        if self.commit.world_size != self.world:
            self.commit = CommitTracker(self.world)
        self.commit.reset(merged)
        durable = None
        if self.commit.committed is None:
            durable = self._durable_restore_point()
            if durable is None:
                self.events.emit(
                    "restart_from_scratch",
                    reason="no step has a copy of every rank's shard on a living node "
                    f"(checkpoint.replicas={self.spec.checkpoint.replicas}, "
                    f"{self.copies} kept) nor on durable storage"
                    + ("" if self.persister else " (checkpoint.persist.uri is not set)"),
                )
        restore = durable.step if durable is not None else self.commit.committed
        self.commit.rollback(self.commit.committed if self.commit.committed is not None else -1)
        self._replicating, self._kept, self._dropped_below = None, (), None
        self._prune_seq += 1
        for agent in self.agents.values():
            agent.prune.remote(above=restore if restore is not None else -1, seq=self._prune_seq)
        # From scratch counts as restoring step 0.
        recorded = len(self.failures)
        self._record_failures(
            failures, restored_step=restore if restore is not None else 0, decided_at=t_decided
        )
        self.open_recovery = {
            "generation": self.generation + 1,
            "failures": self.failures[recorded:],
            "phases": {"abort": t_aborted - t0, "replace": t_replaced - t_aborted},
            "decided_at": t_decided,
            "restore_step": restore,
            "replaced": sorted(replace),
            "from_spares": sorted(used_spares),
        }
        self._start_generation(restore_step=restore, durable=durable)
        self._set(
            JobState.RUNNING,
            f"generation {self.generation}: resumed from "
            f"{'durable' if durable is not None else 'committed'} step {restore}"
            + (f", replaced rank(s) {sorted(replace)}" if replace else "")
            + (f", world size {self.world}" if resized else ""),
        )

    # --- elastic resize -----------------------------------------------------------------------

    def _shrink(self, missing: list[int]) -> None:
        """Continue without `missing` (their replacements found no room): renumber the
        survivors 0..n-1 and rename their shards in every store. Idle workers then wait for
        room (_check_growth): when Ray places them, the job grows back."""
        old_world = self.world
        for rank in missing:
            # Idle workers take their places when capacity returns (_check_growth).
            ray.kill(self.workers.pop(rank), no_restart=True)
            self.worker_info.pop(rank, None)
            self.bundle_of.pop(rank, None)
        survivors = sorted(self.workers)
        mapping = {old: new for new, old in enumerate(survivors)}
        ray.wait(
            [self.workers[r].quiesce.remote() for r in survivors],
            num_returns=len(survivors),
            timeout=60,
        )
        ray.get([a.rekey.remote(mapping) for a in self.agents.values()], timeout=60)
        self.poller.discard_in_flight()
        self.workers = {mapping[r]: a for r, a in self.workers.items()}
        self.worker_info = {
            mapping[r]: {**i, "rank": mapping[r]} for r, i in self.worker_info.items()
        }
        self.bundle_of = {mapping[r]: b for r, b in self.bundle_of.items()}
        self.restore_rank = {
            mapping[r]: mapping[src]
            for r, src in self.restore_rank.items()
            if r in mapping and src in mapping
        }
        self.beats.clear()
        self.stored.clear()
        self.replicas_held.clear()
        self.world = len(survivors)
        self._resized(
            old_world,
            f"no room for rank(s) {missing} within "
            f"failure.replacement_timeout_s={self.spec.failure.replacement_timeout_s}",
            mapping={str(k): v for k, v in mapping.items()},
        )

    def _free_bundles(self) -> list[int]:
        """Held slots on usable nodes that no worker, spare or growing worker uses (their
        rank was dropped by a shrink)."""
        used = {b for b in self.bundle_of.values() if b is not None}
        used |= {b for _, b, _ in self.spares} | {b for _, b in self.spares_starting.values()}
        used |= {b for _, b in self.growing.values()}
        bad = self._bad_nodes()
        return [s for s in self.slots.held() if s not in used and self.slots.node_of(s) not in bad]

    def _grow(self, grown: list[tuple[Any, int | None]]) -> None:
        """Add ready idle workers as ranks world..world+k-1; each restores rank 0's shard
        (data-parallel state is the same on every rank) until it has one of its own."""
        old_world = self.world
        ray.wait(
            [self.workers[r].quiesce.remote() for r in self.workers],
            num_returns=len(self.workers),
            timeout=60,
        )
        infos = ray.get([a.ready.remote() for a, _ in grown], timeout=30)
        fresh = [
            (a, i["node_id"])
            for (a, _), i in zip(grown, infos, strict=True)
            if i["node_id"] not in self.preflight_passed
        ]
        if fresh and self.spec.health.preflight.enabled:
            bad = self._preflight([], fresh, peers=self._preflight_peers([]))
            if bad:
                # Not worth a rank: cordon the node, drop the newcomers there, grow less.
                self._cordon_failed_preflight(bad)
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
            self.workers[rank] = actor
            self.bundle_of[rank] = bundle
            self.restore_rank[rank] = 0
        self._await_ready(new, self.spec.failure.replacement_timeout_s)
        self.world = old_world + len(grown)
        if self.world >= self.spec.max_workers:
            for actor, _ in self.growing.values():
                ray.kill(actor, no_restart=True)
            self.growing.clear()
        self._resized(old_world, "capacity returned", new_ranks=new)

    def _resized(self, old_world: int, reason: str, **extra: Any) -> None:
        entry = {"at": time.time(), "from": old_world, "to": self.world, "reason": reason}
        self.resizes.append({**entry, **extra})
        self.events.emit("resized", old=old_world, new=self.world, reason=reason, **extra)

    def _check_growth(self) -> None:
        """While the world is below its maximum, keep that many workers waiting for room;
        when some are placed and ready, grow."""
        if self.world >= self.spec.max_workers or self.sm.state is not JobState.RUNNING:
            return
        if time.time() - self._last_grow_check < 1.0:
            return
        self._last_grow_check = time.time()
        # Free slots first (held room on a healthy node), and one worker outside any slot
        # per missing rank, which Ray places when a node has room; whichever starts first
        # is used, the rest are stopped once the world is whole.
        free = self._free_bundles()
        missing = self.spec.max_workers - self.world
        outside = sum(1 for _, b in self.growing.values() if b is None)
        for bundle in free[: max(0, missing - (len(self.growing) - outside))]:
            actor = self._create_worker(None, bundle)
            self.growing[actor.ready.remote()] = (actor, bundle)
        for _ in range(max(0, missing - outside)):
            actor = self._create_worker(None, None)
            self.growing[actor.ready.remote()] = (actor, None)
        ready, _ = ray.wait(list(self.growing), num_returns=len(self.growing), timeout=0)
        usable, nodes = [], set()
        for ref in ready:
            actor, bundle = self.growing.pop(ref)
            try:
                info = ray.get(ref)
            except ActorGone:
                continue
            if info["node_id"] in self._bad_nodes():
                ray.kill(actor, no_restart=True)
                if bundle is not None:
                    self.slots.release(bundle)  # its node was cordoned meanwhile
                continue
            usable.append((actor, bundle))
            nodes.add(info["node_id"])
        usable = usable[: self.spec.max_workers - self.world]
        if usable:
            self.events.emit("capacity_returned", nodes=sorted(nodes), workers=len(usable))
            self._recover(
                Decision(Action.RESTART_GROUP),
                f"capacity returned: growing from {self.world} to {self.world + len(usable)} ranks",
                [],
                grow=usable,
            )

    def _record_failures(
        self, failures: list[WorkerFailure], restored_step: int | None, decided_at: float
    ) -> None:
        def fault_of(f: WorkerFailure) -> dict[str, Any] | None:
            for rec in self.fault_records:
                if rec["rank"] == f.rank or (
                    rec["kind"] in NODE_FAULTS and rec.get("node_id") == f.node
                ):
                    return rec
            return None

        used = []
        recorded = len(self.failures)
        reached = max(
            [b.get("step", 0) for b in self.beats.values()]
            + [o.get("step", 0) for o in self.finished.values()]
            + [0]
        )
        for f in per_rank(failures):
            if f.kind is FailureKind.COMM_ERROR and any(
                g.kind is not FailureKind.COMM_ERROR for g in failures
            ):
                continue  # a symptom of the root cause, not a failure of its own
            fault = fault_of(f)
            if fault is not None:
                used.append(fault)
            t_fail = fault["at"] if fault else None
            self.failures.append(
                {
                    "kind": f.kind.value,
                    "rank": f.rank,
                    "node": f.node,
                    "step": fault["step"] if fault else f.step,
                    "injected": fault is not None,
                    "error_type": f.error_type,
                    "failure_class": f.failure_class.value,
                    "message": _describe(f, fault),
                    "failed_at": t_fail,
                    "detected_at": f.at,
                    "detected_after_s": round(f.at - t_fail, 4) if t_fail else None,
                    "decided_after_s": round(decided_at - f.at, 4),
                    "restored_step": restored_step,
                    "steps_redone": (reached - restored_step)
                    if restored_step is not None
                    else None,
                    "recovered_after_s": None,
                }
            )
        self.metrics.count_failures([f["kind"] for f in self.failures[recorded:]])
        for fault in used:
            if fault in self.fault_records:
                self.fault_records.remove(fault)

    def _close_recovery(self) -> None:
        rec = self.open_recovery
        if rec is None or rec["generation"] != self.generation:
            return
        beats = [b for b in self.beats.values() if b.get("generation") == self.generation]
        if len(beats) < len(self.workers):
            return
        timings = [b.get("timings", {}) for b in beats]
        if not all("first_step_done" in t for t in timings):
            return
        started = min(t["started"] for t in timings)
        rdzv = max(t.get("rendezvous_done", started) for t in timings)
        entered = max(t.get("setup_done", rdzv) for t in timings)
        restored = max(t.get("restored", entered) for t in timings)
        first = max(t["first_step_done"] for t in timings)
        phases = dict(rec["phases"])
        # reenter: the train loop's own set-up until ctx.steps(); restore: fetch + load.
        phases.update(
            rendezvous=rdzv - started,
            reenter=entered - rdzv,
            restore=restored - entered,
            first_step=first - restored,
        )
        for f in rec["failures"]:
            origin = f["failed_at"] or f["detected_at"]
            f["recovered_after_s"] = round(first - origin, 4)
            f["phases_s"] = {k: round(v, 4) for k, v in phases.items()}
            f["phases_s"]["detect"] = f["detected_after_s"]
            f["phases_s"]["decide"] = f["decided_after_s"]
        self.events.emit(
            "recovered",
            generation=self.generation,
            restore_step=rec["restore_step"],
            replaced=rec["replaced"],
            from_spares=rec["from_spares"],
            restore_tiers=self.restore_tiers,
            restored_remotely=self.restored_remotely,
            phases_s={k: round(v, 4) for k, v in phases.items()},
            recovered_after_s=[f["recovered_after_s"] for f in rec["failures"]],
            # Per failure: from the failure (when known) to its detection, and to the decision.
            detected_after_s=[f["detected_after_s"] for f in rec["failures"]],
            decided_after_s=[f["decided_after_s"] for f in rec["failures"]],
        )
        self.open_recovery = None

    def _abort_all(self, reason: str) -> None:
        for worker in self.workers.values():
            worker.abort.remote(self.generation, reason)

    def _finish(self) -> None:
        digests = {o["digest"] for o in self.finished.values() if o.get("digest")}
        if len(digests) > 1:
            self.error = {"message": f"ranks ended with different models: {sorted(digests)}"}
            self._set(JobState.FAILED, self.error["message"])
            return
        self._poll_agents(wait_s=2.0)
        self._replicate_final()
        self._persist_final()
        self._set(JobState.SUCCEEDED, f"all {self.world} ranks finished {self.spec.steps} steps")

    def _teardown(self) -> None:
        spares = [s[0] for s in self.spares] + [a for a, _ in self.spares_starting.values()]
        spares += [a for a, _ in self.growing.values()]
        for worker in [*self.workers.values(), *spares]:
            ray.kill(worker, no_restart=True)
        # Agents delete their shared-memory files; one that is gone took them with its node.
        closing = [agent.close.remote() for agent in self.agents.values()]
        ray.wait(closing, num_returns=len(closing), timeout=10)
        for agent in self.agents.values():
            ray.kill(agent, no_restart=True)
        self.slots.close()
        self._store = None

    # --- result -------------------------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        state = self.sm.state
        outs = [self.finished[r] for r in sorted(self.finished)]
        losses = [o["metrics"]["loss"] for o in outs if "loss" in o.get("metrics", {})]
        digests = [o.get("digest") for o in outs if o.get("digest")]
        steps_done = max([o["step"] for o in outs] + [self.progress()["step"]])
        end = self.ended_at or time.time()
        run_s = end - (self.running_since or end)
        samples = sum(o.get("samples", 0.0) for o in outs)
        return {
            "name": self.spec.name,
            "metrics_url": self.metrics_url,
            "status": {
                JobState.SUCCEEDED: "succeeded",
                JobState.FAILED: "failed",
                JobState.CANCELLED: "cancelled",
            }.get(state, state.value.lower()),
            "steps_completed": steps_done,
            "total_steps": self.spec.steps,
            "final_loss": sum(losses) / len(losses) if losses else None,
            "model_digest": digests[0] if digests else None,
            "workers": self.world,
            "resizes": self.resizes,
            "generations": self.generation,
            "restarts": self.restarts,
            "failures": self.failures,
            "lost_steps_total": sum(f["steps_redone"] or 0 for f in self.failures),
            "wall_seconds": round(end - self.started_at, 3),
            "training_seconds": round(run_s, 3),
            # productive / wall seconds since the job first ran (docs/metrics.md, goodput)
            "goodput": self.metrics.goodput,
            "steps_per_second": round(self.spec.steps / run_s, 3)
            if state is JobState.SUCCEEDED and run_s > 0
            else None,
            "samples_per_second": round(samples / run_s, 3)
            if state is JobState.SUCCEEDED and run_s > 0
            else None,
            "committed_step": self.commit.committed,
            "cordoned": self.cordon_log,
            "lost_nodes": sorted(self.lost_nodes),
            "stragglers": self.stragglers,
            "checkpoint": _pipeline_summary(outs),
            "replication": self._replication_summary(),
            "persist": self.persister.summary() if self.persister else None,
            "resumed_from": self.resumed_from,
            "supervisor_restarts": self.supervisor_restarts,
            "error": self.error,
        }


def _pipeline_summary(outs: list[dict[str, Any]]) -> dict[str, Any] | None:
    stats = [o["pipeline"] for o in outs if o.get("pipeline")]
    if not stats:
        return None
    caps = sum(s["captures"] for s in stats)
    return {
        "snapshots": caps,
        "bytes_per_snapshot": max(s["last_bytes"] for s in stats),
        "capture_ms_mean": round(1000 * sum(s["capture_seconds"] for s in stats) / caps, 3)
        if caps
        else None,
        "wait_ms_mean": round(1000 * sum(s["wait_seconds"] for s in stats) / caps, 3)
        if caps
        else None,
        "handover_ms_mean": round(1000 * sum(s["handover_seconds"] for s in stats) / caps, 3)
        if caps
        else None,
        "errors": sum(s["errors"] for s in stats),
    }


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None


def _describe(f: WorkerFailure, fault: dict[str, Any] | None) -> str | None:
    if fault is None:
        return f.message
    if f.kind is FailureKind.WORKER_DIED:
        # Ray's text for a killed actor guesses at OOM; say what really happened.
        return f"killed by chaos fault {fault['kind']} before step {fault['step']}"
    first = (f.message or "").strip().splitlines()[:1]
    return f"chaos fault {fault['kind']} at step {fault['step']}" + (
        f": {first[0][:300]}" if first else ""
    )


def _failure_event(f: WorkerFailure) -> dict[str, Any]:
    return {
        "kind": f.kind.value,
        "rank": f.rank,
        "node": f.node,
        "step": f.step,
        "error_type": f.error_type,
        "message": (f.message or "")[:500],
    }


def _root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    # The exception a user can act on first, a symptom (a collective error) last.
    order = {FailureKind.USER_ERROR: 0, FailureKind.OOM: 0, FailureKind.COMM_ERROR: 2}
    return min(failures, key=lambda f: (order.get(f.kind, 1), f.at))


def _actor_error_text(e: BaseException) -> str:
    text = str(e).strip()
    # Ray's message repeats the actor's whole creation traceback; the last lines carry it.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-12:])
