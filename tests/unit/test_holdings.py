"""ckpt/holdings.py: what the nodes' memory holds, and where each rank restores from."""

from __future__ import annotations

import itertools

import pytest

from stalwart.ckpt.holdings import (
    MEMORY,
    PEER,
    MissingShard,
    Source,
    complete,
    holders,
    in_memory,
    pick,
    restore_source,
)

# Two nodes of two ranks each, replicas=2: each keeps its own ranks' shards and a copy of
# the other's. Node b's copy of rank 0 lags one step behind.
STORED = {"a": {0: [4, 5], 1: [4, 5]}, "b": {2: [4, 5], 3: [4, 5]}}
COPIES = {"a": {2: [4, 5], 3: [4, 5]}, "b": {0: [4], 1: [4, 5]}}


def test_holders_lists_own_stores_before_copies_and_only_live_nodes():
    assert holders(5, (STORED, COPIES), live={"a", "b"}) == {
        0: ["a"],
        1: ["a", "b"],
        2: ["b", "a"],
        3: ["b", "a"],
    }
    assert holders(4, (STORED, COPIES), live={"b"}) == {0: ["b"], 1: ["b"], 2: ["b"], 3: ["b"]}
    assert holders(6, (STORED, COPIES), live={"a", "b"}) == {}


def test_holders_accepts_string_ranks_as_reports_carry_them():
    assert holders(1, ({"a": {"3": [1]}},), live={"a"}) == {3: ["a"]}


def test_in_memory_skips_lost_nodes_and_lends_a_peers_steps_to_a_grown_rank():
    assert in_memory((STORED, COPIES), lost=set()) == {0: {4, 5}, 1: {4, 5}, 2: {4, 5}, 3: {4, 5}}
    # Without node a, rank 0's newest shard is gone (b's copy lags).
    held = in_memory((STORED, COPIES), lost={"a"})
    assert held[0] == {4} and held[1] == {4, 5}
    # Rank 4 was added by a grow: it restores rank 0's shard until it has its own.
    grown = in_memory((STORED, COPIES), lost={"a"}, borrowed={4: 0})
    assert grown[4] == {4}


def test_complete_needs_every_rank_of_the_world():
    held = in_memory((STORED, COPIES), lost={"a"})
    assert complete(held, 4) == {4}
    assert complete(held, 5) == set()  # rank 4 holds nothing
    assert complete({}, 0) == set()


def test_pick_prefers_the_ranks_own_node_then_the_lowest_id():
    assert pick(["b", "a"], "b") == "b"
    assert pick(["c", "b"], "a") == "b"
    assert pick(["c", "b"], None) == "b"


def test_restore_source_tiers():
    by_rank = holders(5, (STORED, COPIES), live={"a", "b"})
    assert restore_source(1, 5, "a", by_rank) == Source("a", 1, MEMORY)
    # Rank 1 on a node that holds no shard of it (a replacement on a new node).
    assert restore_source(1, 5, "c", by_rank) == Source("a", 1, PEER)
    # A fresh start restores nothing.
    assert restore_source(1, None, "a", by_rank) == Source(None, 1, None)


def test_restore_source_falls_back_to_the_borrowed_peer_and_else_raises():
    by_rank = holders(5, (STORED, COPIES), live={"a", "b"})
    assert restore_source(4, 5, "b", by_rank, borrowed=0) == Source("a", 0, PEER)
    with pytest.raises(MissingShard, match="rank 4's shard of committed step 5"):
        restore_source(4, 5, "b", by_rank)


def test_every_rank_restores_after_losing_any_one_of_three_nodes_with_two_copies():
    # Three nodes in one replica group of 2+1 (every node copies every other's shards):
    # whichever node is lost, every rank has a source, and never the lost node.
    nodes = ["a", "b", "c"]
    stored = {n: {i: [7]} for i, n in enumerate(nodes)}
    copies = {n: {i: [7] for i, m in enumerate(nodes) if m != n} for n in nodes}
    for lost in nodes:
        live = set(nodes) - {lost}
        by_rank = holders(7, (stored, copies), live=live)
        assert 7 in complete(in_memory((stored, copies), lost={lost}), 3)
        for rank, here in itertools.product(range(3), nodes):
            src = restore_source(rank, 7, here if here != lost else "new", by_rank)
            assert src.node in live and src.rank == rank
            assert src.tier == (MEMORY if src.node == here else PEER)
