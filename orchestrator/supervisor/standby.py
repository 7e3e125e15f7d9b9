"""Standbys: one idle worker process per node, started in advance, holding no room.

A cold replacement (no spare ready) spends 3-5 s starting a Ray worker process, importing
torch, the train loop and stalwart, and warming DDP up. A standby has done all of that: it
is a TrainWorker with no rank (as a spare), pinned to its node, with zero Ray resources, so
it takes no room from the job or anyone else. A rank moves into it only once the rank's
room is held by a slot on the standby's node (the rank's own slot, or a new one the pool
reserves there), so the accounting stays true: the slot holds the CPUs, the standby's
process uses them.

Whether a job has them (`choose`): failure.standby says so, or, left unset, they are on for
CPU jobs when every node holding ranks has the memory for one beside its checkpoints. They
start together as soon as the ranks are ready, on the nodes the pool names; a used or lost
one is started again by the next fill (the supervisor's tick). Ray cannot hand a GPU to a
process after it started, so jobs with GPUs have none: their warm processes are
failure.spares, each holding its GPU in its slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import ray

from stalwart.orchestrator.supervisor.spares import ASSUME_TIMEOUT_S, GONE, finished

GIB = 1024**3
# What a standby costs: an idle TrainWorker's RSS is ~0.37 GiB (torch and stalwart
# imported, Ray's worker; docs/benchmarks.md), rounded up. Auto keeps a node's standby only
# where this and a headroom are left beside the node's checkpoints.
STANDBY_BYTES = GIB // 2
HEADROOM_BYTES = GIB


def choose(
    setting: bool | None,
    gpu: bool,
    rooms: Mapping[str, Mapping[str, Any]],
    checkpoints: Mapping[str, int],
) -> tuple[bool, str]:
    """Whether the job keeps standbys, and why (a line for its events). `setting`:
    failure.standby (None: decide here); `rooms`: what each node holding ranks has
    (NodeAgent.memory); `checkpoints`: the bytes its checkpoints will take (0: unknown)."""
    if gpu:
        if setting:
            why = "off although failure.standby is true: the job's workers use GPUs"
        else:
            why = "off: the job's workers use GPUs"
        return False, (
            why + " (Ray cannot hand a GPU to a process after it started; failure.spares "
            "are the warm processes of a GPU job)"
        )
    if setting is not None:
        on = "on: one idle worker process per node holding ranks" if setting else "off"
        return setting, f"{on} (failure.standby: {str(setting).lower()})"
    want = STANDBY_BYTES + HEADROOM_BYTES
    short = []
    for node, room in sorted(rooms.items()):
        available = room.get("mem_available")
        if available is not None and available - checkpoints.get(node, 0) < want:
            left = (available - checkpoints.get(node, 0)) / GIB
            short.append(f"node {node[:12]} has {left:.1f} GiB left beside its checkpoints")
    if short:
        return False, (
            f"off: {'; '.join(short)}, and a standby needs {STANDBY_BYTES / GIB:.1f} GiB "
            f"plus {HEADROOM_BYTES / GIB:.0f} GiB of headroom (failure.standby: true starts "
            "them anyway)"
        )
    least = min(
        (
            r["mem_available"] - checkpoints.get(n, 0)
            for n, r in rooms.items()
            if r.get("mem_available")
        ),
        default=None,
    )
    room = f"; every node has {least / GIB:.1f} GiB or more left" if least is not None else ""
    return True, (
        f"on: one idle worker process per node holding ranks, ~{STANDBY_BYTES / GIB:.1f} GiB "
        f"each{room} (failure.standby: false turns them off)"
    )


class Standbys:
    """Node -> its ready standby, and those starting."""

    def __init__(self, start: Callable[[str], Any], emit: Callable[..., None]) -> None:
        self._start = start  # node -> a new standby actor pinned to it
        self._emit = emit
        self.ready: dict[str, Any] = {}
        self.starting: dict[Any, tuple[Any, str]] = {}  # ready() ref -> (actor, node)

    def nodes(self) -> set[str]:
        """Nodes with a standby, ready or starting."""
        return set(self.ready) | {n for _, n in self.starting.values()}

    def fill(self, nodes: set[str]) -> None:
        """Start a standby on each of `nodes` that has none, ready or starting."""
        self.poll()
        for node in sorted(nodes - self.nodes()):
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
            self.ready[node] = actor
            self._emit("standby_ready", node=node)

    def take(self, node: str | None, rank: int) -> Any | None:
        """`node`'s ready standby, now holding `rank`; None if it has none (or it died).
        The caller polls first (it decides where the rank goes by the ready ones)."""
        actor = self.ready.pop(node, None) if node is not None else None
        if actor is None:
            return None
        try:
            ray.get(actor.assume.remote(rank), timeout=ASSUME_TIMEOUT_S)
        except GONE as e:
            self._emit("standby_failed", node=node, message=str(e).strip()[-400:])
            ray.kill(actor, no_restart=True)
            return None
        return actor

    def drop(self, nodes: set[str]) -> None:
        """Stop the standbys on `nodes` (lost, or cordoned)."""
        for node in nodes & set(self.ready):
            ray.kill(self.ready.pop(node), no_restart=True)
        for ref, (actor, node) in list(self.starting.items()):
            if node in nodes:
                del self.starting[ref]
                ray.kill(actor, no_restart=True)

    def actors(self) -> list[Any]:
        return [*self.ready.values(), *(a for a, _ in self.starting.values())]
