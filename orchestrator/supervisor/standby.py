"""Standbys: one idle worker process per node, started in advance, holding no room.

A cold replacement (no spare ready) spends 3-5 s starting a Ray worker process, importing
torch, the train loop and stalwart, and warming DDP up. A standby has done all of that: it
is a TrainWorker with no rank (as a spare), pinned to its node, with zero Ray resources, so
it takes no room from the job or anyone else. A rank moves into it only once the rank's
room is held by a slot on the standby's node (the rank's own slot, or a new one the pool
reserves there), so the accounting stays true: the slot holds the CPUs, the standby's
process uses them.

One standby is started at a time (each imports torch, and a small machine has the ranks
training on its cores), on the nodes the pool names; a used or lost one is started again
by the next fill. Ray cannot hand a GPU to a process after it started, so jobs with GPUs
have none (failure.standby's description says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

ASSUME_TIMEOUT_S = 10.0
_GONE = (RayActorError, ActorUnavailableError, GetTimeoutError)


class Standbys:
    """Node -> its ready standby, and the one starting."""

    def __init__(self, start: Callable[[str], Any], emit: Callable[..., None]) -> None:
        self._start = start  # node -> a new standby actor pinned to it
        self._emit = emit
        self.ready: dict[str, Any] = {}
        self.starting: dict[Any, tuple[Any, str]] = {}  # ready() ref -> (actor, node)

    def nodes(self) -> set[str]:
        """Nodes with a standby, ready or starting."""
        return set(self.ready) | {n for _, n in self.starting.values()}

    def fill(self, nodes: set[str]) -> None:
        """Start a standby on one of `nodes` that has none, unless one is starting."""
        self.poll()
        if self.starting:
            return
        missing = sorted(nodes - self.nodes())
        if missing:
            actor = self._start(missing[0])
            self.starting[actor.ready.remote()] = (actor, missing[0])

    def poll(self) -> None:
        """Take the standbys that became ready."""
        if not self.starting:
            return
        done, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
        for ref in done:
            actor, node = self.starting.pop(ref)
            try:
                ray.get(ref)
            except _GONE as e:
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
        except _GONE as e:
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
