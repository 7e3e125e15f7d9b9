"""Lossy links: which node's network drops packets, from the TCP segments each node sends
again.

A loss of a few percent barely moves round trips (health/slow_link.py): TCP recovers most
lost segments within milliseconds. It does show in the kernel's counters: every lost data
segment is sent again. Each node counts, per peer, the data segments it sent and those it
sent again (orchestrator/agent/tcp_stats.py); the supervisor's node counts its own. One
pair's counters cannot say which end is at fault, since a loss on either end's link shows
on both. Several pairs can: a node whose link drops packets loses them with every peer,
while each of its peers keeps a clean link with someone else.

Per window, a pair of nodes is measured when the two together sent `min_segments` data
segments to each other, and lossy when `threshold` of them or more were sent again. A
node is named when at least two of its pairs are measured and all of them are lossy, while
some measured pair without it is clean; named in `consecutive_windows` windows in a row,
it is flagged. When every measured pair is lossy the fault is not a node's (a switch, or
everything): no node stands out and none is named. Like a slow link, an alert, never a
replacement (health.slow_link.policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Pair = tuple[str, str]  # (a, b) with a < b


@dataclass(frozen=True)
class LossConfig:
    threshold: float = 0.01
    min_segments: int = 100
    window_s: float = 3.0
    consecutive_windows: int = 2


@dataclass(frozen=True)
class LossWindow:
    rates: dict[Pair, float] = field(default_factory=dict)  # measured pairs: sent again / sent
    named: tuple[str, ...] = ()
    node_rates: dict[str, float] = field(default_factory=dict)  # each node's, over its pairs
    segments: dict[Pair, int] = field(default_factory=dict)  # every pair's, measured or not


def pair_counts(views: Mapping[str, Mapping[str, tuple[int, int]]]) -> dict[Pair, list[int]]:
    """`views`: observer node -> peer node -> (data segments sent, sent again) in the
    window. Both directions of a pair together: [sent, sent again]."""
    pairs: dict[Pair, list[int]] = {}
    for me, peers in views.items():
        for peer, (sent, again) in peers.items():
            if peer == me:
                continue
            key = (me, peer) if me < peer else (peer, me)
            total = pairs.setdefault(key, [0, 0])
            total[0] += sent
            total[1] += again
    return pairs


def lossy_window(
    views: Mapping[str, Mapping[str, tuple[int, int]]], config: LossConfig
) -> LossWindow:
    """The window's verdict: each measured pair's rate and the nodes it names."""
    counts = pair_counts(views)
    rates = {
        pair: again / sent for pair, (sent, again) in counts.items() if sent >= config.min_segments
    }
    lossy = {pair for pair, rate in rates.items() if rate >= config.threshold}
    nodes = sorted({n for pair in rates for n in pair})
    named = []
    node_rates = {}
    for node in nodes:
        mine = [pair for pair in rates if node in pair]
        node_rates[node] = round(sum(rates[p] for p in mine) / len(mine), 4)
        clean_elsewhere = any(p not in lossy for p in rates if node not in p)
        if len(mine) >= 2 and all(p in lossy for p in mine) and clean_elsewhere:
            named.append(node)
    return LossWindow(
        {p: round(r, 4) for p, r in rates.items()},
        tuple(named),
        node_rates,
        {p: sent for p, (sent, _) in counts.items()},
    )


def lossy_nodes(windows: list[LossWindow], config: LossConfig) -> tuple[tuple[str, ...], str]:
    """The nodes named in each of the newest `consecutive_windows` windows, and why (a line
    for the job's events)."""
    k = config.consecutive_windows
    if len(windows) < k:
        return (), f"{len(windows)} of {k} windows of TCP counters: not judged yet"
    recent = windows[-k:]
    flagged = set(recent[0].named)
    for w in recent[1:]:
        flagged &= set(w.named)
    last = recent[-1]
    if flagged:
        return tuple(sorted(flagged)), "; ".join(
            f"node {n[:12]} sent again {last.node_rates[n]:.1%} of the data segments on its "
            f"links (every one of its measured peers' links lossy, threshold "
            f"{config.threshold:.1%}; others clean) in {k} consecutive windows of "
            f"{config.window_s:g} s"
            for n in sorted(flagged)
        )
    if not last.rates:
        return (), "no pair of nodes sent enough data segments to each other to judge"
    worst = max(last.node_rates, key=last.node_rates.get)
    return (), f"no lossy link (highest: node {worst[:12]} at {last.node_rates[worst]:.2%})"
