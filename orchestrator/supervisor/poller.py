"""Report polling: one request per node agent in flight, answers taken as they come.

The supervisor never blocks on an agent: each poll sends a request to every agent that has
none outstanding and takes whatever answers are in. An agent that does not answer is not
waited for; the monitor measures its silence from the oldest unanswered request. Each
answer's round trip, timed at its arrival (a callback on the reply), goes to
`on_round_trip` (supervisor/links.py: which node's link is slow).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from stalwart.orchestrator.supervisor.monitor import HealthMonitor


class ReportPoller:
    def __init__(
        self,
        ask: Callable[[str], Any],
        monitor: HealthMonitor,
        on_round_trip: Callable[[str, float], None] | None = None,
    ):
        """`ask(node)` sends one report request to `node`'s agent and returns its ref."""
        self._ask = ask
        self.monitor = monitor
        self._on_round_trip = on_round_trip
        self.outstanding: dict[str, Any] = {}  # node -> report ref in flight
        # node -> the timed reply of its ref in flight: once it holds the answer, that is
        # taken, not deserialized again by ray.get
        self._replies: dict[str, Future] = {}
        self.last_poll = 0.0

    def forget(self, node: str) -> None:
        self.outstanding.pop(node, None)
        self._replies.pop(node, None)

    def discard_in_flight(self) -> None:
        """Answers to requests already sent would describe the stores as they were (before
        a renumbering): ask again. Silence keeps counting from the first request."""
        self.outstanding.clear()
        self._replies.clear()

    def poll(self, nodes: Iterable[str], wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Take the answers that are in, then ask every node in `nodes` without a request in
        flight (so in steady state each node is asked once per poll); with `wait_s`, wait up
        to that long for every answer."""
        reports = self._collect(0.0)
        now = self.last_poll = time.time()
        for node in nodes:
            if node not in self.outstanding:
                sent = time.monotonic()
                ref = self.outstanding[node] = self._ask(node)
                self.monitor.node_asked(node, now)
                if self._on_round_trip is not None:
                    reply = self._replies[node] = ref.future()
                    reply.add_done_callback(partial(self._arrived, node, sent))
        if wait_s > 0:
            reports += self._collect(wait_s)
        return reports

    def _arrived(self, node: str, sent: float, answer: Any) -> None:
        """Ray's thread, as `node`'s answer arrives: its round trip (an answer that is an
        error is not a round trip of the link)."""
        if not answer.cancelled() and answer.exception() is None:
            self._on_round_trip(node, time.monotonic() - sent)

    def _collect(self, wait_s: float) -> list[dict[str, Any]]:
        node_of = {ref: node for node, ref in self.outstanding.items()}
        if not node_of:
            return []
        ready, _ = ray.wait(list(node_of), num_returns=len(node_of), timeout=wait_s)
        reports = []
        for ref in ready:
            node = node_of[ref]
            del self.outstanding[node]
            reply = self._replies.pop(node, None)
            try:
                reports.append(reply.result() if reply and reply.done() else ray.get(ref))
            except ActorUnavailableError:
                continue  # unreachable for now: its silence keeps counting
            except RayActorError:
                self.monitor.agent_died(node)
                continue
            self.monitor.node_answered(node)
        return reports
