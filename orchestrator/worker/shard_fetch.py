"""Where a restoring rank's shard comes from, and its fetch.

`fetch_shard`: from the restore source the supervisor named: its own node's memory (the
file its agent keeps it in, read in place: one copy, no process in between), another
node's (over that agent's channel, agent/channel.py, else Ray), or durable storage.

`Prefetch`: a rank that restores from another node's memory learns the source when its generation
starts (worker/actor.py `run`, from the supervisor's decision). The fetch starts then, on a
thread of its own, while the rank joins the rendezvous and its loop builds its objects
again; the restore takes what has arrived instead of starting the fetch itself. The fetch
keeps its own deadline (failure.restore_timeout_s); what it raised is raised at the
restore, where a fetch that failed has always been reported (RestoreFailed, and the
supervisor restores from the next source). Its own node's memory is read in place at the
restore, not prefetched: there is nothing to move.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from stalwart.ckpt.durable import open_store
from stalwart.ckpt.snapshot import Snapshot
from stalwart.ckpt.store import read_in_place
from stalwart.orchestrator.agent.channel import ChannelError, fetch_from_agent


def on_another_node(source: Any, own_agent: Any) -> bool:
    """A restore source that is another node's agent (not storage, not this node's)."""
    return (
        source is not None
        and not isinstance(source, dict)
        and source._actor_id != own_agent._actor_id
    )


def fetch_shard(
    source: Any, own_agent: Any, rank: int, step: int, timeout_s: float, node_ip: str | None
) -> Snapshot | None:
    """`step`'s shard of `rank` from `source`: an agent's memory (`own_agent`'s when None;
    another node's over its channel) or, for a dict naming a durable target, storage
    (checked). Bounded: a source agent that dies or stalls mid-fetch fails this restore
    (and the supervisor restores from the next source); it never hangs the recovery."""
    if isinstance(source, dict):
        return open_store(source).read_shard(step, rank)
    source, deadline = source or own_agent, time.monotonic() + timeout_s
    if not on_another_node(source, own_agent):  # own node's: read in place, one copy
        where = ray.get(source.locate_shard.remote(rank, step), timeout=10)
        snap = read_in_place(where, step) if where is not None else None
        if snap is not None:
            return snap
    else:  # a peer's: over its channel, else Ray
        try:
            return fetch_from_agent(source, rank, step, deadline - time.monotonic(), node_ip)
        except ChannelError as e:
            print(f"stalwart: restore over the channel failed ({e}): Ray", file=sys.stderr)
    left = max(1.0, deadline - time.monotonic())
    return ray.get(source.get_shard.remote(rank, step), timeout=left)


class Prefetch:
    """`fetch(step)` for one step, started now; `get(step)` hands it over once."""

    def __init__(self, fetch: Callable[[int], Any], step: int):
        self._fetch, self.step = fetch, step
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.started_at = time.time()
        self.arrived_at: float | None = None
        self._taken = False
        threading.Thread(target=self._run, daemon=True, name="stalwart-prefetch").start()

    def _run(self) -> None:
        try:
            self._result = self._fetch(self.step)
        except BaseException as e:  # handed to the restore, which reports it
            self._error = e
        finally:
            self.arrived_at = time.time()
            self._done.set()

    def get(self, step: int) -> Any:
        """`step`'s shard: the prefetched one (waited for), handed over once; another step,
        or a second call, fetches now."""
        if step != self.step or self._taken:
            return self._fetch(step)
        self._done.wait()
        self._taken = True
        result, error = self._result, self._error
        self._result = self._error = None  # the buffer is the restore's now
        if error is not None:
            raise error
        return result
