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
from typing import Any

import ray


class RayNodeTable:
    def __init__(self, every_s: float, read: Callable[[], list[dict[str, Any]]] = ray.nodes):
        """`read`: Ray's node table, one row per node (ray.nodes())."""
        self._every_s, self._read = every_s, read
        self._lock = threading.Lock()
        self._fresh: dict[str, bool] | None = None
        # node id -> its raylet's (address, port), from every read so far
        self._raylets: dict[str, tuple[str, int]] = {}
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

    def raylets(self) -> dict[str, tuple[str, int]]:
        """node id -> its raylet's (address, port), as the reads so far had them; never
        waits (the raylet probe's address book: raylet_probe.py)."""
        with self._lock:
            return dict(self._raylets)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                rows = self._read()
            except Exception:  # the GCS is away (or Ray is shutting down): the next round
                rows = None
            if rows is not None:
                raylets = {
                    n["NodeID"]: (n["NodeManagerAddress"], int(n["NodeManagerPort"]))
                    for n in rows
                    if n.get("NodeManagerAddress") and n.get("NodeManagerPort")
                }
                with self._lock:
                    self._fresh = {n["NodeID"]: bool(n["Alive"]) for n in rows}
                    self._raylets.update(raylets)
            self._stop.wait(self._every_s)

    def close(self) -> None:
        self._stop.set()
