"""Training waits at a step boundary while this rank's copies on peer nodes lag too far.

checkpoint.max_lag_steps bounds how far the newest commit (every rank's shard on
`replicas` nodes) may be behind the newest snapshot, so that a node lost at any moment
costs at most max_lag_steps + 1 steps. The node agent sends every shard on the
replication stride's grid to its peers and says which reached them all; after each
snapshot the rank compares that with the step the bound needs (ckpt/replicas.py
`lag_gate`) and, when its copies are behind, waits here before the next step: the
backpressure that keeps the bound when a link is slow or an agent busy, instead of
training on with nothing recent to fall back on.

Where the rank writes its snapshots into a ring in shared memory, it reads the agent's
answer from the ring's words (no call); through Ray, it asks the agent, only while the last
answer does not already cover the step. A recovery's abort ends a wait at once (the next
step boundary unwinds the loop). The seconds waited and since when are in the heartbeat
(a rank waiting for its copies is not hung: its peers' links are the cause).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from stalwart.ckpt.replicas import lag_gate

Copies = tuple[int, tuple[int, int] | None]  # (stride, 0: none; (generation, step) copied)
ASK_S = 0.5  # through Ray: one call waits this long at most, then the abort is looked at


class CopyWait:
    def __init__(
        self,
        max_lag: int | None,
        read: Callable[[], Copies | None],
        ask: Callable[[int, int, float], Copies],
    ):
        """`read()`: the ring's words, None without a ring; `ask(generation, step,
        timeout_s)`: the agent's answer, waiting up to `timeout_s` for that step."""
        self.max_lag = max_lag
        self._read = read
        self._ask = ask
        self._asked: Copies | None = None  # the agent's last answer (through Ray)
        self.seconds = 0.0  # waited, in all (this process)
        self.waits = 0  # step boundaries at which it waited
        self.since: float | None = None  # when the wait going on began (time.time())

    def after_snapshot(
        self, step: int, generation: int, start: int, interrupted: Callable[[], bool]
    ) -> float:
        """Wait until the copies allow training past snapshot `step` of `generation` (which
        restored from `start`, or started there), or until `interrupted()` (a recovery);
        the seconds waited."""
        if self.max_lag is None:
            return 0.0
        t0 = None
        delay = 0.0002
        need = step - self.max_lag
        try:
            while True:
                stride, copied = self._copies(generation, need, ASK_S if t0 else 0.0)
                if not stride:
                    break
                need = lag_gate(step, self.max_lag, stride, start)
                stale = copied is not None and copied[0] > generation  # this rank is replaced
                if need is None or stale or _covers(copied, generation, need) or interrupted():
                    break
                if t0 is None:
                    t0, self.since = time.monotonic(), time.time()
                    self.waits += 1
                if self._asked is None:  # reading the ring: poll it
                    time.sleep(delay)
                    delay = min(2 * delay, 0.002)
        finally:
            waited = 0.0 if t0 is None else time.monotonic() - t0
            self.seconds += waited
            self.since = None
        return waited

    def _copies(self, generation: int, need: int, timeout_s: float) -> Copies:
        words = self._read()
        if words is not None:
            self._asked = None
            return words
        cached = self._asked
        if cached is not None and (not cached[0] or _covers(cached[1], generation, need)):
            return cached
        self._asked = self._ask(generation, need, timeout_s)
        return self._asked


def _covers(copied: tuple[int, int] | None, generation: int, need: int) -> bool:
    """A copied shard of this generation at or past `need` (an older generation's steps
    were rolled back: they count for nothing)."""
    return copied is not None and copied[0] == generation and copied[1] >= need
