"""Faults of the network in a chaos scenario: `partition`, `loss`, `delay` and `flap` on a
worker node's links, carried out by `stalwart chaos run` on a cluster whose nodes have
networks of their own (orchestrator/chaos/netns.py, `cluster.network: netns`).

Unlike the job's own faults (orchestrator/spec_faults.py, carried out by stalwart inside
the job), these are done to the job from outside, as a switch or a cable would: nothing in
the job is told. So they live in the scenario, not in the job spec; a job spec names none.

    faults:
      - {kind: partition, rank: 1, at_step: 30, seconds: 15}   # rank 1's node, from all
      - {kind: partition, node: 2, from: [head], after_seconds: 20, seconds: 5}
      - {kind: partition, nodes: [1, 2, 3], from: [head], at_step: 40, seconds: 6}
      - {kind: loss, rank: 2, percent: 5, at_step: 10, seconds: 20}
      - {kind: delay, rank: 2, ms: 200, at_step: 10, seconds: 20}       # needs netem
      - {kind: flap, rank: 1, at_step: 20, down_s: 1, up_s: 4, count: 3}

A fault fires once the job reached `at_step` (read from its throughput events, about once
a second) or `after_seconds` after it started training, on the worker node that then hosts
`rank` (or the `node`-th worker node, or the `nodes` at one moment), and is healed
`seconds` later (null: when the job ends). What each did, and when, goes to the verdict.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from stalwart.orchestrator.chaos.netns import NetNode, NetnsCluster


class _NetFault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    rank: int | Literal["random"] | None = Field(
        None, description="hit the worker node that hosts this rank when the fault fires"
    )
    node: int | None = Field(
        None, ge=1, description="instead of `rank`: the node-th worker node (1 is the first)"
    )
    nodes: list[int] | None = Field(
        None,
        min_length=1,
        description="instead of `rank` or `node`: these worker nodes, hit at one moment",
    )
    at_step: int | None = Field(None, ge=0, description="fire once the job reached this step")
    after_seconds: float | None = Field(
        None, ge=0, description="instead of at_step: fire this long after training started"
    )
    seconds: float | None = Field(
        None, gt=0, description="heal after this long (null: when the job ends)"
    )

    @model_validator(mode="after")
    def _one_target_one_trigger(self) -> _NetFault:
        if sum(x is not None for x in (self.rank, self.node, self.nodes)) != 1:
            raise ValueError("name one of `rank` (its node), `node` (1, 2, ...) or `nodes`")
        if self.nodes is not None and min(self.nodes) < 1:
            raise ValueError("nodes: worker nodes are numbered from 1")
        if (self.at_step is None) == (self.after_seconds is None):
            raise ValueError("name one of `at_step` or `after_seconds`")
        return self


class Partition(_NetFault):
    """Cut the node off: every packet between it and `from` dropped, both ways (its
    processes live on, as on a real partition)."""

    kind: Literal["partition"]
    from_: list[int | Literal["head"]] | None = Field(
        None,
        alias="from",
        min_length=1,
        description="the nodes (numbers, or `head`: the supervisor's and the GCS's node) "
        "it is cut off from; null: all of them",
    )


class Loss(_NetFault):
    """Drop this share of the node's packets, each way, at random."""

    kind: Literal["loss"]
    percent: float = Field(gt=0, lt=100, description="packets dropped, percent")


class Delay(_NetFault):
    """Hold every packet the node sends for `ms` (netem, or a delay line where the kernel
    has none: orchestrator/chaos/delay_line.py)."""

    kind: Literal["delay"]
    ms: float = Field(gt=0, le=10_000, description="added one-way delay")
    jitter_ms: float = Field(0.0, ge=0, description="give or take, uniformly")


class Flap(_NetFault):
    """Partition and heal the node `count` times: `down_s` cut off, `up_s` connected."""

    kind: Literal["flap"]
    down_s: float = Field(gt=0, le=600)
    up_s: float = Field(gt=0, le=600)
    count: int = Field(3, ge=1, le=100)


NetFault = Partition | Loss | Delay | Flap
_KINDS: dict[str, type[_NetFault]] = {
    "partition": Partition,
    "loss": Loss,
    "delay": Delay,
    "flap": Flap,
}


def parse(data: dict[str, Any]) -> NetFault:
    """A scenario's network fault, checked (pydantic's ValidationError names the field)."""
    return _KINDS[data["kind"]].model_validate(data)


# What each kind puts on a node's link (netns.py's names), so that its heal undoes only it.
_ON_LINK = {"partition": "cut", "flap": "cut", "loss": "loss", "delay": "delay"}


def is_network(fault: dict[str, Any]) -> bool:
    return isinstance(fault, dict) and fault.get("kind") in _KINDS


