"""Each node's links as the nodes' own TCP counters see them: the data segments sent to each
peer and those sent again (agent/tcp_stats.py, in every agent's report, and the
supervisor's own node read here). Per window the counters' growth, with each peer address
put to its node, goes to health/lossy_link.py's verdict; this keeps the windows and the
flags, so a lasting lossy link is news once and its end is news once.

Where several nodes share one address (a local cluster's nodes without network namespaces
of their own) a peer's counters cannot be put to a node: those addresses are left out, and
such a cluster is not judged at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from stalwart.health.lossy_link import LossConfig, LossWindow, lossy_nodes, lossy_window

Counts = dict[str, tuple[int, int]]


class LossWatch:
    def __init__(
        self,
        config: LossConfig,
        enabled: bool = True,
        own: tuple[str, str, Callable[[], Counts]] | None = None,
    ):
        """`own`: (the supervisor's node, its address, a read of its TCP counters)."""
        self.config = config
        self.enabled = enabled
        self._own = own
        self._node_of: dict[str, str] = {}  # address -> node
        self._shared: set[str] = set()  # addresses of more than one node
        self._counts: dict[str, Counts] = {}  # observer node -> its newest cumulative counts
        self._start: dict[str, Counts] = {}  # observer node -> its counts at the window's start
        self._windows: deque[LossWindow] = deque(maxlen=config.consecutive_windows)
        self._window_at: float | None = None
        self._calm: dict[str, int] = {}  # flagged node -> windows in a row without its name
        self.flagged: dict[str, float] = {}  # node -> when it was flagged
        self.last: LossWindow = LossWindow()
        # Each reporting node's own share of data segments sent again in the last window,
        # to every peer (what its kernel counts, whether or not its peers can be told apart).
        self.sent_again: dict[str, float] = {}
        self._agent_on_own = False
        if own is not None:
            self._address(own[1], own[0])

    def _address(self, address: str, node: str) -> None:
        known = self._node_of.get(address)
        if known is not None and known != node:
            self._shared.add(address)
        self._node_of[address] = node

    def absorb(self, reports: list[dict[str, Any]]) -> None:
        """The agents' newest counters (their reports' `tcp` and `ip`)."""
        if not self.enabled:
            return
        for rep in reports:
            if rep.get("ip"):
                self._address(rep["ip"], rep["node"])
            if rep.get("tcp") is not None:
                self._counts[rep["node"]] = {k: tuple(v) for k, v in rep["tcp"].items()}
                # The supervisor's node has an agent: its report is that node's view.
                self._agent_on_own |= self._own is not None and rep["node"] == self._own[0]

    def forget(self, node: str) -> None:
        """A lost node: its counters, its flag and its address go (no clearing event; a
        node that joins later at that address, a restarted raylet, is a node of its own)."""
        for address in [a for a, n in self._node_of.items() if n == node]:
            del self._node_of[address]
        self._counts.pop(node, None)
        self._start.pop(node, None)
        self._calm.pop(node, None)
        self.flagged.pop(node, None)

    def judge(self, now: float) -> tuple[list[str], list[str], str] | None:
        """At the end of each window: the nodes newly flagged and those cleared (after
        `consecutive_windows` windows without their name), and the verdict's reason; None
        between windows."""
        if not self.enabled:
            return None
        own = self._own
        if own is not None and not self._agent_on_own:
            self._counts[own[0]] = own[2]()
        if self._window_at is None:
            self._window_at, self._start = now, dict(self._counts)
            return None
        if now - self._window_at < self.config.window_s:
            return None
        views: dict[str, dict[str, tuple[int, int]]] = {}
        self.sent_again = {}
        for observer, counts in self._counts.items():
            before = self._start.get(observer)
            if before is None:
                continue
            view = views.setdefault(observer, {})
            total = [0, 0]
            for address, (sent, again) in counts.items():
                s0, a0 = before.get(address, (0, 0))
                grown = (max(0, sent - s0), max(0, again - a0))
                total[0] += grown[0]
                total[1] += grown[1]
                peer = self._node_of.get(address)
                if peer is None or address in self._shared:
                    continue
                s1, a1 = view.get(peer, (0, 0))
                view[peer] = (s1 + grown[0], a1 + grown[1])
            if total[0]:
                self.sent_again[observer] = round(total[1] / total[0], 4)
        self._window_at, self._start = now, dict(self._counts)
        self.last = lossy_window(views, self.config)
        self._windows.append(self.last)
        named, reason = lossy_nodes(list(self._windows), self.config)
        new = [n for n in named if n not in self.flagged]
        for node in named:
            self.flagged.setdefault(node, now)
            self._calm[node] = 0
        cleared = []
        for node in list(self.flagged):
            if node in named:
                continue
            self._calm[node] = self._calm.get(node, 0) + 1
            if self._calm[node] >= self.config.consecutive_windows:
                cleared.append(node)
                del self.flagged[node]
                self._calm.pop(node, None)
        return new, cleared, reason
