"""Snapshot hand-over off the critical path.

The training thread only copies its state into a preallocated buffer (``capture``); a
background thread hands the copy to the store. Two buffers alternate so the next capture can
proceed while the previous hand-over runs; if the hand-over falls two snapshots behind, the
capture waits for it (backpressure), so memory stays bounded and the last committed step
lags visibly instead of silently.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.ckpt.snapshot import Snapshot, SnapshotBuffer


@dataclass
class PipelineStats:
    captures: int = 0
    capture_seconds: float = 0.0  # on the training thread
    handover_seconds: float = 0.0  # in the background
    wait_seconds: float = 0.0  # training thread blocked by backpressure
    last_bytes: int = 0
    last_stored_step: int | None = None
    errors: int = 0
    last_error: str | None = None


class SnapshotPipeline:
    def __init__(self, send: Callable[[Snapshot], Any], pin_memory: bool = False):
        self._send = send
        self._buffers = [SnapshotBuffer(pin_memory), SnapshotBuffer(pin_memory)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(len(self._buffers)):
            self._free.put(i)
        self._work: queue.Queue[tuple[int, Snapshot] | None] = queue.Queue()
        self.stats = PipelineStats()
        self._thread = threading.Thread(target=self._loop, name="stalwart-snapshot", daemon=True)
        self._thread.start()

    def submit(self, step: int, state: Any) -> None:
        t0 = time.perf_counter()
        slot = self._free.get()
        t1 = time.perf_counter()
        snap = self._buffers[slot].capture(step, state)
        t2 = time.perf_counter()
        self.stats.captures += 1
        self.stats.wait_seconds += t1 - t0
        self.stats.capture_seconds += t2 - t1
        self.stats.last_bytes = snap.nbytes
        self._work.put((slot, snap))

    def _loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            slot, snap = item
            t0 = time.perf_counter()
            try:
                self._send(snap)
                self.stats.last_stored_step = snap.step
            except Exception as e:  # the store is gone or refused: the step stays uncommitted
                self.stats.errors += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
            finally:
                self.stats.handover_seconds += time.perf_counter() - t0
                self._free.put(slot)

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted snapshot was handed over."""
        deadline = time.monotonic() + timeout
        while self._free.qsize() < len(self._buffers):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True