class JobWatch:
    """What the job's event log says so far: when it started training, the newest step,
    and which node hosts each rank (the `scheduled` and `replaced` events)."""

    def __init__(self, events: Path):
        self.events = events
        self._read = 0
        self.running_since: float | None = None
        self.step = -1
        self.node_of: dict[int, str] = {}
        self._reading = threading.Lock()

    def poll(self) -> None:
        with contextlib.suppress(OSError):
            with open(self.events, "rb") as fh:
                fh.seek(self._read)
                chunk = fh.read()
            done = chunk.rfind(b"\n") + 1
            self._read += done
            for line in chunk[:done].splitlines():
                with contextlib.suppress(ValueError):
                    self._take(json.loads(line))

    def due(self, at_step: int | None, after_seconds: float | None) -> bool:
        """Whether a fault to fire at `at_step` (else `after_seconds` after the job started
        training) is due, as far as the events read so far say."""
        if at_step is not None:
            return self.step >= at_step
        return self.running_since is not None and time.time() >= self.running_since + (
            after_seconds or 0.0
        )

    def wait_until_due(
        self, at_step: int | None, after_seconds: float | None, done: threading.Event
    ) -> bool:
        """Read the log until the fault is `due` (True), or `done` is set first (False).
        Each fault waits in a thread of its own: one of them reads the log at a time."""
        while not done.is_set():
            with self._reading:
                self.poll()
                if self.due(at_step, after_seconds):
                    return True
            done.wait(0.2)
        return False

    def _take(self, e: dict[str, Any]) -> None:
        kind = e.get("type")
        if kind == "state" and e.get("new") == "RUNNING" and self.running_since is None:
            self.running_since = e["ts"]
        elif kind == "throughput":
            self.step = max(self.step, int(e.get("step") or -1))
        elif kind == "scheduled":
            for rank, w in (e.get("workers") or {}).items():
                self.node_of[int(rank)] = w["node_id"]
        elif kind == "replaced":
            for rank, w in (e.get("ranks") or {}).items():
                self.node_of[int(rank)] = w["node"]


class NetworkInjector:
    """Carries out a scenario's network faults on a NetnsCluster while the chaos run
    trains; heals every one of them by `finish()` at the latest. `applied`: one record per
    fault, for the verdict (what was hit, when, when healed, or why it was not)."""

    def __init__(self, faults: list[NetFault], cluster: NetnsCluster, events: Path):
        self.faults = faults
        self.cluster = cluster
        self.watch = JobWatch(events)
        self.applied: list[dict[str, Any]] = [
            {**f.model_dump(mode="json", by_alias=True), "outcome": "not fired"} for f in faults
        ]
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._one, args=(i,), name=f"chaos-net-{i}", daemon=True)
            for i in range(len(faults))
        ]
        for t in self._threads:
            t.start()

    def _targets(self, f: NetFault) -> list[NetNode]:
        if f.node is not None or f.nodes is not None:
            numbers = [f.node] if f.node is not None else f.nodes
            for n in numbers:
                if n > len(self.cluster.nodes):
                    raise LookupError(f"node {n}: the cluster has {len(self.cluster.nodes)}")
            return [self.cluster.nodes[n - 1] for n in numbers]
        node_id = self.watch.node_of.get(int(f.rank))
        if node_id is None:
            raise LookupError(f"rank {f.rank} is on no node the job's events name")
        node = self.cluster.node_by_id(node_id)
        if node is None:
            raise LookupError(f"rank {f.rank}'s node {node_id[:12]} is none of the cluster's")
        return [node]

    def _peers(self, f: NetFault) -> list[str] | None:
        if not isinstance(f, Partition) or f.from_ is None:
            return None  # from every other address
        return [
            self.cluster.head_ip if p == "head" else self.cluster.nodes[p - 1].ip for p in f.from_
        ]

    def _one(self, i: int) -> None:
        f, rec = self.faults[i], self.applied[i]
        if not self.watch.wait_until_due(f.at_step, f.after_seconds, self._done):
            return
        try:
            nodes = self._targets(f)
        except LookupError as e:
            rec["outcome"] = f"refused: {e}"
            return
        ids = [self.cluster.node_id(node) for node in nodes]
        rec.update(
            outcome="injected",
            target="+".join(f"n{self.cluster.nodes.index(node) + 1}" for node in nodes),
            node_ips=[node.ip for node in nodes],
            node_ids=ids,
            step=self.watch.step,
            at=time.time(),
            windows=[],
        )
        rounds = f.count if isinstance(f, Flap) else 1
        for n in range(rounds):
            start = time.time()
            try:
                for node in nodes:
                    self._apply(f, node)
            except Exception as e:  # a command that failed: the verdict says which
                rec["outcome"] = f"failed: {e}"
                return
            hold = f.down_s if isinstance(f, Flap) else f.seconds
            self._done.wait(hold)  # None: until finish()
            for node in nodes:
                with contextlib.suppress(Exception):
                    self.cluster.heal(node, only=_ON_LINK[f.kind])
            rec["windows"].append([round(start, 3), round(time.time(), 3)])
            if isinstance(f, Flap) and n + 1 < rounds and self._done.wait(f.up_s):
                break
        rec["healed_at"] = time.time()

    def _apply(self, f: NetFault, node: NetNode) -> None:
        if isinstance(f, Partition | Flap):
            self.cluster.partition(node, peers=self._peers(f))
        elif isinstance(f, Loss):
            self.cluster.lose(node, f.percent)
        else:
            self.cluster.delay(node, f.ms, f.jitter_ms)

    def finish(self) -> list[dict[str, Any]]:
        """Stop waiting, heal what is still cut or degraded, return what was done."""
        self._done.set()
        for t in self._threads:
            t.join(timeout=30)
        for node in self.cluster.nodes:
            with contextlib.suppress(Exception):
                self.cluster.heal(node)
        return self.applied
