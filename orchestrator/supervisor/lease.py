"""Keeping the node agents' leases while the control loop is busy.

A node agent outlives its supervisor (a successor takes the job back from its memory) but
frees that memory once no supervisor has called it for its lease (agent/actor.py LEASE_S,
10 minutes). The control loop calls every agent several times a second, yet one long
operation (waiting out failure.replacement_timeout_s for room, a deep verification of a
durable checkpoint, the final persist) would starve them: this thread renews the leases on
its own, with one fire-and-forget ping per agent per interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

RENEW_EVERY_S = 30.0


class LeaseKeeper:
    def __init__(self, agents: Callable[[], list[Any]], every_s: float = RENEW_EVERY_S):
        self._agents = agents
        self._every = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stalwart-leases", daemon=True)
        self.renewals = 0

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                agents = self._agents()
            except RuntimeError:  # the pool's agents changed as they were listed
                continue
            for agent in agents:
                try:
                    agent.ping.remote()
                except Exception:  # a gone agent is the detectors' business
                    log.debug("lease ping failed", exc_info=True)
            self.renewals += 1

    def stop(self) -> None:
        self._stop.set()
