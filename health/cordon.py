"""Cordoned nodes: no new ranks of this job go there until a TTL passes or a user uncordons.

Also the flapping rule: a node that keeps failing (``flap_failures`` failures within
``flap_window_s``) is cordoned even if each failure alone would not cordon it; and where a
lost rank goes among the warm processes: the first ready on a node that is not bad.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Cordon:
    node: str
    reason: str
    at: float
    until: float | None  # None: until uncordoned


class CordonList:
    def __init__(self, ttl_s: float | None):
        self.ttl_s = ttl_s
        self._cordons: dict[str, Cordon] = {}

    def cordon(self, node: str, reason: str, now: float) -> Cordon:
        until = now + self.ttl_s if self.ttl_s is not None else None
        c = Cordon(node, reason, now, until)
        self._cordons[node] = c
        return c

    def uncordon(self, node: str) -> Cordon | None:
        return self._cordons.pop(node, None)

    def expire(self, now: float) -> list[Cordon]:
        """Drop cordons whose TTL passed; returns them."""
        gone = [c for c in self._cordons.values() if c.until is not None and now >= c.until]
        for c in gone:
            del self._cordons[c.node]
        return gone

    def active(self, now: float) -> dict[str, Cordon]:
        return {n: c for n, c in self._cordons.items() if c.until is None or now < c.until}

    def is_cordoned(self, node: str, now: float) -> bool:
        return node in self.active(now)


def flapping_nodes(
    failure_history: Iterable[tuple[str, float]],
    now: float,
    window_s: float,
    threshold: int,
) -> tuple[list[str], str]:
    """Nodes with at least `threshold` failures in the last `window_s` seconds.

    `failure_history`: (node, when) for every failure attributed to a node.
    """
    counts: dict[str, int] = {}
    for node, at in failure_history:
        if now - at <= window_s:
            counts[node] = counts.get(node, 0) + 1
    flapping = sorted(n for n, c in counts.items() if c >= threshold)
    if not flapping:
        return [], "no flapping node"
    return flapping, "; ".join(
        f"node {n[:12]} failed {counts[n]} times in {window_s:.0f} s (threshold {threshold})"
        for n in flapping
    )


def first_usable(nodes: Sequence[str], bad: Collection[str]) -> int | None:
    """Which warm process takes a lost rank: the index of the first of `nodes` (the ready
    spares' nodes, in the order they became ready) that is neither cordoned nor lost
    (`bad`); None when there is none."""
    return next((i for i, node in enumerate(nodes) if node not in bad), None)
