"""What a node's ranks wait on when their copies on peer nodes must not lag
(checkpoint.max_lag_steps; the rule is ckpt/replicas.py `lag_gate`).

The replicator reports each shard that reached every peer; this keeps each rank's newest
(with the generation that wrote it) and the stride the ranks wait on (0: nothing to wait
for: no bound, or no peers), and publishes both where the ranks read them: the words of
their snapshot rings (ckpt/ring.py), read at each step boundary with no call, and for a
rank without a ring (shards through Ray) a call that waits (`reached`).
"""

from __future__ import annotations

import threading
import time

from stalwart.ckpt.ring import pack_replicated
from stalwart.orchestrator.agent.rings import RingHub


class CopyGate:
    def __init__(self, rings: RingHub | None):
        self._rings = rings
        self._cv = threading.Condition()
        self._copied: dict[int, tuple[int, int]] = {}  # rank -> (generation, step)
        self.stride = 0

    def set_stride(self, stride: int) -> None:
        """The stride the ranks wait on (0: none)."""
        with self._cv:
            self.stride = stride
            self._cv.notify_all()
        if self._rings is not None:
            self._rings.set_replication(stride=stride)

    def replicated(self, rank: int, step: int, generation: int | None) -> None:
        """`rank`'s shard of `step` is on every peer."""
        if generation is None:
            return  # a shard sent again to new peers: its writer is not known here
        with self._cv:
            if (generation, step) <= self._copied.get(rank, (-1, -1)):
                return
            self._copied[rank] = (generation, step)
            self._cv.notify_all()
        if self._rings is not None:
            self._rings.set_replication(rank=rank, word=pack_replicated(generation, step))

    def reached(
        self, rank: int, generation: int, step: int, timeout_s: float
    ) -> tuple[int, tuple[int, int] | None]:
        """Wait up to `timeout_s` until `rank`'s shard of `step`, or a newer one of
        `generation`, is on every peer: (the stride the ranks wait on; (generation, step)
        of its newest copied shard, or None)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                got = self._copied.get(rank)
                if not self.stride or (got is not None and got >= (generation, step)):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self.stride, self._copied.get(rank)
