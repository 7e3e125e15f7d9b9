"""The supervisor's side of fencing: calls from a worker process a recovery replaced.

A node cut off by a partition keeps its ranks' processes alive; once it heals they may
still call the supervisor (an exactness warning, a chaos fault they carry out) for ranks
that other processes hold now. Such a call is refused and the job's `fenced` event says so,
once per rank and generation. A worker kept across recoveries (the same process, next
generation) is not replaced: its calls count whatever generation it names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CallerFence:
    def __init__(
        self,
        worker_info: Callable[[], dict[int, dict[str, Any]]],
        generation: Callable[[], int],
        emit: Callable[..., Any],
    ):
        """`worker_info()`: rank -> what the pool knows of its process now ("pid", ...)."""
        self._info, self._generation, self._emit = worker_info, generation, emit
        self._told: set[tuple[int, int]] = set()

    def refuses(self, who: dict[str, Any] | None, what: str) -> bool:
        """Whether the call `what` from `who` ({rank, pid, generation, node_id}: the calling
        process) comes from a process the job replaced. None (a caller that does not say)
        is taken as it is."""
        if who is None:
            return False
        rank, pid, gen = int(who["rank"]), who.get("pid"), int(who.get("generation") or 0)
        now = self._info().get(rank, {})
        if pid is None or now.get("pid") in (None, pid) or gen >= self._generation():
            return False
        if (rank, gen) not in self._told:
            self._told.add((rank, gen))
            self._emit(
                "fenced",
                path="supervisor",
                rank=rank,
                generation=gen,
                node=who.get("node_id"),
                reason=f"{what} from rank {rank}'s process of generation {gen} (pid {pid}) "
                f"refused: a recovery replaced it (pid {now['pid']} holds the rank in "
                f"generation {self._generation()})",
            )
        return True
