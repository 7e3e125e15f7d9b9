"""Where the copies of each node's shards go: Gemini's group placement.

The nodes (sorted, so every party computes the same plan) are cut into groups of
`replicas` nodes; a node short of a full group joins the last full one. Every node holds
its own shards and a copy of the shards of every other node in its group. A group of g
nodes therefore keeps each of its shards on g >= replicas nodes, and the shards of a
group are all lost only when all of its g nodes are. Hence the guarantee:

    losing any `replicas - 1` nodes leaves at least one copy of every shard,

and with several groups many larger failures are survived too (Gemini, SOSP'23, shows
group placement loses data with the lowest probability for a given number of copies).
Fewer nodes than `replicas`: one group of all of them, so `effective(...)` copies.
"""

from __future__ import annotations

from collections.abc import Iterable


def groups(nodes: Iterable[str], replicas: int) -> list[list[str]]:
    """The replica groups of `nodes` (each of size >= replicas, unless fewer nodes)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ordered = sorted(set(nodes))
    if not ordered:
        return []
    if replicas == 1:
        return [[n] for n in ordered]
    if len(ordered) < replicas:
        return [ordered]
    out = [ordered[i : i + replicas] for i in range(0, len(ordered), replicas)]
    if len(out[-1]) < replicas:
        out[-2].extend(out.pop())
    return out


def peers(nodes: Iterable[str], replicas: int) -> dict[str, list[str]]:
    """node -> the other nodes that hold copies of its shards (its group, minus itself)."""
    plan: dict[str, list[str]] = {}
    for group in groups(nodes, replicas):
        for node in group:
            plan[node] = [n for n in group if n != node]
    return plan


def effective(nodes: Iterable[str], replicas: int) -> int:
    """How many copies of each shard the plan keeps (fewer than asked when there are
    fewer nodes than `replicas`)."""
    sizes = [len(g) for g in groups(nodes, replicas)]
    return min([replicas, *sizes]) if sizes else 0
