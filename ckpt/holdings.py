"""What the nodes' memory holds of each rank's shards, and where each rank restores from.

Pure functions of the holdings the node agents report: per node, rank -> the steps of that
rank's shard the node keeps, in its own store (its own ranks' shards) or as a copy (its
replica-group peers' shards, ckpt/replicas.py). A rank added by an elastic grow has no shard
of its own yet: it *borrows* a peer's (data-parallel state is the same on every rank) until
one of its own is committed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

# node -> rank -> the steps of that rank's shard the node holds
Held = Mapping[str, Mapping[int, Iterable[int]]]

MEMORY = "memory"  # the rank's own node holds the shard
PEER = "peer"  # another node's memory holds it (its own store or a copy it keeps)


class MissingShard(LookupError):
    """No live node holds a shard a restore needs."""


@dataclass(frozen=True)
class Source:
    """Where one rank restores from: `node`'s memory, the shard of `rank`, at `tier`.
    `node` and `tier` are None when there is nothing to restore (a fresh start)."""

    node: str | None
    rank: int
    tier: str | None


def holders(step: int, held: Iterable[Held], live: Container[str]) -> dict[int, list[str]]:
    """rank -> the nodes in `live` whose memory holds its shard of `step` (own store or a
    copy), in the order `held` lists them."""
    out: dict[int, list[str]] = defaultdict(list)
    for per_node in held:
        for node, by_rank in per_node.items():
            if node not in live:
                continue
            for r, steps in by_rank.items():
                if step in steps:
                    out[int(r)].append(node)
    return out


def in_memory(
    held: Iterable[Held], lost: Container[str], borrowed: Mapping[int, int] = {}
) -> dict[int, set[int]]:
    """rank -> the steps of which some node not in `lost` holds a shard the rank can
    restore: its own, or for a rank in `borrowed` (rank -> the peer whose shard it
    restores) the peer's too."""
    out: dict[int, set[int]] = defaultdict(set)
    for per_node in held:
        for node, by_rank in per_node.items():
            if node in lost:
                continue
            for r, steps in by_rank.items():
                out[int(r)].update(steps)
    for rank, source in borrowed.items():
        out[rank] |= out.get(source, set())
    return out


def complete(by_rank: Mapping[int, set[int]], world: int) -> set[int]:
    """The steps of which every rank 0..world-1 can restore a shard."""
    sets = [by_rank.get(r, set()) for r in range(world)]
    return set.intersection(*sets) if sets else set()


def pick(nodes: Sequence[str], here: str | None) -> str:
    """The node to read a shard from: the rank's own (`here`) when it holds one (nothing
    crosses the network), else the lowest id, so every party picks the same."""
    return here if here in nodes else min(nodes)


def restore_source(
    rank: int,
    step: int | None,
    here: str | None,
    by_rank: Mapping[int, Sequence[str]],
    borrowed: int | None = None,
) -> Source:
    """Where `rank`, on node `here`, restores `step` from, given `by_rank` (`holders` of
    that step): its own shard if a node holds it, else the `borrowed` peer's. Raises
    MissingShard when neither is held anywhere."""
    if step is None:
        return Source(None, rank, None)
    for source in (rank, borrowed):
        if source is None:
            continue
        nodes = by_rank.get(source, [])
        if nodes:
            node = pick(nodes, here)
            return Source(node, source, MEMORY if node == here else PEER)
    raise MissingShard(f"no store holds rank {rank}'s shard of committed step {step}")
