"""The commit protocol: a step is committed when every rank's shard for it is stored.

Pure bookkeeping, no I/O: fed with what the stores report, asked which step is the newest
committed one and which versions may be dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class CommitTracker:
    def __init__(self, world_size: int, keep: int = 2):
        assert keep >= 1
        self.world_size = world_size
        self.keep = keep
        self._stored: dict[int, set[int]] = {r: set() for r in range(world_size)}
        self._committed: list[int] = []  # ascending, at most `keep`

    def observe(self, stored: Mapping[int, Iterable[int]]) -> int | None:
        """Replace each reporting rank's stored steps; return the newest committed step."""
        for rank, steps in stored.items():
            self._stored[rank] = set(steps)
        common = set.intersection(*self._stored.values()) if self._stored else set()
        for step in sorted(common):
            if not self._committed or step > self._committed[-1]:
                self._committed.append(step)
        del self._committed[: -self.keep]
        return self.committed

    @property
    def committed(self) -> int | None:
        return self._committed[-1] if self._committed else None

    @property
    def retained(self) -> tuple[int, ...]:
        return tuple(self._committed)

    def droppable_below(self) -> int | None:
        """Stores may drop every step older than this one (the oldest kept commit)."""
        return self._committed[0] if len(self._committed) == self.keep else None

    def reset(self, stored: Mapping[int, Iterable[int]]) -> int | None:
        """Start over from exactly what the stores hold now (after a store was lost):
        the committed steps are the newest steps every rank still has."""
        self._stored = {r: set(stored.get(r, ())) for r in range(self.world_size)}
        common = set.intersection(*self._stored.values()) if self._stored else set()
        self._committed = sorted(common)[-self.keep :]
        return self.committed

    def rollback(self, step: int) -> None:
        """After a recovery to `step`, nothing newer is committed until stored again."""
        self._committed = [s for s in self._committed if s <= step]
        for steps in self._stored.values():
            steps.difference_update({s for s in steps if s > step})


def with_copies(
    own: Mapping[int, Iterable[int]],
    holdings: Iterable[Mapping[int, Iterable[int]]],
    copies: int,
) -> dict[int, set[int]]:
    """rank -> those of its steps (from `own`, what each rank's own node stores) of which at
    least `copies` of `holdings` (one per live node: its own store, and separately the
    copies it keeps for peers) hold the shard. These are the steps that count for the
    commit when shards are replicated."""
    own = {int(r): set(steps) for r, steps in own.items()}
    if copies <= 1:
        return own
    count: dict[tuple[int, int], int] = {}
    for held in holdings:
        for rank, steps in held.items():
            for step in steps:
                key = (int(rank), step)
                count[key] = count.get(key, 0) + 1
    return {r: {s for s in steps if count.get((r, s), 0) >= copies} for r, steps in own.items()}
