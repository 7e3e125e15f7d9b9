"""Liveness detectors: lost nodes (silent agents) and hung ranks (beating, not stepping).

Pure functions of observations and ``now``; each returns its findings and a reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.health.hang_timeout import HangTimeouts
from stalwart.health.observations import NodeView, RankView


@dataclass(frozen=True)
class Hang:
    culprits: tuple[int, ...]  # hung outside any collective: the cause
    waiting: tuple[int, ...]  # stuck inside a collective: victims (or a stuck collective)
    stalled_for_s: float


def isolated_for(nodes: Sequence[NodeView], now: float, timeout_s: float) -> float | None:
    """How long every watched node (two at least, none of them dead in Ray's table or in
    its agent) has been silent, the longest silence, once one is past `timeout_s`; else
    None. Every node falling silent at once is this supervisor losing its own link (a
    partition of its node, a stall of its own), not that many nodes dying at the same
    moment: their ranks still train among themselves."""
    live = [n for n in nodes if n.ray_alive and not n.agent_dead]
    if len(live) < 2 or len(live) < len(nodes):
        return None
    silent = [now - n.unanswered_since for n in live if n.unanswered_since is not None]
    # Every node quiet for a third of the timeout at least (a live one answers within
    # milliseconds), one past it: cuts a moment apart are the same spell.
    if len(silent) < len(live) or min(silent) < timeout_s / 3 or max(silent) < timeout_s:
        return None
    return max(silent)


# A raylet's answer says its node is up now if it is this recent (a silent node's raylet is
# asked every 0.5 s, each try given 0.5 s: raylet_probe.py).
ANSWER_FRESH_S = 2.0


def starved(n: NodeView, now: float, timeout_s: float, starved_timeout_s: float) -> bool:
    """An agent silent past `timeout_s` on a node that is still up: its raylet accepted a
    connection begun during the silence, within the last ANSWER_FRESH_S. A host that is
    gone, cut off or whose raylet died accepts none; a live one accepts it in its kernel
    however starved of CPU its processes are. Only until the silence reaches
    `starved_timeout_s` (an agent wedged for good loses its node then)."""
    if n.unanswered_since is None or n.raylet_answered_at is None:
        return False
    silent = now - n.unanswered_since
    return (
        timeout_s <= silent < starved_timeout_s
        and n.raylet_answered_at >= n.unanswered_since
        and now - n.raylet_answered_at <= ANSWER_FRESH_S
    )


def starved_nodes(
    nodes: Sequence[NodeView], now: float, timeout_s: float, starved_timeout_s: float
) -> list[tuple[str, float]]:
    """(node, seconds silent) of each starved agent (`starved`) that Ray and its actor's
    state still count alive."""
    return [
        (n.node, now - n.unanswered_since)
        for n in sorted(nodes, key=lambda n: n.node)
        if n.ray_alive
        and not n.agent_dead
        and n.unanswered_since is not None
        and starved(n, now, timeout_s, starved_timeout_s)
    ]


def lost_nodes(
    nodes: Sequence[NodeView],
    now: float,
    timeout_s: float,
    isolated_timeout_s: float = 0.0,
    starved_timeout_s: float = 0.0,
) -> tuple[list[str], str]:
    """Nodes that are gone: Ray says so, their agent died, or it left a report request
    unanswered for `timeout_s` (up to `starved_timeout_s` while its node's raylet still
    answers: `starved`); but while every node is silent at once (isolated_for), none is
    lost before `isolated_timeout_s`."""
    alone = isolated_for(nodes, now, timeout_s)
    if alone is not None and alone < isolated_timeout_s:
        return [], (
            f"every node silent for {alone:.1f} s at once: this supervisor's own link, not "
            f"{len(nodes)} nodes lost (health.isolated_timeout_s={isolated_timeout_s:g})"
        )
    lost, why = [], []
    for n in sorted(nodes, key=lambda n: n.node):
        silent = now - n.unanswered_since if n.unanswered_since is not None else 0.0
        if not n.ray_alive:
            lost.append(n.node)
            why.append(f"node {n.node[:12]}: Ray marked it dead")
        elif n.agent_dead:
            lost.append(n.node)
            why.append(f"node {n.node[:12]}: its agent died")
        elif silent >= timeout_s and not starved(n, now, timeout_s, starved_timeout_s):
            lost.append(n.node)
            why.append(
                f"node {n.node[:12]}: agent silent for {silent:.1f} s "
                f"(health.heartbeat_timeout_s={timeout_s})"
                + (
                    ", its raylet answering but the agent silent past "
                    f"health.starved_agent_timeout_s={starved_timeout_s:g}"
                    if silent >= starved_timeout_s > timeout_s
                    and n.raylet_answered_at is not None
                    and n.raylet_answered_at >= n.unanswered_since
                    else ""
                )
            )
    return lost, "; ".join(why) if why else "all nodes answering"


def hung_ranks(
    ranks: Sequence[RankView], now: float, timeouts: HangTimeouts, beat_timeout_s: float
) -> tuple[Hang | None, str]:
    """A hang: beating ranks that have not finished a step for their timeout
    (health/hang_timeout.py: fixed by the spec, or derived from the job's steps).

    In data-parallel training one hung rank stalls everyone at the next collective. A rank
    frozen past its timeout *outside* any collective is a culprit, and every rank waiting
    in a collective waits for it. If every beating rank is frozen inside a collective, the
    collective itself is stuck. A rank waiting for its checkpoint copies to reach peer
    nodes (checkpoint.max_lag_steps) is waiting too, not a culprit: if all wait so,
    replication is stuck. A rank still busy on its CPU past a derived step timeout is not
    frozen (until health.hang.busy_limit_s).
    A rank whose heartbeats stopped is not hung but lost; liveness handles it.
    """
    beating = [r for r in ranks if now - r.beat_at < beat_timeout_s]
    if not beating:
        return None, "no fresh heartbeats"
    frozen = [r for r in beating if now - r.step_changed_at >= timeouts.for_rank(r)]
    if not frozen:
        return None, "steps advancing"
    culprits = tuple(sorted(r.rank for r in frozen if not r.waiting))
    if culprits:
        # Everyone in a collective now waits for the culprits, however recently it stepped.
        waiting = tuple(sorted(r.rank for r in beating if r.waiting and r.rank not in culprits))
    elif len(frozen) == len(beating):
        waiting = tuple(sorted(r.rank for r in frozen))
    else:
        return None, "ranks frozen inside a collective while others still step: waiting"
    stalled = min(now - r.step_changed_at for r in frozen)
    first = min(frozen, key=lambda r: (r.waiting, now - r.step_changed_at))
    timeout = timeouts.describe(first)
    if culprits:
        reason = (
            f"rank(s) {', '.join(map(str, culprits))} made no step for {stalled:.1f} s "
            f"({timeout}) outside any collective"
            + (f"; rank(s) {', '.join(map(str, waiting))} wait for them" if waiting else "")
        )
    elif all(r.copies_since is not None for r in frozen):
        reason = (
            f"all {len(frozen)} beating ranks have waited for their checkpoint copies to "
            f"reach peer nodes for {stalled:.1f} s ({timeout}, "
            "checkpoint.max_lag_steps): replication is stuck"
        )
    else:
        reason = (
            f"all {len(frozen)} beating ranks have waited in a collective for {stalled:.1f} s "
            f"({timeout}): the collective is stuck"
        )
    return Hang(culprits, waiting, stalled), reason
