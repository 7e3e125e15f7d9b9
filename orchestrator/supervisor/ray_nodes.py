"""Ray's view of which nodes are alive, read in a thread of its own.

Reading Ray's node table is a call to the GCS, and while the GCS restarts (a head node's
restart, or the chaos fault `restart_gcs`) such a call waits until it is back. Read from the
control loop, that stalled the supervisor: its polls of the agents stopped, every node
looked silent at once, and the ranks waited on commits that nobody counted. Read here, the
control loop takes the newest reading, if there is a new one, and never waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import ray


def _read() -> dict[str, bool]:
    return {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}


class RayNodeTable:
    def __init__(self, every_s: float, read: Callable[[], dict[str, bool]] = _read):
        self._every_s, self._read = every_s, read
        self._lock = threading.Lock()
        self._fresh: dict[str, bool] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> dict[str, bool] | None:
        """The newest reading not taken yet (node id -> alive), or None; starts the reader
        on its first call."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="stalwart-ray-nodes", daemon=True
            )
            self._thread.start()
        with self._lock:
            fresh, self._fresh = self._fresh, None
        return fresh

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                states = self._read()
            except Exception:  # the GCS is away (or Ray is shutting down): the next round
                states = None
            if states is not None:
                with self._lock:
                    self._fresh = states
            self._stop.wait(self._every_s)

    def close(self) -> None:
        self._stop.set()
