"""The supervisor's side of chaos faults: which have fired, which a generation still carries,
and which failure a fault explains.

A worker reports a fault to the supervisor (`record`) just before it carries it out, and
to its node agent, which outlives a dead supervisor: a successor learns from the agents'
reports (`seen`) never to fire it again. Faults at step 0 of kind `slow` stand for a slow
node that preflight should find; a rank moved off a cordoned node leaves that fault behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import TypeAdapter, ValidationError

from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.orchestrator.spec import Fault, JobSpec, _format_error
from stalwart.orchestrator.state import JobState

_FAULT = TypeAdapter(Fault)


class InjectRefused(ValueError):
    """A `stalwart chaos inject` request that is wrong or not allowed (`retry`: not now,
    the job is not running yet or is recovering)."""

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry


NODE_FAULTS = ("kill_node", "kill_raylet", "gpu_xid")  # they hit the node hosting the rank
# Faults that stop no rank: a failure of their rank after them is another fault's, or none.
# (corrupt_shard does: its rank's restore of the damaged copy fails.)
FAIL_NO_RANK = ("storage_unavailable", "drop_replicas", "fill_shm", "kill_supervisor")


class FaultBook:
    def __init__(self, faults: list[Fault], node_scope: str = "job"):
        """`node_scope`: what a kill_node kills on its node: "raylet" (the raylet and every
        process under it, on a cluster the command itself started) or "job" (this job's
        processes there: its workers and its node agent; on anybody else's cluster)."""
        self.faults = faults
        self.node_scope = node_scope
        self._lock = threading.Lock()  # record() is called from the actor's other threads
        self.records: list[dict[str, Any]] = []  # carried out, not yet matched to a failure
        # Node faults matched already, whose node may still surface failures (its ranks do
        # not all die at the same instant) until the recovery they caused is over.
        self.spent: list[dict[str, Any]] = []
        self.fired: set[int] = set()
        self.live: set[int] = set()  # injected into the running job: fire at or after

    def record(self, fault: dict[str, Any]) -> None:
        """A worker is about to carry out `fault` (its index, rank, step, node_id, at)."""
        with self._lock:
            self.records.append(fault)
            self.fired.add(fault["index"])

    def seen(self, indices: Iterable[int], emit: Callable[..., None]) -> None:
        """Faults an agent saw carried out (perhaps under a supervisor that died since):
        each this book had not known of gets a `fault_recalled` event."""
        with self._lock:
            new = sorted(set(indices) - self.fired)
            self.fired.update(new)
        for i in new:
            if i < len(self.faults):
                f = self.faults[i]
                emit(
                    "fault_recalled",
                    index=i,
                    kind=f.kind,
                    rank=f.rank,
                    at_step=f.at_step,
                    reason="carried out under a supervisor that has died since (its node "
                    "agents remember it)",
                )

    @staticmethod
    def refusal(job: str, owned: bool, enabled: bool, request: dict[str, Any]) -> str | None:
        """Why a live fault may not be injected, or None: on a cluster the job's command
        did not start, it needs chaos.enabled in the spec and --allow-remote."""
        remote_ok = request.get("allow_remote")
        if owned or (enabled and remote_ok):
            return None
        missing = [
            *([] if enabled else ["`chaos.enabled: true` in its spec"]),
            *([] if remote_ok else ["--allow-remote on the command"]),
        ]
        return (
            f"refusing to inject a fault into job {job}: its cluster was not started by the "
            f"command that runs it, so that needs {' and '.join(missing)}"
        )

    def add_live(
        self,
        request: dict[str, Any],
        step: int,
        spec: JobSpec,
        owned: bool,
        ranks_on: Callable[[str], list[int]],
        state: JobState = JobState.RUNNING,
    ) -> dict[str, Any]:
        """A fault for the running job (`stalwart chaos inject`): `request` has the kind,
        `rank` or `node` (an id or a unique prefix of one), the kind's own fields, who
        asked (`by`) and `allow_remote`. It fires before the target rank's next step
        (`step` + 1). Returns it as a generation carries it (`live`: at that step or the
        first after); InjectRefused says why not (the opt-ins `owned` does not waive, a
        job in `state` other than RUNNING)."""
        if state is not JobState.RUNNING:
            raise InjectRefused(
                f"job {spec.name} is {state.value}, not RUNNING", retry=not state.terminal
            )
        refused = self.refusal(spec.name, owned, spec.chaos.enabled, request)
        if refused:
            raise InjectRefused(refused)
        world, total_steps = spec.max_workers, spec.steps
        req = {k: v for k, v in request.items() if k not in ("by", "node", "allow_remote")}
        node = request.get("node")
        if node is not None:
            if req.get("rank") is not None:
                raise InjectRefused("give --rank or --node, not both")
            ranks = ranks_on(node)
            if not ranks:
                raise InjectRefused(f"no rank of this job runs on a node matching {node!r}")
            req["rank"] = ranks[0]
        req.setdefault("rank", 0)
        if not 0 <= int(req["rank"]) < world:
            raise InjectRefused(f"rank: must be < workers ({world}), got {req['rank']}")
        req["at_step"] = min(step + 1, total_steps - 1)
        try:
            fault = _FAULT.validate_python(req)
        except ValidationError as e:
            raise InjectRefused("; ".join(_format_error(err) for err in e.errors())) from None
        with self._lock:
            # Indices past the spec's faults that the agents saw fired were live faults of
            # a supervisor that has died since: they stay taken (an agent would report the
            # new fault as fired already) and are never carried (those of them that had
            # not fired died with it).
            while len(self.faults) <= max(self.fired, default=-1):
                self.fired.add(len(self.faults))
                self.faults.append(fault)  # a stand-in, never carried
            self.faults.append(fault)
            index = len(self.faults) - 1
            self.live.add(index)
        out = {**fault.model_dump(mode="json"), "index": index, "live": True}
        if fault.kind == "kill_node":
            out["scope"] = self.node_scope
        return out

    def replacing(
        self, rank: int, reached: int, node: str | None, record: Callable[[dict], None]
    ) -> bool:
        """Is a `during: replace` fault of `rank` due (the job reached its at_step)? Then
        the replacement starting for the rank is to be killed; `record` gets the fault as
        carried out (as a worker's record_fault would)."""
        with self._lock:
            for i, f in enumerate(self.faults):
                due = f.during == "replace" and f.rank == rank and reached >= f.at_step
                if due and i not in self.fired:
                    self.fired.add(i)
                    fault = {**f.model_dump(mode="json"), "index": i, "step": reached}
                    break
            else:
                return False
        record({**fault, "at": time.time(), "node_id": node})
        return True

    def persisting(
        self,
        step: int,
        nodes: Iterable[str],
        node_of: Callable[[int], str],
        record: Callable[[dict], None],
    ) -> dict[str, dict[str, Any]]:
        """The `during: persist` faults due as durable `step` is written by `nodes`: node
        -> the fault its agent carries out after its first shard (each recorded with
        `record`, as a worker's record_fault would, and fired once)."""
        out: dict[str, dict[str, Any]] = {}
        nodes = set(nodes)
        with self._lock:
            for i, f in enumerate(self.faults):
                if f.during != "persist" or i in self.fired or step < f.at_step:
                    continue
                try:
                    node = node_of(f.rank)
                except KeyError:  # no such rank now (an elastic shrink)
                    continue
                if node not in nodes or node in out:
                    continue
                self.fired.add(i)
                out[node] = {
                    **f.model_dump(mode="json"),
                    "index": i,
                    "step": step,
                    "scope": self.node_scope,
                    "node_id": node,
                }
        for fault in out.values():
            record({**fault, "at": time.time()})
        return out

    def wire(self, pool: Any, ckpt: Any, reached: Callable[[], int], record: Callable) -> None:
        """Hand the supervisor's collaborators the faults they carry out themselves: a kill
        of a replacement as it starts (`during: replace`), a node's death while it writes
        a durable checkpoint (`during: persist`)."""
        pool.chaos_replace = lambda rank, node: self.replacing(rank, reached(), node, record)
        ckpt.chaos_persist = lambda step, nodes: self.persisting(step, nodes, pool.node_of, record)

    def slow_at_start(self) -> dict[int, float]:
        """rank -> slow-down factor of the unfired `slow` faults at step 0 (preflight
        times the matmul with it)."""
        return {
            f.rank: f.factor
            for i, f in enumerate(self.faults)
            if f.kind == "slow" and f.at_step == 0 and i not in self.fired
        }

    def moved_off(self, ranks: Iterable[int]) -> None:
        """`ranks` left the cordoned node their step-0 `slow` fault stood for."""
        ranks = set(ranks)
        with self._lock:
            for i, f in enumerate(self.faults):
                if f.kind == "slow" and f.at_step == 0 and f.rank in ranks:
                    self.fired.add(i)

    def for_generation(
        self,
        node_of: Callable[[int], str],
        home_node: str,
        emit: Callable[..., None],
        recovery: bool = False,
        reached: int = 0,
        holder_of: Callable[[int], int | None] = lambda rank: None,
    ) -> list[dict[str, Any]]:
        """The faults a new generation's workers carry: those not fired yet; one that fires
        `during` a phase of a recovery only when this generation is one (`recovery`) and
        the job had `reached` its at_step. A kill_node of the node hosting the supervisor
        is refused (it would kill the supervisor and, on a cluster's head node, the
        cluster), with the reason in the event log. A fault naming `peer_of_rank` goes to
        the rank `holder_of` finds on the node keeping that rank's copies."""
        out = []
        for i, f in enumerate(self.faults):
            if i in self.fired:
                continue
            if f.during in ("replace", "persist"):
                continue  # the supervisor's own (replacing, persisting)
            phase = f.during not in (None, "snapshot")  # a snapshot fault rides every one
            if phase and not (recovery and reached >= f.at_step):
                continue
            fault = {**f.model_dump(mode="json"), "index": i}
            if i in self.live:
                fault["live"] = True
            if f.kind == "kill_node":
                fault["scope"] = self.node_scope
            holder = holder_of(f.peer_of_rank) if f.peer_of_rank is not None else None
            if holder is not None:
                fault["rank"] = holder
            if f.peer_of_rank is not None and holder is None:
                why = (
                    f"no rank of this job runs on a node keeping copies of rank "
                    f"{f.peer_of_rank}'s shards (one copy, or only spares there)"
                )
            elif f.kind == "fill_shm" and self.node_scope != "raylet":
                why = (
                    "fill_shm fills a node's shared memory, which the machine's other "
                    "tenants use too: only on a cluster the command itself started"
                )
            elif f.kind == "kill_raylet" and self.node_scope != "raylet":
                why = (
                    "kill_raylet kills a node's raylet, which the cluster's other jobs use "
                    "too: only on a cluster the command itself started"
                )
            elif f.kind in ("kill_node", "kill_raylet") and node_of(fault["rank"]) == home_node:
                why = "the node hosting this rank also hosts the job's supervisor"
            else:
                out.append(fault)
                continue
            with self._lock:
                self.fired.add(i)  # refused for good, with the reason in the event log
            emit("fault_refused", **fault, reason=why)
        return out

    def explaining(self, f: WorkerFailure) -> dict[str, Any] | None:
        """The recorded fault that caused failure `f`: one on its rank, or a node fault on
        its node (one that explained an earlier failure too, while its recovery is open: a
        node's second rank may be seen dead after the decision on its first)."""
        with self._lock:
            for rec in self.records:
                if rec["kind"] in FAIL_NO_RANK:
                    continue
                if rec["rank"] == f.rank or _on_node(rec, f):
                    return rec
            return next((rec for rec in self.spent if _on_node(rec, f)), None)

    def consume(self, used: Iterable[dict[str, Any]]) -> None:
        """Faults matched to failures: they explain no later failure (a node fault: none
        after its recovery, `settle`)."""
        with self._lock:
            for fault in used:
                if fault in self.records:
                    self.records.remove(fault)
                    if fault["kind"] in NODE_FAULTS:
                        self.spent.append(fault)

    def settle(self) -> None:
        """The recovery the matched faults caused is over."""
        with self._lock:
            self.spent.clear()


def _on_node(rec: dict[str, Any], f: WorkerFailure) -> bool:
    return rec["kind"] in NODE_FAULTS and rec.get("node_id") == f.node


def describe(f: WorkerFailure, fault: dict[str, Any] | None) -> str | None:
    """A failure's message, saying which fault caused it when one did."""
    if fault is None:
        return f.message
    if f.kind is FailureKind.WORKER_DIED:
        # Ray's text for a killed actor guesses at OOM; say what really happened.
        return f"killed by chaos fault {fault['kind']} before step {fault['step']}"
    first = (f.message or "").strip().splitlines()[:1]
    return f"chaos fault {fault['kind']} at step {fault['step']}" + (
        f": {first[0][:300]}" if first else ""
    )
