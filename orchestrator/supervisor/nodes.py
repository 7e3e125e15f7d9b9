"""The nodes that get no new ranks of the job: lost, dead in Ray's view, or cordoned.

The pool asks `all()` before it places a rank, a spare or a standby; the supervisor cordons
a node on a health verdict (a fatal GPU error, a straggler with the cordon policy, a failed
preflight) for health.cordon_ttl_s, and a lost node stays lost for the job's life.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from stalwart.health.cordon import CordonList
from stalwart.orchestrator.spec import JobSpec
from stalwart.orchestrator.supervisor.resources import worker_bundle


class BadNodes:
    def __init__(self, spec: JobSpec, emit: Callable[..., None]) -> None:
        self.spec = spec
        self._emit = emit
        self.lost: set[str] = set()
        # Nodes Ray reported dead while a replacement was placed, before the supervisor's
        # own detection got to them (two nodes lost at once: the first one's replacement
        # can be sent to the second).
        self.dead_in_ray: set[str] = set()
        self.cordons = CordonList(spec.health.cordon_ttl_s)
        self.log: list[dict[str, Any]] = []  # every cordon, for the job's summary

    def all(self, now: float) -> set[str]:
        return self.lost | self.dead_in_ray | set(self.cordons.active(now))

    def note_dead_in_ray(self) -> None:
        self.dead_in_ray |= {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}

    def cordon(self, node: str, reason: str, now: float, world: int) -> None:
        """Give `node` no new ranks of this job, unless the nodes left could not hold the
        job's `world` then (a cordon of the last node(s) with room would only end the job:
        it is skipped, saying so)."""
        bundle = worker_bundle(self.spec)
        bad = self.all(now) | {node}
        left = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in bad]
        short = [
            key
            for key, per_worker in bundle.items()
            if sum(n["Resources"].get(key, 0.0) for n in left) < per_worker * world
        ]
        if short:
            self._emit(
                "cordon_skipped",
                node=node,
                reason=f"{reason}; not cordoned: the other healthy nodes lack the "
                f"{', '.join(short)} for {world} workers",
            )
            return
        c = self.cordons.cordon(node, reason, now)
        self.log.append({"node": node, "at": now, "until": c.until, "reason": reason})
        self._emit("cordoned", node=node, until=c.until, reason=reason)

    def cordoned(self, now: float) -> dict[str, dict[str, Any]]:
        """The active cordons: node -> why, since and until when."""
        return {
            n: {"reason": c.reason, "since": c.at, "until": c.until}
            for n, c in self.cordons.active(now).items()
        }

    def expire(self, now: float) -> None:
        for c in self.cordons.expire(now):
            self._emit("uncordoned", node=c.node, reason="cordon TTL passed")
