"""The supervisor's side of chaos faults: which have fired, which a generation still carries,
and which failure a fault explains.

A worker reports a fault to the supervisor (`record`) just before it carries it out, and
to its node agent, which outlives a dead supervisor: a successor learns from the agents'
reports (`seen`) never to fire it again. Faults at step 0 of kind `slow` stand for a slow
node that preflight should find; a rank moved off a cordoned node leaves that fault behind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from stalwart.health.observations import FailureKind, WorkerFailure
from stalwart.orchestrator.spec import Fault

NODE_FAULTS = ("kill_node", "gpu_xid")  # faults that hit the node hosting the rank


class FaultBook:
    def __init__(self, faults: list[Fault], node_scope: str = "job"):
        """`node_scope`: what a kill_node kills on its node: "raylet" (the raylet and every
        process under it, on a cluster the command itself started) or "job" (this job's
        processes there: its workers and its node agent; on anybody else's cluster)."""
        self.faults = faults
        self.node_scope = node_scope
        self._lock = threading.Lock()  # record() is called from the actor's other threads
        self.records: list[dict[str, Any]] = []  # carried out, not yet matched to a failure
        self.fired: set[int] = set()

    def record(self, fault: dict[str, Any]) -> None:
        """A worker is about to carry out `fault` (its index, rank, step, node_id, at)."""
        with self._lock:
            self.records.append(fault)
            self.fired.add(fault["index"])

    def seen(self, indices: Iterable[int]) -> None:
        """Faults an agent saw carried out (perhaps under a supervisor that died since)."""
        with self._lock:
            self.fired.update(indices)

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
        self, node_of: Callable[[int], str], home_node: str, emit: Callable[..., None]
    ) -> list[dict[str, Any]]:
        """The faults a new generation's workers carry: those not fired yet. A kill_node of
        the node hosting the supervisor is refused (it would kill the supervisor and, on a
        cluster's head node, the cluster), with the reason in the event log."""
        out = []
        for i, f in enumerate(self.faults):
            if i in self.fired:
                continue
            fault = {**f.model_dump(mode="json"), "index": i}
            if f.kind == "kill_node":
                fault["scope"] = self.node_scope
            if f.kind == "kill_node" and node_of(f.rank) == home_node:
                with self._lock:
                    self.fired.add(i)
                emit(
                    "fault_refused",
                    **fault,
                    reason="the node hosting this rank also hosts the job's supervisor",
                )
                continue
            out.append(fault)
        return out

    def explaining(self, f: WorkerFailure) -> dict[str, Any] | None:
        """The recorded fault that caused failure `f`: one on its rank, or a node fault on
        its node."""
        for rec in self.records:
            if rec["rank"] == f.rank or (
                rec["kind"] in NODE_FAULTS and rec.get("node_id") == f.node
            ):
                return rec
        return None

    def consume(self, used: Iterable[dict[str, Any]]) -> None:
        """Faults matched to failures: they explain no later failure."""
        with self._lock:
            for fault in used:
                if fault in self.records:
                    self.records.remove(fault)


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
