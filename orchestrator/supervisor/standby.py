"""Standbys: idle worker processes on each node, started in advance, holding no room.

A cold replacement (no spare ready) spends 3-5 s starting a Ray worker process, importing
torch, the train loop and stalwart, and warming DDP up. A standby has done all of that: it
is a TrainWorker with no rank (as a spare), pinned to its node, with zero Ray resources, so
it takes no room from the job or anyone else. A rank moves into it only once the rank's
room is held by a slot on the standby's node (the rank's own slot, or a new one the pool
reserves there), so the accounting stays true: the slot holds the CPUs, the standby's
process uses them.

How many a job has per node (`choose`): failure.standby says whether, or, left unset, they
are on for CPU jobs when every node holding ranks has the memory for them beside its
checkpoints and its machine a core the ranks leave idle (the nodes of a local multi-node
cluster share one machine's cores); failure.standbys_per_node is the most per node (2: a
second fault on the same node before the first one's standby is started again finds one
ready; on a busy node a start takes 5-10 s). The first of each node's start as soon as the
ranks are placed, the others once the job has trained (they would only slow its first steps
down); a used or lost one is started again by the next fill (the supervisor's tick). Ray
cannot hand a GPU to a process after it started, so jobs with GPUs have none: their warm
processes are failure.spares, each holding its GPU in its slot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import ray

from stalwart.orchestrator.supervisor.spares import ASSUME_TIMEOUT_S, GONE, finished

GIB = 1024**3
# What a standby costs: an idle TrainWorker's RSS is ~0.37 GiB (torch and stalwart
# imported, Ray's worker; docs/benchmarks.md), rounded up. Auto keeps as many per node as fit
# with a headroom beside the node's checkpoints.
STANDBY_BYTES = GIB // 2
HEADROOM_BYTES = GIB


def choose(
    setting: bool | None,
    per_node: int,
    gpu: bool,
    rooms: Mapping[str, Mapping[str, Any]],
    checkpoints: Mapping[str, int],
    busy_cores: Mapping[str, float] | None = None,
) -> tuple[int, str]:
    """How many standbys the job keeps per node (0: none), and why (a line for its events).
    `setting`: failure.standby (None: decide here); `per_node`: failure.standbys_per_node;
    `rooms`: what each node holding ranks has (NodeAgent.memory); `checkpoints`: the bytes
    its checkpoints will take (0: unknown); `busy_cores`: the cores its ranks keep busy on
    each node (a rank at least one)."""
    if gpu:
        if setting:
            why = "off although failure.standby is true: the job's workers use GPUs"
        else:
            why = "off: the job's workers use GPUs"
        return 0, (
            why + " (Ray cannot hand a GPU to a process after it started; failure.spares "
            "are the warm processes of a GPU job)"
        )
    each = f"{per_node} idle worker process{'es' if per_node > 1 else ''} per node holding ranks"
    if setting is not None:
        if not setting:
            return 0, "off (failure.standby: false)"
        return per_node, f"on: {each} (failure.standby: true)"
    if crowded := _crowded_hosts(rooms, busy_cores or {}):
        return 0, (
            f"off: {'; '.join(crowded)}: a standby's start (~3 s of CPU: torch, the train "
            "loop, DDP's warm-up) would be taken from training (failure.standby: true starts "
            "them anyway)"
        )
    left = {
        node: room["mem_available"] - checkpoints.get(node, 0)
        for node, room in rooms.items()
        if room.get("mem_available") is not None
    }
    fits = {node: max(0, int((b - HEADROOM_BYTES) // STANDBY_BYTES)) for node, b in left.items()}
    count = min([per_node, *fits.values()])
    if count == 0:
        short = [
            f"node {node[:12]} has {left[node] / GIB:.1f} GiB left beside its checkpoints"
            for node in sorted(fits)
            if fits[node] == 0
        ]
        return 0, (
            f"off: {'; '.join(short)}, and a standby needs {STANDBY_BYTES / GIB:.1f} GiB "
            f"plus {HEADROOM_BYTES / GIB:.0f} GiB of headroom (failure.standby: true starts "
            "them anyway)"
        )
    room = ""
    if left:
        room = f"; every node has {min(left.values()) / GIB:.1f} GiB or more left"
    fewer = ""
    if count < per_node:
        fewer = f", not failure.standbys_per_node={per_node}: memory for {count} only"
        each = f"{count} idle worker process{'es' if count > 1 else ''} per node holding ranks"
    return count, (
        f"on: {each}, ~{STANDBY_BYTES / GIB:.1f} GiB each{room}{fewer} "
        "(failure.standby: false turns them off)"
    )


def _crowded_hosts(
    rooms: Mapping[str, Mapping[str, Any]], busy_cores: Mapping[str, float]
) -> list[str]:
    """The machines whose cores the job's ranks fill (less than one core idle), as lines.
    Nodes on one machine (a local multi-node cluster: NodeAgent.memory's `host`) share its
    cores; a node that did not say is left out."""
    hosts: dict[str, list[str]] = {}
    for node, room in rooms.items():
        if room.get("cores") is not None and node in busy_cores:
            hosts.setdefault(str(room.get("host") or node), []).append(node)
    lines = []
    for nodes in hosts.values():
        cores = min(float(rooms[n]["cores"]) for n in nodes)
        busy = sum(busy_cores[n] for n in nodes)
        if cores - busy < 1:
            if len(nodes) == 1:
                where = f"node {nodes[0][:12]} has {cores:g} cores"
            else:
                where = f"{len(nodes)} nodes on one machine share {cores:g} cores"
            lines.append(f"{where} and the ranks keep {busy:g} busy")
    return sorted(lines)


class Standbys:
    """Node -> its ready standbys, and those starting."""

    def __init__(self, start: Callable[[str], Any], emit: Callable[..., None]) -> None:
        self._start = start  # node -> a new standby actor pinned to it
        self._emit = emit
        self.ready: dict[str, list[Any]] = {}  # node -> its ready standbys, oldest first
        self.starting: dict[Any, tuple[Any, str]] = {}  # ready() ref -> (actor, node)

    def count(self) -> int:
        """How many are ready."""
        return sum(len(actors) for actors in self.ready.values())

    def ready_nodes(self) -> set[str]:
        """Nodes with a ready standby."""
        return {node for node, actors in self.ready.items() if actors}

    def fill(self, nodes: set[str], depth: int) -> None:
        """Start standbys on each of `nodes` until it has `depth`, ready or starting."""
        self.poll()
        have = Counter(node for _, node in self.starting.values())
        for node, actors in self.ready.items():
            have[node] += len(actors)
        for node in sorted(nodes):
            for _ in range(depth - have[node]):
                actor = self._start(node)
                self.starting[actor.ready.remote()] = (actor, node)

    def poll(self) -> None:
        """Take the standbys that became ready."""
        for ref, (actor, node) in finished(self.starting):
            try:
                ray.get(ref)
            except GONE as e:
                self._emit("standby_failed", node=node, message=str(e).strip()[-400:])
                continue
            self.ready.setdefault(node, []).append(actor)
            self._emit("standby_ready", node=node)

    def take(self, node: str | None, rank: int) -> Any | None:
        """A ready standby of `node`, now holding `rank`; None if it has none (or those it
        had died). The caller polls first (it decides where the rank goes by the ready
        ones)."""
        while node is not None and self.ready.get(node):
            actor = self.ready[node].pop(0)
            try:
                ray.get(actor.assume.remote(rank), timeout=ASSUME_TIMEOUT_S)
            except GONE as e:
                self._emit("standby_failed", node=node, message=str(e).strip()[-400:])
                ray.kill(actor, no_restart=True)
                continue
            return actor
        return None

    def drop(self, nodes: set[str]) -> None:
        """Stop the standbys on `nodes` (lost, or cordoned)."""
        for node in nodes & set(self.ready):
            for actor in self.ready.pop(node):
                ray.kill(actor, no_restart=True)
        for ref, (actor, node) in list(self.starting.items()):
            if node in nodes:
                del self.starting[ref]
                ray.kill(actor, no_restart=True)

    def actors(self) -> list[Any]:
        ready = [a for actors in self.ready.values() for a in actors]
        return [*ready, *(a for a, _ in self.starting.values())]
