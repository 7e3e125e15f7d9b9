"""Warm spares: idle workers (torch imported, entrypoint loaded, DDP built) that each hold a
slot of the job's room and take a lost rank's place without starting a process.

The pool (supervisor/pool.py) starts them with the job and asks for one when it replaces a
rank. A used spare is started again once the recovery's replacements have their places (a
refill must never take the room a lost rank needs): `refills` holds the freed slots until
then. A spare lost with its node is started again elsewhere; one that failed to start is
started again too, up to RESTARTS per spare the job has in a row (a spare that cannot start
at all, its entrypoint does not import, must not be started forever).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from stalwart.health.cordon import first_usable
from stalwart.orchestrator.supervisor.startup import StartupClock

RESTARTS = 3
ATTACH_TIMEOUT_S = 30.0
ASSUME_TIMEOUT_S = 10.0
# A pre-started worker that is gone, cannot be reached or does not answer in time.
GONE = (RayActorError, ActorUnavailableError, GetTimeoutError)


def finished(starting: dict[Any, Any]) -> list[tuple[Any, Any]]:
    """The (ready() ref, what it started) of `starting` whose ready() has returned or
    failed by now, taken out of it (spares here, standbys in supervisor/standby.py)."""
    if not starting:
        return []
    done, _ = ray.wait(list(starting), num_returns=len(starting), timeout=0)
    return [(ref, starting.pop(ref)) for ref in done]


class Spares:
    """The ready spares (actor, slot or None, node), those starting, and the refills due."""

    def __init__(
        self,
        per_job: int,
        create: Callable[[int | None], Any],
        agent_of: Callable[[str], Any],
        usable: Callable[[int | None], int | None],
        bad_nodes: Callable[[], set[str]],
        clock: StartupClock,
        emit: Callable[..., None],
    ) -> None:
        self._per_job = per_job  # failure.spares
        self._create = create  # slot or None -> a new idle worker there
        self._agent_of = agent_of  # node -> its agent (started if need be)
        self._usable = usable  # a freed slot -> itself, or None where its node is bad
        self._bad_nodes = bad_nodes
        self._clock = clock
        self._emit = emit
        self.ready: list[tuple[Any, int | None, str]] = []
        self.starting: dict[Any, tuple[Any, int | None]] = {}  # ready() ref -> (actor, slot)
        self.refills: list[int | None] = []
        self.failures = 0

    def start(self, slot: int | None) -> None:
        """Start an idle worker (in `slot`, or on any healthy node if None); it becomes
        usable once ready() returns."""
        actor = self._create(slot)
        self.starting[actor.ready.remote()] = (actor, slot)

    def check(self) -> None:
        """Take the spares that became ready (attached to their node's agent)."""
        for ref, (actor, slot) in finished(self.starting):
            try:
                info = ray.get(ref)
                ray.get(
                    actor.attach.remote(self._agent_of(info["node_id"])),
                    timeout=ATTACH_TIMEOUT_S,
                )
            except GONE as e:
                self._emit("spare_failed", bundle=slot, message=actor_error_text(e))
                self.lost(slot)
                continue
            self.ready.append((actor, slot, info["node_id"]))
            self.failures = 0  # it can start: only failures in a row count
            self._clock.spare_ready(slot, info.get("boot", {}))
            self._emit("spare_ready", bundle=slot, node=info["node_id"], spares=len(self.ready))

    def take(self, rank: int) -> tuple[Any, int | None] | None:
        """A ready spare on a healthy node, now holding `rank`; None if there is none."""
        bad = self._bad_nodes()
        while (i := first_usable([node for _, _, node in self.ready], bad)) is not None:
            actor, slot, _ = self.ready.pop(i)
            try:
                ray.get(actor.assume.remote(rank), timeout=ASSUME_TIMEOUT_S)
            except GONE as e:
                self._emit("spare_failed", bundle=slot, message=actor_error_text(e))
                ray.kill(actor, no_restart=True)
                self.refills.append(slot)
                continue
            return actor, slot
        return None

    def lost(self, slot: int | None) -> None:
        """A spare failed to start: start another by the next refill, unless spares have
        failed to start RESTARTS times per spare in a row."""
        self.failures += 1
        if self.failures <= RESTARTS * self._per_job:
            self.refills.append(slot)

    def refill(self) -> None:
        """Start the spares due (in their freed slots where those are on healthy nodes)."""
        refills, self.refills = self.refills, []
        for slot in refills:
            self.start(self._usable(slot))

    def nodes(self) -> frozenset[str]:
        """Healthy nodes with a ready spare."""
        bad = self._bad_nodes()
        return frozenset(n for _, _, n in self.ready if n not in bad)

    def restart_on(self, nodes: set[str] | dict[str, Any]) -> None:
        """Spares on `nodes` (which failed preflight) are stopped and started elsewhere."""
        for entry in [s for s in self.ready if s[2] in nodes]:
            self.ready.remove(entry)
            ray.kill(entry[0], no_restart=True)
            self.start(None)

    def drop_node(self, node: str) -> int:
        """`node` is gone: its ready spares are killed and started again elsewhere (by the
        next refill). Returns how many."""
        dropped = [s for s in self.ready if s[2] == node]
        self.ready = [s for s in self.ready if s[2] != node]
        for actor, slot, _ in dropped:
            ray.kill(actor, no_restart=True)
            self.refills.append(slot)  # not its failure: always started again
        return len(dropped)

    def slots(self) -> set[int]:
        """Slots the spares hold, ready or starting."""
        held = {s for _, s, _ in self.ready} | {s for _, s in self.starting.values()}
        return {s for s in held if s is not None}

    def actors(self) -> list[Any]:
        return [a for a, _, _ in self.ready] + [a for a, _ in self.starting.values()]


def actor_error_text(e: BaseException) -> str:
    text = str(e).strip()
    # Ray's message repeats the actor's whole creation traceback; the last lines carry it.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-12:])
