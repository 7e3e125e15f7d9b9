"""A node's record of its job's rollbacks, and what it makes stale.

A recovery that rolls the job back to a restore step starts a new generation and tells
every agent (`NodeAgent.prune(above=..., fence=...)`). From then:

- a hand-over (a rank's new snapshot) written by an older generation is stale, whatever
  its step: only a process of a generation the supervisor ended can still write one;
- a peer's copy written by an older generation is stale only above that rollback's
  restore step: at or below it, the step is the job's history, the same whichever
  generation wrote it, and a live node's replicator may still be sending it.

A node cut off by a partition heals with its old generation's shards queued for its peers:
this is what refuses them.
"""

from __future__ import annotations

import threading

KEPT = 64  # rollbacks remembered: a copy older than all of them was refused long ago


class Fence:
    def __init__(self) -> None:
        self._rollbacks: list[tuple[int, int]] = []  # (generation started, its restore step)

    @property
    def generation(self) -> int:
        """The newest generation a rollback started: hand-overs of older ones are stale."""
        return max((g for g, _ in self._rollbacks), default=0)

    def rolled_back(self, generation: int, above: int | None) -> None:
        """Generation `generation` starts from step `above` (None: from scratch)."""
        self._rollbacks = [
            *self._rollbacks[-(KEPT - 1) :],
            (generation, -1 if above is None else above),
        ]

    def stale(self, generation: int | None) -> bool:
        """A hand-over written by `generation` (None: not known) counts for nothing."""
        return generation is not None and generation < self.generation

    def refuses(self, generation: int | None, step: int) -> str | None:
        """Why a peer's copy of `step` written by `generation` is refused, or None."""
        if generation is None:
            return None
        for started, above in self._rollbacks:
            if generation < started and step > above:
                return (
                    f"step {step} written by generation {generation}, fenced off: generation "
                    f"{started} restarted from step {above}"
                )
        return None


class Refusals:
    """What a node refused as fenced off, told to the supervisor once per path and
    generation (the job's `fenced` events): a fenced generation's ranks keep trying, every
    step, until they are stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # noted from the channel's, ring's and Ray's threads
        self._told: set[tuple[str, int | None]] = set()
        self._notes: list[dict[str, object]] = []

    def note(self, path: str, generation: int | None, reason: str) -> None:
        """`path`: what was refused ("ring": a rank's hand-over, "replicas": a peer's copy)."""
        with self._lock:
            if (path, generation) in self._told:
                return
            self._told.add((path, generation))
            self._notes.append(
                {"type": "fenced", "path": path, "generation": generation, "reason": reason}
            )

    def take(self) -> list[dict[str, object]]:
        with self._lock:
            notes, self._notes = self._notes, []
        return notes
