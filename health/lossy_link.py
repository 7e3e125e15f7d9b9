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
node is named when at least two of its pairs are measured, most of them are lossy and all
of them together are (the segments sent again over those sent, on every link of the node),
while most measured pairs without it are clean. Most, not all: losses come in bursts (a
queue that overflows drops a run of packets), so in one window a pair of a lossy node can
read clean, or a clean pair lossy, by chance. A node's peer is not named with it: of the
peer's links, only the one to the lossy node is lossy. Named in `consecutive_windows`
windows in a row, a node is flagged. When most measured pairs are lossy the fault is not a
node's (a switch, or everything): no node stands out and none is named. Like a slow link,
an alert, never a replacement (health.slow_link.policy).
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
    links: dict[str, tuple[int, int]] = field(default_factory=dict)  # node: (lossy, measured)
    rest_rates: dict[str, float] = field(default_factory=dict)  # over the pairs without it
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


def _rate(counts: Mapping[Pair, list[int]], pairs: list[Pair]) -> float:
    """The segments sent again over those sent, on `pairs` together."""
    return round(sum(counts[p][1] for p in pairs) / sum(counts[p][0] for p in pairs), 4)


def lossy_window(
    views: Mapping[str, Mapping[str, tuple[int, int]]], config: LossConfig
) -> LossWindow:
    """The window's verdict: each measured pair's rate and the nodes it names."""
    counts = pair_counts(views)
    measured = {pair: c for pair, c in counts.items() if c[0] >= config.min_segments}
    rates = {pair: again / sent for pair, (sent, again) in measured.items()}
    lossy = {pair for pair, rate in rates.items() if rate >= config.threshold}
    nodes = sorted({n for pair in rates for n in pair})
    named = []
    node_rates, rest_rates = {}, {}
    links = {}
    for node in nodes:
        mine = [pair for pair in rates if node in pair]
        others = [pair for pair in rates if node not in pair]
        node_rates[node] = _rate(measured, mine)
        if others:
            rest_rates[node] = _rate(measured, others)
        links[node] = (sum(p in lossy for p in mine), len(mine))
        most_mine_lossy = 2 * links[node][0] > len(mine)
        most_others_clean = 2 * sum(p not in lossy for p in others) > len(others)
        if (
            len(mine) >= 2
            and most_mine_lossy
            and node_rates[node] >= config.threshold
            and most_others_clean
        ):
            named.append(node)
    return LossWindow(
        rates={p: round(r, 4) for p, r in rates.items()},
        named=tuple(named),
        node_rates=node_rates,
        links=links,
        rest_rates=rest_rates,
        segments={p: sent for p, (sent, _) in counts.items()},
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
            f"links ({last.links[n][0]} of its {last.links[n][1]} measured links lossy, "
            f"threshold {config.threshold:.1%}; {last.rest_rates[n]:.1%} on the links without "
            f"it) in {k} consecutive windows of {config.window_s:g} s"
            for n in sorted(flagged)
        )
    if not last.rates:
        return (), "no pair of nodes sent enough data segments to each other to judge"
    worst = max(last.node_rates, key=last.node_rates.get)
    return (), f"no lossy link (highest: node {worst[:12]} at {last.node_rates[worst]:.2%})"
