"""Where the copies of each node's shards go (Gemini's group placement), and how far apart in steps.

The nodes (sorted, so every party computes the same plan) are cut into groups of
`replicas` nodes; a node short of a full group joins the last full one. Every node holds
its own shards and a copy of the shards of every other node in its group. A group of g
nodes therefore keeps each of its shards on g >= replicas nodes, and the shards of a
group are all lost only when all of its g nodes are. Hence the guarantee:

    losing any `replicas - 1` nodes leaves at least one copy of every shard,

and with several groups many larger failures are survived too (Gemini, SOSP'23, shows
group placement loses data with the lowest probability for a given number of copies).
Fewer nodes than `replicas`: one group of all of them, so `effective(...)` copies.

The placement knows the mesh (`holds`: node -> the shards its ranks hold, by signature,
ckpt/dtensor.py `shard_signature`): under HSDP the ranks along the replicate dimension hold
the same parameter and optimizer shards, and a copy of a node's shards is worth most on a
node that does not hold them already. Groups are filled so that no two nodes of a group
hold the same shard where the nodes allow it; the guarantee above is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Holds = Mapping[str, Iterable[str]]


def groups(nodes: Iterable[str], replicas: int, holds: Holds | None = None) -> list[list[str]]:
    """The replica groups of `nodes` (each of size >= replicas, unless fewer nodes); with
    `holds`, nodes holding the same shard are kept apart where they can be."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    ordered = sorted(set(nodes))
    if not ordered:
        return []
    if replicas == 1:
        return [[n] for n in ordered]
    if len(ordered) < replicas:
        return [ordered]
    if holds:
        ordered = _apart(ordered, replicas, {n: set(holds.get(n, ())) for n in ordered})
    out = [ordered[i : i + replicas] for i in range(0, len(ordered), replicas)]
    if len(out[-1]) < replicas:
        out[-2].extend(out.pop())
    return out


def _apart(ordered: list[str], size: int, held: dict[str, set[str]]) -> list[str]:
    """`ordered` rearranged so that each run of `size` nodes (a group) holds no shard twice,
    greedily in node order: each group takes the first node left that shares no shard with
    it, else the first node left. Every party computes the same order."""
    left, out = list(ordered), []
    while left:
        group: set[str] = set()
        for _ in range(min(size, len(left))):
            pick = next((n for n in left if not held[n] & group), left[0])
            left.remove(pick)
            out.append(pick)
            group |= held[pick]
    return out


def peers(nodes: Iterable[str], replicas: int, holds: Holds | None = None) -> dict[str, list[str]]:
    """node -> the other nodes that hold copies of its shards (its group, minus itself)."""
    plan: dict[str, list[str]] = {}
    for group in groups(nodes, replicas, holds):
        for node in group:
            plan[node] = [n for n in group if n != node]
    return plan


def effective(nodes: Iterable[str], replicas: int) -> int:
    """How many copies of each shard the plan keeps (fewer than asked when there are
    fewer nodes than `replicas`)."""
    sizes = [len(g) for g in groups(nodes, replicas)]
    return min([replicas, *sizes]) if sizes else 0


def choose_stride(
    steps_per_s: float,
    every: int,
    current: int,
    max_per_s: float,
    duty: float,
    round_s: float | None = None,
) -> tuple[int, str]:
    """Steps apart of the copies sent to peers (a multiple of `every`, the snapshot interval)
    and why. Copies are thinned so that (a) at most `max_per_s` rounds are sent a second and
    (b) a node's sender is busy at most `duty` of the time, where `round_s` is the measured
    time one round takes (the node's shards of one step to all its peers). The stride moves
    only by a factor of 2 or more: measuring under a new stride must not make it flap."""
    if steps_per_s <= 0:
        return current, "no step rate measured"
    snapshots_per_s = steps_per_s / every
    k = max(1, math.ceil(snapshots_per_s / max_per_s))
    why = f"at most {max_per_s:g} rounds/s at {steps_per_s:.2f} steps/s"
    if round_s is not None:
        by_cost = math.ceil(round_s * snapshots_per_s / duty - 1e-9)
        if by_cost > k:
            k = by_cost
            why = (
                f"a round of copies takes {round_s:.3f} s; at {steps_per_s:.2f} steps/s every "
                f"{k * every} steps keeps the sender busy <= {duty:.0%} of the time"
            )
    cur = max(1, current // every)
    if k != cur and (k >= 2 * cur or 2 * k <= cur):
        return k * every, why
    return current, why


def bounded_stride(every: int, max_lag: int) -> int:
    """Steps apart of the copies sent to peers when the commit may lag the newest snapshot
    by at most `max_lag` steps: the largest multiple of `every` (the snapshot interval)
    not above `max_lag`, and `every` when that is larger. Copies as far apart as the bound
    allows, each then given `max_lag - stride + 1` steps to reach the peers (lag_gate)."""
    if every < 1 or max_lag < 0:
        raise ValueError(f"every must be >= 1 and max_lag >= 0, got {every} and {max_lag}")
    return max(every, max_lag // every * every)


def lag_gate(step: int, max_lag: int, stride: int, start: int) -> int | None:
    """The step whose copies must be on the peers before training goes past snapshot `step`,
    so that the newest commit is never more than `max_lag` steps behind it: the first
    multiple of `stride` (the steps the replicator sends) at or above `step - max_lag`.
    None: nothing to wait for (the generation restored from `start`, already committed, and
    the step asked for is not newer)."""
    need = -(-(step - max_lag) // stride) * stride  # ceil to the stride's grid
    return need if need > start else None
