"""A node agent notices its raylet's death at once.

When a raylet dies alone (a crash; chaos `kill_raylet`), the processes it started live on
for a while: Ray takes them down only once the GCS has declared the node dead, ~10 s of
health checks later (measured here: the job's ranks and agent on that node answered for
12 s). Meanwhile the agent still answers the supervisor, so nothing looks lost. The agent is
a process the raylet started: when the raylet dies the kernel gives it another parent,
which is what this watches for (no call to anyone: it reads its own parent pid).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

RAYLET_CHECK_S = 0.25


class RayletWatch:
    def __init__(
        self,
        on_gone: Callable[[], None],
        every_s: float = RAYLET_CHECK_S,
        parent: Callable[[], int] = os.getppid,
    ):
        """`on_gone()` is called once, from the watch's thread, when this process's parent
        (the raylet that started it) is no longer its parent."""
        self._on_gone, self._every_s, self._parent = on_gone, every_s, parent
        self.raylet = parent()
        self._stop = threading.Event()

    def start(self) -> RayletWatch:
        threading.Thread(target=self._loop, name="stalwart-raylet-watch", daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            if self._parent() != self.raylet:
                self._on_gone()
                return

    def close(self) -> None:
        self._stop.set()
